"""`fdserve`: --version, client-config (without loading the model), serve + SIGTERM drain."""
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from engine import AsyncEngine, load_config
from server import __version__
from server.cli.client_config import client_settings
from server.cli.main import SUBCOMMANDS, build_parser, config_from_args, main
from tests.support.server_harness import free_port, wait_until
from tests.support.tiny_models import make_tiny_model

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("m") / "tiny-cli", "llama", max_position_embeddings=1536)


def run_cli(*args, timeout=60):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "server.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"fdserve {__version__}"


def test_subcommands_registered():
    assert {"serve", "client-config"} <= set(SUBCOMMANDS)
    assert main([]) == 2  # no command: help, exit 2


def test_overrides_and_set():
    args = build_parser().parse_args(["serve", "--port", "9100", "--served-model-name", "m", "--api-key", "k",
                                      "--max-context-len", "4096", "--set", "flashdecoding.enable=false",
                                      "--set", "backend.block_size=32", "--set", "model.name=/tmp/some model"])
    config = config_from_args(args)
    assert config.server.port == 9100 and config.model.served_model_name == "m"
    assert config.api.api_keys == ["k"] and config.model.max_context_len == 4096
    assert config.flashdecoding.enable is False and config.backend.block_size == 32
    assert config.model.name == "/tmp/some model"


def test_bad_config_is_a_clear_error(capsys, tmp_path):
    assert main(["client-config", "openai", "--set", "server.prot=1"]) == 2
    assert "did you mean 'port'" in capsys.readouterr().err
    assert main(["client-config", "openai", "--config", str(tmp_path / "nope.toml")]) == 2


def test_client_config_does_not_load_the_model(model_dir):
    probe = ("import sys; from server.cli.main import main; "
             f"main(['client-config', 'cline', '--model', {str(model_dir)!r}, '--port', '9123']); "
             "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("NO-TORCH")
    settings = json.loads(result.stdout[result.stdout.index("{"):result.stdout.rindex("}") + 1])
    assert settings["openAiBaseUrl"] == "http://127.0.0.1:9123/v1" and settings["openAiModelId"] == "tiny-cli"
    assert settings["openAiModelInfo"]["contextWindow"] == 1536


@pytest.mark.parametrize("client", ["cline", "cc-switch", "openai", "curl"])
def test_client_config_snippets(capsys, model_dir, client):
    assert main(["client-config", client, "--model", str(model_dir), "--max-context-len", "1024",
                 "--set", 'api.base_url="https://llm.example.com/v1"', "--api-key", "secret"]) == 0
    out = capsys.readouterr().out
    assert "https://llm.example.com/v1" in out and "tiny-cli" in out and "secret" not in out
    if client in ("cline", "cc-switch"):
        assert "1024" in out
    if client == "cline":   # the CLI's own setup command, with the same URL and model
        assert "cline auth -p openai-compatible -b https://llm.example.com/v1 -k " in out and "-m tiny-cli" in out


def test_client_config_claude_code(capsys, model_dir):
    """Claude Code's environment: the server root without /v1 (it appends /v1/messages), the key,
    the served id for every model slot, and no traffic beyond this server."""
    assert main(["client-config", "claude-code", "--model", str(model_dir), "--max-context-len", "1024",
                 "--set", 'api.base_url="https://llm.example.com/v1"', "--api-key", "secret"]) == 0
    out = capsys.readouterr().out
    exports = dict(line.removeprefix("export ").split("=", 1) for line in out.splitlines()
                   if line.startswith("export "))
    assert exports["ANTHROPIC_BASE_URL"] == "https://llm.example.com"
    assert exports["ANTHROPIC_MODEL"] == exports["ANTHROPIC_SMALL_FAST_MODEL"] == "tiny-cli"
    assert exports["ANTHROPIC_DEFAULT_HAIKU_MODEL"] == "tiny-cli" and "secret" not in out
    assert {exports[k] for k in ("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "DISABLE_TELEMETRY",
                                 "DISABLE_AUTOUPDATER")} == {"1"}
    assert "CLAUDE_CODE_ATTRIBUTION_HEADER=" not in out and "1024 tokens" in out  # too small a window is flagged
    settings = json.loads(out[out.index("{\n"):out.rindex("}") + 1])
    assert settings["env"] == exports
    assert main(["client-config", "cc-switch", "--model", str(model_dir), "--port", "9001"]) == 0
    assert '"ANTHROPIC_BASE_URL": "http://127.0.0.1:9001"' in capsys.readouterr().out


def test_client_config_agrees_with_the_engine(model_dir):
    for overrides in ({}, {"model.max_context_len": 1000, "model.served_model_name": "alias"}):
        config = load_config(None, overrides={"model.name": str(model_dir), **overrides})
        engine = AsyncEngine(config)
        settings = client_settings(config)
        assert settings.context_window == engine.max_context_len
        assert settings.model == engine.served_model_name


def test_serve_exits_1_when_the_model_fails_to_load(tmp_path):
    """A model that cannot load stops the server with a non-zero status (service managers and scripts
    see the failure), after logging why."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    run = subprocess.run(
        [sys.executable, "-m", "server.cli.main", "serve", "--model", str(tmp_path / "missing"), "--host", "127.0.0.1",
         "--port", str(free_port())],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=120, check=False)
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-2000:]
    assert "model failed to load" in run.stdout + run.stderr


def test_serve_drains_on_sigterm(model_dir):
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    process = subprocess.Popen(
        [sys.executable, "-m", "server.cli.main", "serve", "--model", str(model_dir), "--host", "127.0.0.1",
         "--port", str(port), "--set", "backend.cpu_kv_cache_bytes=8388608", "--set", "server.log_level=info"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
    root = f"http://127.0.0.1:{port}"
    log: list[str] = []
    reader = threading.Thread(target=lambda: log.extend(iter(process.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        def healthy():
            try:
                return httpx.get(root + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        assert wait_until(healthy, timeout=90, interval=0.2), "".join(log)
        body = {"model": "tiny-cli", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1200,
                "ignore_eos": True, "stream": True}
        finish = None
        with httpx.stream("POST", root + "/v1/chat/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            first = next(lines)
            assert first.startswith("data: ")
            process.send_signal(signal.SIGTERM)  # mid-stream: the request must still complete
            rest = list(lines)
        events = [line[6:] for line in rest if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        for event in events[:-1]:
            for choice in json.loads(event)["choices"]:
                finish = choice["finish_reason"] or finish
        assert finish == "length"
        # uvicorn re-raises the SIGTERM it drained on, so the exit status says "terminated" (143)
        assert process.wait(timeout=30) in (0, -signal.SIGTERM)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    reader.join(timeout=5)
    text = "".join(log)
    assert f"http://127.0.0.1:{port}/v1" in text and "attention path:" in text
    assert "completion_tokens=1200" in text and "status=200" in text
