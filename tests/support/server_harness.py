"""Helpers for the server tests: a live uvicorn on 127.0.0.1 in a thread, tiny engines, metrics."""
from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from engine import load_config
from engine.text.tokenizer import FALLBACK_CHATML_TEMPLATE

# A Hermes-style ChatML template that renders tools, tool calls and tool results (the test
# stand-in for Qwen/Hermes templates).
TOOLS_TEMPLATE = FALLBACK_CHATML_TEMPLATE


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def tiny_config(model_dir: Path, **overrides: Any):
    settings = {"model.name": str(model_dir), "backend.cpu_kv_cache_bytes": 4 * 1024 * 1024,
                "backend.block_size": 16, "backend.max_num_batched_tokens": 1024,
                "server.log_level": "warning"}
    settings.update(overrides)
    return load_config(None, overrides=settings)


class LiveServer:
    """uvicorn serving `app` on a free port of 127.0.0.1, in a background thread."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    access_log=False, timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return self.root + "/v1"

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


def named_sse_events(url: str, body: dict, headers: dict[str, str]) -> list[tuple[str, dict]]:
    """(event name, data) of a raw stream of named events (Messages, Responses), checking that each
    `event:` line names its data's type."""
    events = []
    with httpx.stream("POST", url, json={**body, "stream": True}, headers=headers, timeout=60) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: "):])
                assert data["type"] == name
                events.append((name, data))
    return events


FAILURE_MESSAGE = "simulated kernel failure"


@contextmanager
def failing_server(model_dir: Path, steps: int = 5) -> Iterator[LiveServer]:
    """A live server on a fresh engine whose step fails (FAILURE_MESSAGE) after `steps` steps."""
    from engine import AsyncEngine
    from server.app.build import build_app

    broken = AsyncEngine(tiny_config(model_dir))
    broken.start()
    fail_after_steps(broken, steps)
    try:
        with LiveServer(build_app(broken.config, broken)) as live:
            yield live
    finally:
        broken.shutdown()


def fail_after_steps(async_engine: Any, steps: int = 5) -> None:
    """Make a started AsyncEngine's engine raise FAILURE_MESSAGE from its step after `steps` steps."""
    real_step, calls = async_engine.engine.step, {"n": 0}

    def failing_step():
        calls["n"] += 1
        if calls["n"] > steps:
            raise RuntimeError(FAILURE_MESSAGE)
        return real_step()

    async_engine.engine.step = failing_step


def metric(root: str, name: str, labels: str = "") -> float:
    """One sample from /metrics (0 when absent)."""
    text = httpx.get(root + "/metrics", timeout=10).text
    pattern = re.compile(rf"^{re.escape(name)}{re.escape(labels)}\s+([0-9.eE+-]+)$", re.M)
    match = pattern.search(text)
    return float(match.group(1)) if match else 0.0


def wait_until(condition, timeout: float = 20.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return condition()
