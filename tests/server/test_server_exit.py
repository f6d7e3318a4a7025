"""An engine that cannot continue makes the server answer what is in flight with errors and exit
non-zero within a bounded time, so that a supervisor restarts it."""
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from server.cli.main import FAILURE_EXIT_DEADLINE_S
from server.core.state import EXIT_ENGINE_FAILED
from tests.support.server_harness import free_port, wait_until
from tests.support.tiny_models import make_tiny_model

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("m") / "tiny", "llama")


def test_a_device_error_ends_in_flight_requests_with_errors_and_exits_3(model_dir, tmp_path):
    port, trigger = free_port(), tmp_path / "fail-now"
    log = (tmp_path / "server.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "tests.support.failing_server",
                             str(model_dir), str(port), str(trigger)], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        assert wait_until(lambda: _status(base + "/health") == 200, timeout=120), "the server did not come up"
        results: dict[str, httpx.Response] = {}
        body = {"messages": [{"role": "user", "content": "count"}], "max_tokens": 4000, "ignore_eos": True}

        def send(name, stream):
            results[name] = httpx.post(base + "/v1/chat/completions", json={**body, "stream": stream}, timeout=60)
        threads = [threading.Thread(target=send, args=(name, name == "stream")) for name in ("stream", "plain")]
        for t in threads:
            t.start()
        time.sleep(1.0)   # both are generating
        trigger.touch()
        failed_at = time.monotonic()
        for t in threads:
            t.join(60)
        code = proc.wait(timeout=FAILURE_EXIT_DEADLINE_S + 15)
        took = time.monotonic() - failed_at
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    output = (tmp_path / "server.log").read_text()
    assert code == EXIT_ENGINE_FAILED, output[-3000:]
    assert took < FAILURE_EXIT_DEADLINE_S + 10
    events = [line[6:] for line in results["stream"].text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and "illegal memory access" in json.loads(events[-2])["error"]["message"]
    assert results["plain"].status_code == 500
    assert "illegal memory access" in results["plain"].json()["error"]["message"]
    assert "engine failed; the server exits with status 3" in output


def _status(url: str) -> int:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.HTTPError:
        return 0
