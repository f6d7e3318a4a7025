"""Tool calls out of generated text, incrementally: content pieces and OpenAI tool-call deltas.

Two output conventions are understood:
- "hermes" (Hermes, Qwen2/2.5/3, our fallback template): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  possibly several, possibly after some text;
- "llama3_json" (Llama 3.1/3.2/3.3): the whole reply is `{"name": ..., "parameters": {...}}`
  (calls separated by `;`), optionally after `<|python_tag|>`.

Arguments are streamed as the model writes them: the raw text of the arguments object is cut
out of the call as it grows (no re-serialisation, so no half-closed braces are ever sent). The
first delta of each call carries index, id, type and function.name; later ones only index and
an arguments fragment; clients concatenate the fragments.
"""
from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

HERMES = "hermes"
LLAMA3_JSON = "llama3_json"
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
_ARG_KEYS = ("arguments", "parameters")


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


class ObjectScanner:
    """Incremental scan of one JSON object: where each top-level value starts and ends.

    Positions index `text`. Text before the opening brace is skipped (and remembered in `junk`
    when it is not whitespace, which means the text is not a tool call).
    """

    def __init__(self) -> None:
        self.text = ""
        self.start: int | None = None  # index of the opening brace
        self.end: int | None = None  # one past the closing brace
        self.spans: dict[str, list[int | None]] = {}  # key -> [value start, value end]
        self.junk = False
        self._pos = 0
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._string_start = 0
        self._expect_key = True
        self._key: str | None = None  # key whose value is being read at depth 1
        self._value_key: str | None = None

    def feed(self, more: str) -> None:
        self.text += more
        text = self.text
        while self._pos < len(text) and self.end is None:
            self._step(text, text[self._pos])
            self._pos += 1

    def _step(self, text: str, c: str) -> None:
        if self._in_string:
            if self._escape:
                self._escape = False
            elif c == "\\":
                self._escape = True
            elif c == '"':
                self._in_string = False
                if self._depth == 1 and self._expect_key:
                    self._key = _loads_or_none(text[self._string_start:self._pos + 1])
                elif self._depth == 1 and self._value_key is not None:
                    self._close_value(self._pos + 1)
            return
        if self._depth == 0:
            if c == "{":
                self.start, self._depth = self._pos, 1
            elif not c.isspace():
                self.junk = True
            return
        if c == '"':
            self._in_string = True
            self._string_start = self._pos
            self._open_value()
        elif c in "{[":
            self._open_value()
            self._depth += 1
        elif c in "}]":
            if self._depth == 1:
                self._close_value(self._trimmed(self._pos))
                self.end = self._pos + 1
            self._depth -= 1
            if self._depth == 1 and self._value_key is not None:
                self._close_value(self._pos + 1)
        elif self._depth == 1 and c == ":":
            self._expect_key = False
            self._value_key = self._key
        elif self._depth == 1 and c == ",":
            self._close_value(self._trimmed(self._pos))
            self._expect_key = True
        elif self._depth == 1 and not c.isspace():
            self._open_value()  # a number, true, false or null

    def _open_value(self) -> None:
        if self._depth == 1 and not self._expect_key and self._value_key is not None:
            span = self.spans.setdefault(self._value_key, [None, None])
            if span[0] is None:
                span[0] = self._pos

    def _close_value(self, end: int) -> None:
        key = self._value_key
        if key is not None and key in self.spans and self.spans[key][1] is None:
            self.spans[key][1] = end
        self._value_key = None

    def _trimmed(self, end: int) -> int:
        while end > 0 and self.text[end - 1].isspace():
            end -= 1
        return end

    def value_text(self, key: str) -> tuple[str | None, bool]:
        """The raw text of `key`'s value so far, and whether it is complete."""
        span = self.spans.get(key)
        if span is None or span[0] is None:
            return None, False
        if span[1] is None:
            return self.text[span[0]:self._pos], False
        return self.text[span[0]:span[1]], True

    def first_key(self) -> str | None:
        return min(self.spans, key=lambda k: self.spans[k][0] or 0) if self.spans else None


def _loads_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


@dataclass
class ParsedCall:
    index: int
    id: str = field(default_factory=new_call_id)
    name: str | None = None
    arguments_sent: str = ""  # the argument text already streamed
    announced: bool = False  # the first delta (id, type, name) went out

    def as_message_call(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name or "", "arguments": self.arguments_sent or "{}"}}


class _CallBuilder:
    """One call's JSON text → deltas; streams arguments only when "name" comes first."""

    def __init__(self, call: ParsedCall) -> None:
        self.call = call
        self.scanner = ObjectScanner()

    def feed(self, text: str) -> list[dict[str, Any]]:
        self.scanner.feed(text)
        return self._deltas(final=False)

    def _name(self) -> str | None:
        text, complete = self.scanner.value_text("name")
        value = _loads_or_none(text) if complete and text else None
        return value if isinstance(value, str) else None

    def _arguments(self, final: bool) -> str | None:
        for key in _ARG_KEYS:
            text, complete = self.scanner.value_text(key)
            if text is None:
                continue
            if text.startswith("{") or text.startswith("["):
                return text
            if complete or final:  # a string holding JSON (some models) or a scalar: send whole
                value = _loads_or_none(text)
                return value if isinstance(value, str) else text
            return ""
        return None

    def _deltas(self, final: bool) -> list[dict[str, Any]]:
        call = self.call
        name = self._name()
        streamable = self.scanner.first_key() == "name" or final
        if name is None or not streamable:
            return []
        out: list[dict[str, Any]] = []
        if not call.announced:
            call.name, call.announced = name, True
            out.append({"index": call.index, "id": call.id, "type": "function",
                        "function": {"name": name, "arguments": ""}})
        arguments = self._arguments(final)
        if arguments and len(arguments) > len(call.arguments_sent) and arguments.startswith(call.arguments_sent):
            piece = arguments[len(call.arguments_sent):]
            call.arguments_sent = arguments
            out.append({"index": call.index, "function": {"arguments": piece}})
        return out

    def finish(self) -> tuple[bool, list[dict[str, Any]]]:
        """(is a valid call, last deltas)."""
        scanner = self.scanner
        if scanner.junk or scanner.start is None:
            return False, []
        whole = _loads_or_none(scanner.text[scanner.start:scanner.end]) if scanner.end else None
        if not self.call.announced and not (isinstance(whole, dict) and isinstance(whole.get("name"), str)):
            return False, []
        deltas = self._deltas(final=True)
        if self.call.announced and not self.call.arguments_sent:
            self.call.arguments_sent = "{}"
            deltas.append({"index": self.call.index, "function": {"arguments": "{}"}})
        return True, deltas


