"""The engine behind the server: a step loop in its own thread, an async stream per request.

Requests and aborts enter through a thread-safe queue that the loop drains before every step;
each request's deltas go back to its asyncio queue with `call_soon_threadsafe`. Closing or
cancelling a request's stream aborts it, which frees its KV blocks at the next step.

A request that fails inside a step ends alone (engine/core/step_isolation.py). When the loop itself
stops (`EngineUnrecoverable`, or any exception outside the per-request handling), every request
in flight gets `EngineDead`, new ones are refused, and the failure listeners are told once, so
the server can report it and exit for its supervisor to restart it.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Literal

from engine.config import FdserveConfig
from engine.core.faults import EngineUnrecoverable, describe
from engine.core.llm_engine import LLMEngine
from engine.request.errors import EngineDead, EngineOverloaded, RequestTimedOut
from engine.request.outputs import EngineStats, RequestOutput
from engine.request.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# (reason label, message): called once, from the engine thread, when the loop stops on a failure
FailureListener = Callable[[str, str], None]
# What the loop's inbox carries: a request to add (its future settles once it is added or refused), an abort.
_Add = tuple[Literal["add"], str, list[int], SamplingParams, "asyncio.Future[None]"]
_Abort = tuple[Literal["abort"], str]
_Message = _Add | _Abort

STATS_PERIOD_S = 0.05  # /metrics reads a snapshot at most this old while busy; idle refreshes it at once


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]


class AsyncEngine:
    def __init__(self, config: FdserveConfig, engine: LLMEngine | None = None) -> None:
        self.config = config
        self.engine = engine or LLMEngine(config)
        self.tokenizer = self.engine.tokenizer
        self.served_model_name = self.engine.served_model_name
        self.max_context_len = self.engine.max_context_len
        self.max_new_tokens = self.engine.max_new_tokens
        self.attention_path = self.engine.backend.name
        self._inbox: queue.SimpleQueue[_Message] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._accepting = True
        self._dead: str | None = None          # why the loop stopped, once it has
        self._failure_reason: str | None = None
        self._failure_listeners: list[FailureListener] = []
        self._stats = self.engine.stats()

    # ----- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="fdserve-engine", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        self._stopping = True
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        self.engine.close()

    async def drain(self, timeout: float) -> None:
        """Stop admitting requests and wait (up to `timeout` s) for those in flight."""
        self._accepting = False
        deadline = time.monotonic() + timeout
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def add_failure_listener(self, listener: FailureListener) -> None:
        """`listener(reason, message)` once the loop stops on a failure (at once if it already has)."""
        with self._lock:
            self._failure_listeners.append(listener)
            failed = self._failure_reason, self._dead
        if failed[0] is not None and failed[1] is not None:
            listener(failed[0], failed[1])

    # ----- requests --------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncGenerator[RequestOutput, None]:
        if self._dead is not None:
            raise EngineDead(self._dead)
        if not self._accepting:
            raise EngineOverloaded("the server is shutting down")
        if len(self._streams) >= self.config.server.max_queued_requests + self.config.backend.max_num_seqs:
            raise EngineOverloaded("too many requests in flight; retry later")
        params.validate()
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue())
        added: asyncio.Future[None] = loop.create_future()
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream
        self._inbox.put(("add", request_id, prompt_token_ids, params, added))
        self._wakeup.set()
        finished = False
        try:
            await added  # raises the engine's validation errors before anything is yielded
            deadline = time.monotonic() + self.config.server.request_timeout
            while True:
                remaining = deadline - time.monotonic()
                try:
                    item = await asyncio.wait_for(stream.queue.get(), timeout=max(remaining, 0.001))
                except asyncio.TimeoutError:
                    raise RequestTimedOut(f"request exceeded server.request_timeout "
                                          f"({self.config.server.request_timeout:g} s)") from None
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wakeup.set()

    def stats(self) -> EngineStats:
        return self._stats

    # ----- the loop thread -------------------------------------------------------------------
    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _drain_inbox(self) -> None:
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            if message[0] == "add":
                _, request_id, prompt, params, added = message
                try:
                    self.engine.add_request(request_id, prompt, params)
                except Exception as exc:  # validation: hand the error to the waiting caller
                    _resolve(added, exc)
                else:
                    _resolve(added, None)
            else:
                self.engine.abort(message[1])

    def _loop(self) -> None:
        stats_at = 0.0
        try:
            while not self._stopping:
                self.engine.check_health()   # a tensor-parallel rank lost while idle ends the engine too
                self._drain_inbox()
                if not self.engine.has_unfinished():
                    self._stats = self.engine.stats()
                    self._wakeup.wait(timeout=0.5)
                    self._wakeup.clear()
                    continue
                for output in self.engine.step():
                    self._deliver(output.request_id, output)
                now = time.monotonic()
                if now - stats_at >= STATS_PERIOD_S:  # a snapshot per scrape interval, not per step
                    self._stats, stats_at = self.engine.stats(), now
        except BaseException as exc:  # noqa: BLE001 - every waiting client must hear about it
            self._stop_on_failure(exc)

    def _stop_on_failure(self, exc: BaseException) -> None:
        reason = exc.reason if isinstance(exc, EngineUnrecoverable) else "engine_error"
        logger.critical("the engine cannot continue (%s): %s", reason, describe(exc), exc_info=exc)
        message = f"the engine stopped after an internal error ({reason}): {describe(exc)}"
        with self._lock:
            self._dead, self._failure_reason = message, reason
            ids = list(self._streams)
            listeners = list(self._failure_listeners)
        for request_id in ids:
            self._deliver(request_id, EngineDead(message))
        try:
            self._stats = self.engine.stats()
        except Exception:  # noqa: BLE001 - the last snapshot stays
            pass
        for listener in listeners:
            listener(reason, message)


def _resolve(future: asyncio.Future[None], exc: BaseException | None) -> None:
    def settle() -> None:
        if future.done():
            return
        if exc is None:
            future.set_result(None)
        else:
            future.set_exception(exc)
    future.get_loop().call_soon_threadsafe(settle)
