"""`fdserve serve` with tensor parallelism on this host (gloo): a rank that dies or hangs makes the server
exit non-zero within a bounded time; two "nodes" started with the multi-node flags serve one model."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from engine.core.offline import LLM
from engine.request.sampling_params import SamplingParams
from server.core.state import EXIT_ENGINE_FAILED
from tests.support.server_harness import free_port, wait_until
from tests.support.tiny_models import make_tiny_model

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 5.0   # [distributed] timeout_s: how long a hung rank may stay silent


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("m") / "tiny", "llama")


def _serve(model_dir: Path, port: int, log: Path, *flags: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "server.cli.main", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--model", str(model_dir), "--set", "model.dtype=float32", "--set", "backend.num_kv_blocks=64",
           "--set", f"distributed.timeout_s={TIMEOUT_S}", *flags]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT)


def _healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs /proc to find the rank processes")
@pytest.mark.parametrize("fault", ["killed", "hung"])
def test_a_lost_rank_makes_the_server_exit_non_zero(model_dir: Path, tmp_path: Path, fault: str) -> None:
    port, log = free_port(), tmp_path / "server.log"
    proc = _serve(model_dir, port, log, "--set", "backend.tensor_parallel_size=2")
    rank = None
    try:
        assert wait_until(lambda: _healthy(port), timeout=180, interval=0.2), log.read_text()[-3000:]
        (rank,) = _children(proc.pid)
        os.kill(rank, signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
        lost_at = time.monotonic()
        code = proc.wait(timeout=120)
        took = time.monotonic() - lost_at
        # no rank outlives the server, not even a stopped one
        assert wait_until(lambda: not _alive(rank), timeout=15), f"rank {rank} outlived the server"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if rank is not None and fault == "hung":
            try:
                os.kill(rank, signal.SIGKILL)
            except ProcessLookupError:
                pass
    output = log.read_text()
    print(f"{fault}: exited {code} {took:.1f} s after the rank was lost")
    assert code == EXIT_ENGINE_FAILED, output[-3000:]
    assert "tensor_parallel_rank_failed" in output and "engine failed; the server exits with status 3" in output
    if fault == "killed":
        assert "rank 1 exited with status -9" in output
    # detected by the idle heartbeat within the group's timeout; then the server drains and exits
    assert took < TIMEOUT_S + 40, output[-3000:]


def test_two_nodes_started_with_the_multi_node_flags_serve_one_model(model_dir: Path, tmp_path: Path) -> None:
    port, rendezvous = free_port(), free_port()
    nodes = ["--set", "backend.tensor_parallel_size=2", "--nnodes", "2", "--master-addr", "127.0.0.1",
             "--master-port", str(rendezvous)]
    head = _serve(model_dir, port, tmp_path / "node0.log", *nodes, "--node-rank", "0")
    other = _serve(model_dir, free_port(), tmp_path / "node1.log", *nodes, "--node-rank", "1")
    prompt = "the ranks agree"
    try:
        assert wait_until(lambda: _healthy(port), timeout=180, interval=0.2), (tmp_path / "node0.log").read_text()
        body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        served = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60).json()
        assert other.poll() is None                       # node 1 serves no HTTP, it runs its rank
        head.send_signal(signal.SIGTERM)
        assert head.wait(timeout=60) in (0, -signal.SIGTERM)
        assert other.wait(timeout=60) == 0, (tmp_path / "node1.log").read_text()[-3000:]
    finally:
        for proc in (head, other):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    llm = LLM(**{"model.name": str(model_dir), "model.dtype": "float32", "backend.num_kv_blocks": 64})
    alone = llm.generate(prompt, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    assert served["choices"][0]["text"] == alone[0].outputs[0].text
    assert served["usage"]["completion_tokens"] == 16
    assert "rank 1 of 2 joined" in (tmp_path / "node1.log").read_text()


def test_sigterm_drains_the_request_in_flight_and_stops_the_ranks(model_dir: Path, tmp_path: Path) -> None:
    """Shutdown keeps every rank until the drain is over, then tells them to stop (no rank error)."""
    import json

    port, log = free_port(), tmp_path / "server.log"
    proc = _serve(model_dir, port, log, "--set", "backend.tensor_parallel_size=2")
    try:
        assert wait_until(lambda: _healthy(port), timeout=180, interval=0.2), log.read_text()[-3000:]
        (rank,) = _children(proc.pid)
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 400, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=60) as resp:
            lines = resp.iter_lines()
            assert next(lines).startswith("data: ")
            proc.send_signal(signal.SIGTERM)   # mid-stream: the request must still complete on both ranks
            rest = list(lines)
        events = [line[6:] for line in rest if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        finish = [c["finish_reason"] for e in events[:-1] for c in json.loads(e)["choices"] if c["finish_reason"]]
        assert finish == ["length"]
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
        assert wait_until(lambda: not _alive(rank), timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = log.read_text()
    errors = [line for line in output.splitlines() if " ERROR " in line or "stopped on an error" in line]
    assert not errors, output[-3000:]


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs /proc to find the rank processes")
def test_ranks_exit_when_the_server_is_killed(model_dir: Path, tmp_path: Path) -> None:
    port, log = free_port(), tmp_path / "server.log"
    proc = _serve(model_dir, port, log, "--set", "backend.tensor_parallel_size=2")
    try:
        assert wait_until(lambda: _healthy(port), timeout=180, interval=0.2), log.read_text()[-3000:]
        (rank,) = _children(proc.pid)
        proc.kill()
        proc.wait()
        assert wait_until(lambda: not _alive(rank), timeout=15), f"rank {rank} outlived a killed server"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
