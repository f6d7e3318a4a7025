"""schemathesis over the app's own /openapi.json: generated bodies on every POST route, valid and
not, and no answer is a 5xx; the server is alive and serving afterwards."""
import shutil
import subprocess

import httpx
import pytest

from engine import AsyncEngine
from server.app.build import build_app
from tests.support.server_harness import LiveServer, tiny_config
from tests.support.tiny_models import make_tiny_model

FUZZ_SECONDS = 40

pytestmark = pytest.mark.skipif(shutil.which("schemathesis") is None,
                                reason="schemathesis not installed (pip install '.[test]')")


def test_no_generated_request_gets_a_server_error(tmp_path):
    model_dir = make_tiny_model(tmp_path / "tiny", "llama")
    config = tiny_config(model_dir, **{"model.max_new_tokens": 8, "model.max_context_len": 512})
    engine = AsyncEngine(config)
    engine.start()
    try:
        with LiveServer(build_app(config, engine)) as server:
            document = httpx.get(server.root + "/openapi.json").json()
            posts = sum("post" in item for item in document["paths"].values())
            run = subprocess.run(
                ["schemathesis", "run", server.root + "/openapi.json", "--checks", "not_a_server_error",
                 "--include-method", "POST", "--max-time", str(FUZZ_SECONDS), "--request-timeout", "60",
                 "--seed", "20261202", "--generation-database", "none", "--workers", "1", "--no-color"],
                capture_output=True, text=True, timeout=FUZZ_SECONDS * 3, cwd=tmp_path)
            assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
            assert f"{posts} selected" in run.stdout and f"Tested: {posts}" in run.stdout
            assert httpx.get(server.root + "/health").status_code == 200
            reply = httpx.post(server.base_url + "/chat/completions", timeout=60,
                               json={"messages": [{"role": "user", "content": "still there?"}], "max_tokens": 4})
            assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] >= 1
    finally:
        engine.shutdown()
