"""Reasoning out of generated text: what a thinking model writes between `<think>` and `</think>`.

Qwen3, QwQ and the DeepSeek-R1 distills reason in `<think>…</think>` before they answer; some
templates already open the `<think>` in the generation prompt, so the output starts inside it
and only the closing tag appears. `ReasoningParser` splits one choice's text deltas into
(reasoning, content) as they arrive, holding back a tag cut across deltas; every protocol
writer gets the reasoning from the protocol-neutral deltas (server/openai/chat_stream.py).

[model] reasoning_parser: "auto" (on when the chat template mentions `<think>`), "think"
(always), "none" (never: the tags stay in the text). Constrained output (a JSON schema, a
forced tool call) is never split: its grammar leaves no room for a thought.
"""
from __future__ import annotations

from dataclasses import dataclass

from server.openai.tool_parser import partial_suffix

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
AUTO, THINK, NONE = "auto", "think", "none"
REASONING_PARSERS = (AUTO, THINK, NONE)


@dataclass(frozen=True)
class ReasoningSplit:
    """How a generation's text is split: `opens_inside` when the prompt left a `<think>` open."""

    opens_inside: bool


def parser_enabled(mode: str, chat_template: str) -> bool:
    if mode == AUTO:
        return THINK_OPEN in chat_template
    return mode == THINK


def prompt_opens_thought(prompt: str) -> bool:
    """The generation prompt ends inside an open `<think>` (the model continues the thought)."""
    last_open, last_close = prompt.rfind(THINK_OPEN), prompt.rfind(THINK_CLOSE)
    return last_open > last_close and not prompt[last_open + len(THINK_OPEN):].strip()


def reasoning_split(mode: str, chat_template: str, prompt: str, constrained: bool) -> ReasoningSplit | None:
    """The split for one request, or None when its text is not split."""
    if constrained or not parser_enabled(mode, chat_template):
        return None
    return ReasoningSplit(opens_inside=prompt_opens_thought(prompt))


class ReasoningParser:
    """Feed one choice's text deltas; get (reasoning, content) per feed. States: before the reply
    (a leading `<think>` opens a thought), thinking (until `</think>`), answering (all content)."""

    def __init__(self, split: ReasoningSplit) -> None:
        self._state = "thinking" if split.opens_inside else "before"
        self._buffer = ""
        self._after_close = False  # strip the blank lines a template puts between thought and answer

    def feed(self, text: str) -> tuple[str, str]:
        self._buffer += text
        return self._drain(final=False)

    def finish(self) -> tuple[str, str]:
        return self._drain(final=True)

    def _drain(self, final: bool) -> tuple[str, str]:
        reasoning, content = [], []
        while self._buffer:
            if self._state == "before":
                stripped = self._buffer.lstrip()
                if stripped.startswith(THINK_OPEN):
                    self._buffer, self._state = stripped[len(THINK_OPEN):], "thinking"
                    continue
                if not final and THINK_OPEN.startswith(stripped):
                    break  # whitespace or a part of the tag: wait for more
                self._state = "answering"
            elif self._state == "thinking":
                at = self._buffer.find(THINK_CLOSE)
                if at >= 0:
                    reasoning.append(self._buffer[:at])
                    self._buffer, self._state = self._buffer[at + len(THINK_CLOSE):], "answering"
                    self._after_close = True
                    continue
                keep = 0 if final else partial_suffix(self._buffer, THINK_CLOSE)
                cut = len(self._buffer) - keep
                reasoning.append(self._buffer[:cut])
                self._buffer = self._buffer[cut:]
                break
            else:
                if self._after_close:
                    stripped = self._buffer.lstrip("\n")
                    if not stripped and not final:
                        self._buffer = ""
                        break
                    self._buffer, self._after_close = stripped, False
                content.append(self._buffer)
                self._buffer = ""
        return "".join(reasoning), "".join(content)
