"""Token ids to their own text, for logprobs in every protocol."""
from __future__ import annotations

from typing import Any


class TokenTexts:
    """Each token's own text (special tokens shown), decoded once and cached."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            try:
                text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            except TypeError:  # a tokenizer whose decode takes only the ids
                text = self._tokenizer.decode([token_id])
            self._cache[token_id] = text
        return text
