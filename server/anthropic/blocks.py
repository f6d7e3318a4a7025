"""Parsed chat deltas → Anthropic content blocks, as stream events and as the finished list.

Reasoning, text and tool calls become `thinking`, `text` and `tool_use` blocks in the order the
model wrote them; a block closes when the next one starts or the turn ends. A thinking block
streams `thinking_delta`s, then one `signature_delta` just before it closes (the signature is
a digest of the thought: clients send it back with the block, and the server drops both). Tool-call arguments stream as
`input_json_delta` pieces (their concatenation is the input object's JSON); the finished
block's `input` is that object ({} when the model was cut off before closing it).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from server.openai.chat_stream import LENGTH, TOOL_CALLS, ChoiceDelta, ToolCallDelta

Event = tuple[str, dict[str, Any]]  # (SSE event name, payload)


def tool_use_id(call_id: str) -> str:
    """Anthropic's toolu_ prefix on the id the tool-call parser made."""
    return "toolu_" + call_id.removeprefix("call_")


def stop_reason(finish_reason: str | None, stop_sequence: str | None) -> str:
    if finish_reason == TOOL_CALLS:
        return "tool_use"
    if finish_reason == LENGTH:
        return "max_tokens"
    return "stop_sequence" if stop_sequence is not None else "end_turn"


def thinking_signature(thinking: str) -> str:
    return "fdserve-" + hashlib.sha256(thinking.encode("utf-8")).hexdigest()[:32]


def _input_object(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


@dataclass
class ContentBlocks:
    blocks: list[dict[str, Any]] = field(default_factory=list)
    _open: dict[str, Any] | None = None
    _arguments: str = ""
    _call_index: int | None = None

    def feed(self, delta: ChoiceDelta) -> list[Event]:
        events: list[Event] = []
        if delta.reasoning:
            events += self._grow("thinking", "thinking", delta.reasoning)
        if delta.text:
            events += self._grow("text", "text", delta.text)
        for piece in delta.tool_calls:
            events += self._tool_call(piece)
        return events

    def close(self) -> list[Event]:
        block = self._open
        if block is None:
            return []
        events: list[Event] = []
        if block["type"] == "tool_use":
            block["input"] = _input_object(self._arguments)
        elif block["type"] == "thinking":
            block["signature"] = thinking_signature(block["thinking"])
            events.append(self._delta({"type": "signature_delta", "signature": block["signature"]}))
        self._open, self._arguments, self._call_index = None, "", None
        return events + [("content_block_stop", {"type": "content_block_stop", "index": len(self.blocks) - 1})]

    def _start(self, block: dict[str, Any]) -> list[Event]:
        events = self.close()
        self.blocks.append(block)
        self._open = block
        empties: dict[str, dict[str, Any]] = {"tool_use": {"input": {}}, "thinking": {"thinking": "", "signature": ""}}
        empty = empties.get(block["type"], {"text": ""})
        shown = {**block, **empty}
        events.append(("content_block_start", {"type": "content_block_start", "index": len(self.blocks) - 1,
                                               "content_block": shown}))
        return events

    def _delta(self, delta: dict[str, Any]) -> Event:
        return "content_block_delta", {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}

    def _grow(self, block_type: str, key: str, text: str) -> list[Event]:
        """Append to the open block of this type (thinking or text), opening one if needed."""
        if self._open is None or self._open["type"] != block_type:
            fresh = {"type": block_type, key: "", **({"signature": ""} if block_type == "thinking" else {})}
            events = self._start(fresh)
        else:
            events = []
        assert self._open is not None
        self._open[key] += text
        return events + [self._delta({"type": f"{key}_delta", key: text})]

    def _tool_call(self, piece: ToolCallDelta) -> list[Event]:
        events: list[Event] = []
        if piece.opens_call and piece.id is not None:
            events = self._start({"type": "tool_use", "id": tool_use_id(piece.id), "name": piece.name or "",
                                  "input": {}})
            self._call_index = piece.call_index
        if piece.arguments and self._call_index == piece.call_index:
            self._arguments += piece.arguments
            events.append(self._delta({"type": "input_json_delta", "partial_json": piece.arguments}))
        return events
