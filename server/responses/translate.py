"""A Responses request as the chat request that the chat pipeline runs.

- `instructions` and every system / developer message become the one system prompt, in order
  (chat templates accept a system turn only first).
- User messages → user turns; assistant messages → assistant turns; a `function_call` or
  `custom_tool_call` item joins the assistant turn before it (one turn with tool_calls, as chat
  templates expect); `function_call_output` / `custom_tool_call_output` → tool turns.
- `reasoning` items that clients echo back are dropped: the model sees its earlier answers, not
  its earlier reasoning (as the templates of reasoning models do). Other item types with nothing
  for a text model (web search calls, ...) are dropped too.
- Image, file and audio parts are refused (400): the served models read text only.
- Tools: `function` tools as they are; `custom` (freeform) tools as a function taking one string
  argument, `input`, whose description carries the tool's grammar (custom_tools.py); hosted and
  namespaced tools are not shown to the model.
- tool_choice auto / none / required / {type: function | custom, name}; text.format → the chat
  request's response_format (constrained decoding); reasoning.effort "none" →
  `enable_thinking: false` for templates that read it (Qwen3); `chat_template_kwargs` pass on.
- Stateless: `previous_response_id`, `conversation` and `background` are a 400 naming the field
  (no response is kept; clients such as Codex send `store: false` and the whole history).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from server.core.errors import bad_request
from server.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    FunctionDefinition,
    JsonSchemaFormat,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    Tool,
    ToolCall,
)
from server.responses.custom_tools import CUSTOM_INPUT_KEY, custom_tool_definition
from server.responses.protocol import (
    Content,
    CustomTool,
    CustomToolCallItem,
    CustomToolCallOutputItem,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    MediaPart,
    MessageItem,
    NamedTool,
    RefusalPart,
    ResponseInput,
    ResponsesRequest,
)


@dataclass(frozen=True)
class Translation:
    chat: ChatCompletionRequest
    custom_tools: frozenset[str]  # calls of these become custom_tool_call items


def _text(content: Content, where: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if isinstance(part, MediaPart):
            raise bad_request(f"{where}[{j}]: {part.type} content is not supported; this server's model reads text "
                              "only", f"{where}[{j}]")
        texts.append(part.refusal if isinstance(part, RefusalPart) else part.text)
    return "\n".join(texts)


def _refuse_state(req: ResponseInput) -> None:
    if req.previous_response_id is not None:
        raise bad_request("previous_response_id is not supported: this server keeps no responses; send the whole "
                          "conversation as input (as store: false clients do)", "previous_response_id")
    if req.conversation is not None:
        raise bad_request("conversation is not supported: this server keeps no conversations; send the whole "
                          "conversation as input", "conversation")


class _Turns:
    """Chat turns built item by item; calls join the assistant turn they follow."""

    def __init__(self) -> None:
        self.system: list[str] = []
        self.turns: list[ChatMessage] = []

    def message(self, item: MessageItem, where: str) -> None:
        text = _text(item.content, f"{where}.content")
        if item.role in ("system", "developer"):
            if text:
                self.system.append(text)
        else:
            self.turns.append(ChatMessage(role=item.role, content=text))

    def call(self, call_id: str, name: str, arguments: str) -> None:
        call = ToolCall(id=call_id, function=FunctionCall(name=name, arguments=arguments))
        last = self.turns[-1] if self.turns else None
        if last is not None and last.role == "assistant":
            last.tool_calls = [*(last.tool_calls or []), call]
        else:
            self.turns.append(ChatMessage(role="assistant", content="", tool_calls=[call]))

    def output(self, call_id: str, output: Content, where: str) -> None:
        self.turns.append(ChatMessage(role="tool", tool_call_id=call_id, content=_text(output, where)))

    def messages(self) -> list[ChatMessage]:
        if not self.turns:
            raise bad_request("input: no user or assistant content to answer", "input")
        system = [ChatMessage(role="system", content="\n\n".join(self.system))] if self.system else []
        return system + self.turns


def chat_messages(req: ResponseInput) -> list[ChatMessage]:
    turns = _Turns()
    if req.instructions:
        turns.system.append(req.instructions)
    items = [MessageItem(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if isinstance(item, MessageItem):
            turns.message(item, where)
        elif isinstance(item, FunctionCallItem):
            turns.call(item.call_id, item.name, item.arguments)
        elif isinstance(item, CustomToolCallItem):
            turns.call(item.call_id, item.name, json.dumps({CUSTOM_INPUT_KEY: item.input}, ensure_ascii=False))
        elif isinstance(item, (FunctionCallOutputItem, CustomToolCallOutputItem)):
            turns.output(item.call_id, item.output, f"{where}.output")
    return turns.messages()


def _tools(req: ResponseInput) -> tuple[list[Tool], frozenset[str]]:
    tools, custom = [], set()
    for spec in req.tools or []:
        if isinstance(spec, FunctionTool):
            tools.append(Tool(function=FunctionDefinition(name=spec.name, description=spec.description,
                                                          parameters=spec.parameters, strict=spec.strict)))
        elif isinstance(spec, CustomTool):
            tools.append(Tool(function=custom_tool_definition(spec)))
            custom.add(spec.name)
    return tools, frozenset(custom)


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, NamedTool):
        if choice.type not in ("function", "custom"):
            return "auto"  # a hosted tool (web_search, ...) that is not shown to the model
        if not choice.name:
            raise bad_request(f"tool_choice of type {choice.type!r} needs the tool's name", "tool_choice.name")
        return NamedToolChoice(function=NamedFunction(name=choice.name))
    return choice


def _template_kwargs(req: ResponseInput) -> dict[str, Any] | None:
    kwargs = dict(req.chat_template_kwargs or {})
    if req.reasoning is not None and req.reasoning.effort == "none":
        kwargs.setdefault("enable_thinking", False)
    return kwargs or None


def _response_format(req: ResponseInput) -> ResponseFormat | None:
    spec = req.text.format if req.text is not None else None
    if spec is None:
        return None
    if spec.type != "json_schema":
        return ResponseFormat(type=spec.type)
    if spec.schema_ is None:
        raise bad_request("text.format of type json_schema needs schema", "text.format.schema")
    return ResponseFormat(type="json_schema",
                          json_schema=JsonSchemaFormat(name=spec.name, schema=spec.schema_, strict=spec.strict))


def _conversation_fields(req: ResponseInput) -> tuple[dict[str, Any], frozenset[str]]:
    _refuse_state(req)
    tools, custom = _tools(req)
    fields = dict(model=req.model, messages=chat_messages(req), tools=tools or None,
                  tool_choice=_tool_choice(req.tool_choice), parallel_tool_calls=req.parallel_tool_calls,
                  response_format=_response_format(req), chat_template_kwargs=_template_kwargs(req))
    return fields, custom


def prompt_request(req: ResponseInput) -> Translation:
    """The prompt part only (input_tokens)."""
    fields, custom = _conversation_fields(req)
    return Translation(ChatCompletionRequest(**fields), custom)


def generation_request(req: ResponsesRequest) -> Translation:
    """The whole request: the prompt, the output budget and the sampling fields."""
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise bad_request(f"max_output_tokens must be at least 1, got {req.max_output_tokens}", "max_output_tokens")
    if req.background:
        raise bad_request("background responses are not supported: this server keeps no responses", "background")
    fields, custom = _conversation_fields(req)
    chat = ChatCompletionRequest(**fields, max_completion_tokens=req.max_output_tokens, temperature=req.temperature,
                                 top_p=req.top_p, stream=bool(req.stream))
    return Translation(chat, custom)
