"""A chat generation as protocol-neutral events, for every wire format that renders a chat turn.

`ChatDecoder` runs the engine's outputs through the reasoning parser (server/openai/reasoning.py, for
thinking models) and the tool-call parser of each choice and yields one `ChoiceDelta` per
engine delta: new reasoning text, new answer text, tool-call pieces (a call's first piece
carries its id and name, later ones only argument text), and, on the last one, the finish
reason and the stop sequence that ended it. Writers (OpenAI chat in server/openai/chat.py, Anthropic Messages in
server/anthropic/) turn these into their own JSON or SSE; none of them sees the engine or the
parser. Usage comes from the Generation (`TurnUsage.of`).
"""
from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from engine.request.outputs import CompletionDelta
from engine.request.sequence import TokenLogprob
from server.core.generation import Generation
from server.openai.reasoning import ReasoningParser, ReasoningSplit
from server.openai.respond import choice_error
from server.openai.tool_parser import ToolCallParser
from server.openai.tools import ToolPlan

STOP, LENGTH, TOOL_CALLS = "stop", "length", "tool_calls"


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of one tool call: the first has `id` and `name` (and maybe no arguments yet)."""

    call_index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    @property
    def opens_call(self) -> bool:
        return self.id is not None

    @staticmethod
    def from_parser(piece: dict[str, Any]) -> ToolCallDelta:
        function = piece.get("function", {})
        return ToolCallDelta(piece["index"], function.get("arguments", ""), piece.get("id"), function.get("name"))


@dataclass(frozen=True)
class ChoiceDelta:
    """One engine delta of one choice, parsed. `reasoning` comes before `text` in the output;
    `finish_reason`: stop | length | tool_calls."""

    index: int
    text: str
    reasoning: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str | None = None
    stop_sequence: str | None = None


@dataclass(frozen=True)
class TurnUsage:
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int

    @staticmethod
    def of(gen: Generation) -> TurnUsage:
        return TurnUsage(gen.num_prompt_tokens, gen.num_cached_tokens, gen.num_output_tokens)


def finish_reason(engine_reason: str, has_tool_calls: bool) -> str:
    if engine_reason == STOP and has_tool_calls:
        return TOOL_CALLS
    return engine_reason


@dataclass
class _ChoiceState:
    parser: ToolCallParser | None
    thoughts: ReasoningParser | None
    finish_reason: str | None = None

    def feed(self, delta: CompletionDelta) -> tuple[str, str, list[dict[str, Any]]]:
        """(reasoning, text, tool-call pieces) of one engine delta."""
        reasoning, text = "", delta.text
        if self.thoughts is not None:
            reasoning, text = self.thoughts.feed(text)
            if delta.finish_reason:
                more_reasoning, more_text = self.thoughts.finish()
                reasoning, text = reasoning + more_reasoning, text + more_text
        if self.parser is None:
            return reasoning, text, []
        text, calls = self.parser.feed(text)
        if delta.finish_reason:
            more_text, more_calls = self.parser.finish()
            text, calls = text + more_text, calls + more_calls
        return reasoning, text, calls

    @property
    def has_tool_calls(self) -> bool:
        return self.parser is not None and self.parser.has_calls


@dataclass
class ChatDecoder:
    """The parsed deltas of a chat generation; raises APIError for a choice the engine failed."""

    plan: ToolPlan | None
    num_choices: int
    reasoning: ReasoningSplit | None = None
    _choices: list[_ChoiceState] = field(init=False)

    def __post_init__(self) -> None:
        parse = self.plan is not None and self.plan.parse_calls
        self._choices = [_ChoiceState(ToolCallParser(self.plan.style) if parse and self.plan else None,
                                      ReasoningParser(self.reasoning) if self.reasoning is not None else None)
                         for _ in range(self.num_choices)]

    @property
    def finish_reasons(self) -> list[str]:
        return [c.finish_reason for c in self._choices if c.finish_reason]

    def finish_reason_of(self, index: int) -> str | None:
        return self._choices[index].finish_reason

    async def deltas(self, gen: Generation) -> AsyncGenerator[ChoiceDelta, None]:
        async for _, out in gen.outputs():
            for delta in out.deltas:
                failure = choice_error(delta, out.error) if delta.finish_reason else None
                if failure is not None:
                    raise failure
                yield self._parse(delta)

    def _parse(self, delta: CompletionDelta) -> ChoiceDelta:
        choice = self._choices[delta.index]
        reasoning, text, calls = choice.feed(delta)
        reason, stop_sequence = None, None
        if delta.finish_reason:
            reason = choice.finish_reason = finish_reason(delta.finish_reason, choice.has_tool_calls)
            stop_sequence = delta.stop_reason if isinstance(delta.stop_reason, str) else None
        return ChoiceDelta(delta.index, text, reasoning, tuple(ToolCallDelta.from_parser(c) for c in calls),
                           tuple(delta.logprobs), reason, stop_sequence)
