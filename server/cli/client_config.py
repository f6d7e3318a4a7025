"""Client settings (curl, openai SDK, Cline, CC Switch, Claude Code, Codex) made from the server's own config.

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
from server.core.state import public_base_url

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
        # Cline CLI (npm install -g cline): configure once, then give it a task
        cline auth -p openai-compatible -b {s.base_url} -k {s.api_key} -m {s.model}
        cline "your task"
        # The CLI sizes the context at 128K tokens whatever the server says; this server's window is
        # {s.context_window} tokens, and a longer prompt gets the context_length_exceeded error Cline recognises.

        # Cline in VS Code: Settings -> API Provider "OpenAI Compatible"
        Base URL:            {s.base_url}
        API Key:             {s.api_key}
        Model ID:            {s.model}
        Model Configuration:
          Context Window Size: {s.context_window}
          Max Output Tokens:   {s.max_tokens}
          Supports Images:     off
        # the same settings as JSON (Cline's OpenAI-compatible provider fields):
        """) + json.dumps(settings, indent=2) + "\n"


def anthropic_base_url(base_url: str) -> str:
    """Claude Code appends /v1/messages itself: the server root, without /v1."""
    trimmed = base_url.rstrip("/")
    return trimmed.removesuffix("/v1") if trimmed.endswith("/v1") else trimmed


CLAUDE_CODE_CONTEXT = 32768  # its first request (system prompt, tool definitions) is ~20K tokens


def claude_code_env(s: ClientSettings) -> dict[str, str]:
    return {"ANTHROPIC_BASE_URL": anthropic_base_url(s.base_url), "ANTHROPIC_AUTH_TOKEN": s.api_key,
            "ANTHROPIC_MODEL": s.model, "ANTHROPIC_SMALL_FAST_MODEL": s.model,
            "ANTHROPIC_DEFAULT_HAIKU_MODEL": s.model, "ANTHROPIC_DEFAULT_SONNET_MODEL": s.model,
            "ANTHROPIC_DEFAULT_OPUS_MODEL": s.model, "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1"}


def _context_warning(s: ClientSettings, client: str = "Claude Code", first_request: str = "alone is\n# ~20K") -> str:
    if s.context_window >= CLAUDE_CODE_CONTEXT:
        return ""
    return (f"# Warning: the context window is {s.context_window} tokens; {client}'s first request {first_request}."
            f" Serve more: --max-context-len 32768 (past the model's own length, with\n"
            f"# --set 'model.rope_scaling={{type=\"yarn\",factor=4.0}}'); see config.toml.\n")


def render_claude_code(s: ClientSettings) -> str:
    env = claude_code_env(s)
    exports = "".join(f"export {name}={value}\n" for name, value in env.items())
    settings = {"env": env}
    return (textwrap.dedent(f"""\
        # Claude Code (`npm install -g @anthropic-ai/claude-code`) speaks Anthropic's Messages API,
        # which this server answers at {env["ANTHROPIC_BASE_URL"]}/v1/messages. In the shell:
        """) + exports + textwrap.dedent("""\
        # (CLAUDE_CODE_ATTRIBUTION_HEADER can stay at its default: the server keeps the per-request
        # attribution block out of the prompt, so turns are served from the prefix cache.)
        # On a CPU server the first prompt (~20K tokens with all tools) takes minutes to prefill;
        # Claude Code drops a stream with no output for 5 minutes unless told to wait longer:
        # export CLAUDE_STREAM_IDLE_TIMEOUT_MS=1800000 API_TIMEOUT_MS=1800000
        claude                 # or one prompt: claude -p "say hi"
        """) + _context_warning(s) + "# the same, for ~/.claude/settings.json:\n"
        + json.dumps(settings, indent=2) + "\n")


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
        """) + json.dumps(provider, indent=2) + "\n" + _cc_switch_direct(s)


def _cc_switch_direct(s: ClientSettings) -> str:
    """Direct mode (CC Switch's default): it writes the provider into Claude Code's settings, and
    Claude Code then calls this server's Messages API itself."""
    env = claude_code_env(s)
    provider = {"name": "fdserve (direct)", "settingsConfig": {"env": env}}
    return textwrap.dedent(f"""\
        # Or without the proxy (direct mode): a Claude provider (custom) whose Claude Code settings are
        Base URL:        {env["ANTHROPIC_BASE_URL"]}   (no /v1: Claude Code appends /v1/messages)
        API Key:         {s.api_key}
        Model:           {s.model}  (also for the Haiku / Sonnet / Opus slots)
        # as CC Switch stores it:
        """) + json.dumps(provider, indent=2) + "\n" + _context_warning(s) + _cc_switch_codex(s)


def _cc_switch_codex(s: ClientSettings) -> str:
    """A Codex provider: CC Switch writes its config.toml and key into Codex's settings."""
    provider = {"name": "fdserve", "settingsConfig": {"auth": {"OPENAI_API_KEY": s.api_key},
                                                      "config": codex_config_toml(s, "OPENAI_API_KEY")}}
    return textwrap.dedent(f"""\
        # Codex: a Codex provider (custom) with this config.toml, and the key as OPENAI_API_KEY:
        Base URL:        {s.base_url}   (wire_api = "responses")
        Model:           {s.model}
        # as CC Switch stores it:
        """) + json.dumps(provider, indent=2) + "\n"


CODEX_KEY_ENV = "FDSERVE_API_KEY"
CODEX_PROVIDER = "fdserve"


def codex_config_toml(s: ClientSettings, key_env: str = CODEX_KEY_ENV) -> str:
    """The provider block of ~/.codex/config.toml: Codex speaks the Responses API (wire_api)."""
    return textwrap.dedent(f"""\
        model = "{s.model}"
        model_provider = "{CODEX_PROVIDER}"

        [model_providers.{CODEX_PROVIDER}]
        name = "fdserve"
        base_url = "{s.base_url}"
        env_key = "{key_env}"
        wire_api = "responses"
        """)


def render_codex(s: ClientSettings) -> str:
    return (textwrap.dedent(f"""\
        # Codex CLI (`npm install -g @openai/codex`) speaks the Responses API, which this server
        # answers at {s.base_url}/responses. In ~/.codex/config.toml (or $CODEX_HOME/config.toml):
        """) + codex_config_toml(s) + textwrap.dedent(f"""\
        # and in the shell, the key Codex sends:
        export {CODEX_KEY_ENV}={s.api_key}
        codex                  # or one task: codex exec --skip-git-repo-check "say hi"
        """) + _context_warning(s, "Codex", "is ~6.5K tokens\n# and every turn resends the whole history"))


RENDERERS = {"curl": render_curl, "openai": render_openai, "cline": render_cline, "cc-switch": render_cc_switch,
             "claude-code": render_claude_code, "codex": render_codex}
