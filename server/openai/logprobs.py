"""Token logprobs in the two OpenAI formats (chat's `content` list, legacy completions' columns)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.request.sequence import TokenLogprob
from server.core.token_texts import TokenTexts


def _finite(value: float) -> float:
    # JSON has no -inf; OpenAI reports -9999.0 for impossible tokens.
    return value if value > -9999.0 else -9999.0


def chat_logprobs(entries: list[TokenLogprob], texts: TokenTexts) -> list[dict[str, Any]]:
    out = []
    for entry in entries:
        token = texts(entry.token_id)
        out.append({
            "token": token, "logprob": _finite(entry.logprob), "bytes": list(token.encode("utf-8")),
            "top_logprobs": [{"token": texts(i), "logprob": _finite(lp), "bytes": list(texts(i).encode("utf-8"))}
                             for i, lp in entry.top],
        })
    return out


class CompletionLogprobs:
    """Accumulates the legacy format: tokens, token_logprobs, top_logprobs, text_offset."""

    def __init__(self, texts: TokenTexts, offset: int = 0) -> None:
        self._texts = texts
        self._offset = offset

    def piece(self, entries: list[TokenLogprob]) -> dict[str, Any]:
        return self.tokens_piece([entry.token_id for entry in entries], entries)

    def tokens_piece(self, token_ids: list[int], entries: Sequence[TokenLogprob | None]) -> dict[str, Any]:
        """Tokens with their entries; a token without one (an echoed prompt's first) gets null, as
        OpenAI reports it."""
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for token_id, entry in zip(token_ids, entries, strict=False):
            token = self._texts(token_id)
            tokens.append(token)
            token_logprobs.append(None if entry is None else _finite(entry.logprob))
            tops.append(None if entry is None else {self._texts(i): _finite(lp) for i, lp in entry.top})
            offsets.append(self._offset)
            self._offset += len(token)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def merge_completion_logprobs(pieces: list[dict[str, Any]]) -> dict[str, Any]:
    merged: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for piece in pieces:
        for key in merged:
            merged[key].extend(piece[key])
    return merged
