"""Incremental detokenization with stop strings: token ids in, finished text deltas out.

Text is decoded from a short window of recent tokens (the "offset" technique): `prefix`
tokens were already emitted and are decoded again only so that the new tokens' text comes out
as it does in context (SentencePiece drops the leading space of the first token of a decode,
byte-level BPE tokens may hold half a character). Each step costs O(window), not O(length).

The window starts on the last few prompt tokens, so the first output token keeps the space it
carries after the prompt (" Paris" after "The capital of France is"). For byte-level BPE
tokenizers (GPT-2, Llama 3, Qwen, SmolLM) that is exactly `decode(output_ids)`; for
SentencePiece ones it differs from it only by that leading space.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.text.tokenizer import Tokenizer

_PROMPT_CONTEXT_TOKENS = 5
_INCOMPLETE = "\ufffd"  # what a decoder yields for bytes that do not (yet) form a character


@dataclass
class DetokenizerStep:
    text: str  # newly finalised text: whole characters, no part of a stop string
    stop_str: str | None  # the stop string that ended the output, if one did


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], stop: list[str],
                 skip_special_tokens: bool = True, include_stop_str_in_output: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._stop = [s for s in stop if s]
        self._include_stop = include_stop_str_in_output
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        if self._decode(context).endswith(_INCOMPLETE):
            context = []  # the prompt ends inside a character: a text diff would be off, start clean
        self._ids = context  # only the window's tokens are kept; older ones are dropped
        self._read = len(context)  # _ids[:_read] has been turned into text
        self._prefix_text = self._decode(self._ids)
        self._held = ""  # decoded text that might be the start of a stop string
        self.stop_str: str | None = None

    @property
    def finished(self) -> bool:
        return self.stop_str is not None

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def add_tokens(self, new_token_ids: list[int]) -> DetokenizerStep:
        """Feed newly generated tokens; after a stop string hit, further tokens are ignored."""
        if self.finished or not new_token_ids:
            return DetokenizerStep("", self.stop_str)
        self._ids.extend(new_token_ids)
        text = self._decode(self._ids)
        if len(text) <= len(self._prefix_text) or text.endswith(_INCOMPLETE):
            return DetokenizerStep("", None)  # nothing complete yet: keep the tokens in the window
        new_text = text[len(self._prefix_text):]
        # Slide: the tokens just decoded become the next prefix.
        self._ids = self._ids[self._read:]
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        return self._release(new_text, final=False)

    def flush(self) -> str:
        """At a normal finish (EOS, length): everything still held back, incomplete bytes included."""
        if self.finished:
            return ""
        text = self._decode(self._ids)
        new_text = text[len(self._prefix_text):]
        self._ids, self._read, self._prefix_text = [], 0, ""
        return self._release(new_text, final=True).text

    def _release(self, new_text: str, final: bool) -> DetokenizerStep:
        buf = self._held + new_text
        hit = self._find_stop(buf)
        if hit is not None:
            start, stop = hit
            self.stop_str = stop
            self._held = ""
            return DetokenizerStep(buf[:start + len(stop)] if self._include_stop else buf[:start], stop)
        keep = 0 if final else self._partial_stop_len(buf)
        self._held = buf[len(buf) - keep:] if keep else ""
        return DetokenizerStep(buf[:len(buf) - keep], None)

    def _find_stop(self, buf: str) -> tuple[int, str] | None:
        # The stop that completes first wins (ties: the one starting earlier), which is what a
        # character-by-character stream would see, so the result never depends on how the text
        # was split into tokens. Held text never contains a whole stop string, so searching
        # only `held + new` finds every occurrence.
        best: tuple[int, int, str] | None = None
        for stop in self._stop:
            start = buf.find(stop)
            if start >= 0:
                key = (start + len(stop), start, stop)
                if best is None or key[:2] < best[:2]:
                    best = key
        return None if best is None else (best[1], best[2])

    def _partial_stop_len(self, buf: str) -> int:
        """Length of the longest tail of `buf` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stop:
            for k in range(min(len(stop) - 1, len(buf)), longest, -1):
                if buf[-k] == stop[0] and buf.endswith(stop[:k]):  # cheap first-char filter
                    longest = k
                    break
        return longest
