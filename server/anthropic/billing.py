"""Claude Code's attribution block: kept out of the prompt so that the prefix cache can work.

Claude Code sends, as the first system block, text such as
`x-anthropic-billing-header: cc_version=2.1.197.abc; cc_entrypoint=cli; cch=3f9a1;` whose
`cch` value changes on every request. Rendered into the prompt, it would make every turn's
first tokens differ and no prefix would ever be reused. It carries nothing for the model, so the
block is dropped from the prompt.
"""
from __future__ import annotations

BILLING_HEADER_PREFIX = "x-anthropic-billing-header:"


def is_billing_header(text: str) -> bool:
    return text.lstrip().lower().startswith(BILLING_HEADER_PREFIX)


def without_billing_header(texts: list[str]) -> list[str]:
    return [text for text in texts if not is_billing_header(text)]
