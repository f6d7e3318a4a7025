"""Helpers for the server tests: a live uvicorn on 127.0.0.1 in a thread, tiny engines, metrics."""
from __future__ import annotations

import re
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from engine import load_config
from engine.tokenizer import FALLBACK_CHATML_TEMPLATE

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
