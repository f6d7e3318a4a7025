"""A Messages request as the chat request that the chat pipeline runs.

- `system` (a string or text blocks) and every `role: "system"` message become the one system
  prompt, in order: chat templates accept a system turn only first. Claude Code's billing
  block is dropped (billing.py).
- User text → user turns; each `tool_result` → a `tool` turn (`is_error` marks its text with
  "Error: "); assistant text and `tool_use` → an assistant turn with tool_calls.
- `thinking` / `redacted_thinking` blocks that clients echo back are dropped: the model sees
  its earlier answers, not its earlier reasoning (as templates of reasoning models do too).
- Images and documents are refused (400): the served models read text only.
- tool_choice auto / any / tool / none → auto / required / the named function / none; thinking
  disabled → `enable_thinking: false` for templates that read it (Qwen3).
"""
from __future__ import annotations

import json
from typing import Any

from server.anthropic.billing import without_billing_header
from server.anthropic.protocol import (
    Conversation,
    MediaBlock,
    Message,
    MessagesRequest,
    TextBlock,
    ThinkingBlock,
    ToolChoice,
    ToolResultBlock,
    ToolUseBlock,
)
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


def _refuse_media(where: str, block: MediaBlock) -> None:
    raise bad_request(f"{where}: {block.type} content blocks are not supported; this server's model reads text only",
                      where)


def _system_texts(req: Conversation) -> list[str]:
    if req.system is None:
        texts = []
    elif isinstance(req.system, str):
        texts = [req.system]
    else:
        texts = [block.text for block in req.system]
    for i, message in enumerate(req.messages):
        if message.role == "system":
            texts.extend(_texts(message, f"messages[{i}].content"))
    return [t for t in without_billing_header(texts) if t]


def _texts(message: Message, where: str) -> list[str]:
    out = []
    for j, block in enumerate(message.blocks()):
        if isinstance(block, TextBlock):
            out.append(block.text)
        elif isinstance(block, MediaBlock):
            _refuse_media(f"{where}[{j}]", block)
        elif not isinstance(block, ThinkingBlock):
            raise bad_request(f"{where}[{j}]: {block.type} blocks belong in user or assistant messages", where)
    return out


def _tool_result_text(block: ToolResultBlock, where: str) -> str:
    if block.content is None:
        text = ""
    elif isinstance(block.content, str):
        text = block.content
    else:
        parts = []
        for k, part in enumerate(block.content):
            if isinstance(part, MediaBlock):
                _refuse_media(f"{where}.content[{k}]", part)
            else:
                parts.append(part.text)
        text = "\n".join(parts)
    return f"Error: {text}" if block.is_error else text


def _user_turns(message: Message, where: str) -> list[ChatMessage]:
    turns: list[ChatMessage] = []
    pending: list[str] = []

    def flush() -> None:
        if pending:
            turns.append(ChatMessage(role="user", content="\n".join(pending)))
            pending.clear()

    for j, block in enumerate(message.blocks()):
        if isinstance(block, TextBlock):
            pending.append(block.text)
        elif isinstance(block, ToolResultBlock):
            flush()
            turns.append(ChatMessage(role="tool", tool_call_id=block.tool_use_id,
                                     content=_tool_result_text(block, f"{where}[{j}]")))
        elif isinstance(block, MediaBlock):
            _refuse_media(f"{where}[{j}]", block)
        elif isinstance(block, ToolUseBlock):
            raise bad_request(f"{where}[{j}]: tool_use blocks belong in assistant messages", f"{where}[{j}]")
    flush()
    return turns


def _assistant_turn(message: Message, where: str) -> ChatMessage | None:
    texts, calls = [], []
    for j, block in enumerate(message.blocks()):
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolUseBlock):
            calls.append(ToolCall(id=block.id, function=FunctionCall(
                name=block.name, arguments=json.dumps(block.input, ensure_ascii=False))))
        elif isinstance(block, MediaBlock):
            _refuse_media(f"{where}[{j}]", block)
        elif isinstance(block, ToolResultBlock):
            raise bad_request(f"{where}[{j}]: tool_result blocks belong in user messages", f"{where}[{j}]")
    if not texts and not calls:
        return None  # only thinking: nothing the model should see again
    return ChatMessage(role="assistant", content="".join(texts), tool_calls=calls or None)


def chat_messages(req: Conversation) -> list[ChatMessage]:
    system = _system_texts(req)
    out = [ChatMessage(role="system", content="\n\n".join(system))] if system else []
    for i, message in enumerate(req.messages):
        where = f"messages[{i}].content"
        if message.role == "user":
            out.extend(_user_turns(message, where))
        elif message.role == "assistant":
            turn = _assistant_turn(message, where)
            if turn is not None:
                out.append(turn)
    if len(out) == (1 if system else 0):
        raise bad_request("messages: no user or assistant content to answer", "messages")
    return out


def _tool_choice(choice: ToolChoice | None) -> Any:
    if choice is None:
        return None
    if choice.type == "tool":
        if not choice.name:
            raise bad_request("tool_choice of type 'tool' needs the tool's name", "tool_choice.name")
        return NamedToolChoice(function=NamedFunction(name=choice.name))
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def _template_kwargs(req: Conversation) -> dict[str, Any] | None:
    if req.thinking is None:
        return None
    return {"enable_thinking": req.thinking.type != "disabled"}


def _conversation_fields(req: Conversation) -> dict[str, Any]:
    tools = [Tool(function=FunctionDefinition(name=t.name, description=t.description, parameters=t.input_schema))
             for t in req.tools or []]
    return dict(model=req.model, messages=chat_messages(req), tools=tools or None,
                tool_choice=_tool_choice(req.tool_choice), chat_template_kwargs=_template_kwargs(req))


def chat_request(req: Conversation) -> ChatCompletionRequest:
    """The prompt part only (count_tokens)."""
    return ChatCompletionRequest(**_conversation_fields(req))


def generation_request(req: MessagesRequest) -> ChatCompletionRequest:
    """The whole request: the prompt, the output budget and the sampling fields."""
    if req.max_tokens < 1:
        raise bad_request(f"max_tokens must be at least 1, got {req.max_tokens}", "max_tokens")
    response_format = None
    if req.output_config is not None and req.output_config.format is not None:
        response_format = ResponseFormat(type="json_schema",
                                         json_schema=JsonSchemaFormat(schema=req.output_config.format.schema_))
    return ChatCompletionRequest(**_conversation_fields(req), max_tokens=req.max_tokens, stop=req.stop_sequences,
                                 temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                                 response_format=response_format, stream=bool(req.stream))
