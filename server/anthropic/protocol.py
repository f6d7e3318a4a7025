"""Request bodies of Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens).

Unknown fields are ignored, as the Messages API grows new ones often (`metadata`,
`context_management`, `output_config`'s effort, ...). Content blocks are told apart by `type`;
image and document blocks parse here and are refused by the translation with a clear 400.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextBlock(_Lenient):
    type: Literal["text"]
    text: str


class MediaBlock(_Lenient):
    """Images and documents: accepted by the parser only so that the refusal can name them."""

    type: Literal["image", "document"]


class ToolUseBlock(_Lenient):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any] = Field(default_factory=dict)


class ToolResultBlock(_Lenient):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[TextBlock | MediaBlock, Field(discriminator="type")]] | None = None
    is_error: bool | None = None


class ThinkingBlock(_Lenient):
    """Reasoning an assistant turn carried, echoed back by clients; not shown to the model again."""

    type: Literal["thinking", "redacted_thinking"]


ContentBlock = Annotated[TextBlock | MediaBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock,
                         Field(discriminator="type")]


class Message(_Lenient):
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]

    def blocks(self) -> list[Any]:
        if isinstance(self.content, str):
            return [TextBlock(type="text", text=self.content)]
        return list(self.content)


class ToolDefinition(_Lenient):
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})


class ToolChoice(_Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(_Lenient):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class OutputFormat(_Lenient):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Lenient):
    format: OutputFormat | None = None


class Conversation(_Lenient):
    """What both routes read: the prompt (system, messages, tools) and the model id."""

    model: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None


class CountTokensRequest(Conversation):
    pass


class MessagesRequest(Conversation):
    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool | None = False
    output_config: OutputConfig | None = None
