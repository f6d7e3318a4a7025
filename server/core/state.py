"""The server's view of the engine: loading (in a background thread), ready, draining, failed.

The HTTP port opens before the model has loaded, so /health can answer 503 while it loads
(orchestrators and clients wait on it) and a load failure is reported, not hidden. When the
engine stops on a failure while serving, /health says so and `on_failure` asks the process
to exit (`exit_code` says how), so that Docker, systemd or Kubernetes restart it.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from engine.config import FdserveConfig
from engine.request.outputs import EngineStats
from server.core.engine_client import EngineClient
from server.core.errors import APIError, model_not_found, unavailable
from server.core.metrics import ServerMetrics
from server.core.token_texts import TokenTexts

logger = logging.getLogger("fdserve.server")

EngineFactory = Callable[[FdserveConfig], EngineClient]

EXIT_OK = 0
EXIT_LOAD_FAILED = 1          # the model did not load (bad path, config, out of memory at startup)
EXIT_ENGINE_FAILED = 3        # the engine stopped while serving (a device error, an unrecoverable OOM)


def default_engine_factory(config: FdserveConfig) -> EngineClient:
    from engine.core.async_engine import AsyncEngine  # lazy: the model code loads with the engine, not the server

    return AsyncEngine(config)


def public_base_url(config: FdserveConfig) -> str:
    """The URL clients should use: [api] base_url, else this host and port with /v1."""
    if config.api.base_url:
        return config.api.base_url.rstrip("/")
    host = config.server.host
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    elif ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{config.server.port}/v1"


class ServerState:
    def __init__(self, config: FdserveConfig, engine: EngineClient | None = None) -> None:
        self.config = config
        self.engine: EngineClient | None = engine
        self.phase = "ready" if engine is not None else "loading"
        self.load_error: str | None = None
        self.exit_code = EXIT_OK
        self.started = time.time()
        self.metrics = ServerMetrics(self._stats)
        self.token_texts: TokenTexts | None = TokenTexts(engine.tokenizer) if engine is not None else None
        self.on_failure: Callable[[], None] | None = None   # the server should stop (load or engine failure)
        self._release_loader = threading.Event()
        if engine is not None:
            self._watch(engine)

    def _watch(self, engine: EngineClient) -> None:
        self.metrics.engine_starts.inc()
        engine.add_failure_listener(self._engine_failed)

    def _stats(self) -> EngineStats | None:
        return self.engine.stats() if self.engine is not None else None

    # ----- loading ---------------------------------------------------------------------------
    def load_in_background(self, factory: EngineFactory = default_engine_factory) -> threading.Thread:
        thread = threading.Thread(target=self._load, args=(factory,), name="fdserve-load", daemon=True)
        thread.start()
        return thread

    def _load(self, factory: EngineFactory) -> None:
        started = time.monotonic()
        try:
            engine = factory(self.config)
            engine.start()
        except Exception as exc:  # noqa: BLE001 - reported on /health and in the log, then the server stops
            self.load_error = f"{type(exc).__name__}: {exc}"
            self.phase = "failed"
            self.exit_code = EXIT_LOAD_FAILED
            logger.error("model failed to load: %s", self.load_error)
            if self.on_failure is not None:
                self.on_failure()
            return
        self.token_texts = TokenTexts(engine.tokenizer)
        self.engine = engine
        self.phase = "ready"
        self._watch(engine)
        self.log_ready(time.monotonic() - started)
        # Park this thread: once the thread that loaded the model exits, the CPU step thread runs 20-50x slower.
        self._release_loader.wait()

    def log_ready(self, load_seconds: float | None = None) -> None:
        engine = self.ready_engine()
        took = f" in {load_seconds:.1f}s" if load_seconds is not None else ""
        logger.info("fdserve ready%s: base URL %s | model %s | context %d tokens | attention path: %s",
                    took, public_base_url(self.config), engine.served_model_name, engine.max_context_len,
                    engine.attention_path)

    def _engine_failed(self, reason: str, message: str) -> None:
        """The engine loop stopped (called from its thread): /health says so (503), new requests
        are refused, and the server is asked to exit."""
        self.metrics.engine_exits.labels(reason).inc()
        self.load_error = message
        self.phase = "failed"
        self.exit_code = EXIT_ENGINE_FAILED
        logger.error("engine failed; the server exits with status %d: %s", EXIT_ENGINE_FAILED, message)
        if self.on_failure is not None:
            self.on_failure()

    # ----- per request -----------------------------------------------------------------------
    def ready_engine(self) -> EngineClient:
        if self.phase == "ready" and self.engine is not None:
            return self.engine
        if self.phase == "loading":
            raise unavailable("the model is still loading; retry shortly", "model_loading")
        if self.phase == "draining":
            raise unavailable("the server is shutting down", "shutting_down")
        raise APIError(503, f"the engine is not available: {self.load_error}", "service_unavailable_error",
                       None, "engine_unavailable")

    def ready_token_texts(self) -> TokenTexts:
        """The ready engine's token texts (for logprobs); raises as ready_engine() does."""
        self.ready_engine()
        if self.token_texts is None:  # set before the engine, so never while it is ready
            raise RuntimeError("the engine is ready without its token texts")
        return self.token_texts

    def check_model(self, model: str | None) -> None:
        """Single-model server: the served name, an id matching [model] aliases, or no model field at
        all is accepted; anything else is 404."""
        engine = self.ready_engine()
        if model is not None and model != engine.served_model_name and not self.config.model.matches_alias(model):
            raise model_not_found(model, engine.served_model_name)

    async def shutdown(self, drain_timeout: float) -> None:
        """SIGTERM: refuse new requests, let those in flight finish, stop the engine."""
        engine = self.engine
        if self.phase != "failed":      # a failed load or engine stays failed: `fdserve serve` exits non-zero
            self.phase = "draining"
        self._release_loader.set()
        if engine is None:
            return
        logger.info("draining: waiting up to %.0fs for requests in flight", drain_timeout)
        await engine.drain(drain_timeout)
        engine.shutdown()
        if self.exit_code == EXIT_OK:
            self.metrics.engine_exits.labels("shutdown").inc()
        logger.info("engine stopped")
