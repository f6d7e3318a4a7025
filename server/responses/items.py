"""Parsed chat deltas → Responses output items, as stream events and as the finished list.

Reasoning, text and tool calls become `reasoning`, `message` and `function_call` /
`custom_tool_call` items in the order the model wrote them; an item closes when the next one
opens or the turn ends, and every delta event of an item comes after its
`response.output_item.added` and before its `response.output_item.done`:

- reasoning: `response.reasoning_text.delta`* → `response.reasoning_text.done`
- message: `response.content_part.added` → `response.output_text.delta`* →
  `response.output_text.done` → `response.content_part.done`
- function_call: `response.function_call_arguments.delta`* → `.done`
- custom_tool_call: its input (the `input` argument of the function it is shown as) once the call
  is complete, as one `response.custom_tool_call_input.delta` → `.done`

Events carry no sequence number here; the writer numbers the whole stream (run.py).
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

from server.openai.chat_stream import ChoiceDelta, ToolCallDelta
from server.responses.custom_tools import custom_input

Event = tuple[str, dict[str, Any]]  # (event type, payload without type and sequence_number)
COMPLETED, INCOMPLETE, IN_PROGRESS = "completed", "incomplete", "in_progress"


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}


@dataclass
class OutputItems:
    custom_tools: frozenset[str] = frozenset()
    items: list[dict[str, Any]] = field(default_factory=list)
    _open: dict[str, Any] | None = None
    _call_index: int | None = None
    _arguments: str = ""  # a custom call's function arguments, unwrapped when it closes

    @property
    def reasoning_text(self) -> str:
        return "".join(part["text"] for item in self.items if item["type"] == "reasoning" for part in item["content"])

    def feed(self, delta: ChoiceDelta) -> list[Event]:
        events: list[Event] = []
        if delta.reasoning:
            events += self._reasoning(delta.reasoning)
        if delta.text:
            events += self._text(delta.text)
        for piece in delta.tool_calls:
            events += self._tool_call(piece)
        return events

    def close(self, status: str = COMPLETED) -> list[Event]:
        item = self._open
        if item is None:
            return []
        self._open, self._call_index = None, None
        item["status"] = status
        where = self._where(item)
        kind = item["type"]
        if kind == "reasoning":
            text = item["content"][0]["text"]
            events = [("response.reasoning_text.done", {**where, "content_index": 0, "text": text})]
        elif kind == "message":
            part = item["content"][0]
            events = [("response.output_text.done",
                       {**where, "content_index": 0, "text": part["text"], "logprobs": []}),
                      ("response.content_part.done", {**where, "content_index": 0, "part": part})]
        elif kind == "function_call":
            item["arguments"] = item["arguments"] or "{}"
            events = [("response.function_call_arguments.done", {**where, "arguments": item["arguments"]})]
        else:
            item["input"] = custom_input(self._arguments)
            self._arguments = ""
            events = [("response.custom_tool_call_input.delta", {**where, "delta": item["input"]}),
                      ("response.custom_tool_call_input.done", {**where, "input": item["input"]})]
        return events + [("response.output_item.done", {"output_index": where["output_index"], "item": item})]

    # ----- one item at a time ----------------------------------------------------------------------
    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self.items.index(item)}

    def _start(self, item: dict[str, Any], shown: dict[str, Any]) -> list[Event]:
        events = self.close()
        self.items.append(item)
        self._open = item
        return events + [("response.output_item.added", {"output_index": len(self.items) - 1, "item": shown})]

    def _is_open(self, kind: str) -> bool:
        return self._open is not None and self._open["type"] == kind

    def _reasoning(self, text: str) -> list[Event]:
        events: list[Event] = []
        if not self._is_open("reasoning"):
            item = {"id": new_id("rs"), "type": "reasoning", "summary": [],
                    "content": [{"type": "reasoning_text", "text": ""}], "status": IN_PROGRESS}
            events = self._start(item, {**item, "content": []})
        assert self._open is not None
        self._open["content"][0]["text"] += text
        return events + [("response.reasoning_text.delta", {**self._where(self._open), "content_index": 0,
                                                             "delta": text})]

    def _text(self, text: str) -> list[Event]:
        events: list[Event] = []
        if not self._is_open("message"):
            item = {"id": new_id("msg"), "type": "message", "role": "assistant", "status": IN_PROGRESS,
                    "content": [output_text("")]}
            events = self._start(item, {**item, "content": []})
            events.append(("response.content_part.added", {**self._where(item), "content_index": 0,
                                                            "part": output_text("")}))
        assert self._open is not None
        self._open["content"][0]["text"] += text
        return events + [("response.output_text.delta", {**self._where(self._open), "content_index": 0,
                                                          "delta": text, "logprobs": []})]

    def _tool_call(self, piece: ToolCallDelta) -> list[Event]:
        events: list[Event] = []
        if piece.opens_call and piece.id is not None:
            name = piece.name or ""
            if name in self.custom_tools:
                opened: dict[str, Any] = {"id": new_id("ctc"), "type": "custom_tool_call", "call_id": piece.id,
                                          "name": name, "input": "", "status": IN_PROGRESS}
            else:
                opened = {"id": new_id("fc"), "type": "function_call", "call_id": piece.id, "name": name,
                          "arguments": "", "status": IN_PROGRESS}
            events = self._start(opened, dict(opened))
            self._call_index = piece.call_index
        item = self._open
        if not piece.arguments or item is None or self._call_index != piece.call_index:
            return events
        if item["type"] == "custom_tool_call":
            self._arguments += piece.arguments
            return events
        item["arguments"] += piece.arguments
        return events + [("response.function_call_arguments.delta", {**self._where(item), "delta": piece.arguments})]
