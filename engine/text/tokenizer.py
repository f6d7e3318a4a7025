"""The tokenizer and chat-template layer: a thin wrapper over a Hugging Face fast tokenizer.

Chat messages arrive OpenAI-style and are normalised before the model's own Jinja template
renders them (see `normalize_messages`). A tokenizer without a template gets
`FALLBACK_CHATML_TEMPLATE`: plain ChatML (`<|im_start|>role\\ncontent<|im_end|>\\n`), with
tools, tool calls and tool results in the Hermes convention (`<tools>`, `<tool_call>`,
`<tool_response>`) so a model that has never seen a template still gets the whole context.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2

FALLBACK_CHATML_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- 'You may call one or more functions. Function signatures are within <tools></tools>:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\nFor each call, reply with <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>'"
    " + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (tools and loop.first and message.role == 'system') %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.role == 'tool' %}{{- '<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- else %}{{- message.content }}{%- endif %}"
    "{%- for call in message.tool_calls or [] %}"
    "{{- '\\n<tool_call>\\n' + ({'name': call.function.name, 'arguments': call.function.arguments} | tojson)"
    " + '\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


class ChatTemplateError(ValueError):
    """The messages cannot be rendered (the template raised, or a content part is unsupported)."""


def _content_text(content: Any, role: str) -> str:
    if content is None:
        return ""  # assistant turns that only carry tool_calls; "" keeps `a + content` templates working
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ChatTemplateError(f"unsupported content part type {kind!r} in a {role} message; "
                                        "only 'text' parts are supported")
            texts.append(part.get("text") or "")
        return "\n".join(texts)
    raise ChatTemplateError(f"message content must be a string, a list of parts or null, not {type(content).__name__}")


def _parse_arguments(arguments: Any) -> Any:
    # Most tool-aware templates (Qwen2.5, Llama 3.1, Hermes) run `arguments | tojson`, which would
    # double-encode the JSON string OpenAI clients send; an object is what they expect.
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return arguments
        return parsed if isinstance(parsed, dict) else arguments
    return arguments


def normalize_messages(messages: list[dict]) -> list[dict]:
    """OpenAI messages → what HF templates expect; the input is not modified.

    `developer` becomes `system`; consecutive system messages merge into one (many templates
    only look at messages[0] for the system prompt); list content is joined; null content
    becomes ""; tool_calls' `function.arguments` JSON strings become objects.
    """
    out: list[dict] = []
    for message in messages:
        msg = dict(message)
        role = msg.get("role")
        if role == "developer":
            role = "system"
        msg["role"] = role
        msg["content"] = _content_text(msg.get("content"), str(role))
        if msg.get("tool_calls"):
            calls = []
            for call in msg["tool_calls"]:
                call = dict(call)
                if isinstance(call.get("function"), dict):
                    function = dict(call["function"])
                    function["arguments"] = _parse_arguments(function.get("arguments"))
                    call["function"] = function
                calls.append(call)
            msg["tool_calls"] = calls
        if role == "system" and out and out[-1]["role"] == "system":
            out[-1] = {**out[-1], "content": out[-1]["content"] + "\n\n" + msg["content"]}
            continue
        out.append(msg)
    return out


def _eos_ids_from_json(path: Path) -> set[int]:
    try:
        value = json.loads(path.read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return set()
    if isinstance(value, int):
        return {value}
    if isinstance(value, list):
        return {v for v in value if isinstance(v, int)}
    return set()


class Tokenizer:
    """A HF fast tokenizer plus the model folder's end-of-sequence ids."""

    def __init__(self, hf_tokenizer: Any, extra_eos_token_ids: set[int] | None = None) -> None:
        self.hf = hf_tokenizer
        eos = set(extra_eos_token_ids or ())
        if hf_tokenizer.eos_token_id is not None:
            eos.add(int(hf_tokenizer.eos_token_id))
        self.eos_token_ids: set[int] = eos
        # len() of a HF tokenizer rebuilds its added-token map: read it once, callers check per token.
        self.vocab_size: int = len(hf_tokenizer)  # includes added tokens, unlike hf.vocab_size

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer:
        """Load from a local folder; eos ids also come from its generation_config.json and
        config.json (instruct models list their end-of-turn tokens there)."""
        from transformers import AutoTokenizer

        folder = Path(path)
        hf = AutoTokenizer.from_pretrained(str(folder))
        extra = _eos_ids_from_json(folder / "generation_config.json") | _eos_ids_from_json(folder / "config.json")
        return cls(hf, extra)

    @property
    def chat_template_source(self) -> str:
        """The Jinja source that renders chats: the model's own, else the fallback ChatML."""
        template = self.hf.chat_template
        return template if isinstance(template, str) and template else FALLBACK_CHATML_TEMPLATE

    @property
    def bos_token_id(self) -> int | None:
        return self.hf.bos_token_id

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        # No tokenization-space cleanup: it rewrites generated text (" ." → ".") and would make
        # decoding a window differ from decoding the whole, which the detokenizer relies on.
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            add_generation_prompt: bool = True, **template_kwargs: Any) -> str:
        """Render OpenAI-style messages to the prompt text; raises ChatTemplateError."""
        conversation = normalize_messages(messages)
        template = None if self.hf.chat_template else FALLBACK_CHATML_TEMPLATE
        try:
            return self.hf.apply_chat_template(conversation, tools=tools or None, chat_template=template,
                                               add_generation_prompt=add_generation_prompt, tokenize=False,
                                               **template_kwargs)
        except jinja2.TemplateError as exc:  # raise_exception(...) in the template: a client error
            raise ChatTemplateError(str(exc)) from exc
        except (TypeError, KeyError, AttributeError, IndexError) as exc:
            raise ChatTemplateError(f"the chat template could not render these messages: {exc}") from exc
