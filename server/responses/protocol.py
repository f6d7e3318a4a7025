"""Request bodies of OpenAI's Responses API (POST /v1/responses, /v1/responses/input_tokens).

Unknown fields are ignored, as in the other protocols (`include`, `prompt_cache_key`,
`client_metadata`, `service_tier`, `text.verbosity`, ...). Input items and tools are told apart
by `type` (a message item may leave it out). Item types that carry nothing for a text model
(web search calls, ...) and tools the server cannot run (`web_search`, `local_shell`,
`namespace`, `file_search`, ...) are accepted and left out; image, file and audio parts parse
so that the translation can refuse them by name.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


def _kind(default: str, tags: dict[str, str]) -> Any:
    """A discriminator on `type` (`default` when absent) through `tags`; unknown types go to "other"."""
    def pick(value: Any) -> str:
        kind = value.get("type", default) if isinstance(value, dict) else getattr(value, "type", default)
        return tags.get(kind, "other") if isinstance(kind, str) else "other"   # a non-string type is no known one
    return Discriminator(pick)


def _same(*types: str) -> dict[str, str]:
    return {t: t for t in types}


# ----- content parts -----------------------------------------------------------------------------

class TextPart(_Lenient):
    type: Literal["input_text", "output_text", "text", "summary_text", "reasoning_text"]
    text: str


class RefusalPart(_Lenient):
    type: Literal["refusal"]
    refusal: str


class MediaPart(_Lenient):
    """Images, files and audio: accepted by the parser only so that the refusal can name them."""

    type: str


_TEXT_PARTS = {t: "text" for t in ("input_text", "output_text", "text", "summary_text", "reasoning_text")}
ContentPart = Annotated[Annotated[TextPart, Tag("text")] | Annotated[RefusalPart, Tag("refusal")]
                        | Annotated[MediaPart, Tag("other")],
                        _kind("input_text", {**_TEXT_PARTS, "refusal": "refusal"})]
Content = str | list[ContentPart]


# ----- input items -------------------------------------------------------------------------------

class MessageItem(_Lenient):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: Content


class FunctionCallItem(_Lenient):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str = "{}"


class FunctionCallOutputItem(_Lenient):
    type: Literal["function_call_output"]
    call_id: str
    output: Content


class CustomToolCallItem(_Lenient):
    type: Literal["custom_tool_call"]
    call_id: str
    name: str
    input: str = ""


class CustomToolCallOutputItem(_Lenient):
    type: Literal["custom_tool_call_output"]
    call_id: str
    output: Content


class ReasoningItem(_Lenient):
    """An earlier turn's reasoning, echoed back by clients; not shown to the model again."""

    type: Literal["reasoning"]


class OtherItem(_Lenient):
    """Item types with nothing for the model (web search calls, compaction markers, ...)."""

    type: str


_ITEM_TYPES = _same("message", "function_call", "function_call_output", "custom_tool_call",
                    "custom_tool_call_output", "reasoning")
InputItem = Annotated[Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
                      | Annotated[CustomToolCallItem, Tag("custom_tool_call")]
                      | Annotated[CustomToolCallOutputItem, Tag("custom_tool_call_output")]
                      | Annotated[ReasoningItem, Tag("reasoning")] | Annotated[OtherItem, Tag("other")],
                      _kind("message", _ITEM_TYPES)]


# ----- tools -------------------------------------------------------------------------------------

class FunctionTool(_Lenient):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class CustomToolFormat(_Lenient):
    type: Literal["text", "grammar"]
    syntax: Literal["lark", "regex"] | None = None
    definition: str | None = None


class CustomTool(_Lenient):
    """A freeform tool (Codex's apply_patch): its input is one string, optionally in a grammar."""

    type: Literal["custom"]
    name: str = Field(min_length=1)
    description: str | None = None
    format: CustomToolFormat | None = None


class OtherTool(_Lenient):
    """Hosted and namespaced tools (web_search, local_shell, namespace, ...): not shown to the model."""

    type: str


ToolSpec = Annotated[Annotated[FunctionTool, Tag("function")] | Annotated[CustomTool, Tag("custom")]
                     | Annotated[OtherTool, Tag("other")],
                     _kind("function", _same("function", "custom"))]


class NamedTool(_Lenient):
    """tool_choice naming one tool: {type: function | custom, name}; other types mean auto."""

    type: str
    name: str | None = None


# ----- the rest ----------------------------------------------------------------------------------

class TextFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(_Lenient):
    format: TextFormat | None = None
    verbosity: str | None = None


class ReasoningConfig(_Lenient):
    effort: str | None = None
    summary: str | None = None


class ResponseInput(_Lenient):
    """What both routes read: the prompt (instructions, input, tools) and the model id."""

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedTool | None = None
    parallel_tool_calls: bool | None = None
    reasoning: ReasoningConfig | None = None
    text: TextConfig | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None


class InputTokensRequest(ResponseInput):
    pass


class ResponsesRequest(ResponseInput):
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    store: bool | None = None
    background: bool | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
