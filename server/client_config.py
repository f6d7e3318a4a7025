"""Client settings (curl, openai SDK, Cline, CC Switch) made from the server's own config.

The context window printed is the one the server enforces, so client and server never
disagree about it. Nothing here loads the model (or imports torch): the context length
comes from the config, else from the model folder's config.json or the GGUF header.
"""
from __future__ import annotations

import json
import textwrap
from dataclasses import dataclass
from pathlib import Path

from engine.config import FdserveConfig
from server.state import public_base_url

EMBEDDED_DEFAULT_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_DEFAULT_ALIASES = {"HuggingFaceTB/SmolLM2-135M-Instruct", EMBEDDED_DEFAULT_NAME}
EMBEDDED_DEFAULT_CONTEXT = 8192
FALLBACK_CONTEXT = 2048  # what the engine assumes when a config names no context length
KEY_PLACEHOLDER = "<your [api] api_key>"
NO_KEY_PLACEHOLDER = "fdserve"  # clients insist on some key; this server then accepts any


@dataclass(frozen=True)
class ClientSettings:
    base_url: str
    api_key: str
    model: str
    context_window: int
    max_tokens: int


def served_model_name(config: FdserveConfig) -> str:
    name = config.model.name
    if config.model.served_model_name:
        return config.model.served_model_name
    if not name or name in EMBEDDED_DEFAULT_ALIASES:
        return EMBEDDED_DEFAULT_NAME
    return Path(name).name.removesuffix(".gguf")


def _hf_config_context(path: Path) -> int | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    data = data.get("text_config", data) if isinstance(data, dict) else {}
    value = data.get("max_position_embeddings")
    return int(value) if isinstance(value, int) and value > 0 else None


def _gguf_context(path: Path) -> int | None:
    try:
        import gguf

        reader = gguf.GGUFReader(str(path))
        arch_field = reader.fields["general.architecture"]
        arch = bytes(arch_field.parts[arch_field.data[0]]).decode()
        field = reader.fields.get(f"{arch}.context_length")
        return int(field.parts[field.data[0]][0]) if field is not None else None
    except Exception:  # noqa: BLE001 - an unreadable header just means "unknown"
        return None


def _hub_cache_context(repo_id: str) -> int | None:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    found = try_to_load_from_cache(repo_id, "config.json")
    return _hf_config_context(Path(found)) if isinstance(found, str) else None


def model_context_len(config: FdserveConfig) -> int:
    """What the engine will enforce: max_context_len, else what rope_scaling reaches, else the model's own."""
    if config.model.max_context_len:
        return config.model.max_context_len
    own = _own_context_len(config)
    scaling = config.model.rope_scaling
    if scaling is not None:
        return int(scaling.factor * (scaling.original_max_position_embeddings or own))
    return own


def _own_context_len(config: FdserveConfig) -> int:
    name = config.model.name
    if not name or name in EMBEDDED_DEFAULT_ALIASES:
        return EMBEDDED_DEFAULT_CONTEXT
    path = Path(name).expanduser()
    if path.is_dir():
        found = _hf_config_context(path / "config.json")
    elif path.suffix == ".gguf":
        found = _gguf_context(path)
    else:
        found = _hub_cache_context(name)
    return found or FALLBACK_CONTEXT


def client_settings(config: FdserveConfig) -> ClientSettings:
    context = model_context_len(config)
    return ClientSettings(
        base_url=public_base_url(config),
        api_key=KEY_PLACEHOLDER if config.api.api_keys else NO_KEY_PLACEHOLDER,
        model=served_model_name(config),
        context_window=context,
        max_tokens=min(config.model.max_new_tokens, context),
    )


def render_curl(s: ClientSettings) -> str:
    body = json.dumps({"model": s.model, "messages": [{"role": "user", "content": "Hello!"}],
                       "stream": True, "stream_options": {"include_usage": True}})
    return textwrap.dedent(f"""\
        # curl: streaming chat completion (drop "stream" for one JSON answer)
        curl {s.base_url}/chat/completions \\
          -H "Authorization: Bearer {s.api_key}" \\
          -H "Content-Type: application/json" \\
          -d '{body}'
        """)


def render_openai(s: ClientSettings) -> str:
    return textwrap.dedent(f"""\
        # openai Python SDK (`pip install openai`). Any OpenAI SDK reads the same two settings from
        # the environment: OPENAI_BASE_URL={s.base_url} OPENAI_API_KEY={s.api_key}
        from openai import OpenAI

        client = OpenAI(base_url="{s.base_url}", api_key="{s.api_key}")
        stream = client.chat.completions.create(
            model="{s.model}",
            messages=[{{"role": "user", "content": "Hello!"}}],
            max_tokens=256,  # up to {s.max_tokens}; the context window is {s.context_window} tokens
            stream=True,
            stream_options={{"include_usage": True}},
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                print(chunk.choices[0].delta.content, end="", flush=True)
        """)


def render_cline(s: ClientSettings) -> str:
    settings = {"apiProvider": "openai", "openAiBaseUrl": s.base_url, "openAiApiKey": s.api_key,
                "openAiModelId": s.model,
                "openAiModelInfo": {"contextWindow": s.context_window, "maxTokens": s.max_tokens,
                                    "supportsImages": False, "supportsPromptCache": False,
                                    "inputPrice": 0, "outputPrice": 0}}
    return textwrap.dedent(f"""\
        # Cline: Settings -> API Provider "OpenAI Compatible"
        Base URL:            {s.base_url}
        API Key:             {s.api_key}
        Model ID:            {s.model}
        Model Configuration:
          Context Window Size: {s.context_window}
          Max Output Tokens:   {s.max_tokens}
          Supports Images:     off
        # the same settings as JSON (Cline's OpenAI-compatible provider fields):
        """) + json.dumps(settings, indent=2) + "\n"


def render_cc_switch(s: ClientSettings) -> str:
    provider = {"name": "fdserve", "apiFormat": "OpenAI Chat Completions", "baseUrl": s.base_url,
                "apiKey": s.api_key, "model": s.model, "haikuModel": s.model, "sonnetModel": s.model,
                "opusModel": s.model, "contextWindow": s.context_window, "maxOutputTokens": s.max_tokens}
    return textwrap.dedent(f"""\
        # CC Switch: Claude Code talks to CC Switch's local proxy, which turns its Anthropic calls
        # into chat completions for this server. Add a Claude provider (custom) with:
        API format:      OpenAI Chat Completions
        Base URL:        {s.base_url}
        API Key:         {s.api_key}
        Model:           {s.model}  (also for the Haiku / Sonnet / Opus slots)
        Context window:  {s.context_window} tokens, max output {s.max_tokens}
        # then switch to it with the proxy enabled. The same values, for scripting:
        """) + json.dumps(provider, indent=2) + "\n"


RENDERERS = {"curl": render_curl, "openai": render_openai, "cline": render_cline, "cc-switch": render_cc_switch}