class ToolCallParser:
    """Feed text deltas of one choice; get back (content, tool-call deltas) per feed."""

    def __init__(self, style: str = HERMES) -> None:
        if style not in (HERMES, LLAMA3_JSON):
            raise ValueError(f"unknown tool-call style {style!r}")
        self.style = style
        self.calls: list[ParsedCall] = []
        self._buffer = ""  # text not yet classified
        self._builder: _CallBuilder | None = None
        self._raw_call = ""  # the current call's text, to hand back as content if it is no call
        self._mode = "start" if style == LLAMA3_JSON else "text"

    @property
    def has_calls(self) -> bool:
        return any(c.announced for c in self.calls)

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        self._buffer += text
        return self._drain(final=False)

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        return self._drain(final=True)

    # -- the state machine --

    def _drain(self, final: bool) -> tuple[str, list[dict[str, Any]]]:
        content, deltas = [], []
        while True:
            before = (self._mode, len(self._buffer))
            if self._mode == "start":
                self._start(final)
            if self._mode == "text":
                content.append(self._text(final))
            if self._mode == "call":
                piece, more = self._in_call(final)
                content.append(piece)
                deltas.extend(more)
            if (self._mode, len(self._buffer)) == before or not self._buffer:
                break
        if final and self._mode == "call" and self._builder is not None:
            content.append(self._end_call(deltas))  # cut off: no closing tag or brace
        text = "".join(content)
        if final:
            text += self._buffer
            self._buffer = ""
        return text, deltas

    def _start(self, final: bool) -> None:
        """llama3_json: a reply (or what follows a call) that opens with `{` is a call."""
        stripped = self._buffer.lstrip()
        if stripped.startswith(_PYTHON_TAG):
            stripped = stripped[len(_PYTHON_TAG):].lstrip()
        if self.has_calls:
            stripped = stripped.lstrip("; \n\t")
        if not stripped:
            if self.has_calls:
                self._buffer = ""  # separators between calls are no content
            if final:
                self._mode = "text"
            return
        if _PYTHON_TAG.startswith(stripped) and not final:
            return
        if stripped.startswith("{"):
            self._buffer = stripped
            self._open_call()
        else:
            self._mode = "text"

    def _text(self, final: bool) -> str:
        if self.style == LLAMA3_JSON:
            out, self._buffer = self._buffer, ""
            return out
        at = self._buffer.find(_OPEN)
        if at >= 0:
            out = self._buffer[:at]
            self._buffer = self._buffer[at + len(_OPEN):]
            self._open_call()
            return "" if self.has_calls and not out.strip() else out
        keep = 0 if final else partial_suffix(self._buffer, _OPEN)
        cut = len(self._buffer) - keep
        out, self._buffer = self._buffer[:cut], self._buffer[cut:]
        if self.has_calls and not out.strip():
            return ""  # whitespace between or after calls
        return out

    def _open_call(self) -> None:
        self._builder = _CallBuilder(ParsedCall(index=len(self.calls)))
        self._raw_call = ""
        self._mode = "call"

    def _in_call(self, final: bool) -> tuple[str, list[dict[str, Any]]]:
        assert self._builder is not None
        if self.style == HERMES:
            at = self._buffer.find(_CLOSE)
            if at < 0:
                keep = 0 if final else partial_suffix(self._buffer, _CLOSE)
                cut = len(self._buffer) - keep
                chunk, self._buffer = self._buffer[:cut], self._buffer[cut:]
                self._raw_call += chunk
                return "", self._builder.feed(chunk)
            chunk, self._buffer = self._buffer[:at], self._buffer[at + len(_CLOSE):]
            self._raw_call += chunk
            deltas = self._builder.feed(chunk)
            return self._end_call(deltas, closed=True), deltas
        # llama3_json: the call ends with its closing brace; `;` or whitespace may separate calls
        deltas = self._builder.feed(self._buffer)
        self._raw_call += self._buffer
        self._buffer = ""
        scanner = self._builder.scanner
        if scanner.end is None:
            return "", deltas
        rest = scanner.text[scanner.end:]
        if rest:
            self._raw_call = self._raw_call[:-len(rest)]
        content = self._end_call(deltas, closed=True)
        self._buffer = rest
        self._mode = "start"
        return content, deltas

    def _end_call(self, deltas: list[dict[str, Any]], closed: bool = False) -> str:
        """Close the current call; returns content to emit when it turned out not to be a call."""
        assert self._builder is not None
        ok, more = self._builder.finish()
        deltas.extend(more)
        builder, self._builder = self._builder, None
        self._mode = "text"
        if ok:
            self.calls.append(builder.call)
            return ""
        raw = self._raw_call
        if self.style == HERMES:
            return _OPEN + raw + (_CLOSE if closed else "")
        return raw


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag` (held back)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0
