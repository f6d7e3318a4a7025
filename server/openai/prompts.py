"""Chat messages → prompt text → token ids, through the model's chat template."""
from __future__ import annotations

from typing import Any

from server.core.engine_client import EngineClient
from server.core.errors import bad_request
from server.openai.protocol import ChatMessage
from server.openai.tools import ToolPlan, fallback_messages, template_info

_RESERVED_TEMPLATE_ARGS = {"messages", "conversation", "tools", "add_generation_prompt", "tokenize",
                           "chat_template", "return_dict", "documents"}


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """What templates read: text content ("" for null), tool calls with their ids."""
    out = []
    for message in messages:
        item: dict[str, Any] = {"role": message.role, "content": message.text()}
        if message.name:
            item["name"] = message.name
        if message.tool_calls:
            item["tool_calls"] = [c.model_dump(exclude_none=True) for c in message.tool_calls]
        if message.tool_call_id:
            item["tool_call_id"] = message.tool_call_id
        out.append(item)
    return out


def render_chat(engine: EngineClient, messages: list[ChatMessage], plan: ToolPlan | None,
                add_generation_prompt: bool = True, template_kwargs: dict[str, Any] | None = None) -> str:
    """The prompt text; a template error (roles out of order, ...) is a 400 on `messages`."""
    tokenizer = engine.tokenizer
    conversation = message_dicts(messages)
    tools = plan.tools if plan is not None else None
    uses_calls = any(m.get("tool_calls") or m["role"] == "tool" for m in conversation)
    if (tools or uses_calls) and not template_info(tokenizer).supports_tools:
        conversation, tools = fallback_messages(conversation, tools), None
    extra = {k: v for k, v in (template_kwargs or {}).items() if k not in _RESERVED_TEMPLATE_ARGS}
    try:
        return tokenizer.apply_chat_template(conversation, tools=tools, add_generation_prompt=add_generation_prompt,
                                             **extra)
    except ValueError as exc:  # the tokenizer's ChatTemplateError
        raise bad_request(f"the chat template could not render these messages: {exc}", "messages") from None


def encode_prompt(engine: EngineClient, text: str) -> list[int]:
    return list(engine.tokenizer.encode(text))
