"""The real Cline CLI against `fdserve serve` on the embedded default, configured as a user does
(`cline auth -p openai-compatible -b URL -k KEY -m MODEL`, the command `fdserve client-config
cline` prints), in a loopback-only network namespace with update checks and telemetry off.
Opt-in (`-m clients`): Cline's ~5.7K-token system prompt takes ~20 s to prefill on a 2-core CPU
(longer while other work shares the cores), and Cline gives up on a request after 300 s.

Needs node, the CLI (`npm install -g cline`), `unshare -n` and the embedded default model.
"""
from __future__ import annotations

import shlex

import pytest

from tests.support.client_cli import MODEL, missing_requirements, run_client, serve_command

pytestmark = pytest.mark.clients

PORT = 8767
ENV = "HOME=$PWD CLINE_NO_AUTO_UPDATE=1 DISABLE_TELEMETRY=1 DISABLE_UPDATES=1"


def test_cline_answers_a_one_line_task(tmp_path):
    missing = missing_requirements("cline", "npm install -g cline")
    if missing:
        pytest.skip(missing)
    base_url = f"http://127.0.0.1:{PORT}/v1"
    auth = shlex.join(["cline", "auth", "-p", "openai-compatible", "-b", base_url, "-k", "fdserve", "-m", MODEL,
                       "--data-dir", "data"])
    task = shlex.join(["cline", "--data-dir", "data", "--json", "--retries", "1", "-t", "1200",
                       "Reply with one word: hello"])
    serve = serve_command(PORT, "--set", "model.max_new_tokens=32", "--set", "server.request_timeout=1800")
    run = run_client(tmp_path, serve, PORT, f"{ENV} {auth} && {ENV} timeout 1500 {task}")
    chat = [status for _, route, status in run.requests if route == "chat"]
    assert chat and all(status == "200" for status in chat), run.describe()
    assert '"type":"run_result"' in run.output, run.describe()   # Cline ended its run by itself
    assert "timed out" not in run.output, run.describe()
