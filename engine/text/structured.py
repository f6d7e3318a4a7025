"""Grammar-constrained decoding (JSON mode, JSON schema, forced tool calls) with llguidance.

A `GrammarLogitsProcessor` is a per-request logits processor: called with one sequence's output
token ids so far and that sequence's logits row, it sets every token the grammar does not allow
next to -inf. It is stateless towards the engine: it finds (or rebuilds) the matcher whose
consumed tokens are a prefix of the ids it is given, so `n` choices, preemption by recompute
and repeated calls for the same step all work without any engine bookkeeping.
"""
from __future__ import annotations

import json
import threading
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # declared only in the stub; llguidance loads lazily

_JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "lenient": True}
# Per HF tokenizer object (weakly held: a new tokenizer may reuse a dead one's id) and settings.
_tokenizer_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_tokenizer_lock = threading.Lock()


class GrammarError(ValueError):
    """The grammar or schema cannot be compiled; the message says why."""


def _ll_tokenizer(hf_tokenizer: Any, eos_token_ids: list[int], vocab_size: int) -> Any:
    import llguidance.hf

    key = (vocab_size, tuple(sorted(eos_token_ids)))
    with _tokenizer_lock:
        built = _tokenizer_cache.setdefault(hf_tokenizer, {})
        if key not in built:  # ~1 s for a 150k vocabulary: once per tokenizer
            built[key] = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=list(key[1]))
        return built[key]


def json_schema_grammar(schema: dict[str, Any] | None) -> str:
    """A grammar for one JSON value matching `schema` (None: any JSON object, i.e. JSON mode)."""
    import llguidance

    schema = {"type": "object"} if schema is None else schema
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
    except ValueError as exc:
        raise GrammarError(f"invalid JSON schema: {exc}") from exc


def lark_grammar(lark: str) -> str:
    import llguidance

    return llguidance.LLMatcher.grammar_from_lark(lark)


def json_in_lark(schema: dict[str, Any]) -> str:
    """`%json {...}`: a JSON-schema value inside a Lark rule (compact, lenient)."""
    return "%json " + json.dumps({**schema, "x-guidance": _JSON_OPTIONS})


class GrammarLogitsProcessor:
    def __init__(self, grammar: str, hf_tokenizer: Any, eos_token_ids: list[int] | set[int],
                 vocab_size: int) -> None:
        import llguidance

        self._vocab_size = vocab_size
        self._tokenizer = _ll_tokenizer(hf_tokenizer, list(eos_token_ids), vocab_size)
        self._root = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if self._root.is_error():
            raise GrammarError(self._root.get_error())
        self._branches: list[tuple[list[int], Any]] = []  # (consumed ids, matcher)
        self._lock = threading.Lock()

    def _matcher_for(self, output_ids: list[int]) -> Any:
        best = None
        for index, (consumed, _) in enumerate(self._branches):
            if len(consumed) <= len(output_ids) and output_ids[:len(consumed)] == consumed:
                if best is None or len(consumed) > len(self._branches[best][0]):
                    best = index
        if best is None:
            consumed, matcher = [], self._root.deep_copy()
            self._branches.append((consumed, matcher))
        else:
            consumed, matcher = self._branches[best]
        new = output_ids[len(consumed):]
        if new:
            matcher.consume_tokens(new)
            consumed.extend(new)
        return matcher

    def __call__(self, output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        with self._lock:
            matcher = self._matcher_for(list(output_ids))
            if matcher.is_error():
                return logits  # a token the grammar refused got in (it cannot, unless forced): do no harm
            packed = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(packed, bitorder="little")[:self._vocab_size].astype(bool)
        mask = torch.zeros(logits.shape[-1], dtype=torch.bool)
        mask[:allowed.size] = torch.from_numpy(allowed)[:logits.shape[-1]]
        return logits.masked_fill(~mask.to(logits.device), float("-inf"))
