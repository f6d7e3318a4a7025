"""response_format and forced tool calls → a grammar logits processor for the request.

The engine applies `SamplingParams.logits_processors` to each sequence's logits before it
samples (see engine/text/structured.py for the processor). Building a grammar can take a while
(the tokenizer index once, ~1 s on a large vocabulary), so it runs off the event loop.
"""
from __future__ import annotations

import asyncio
from typing import Any

from engine.text.structured import GrammarError, GrammarLogitsProcessor, json_schema_grammar, lark_grammar
from server.core.engine_client import EngineClient
from server.core.errors import bad_request
from server.openai.protocol import ResponseFormat
from server.openai.tools import ToolPlan, forced_call_grammar


def _grammar(response_format: ResponseFormat | None, plan: ToolPlan | None) -> tuple[str, str] | None:
    """(grammar, request field it comes from), or None when the output is free."""
    if plan is not None and plan.forced:
        return lark_grammar(forced_call_grammar(plan)), "tool_choice"
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return json_schema_grammar(None), "response_format"
    spec = response_format.json_schema
    if spec is None or spec.schema_ is None:
        raise bad_request("response_format json_schema needs json_schema.schema", "response_format.json_schema")
    try:
        return json_schema_grammar(spec.schema_), "response_format"
    except GrammarError as exc:
        raise bad_request(str(exc), "response_format.json_schema") from None


async def constraint_processors(engine: EngineClient, response_format: ResponseFormat | None,
                                plan: ToolPlan | None = None) -> list[Any]:
    found = _grammar(response_format, plan)
    if found is None:
        return []
    grammar, param = found
    hf_tokenizer = getattr(engine.tokenizer, "hf", None)
    if hf_tokenizer is None:
        raise bad_request(f"{param} needs constrained decoding, which this tokenizer does not offer", param)
    tokenizer = engine.tokenizer

    def build() -> GrammarLogitsProcessor:
        return GrammarLogitsProcessor(grammar, hf_tokenizer, tokenizer.eos_token_ids, tokenizer.vocab_size)

    try:
        return [await asyncio.get_running_loop().run_in_executor(None, build)]
    except GrammarError as exc:
        raise bad_request(f"{param}: {exc}", param) from None
