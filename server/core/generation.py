"""One API request's run through the engine: start, outputs, abort, timing, the request log line.

`start()` waits for each prompt's first output before any response is sent (streams: for a
short grace period): the engine raises its refusals (context length, overload, bad parameters)
before yielding, so they become real HTTP 4xx/503 answers instead of errors inside an
already-open stream. A batch of prompts (legacy completions) runs as one engine request per
prompt, merged as they come.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from typing import TypeVar

from fastapi import Request

from engine.request.outputs import RequestOutput
from engine.request.sampling_params import SamplingParams
from server.core.engine_client import EngineClient
from server.core.errors import APIError, from_engine_error
from server.core.metrics import ServerMetrics

request_log = logging.getLogger("fdserve.requests")

T = TypeVar("T")


class ClientDisconnected(Exception):
    pass


class Generation:
    def __init__(self, engine: EngineClient, metrics: ServerMetrics, route: str, request_id: str,
                 prompts: list[list[int]], params: SamplingParams, prompt_param: str = "messages") -> None:
        self.engine = engine
        self.metrics = metrics
        self.route = route
        self.request_id = request_id
        self.prompts = prompts
        self.params = params
        self.prompt_param = prompt_param
        self._ids = [request_id if len(prompts) == 1 else f"{request_id}-{i}" for i in range(len(prompts))]
        self._streams: list[AsyncGenerator[RequestOutput, None]] = []
        self._first: list[asyncio.Future[RequestOutput]] = []  # each stream's first __anext__
        self._closed = False
        # timing and usage
        self.arrival = time.monotonic()
        self.first_token_at: float | None = None
        self.last_output_at: float | None = None
        self.num_prompt_tokens = sum(len(p) for p in prompts)
        self.num_cached_tokens = 0
        self.num_output_tokens = 0
        self._per_prompt_output = [0] * len(prompts)
        self._per_prompt_cached = [0] * len(prompts)
        self.finish_reasons: list[str] = []

    # ----- lifecycle -------------------------------------------------------------------------
    async def start(self, grace: float | None = None) -> None:
        """Submit every prompt and wait for its first output (at most `grace` seconds when given):
        a request the engine refuses raises here, as an APIError, before any response is sent.
        Streams pass a grace period so that a request waiting in the queue still gets its
        stream opened; the engine refuses requests at once, not after queueing them."""
        self.metrics.in_flight.inc()
        try:
            for request_id, prompt in zip(self._ids, self.prompts, strict=True):
                stream = self.engine.generate(request_id, prompt, self.params)
                self._streams.append(stream)
                self._first.append(asyncio.ensure_future(stream.__anext__()))
            await asyncio.wait(self._first, timeout=grace, return_when=asyncio.FIRST_EXCEPTION)
            for first in self._first:
                if first.done():
                    first.result()
        except StopAsyncIteration:
            await self.aclose()
            raise APIError(500, "the engine ended a request without output", "server_error") from None
        except BaseException as exc:
            await self.aclose()
            if isinstance(exc, (asyncio.CancelledError, ClientDisconnected)):
                raise
            raise self._api_error(exc) from None

    async def aclose(self) -> None:
        """Abort whatever is still running (idempotent; the engine frees the KV blocks)."""
        if self._closed:
            return
        self._closed = True
        self.metrics.in_flight.dec()
        for request_id in self._ids[:len(self._streams)]:
            self.engine.abort(request_id)  # first, and without awaiting: this must happen even if cancelled
        try:
            for first in self._first:
                first.cancel()
            await asyncio.gather(*self._first, return_exceptions=True)
            for stream in self._streams:
                try:
                    await stream.aclose()
                except Exception:  # noqa: BLE001 - a stream that failed is finished anyway
                    pass
        except asyncio.CancelledError:
            pass

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) as they arrive; raises APIError for errors after the start."""
        try:
            if len(self._streams) == 1:
                async for out in self._outputs_of(0):
                    yield 0, out
            else:
                async for item in self._merged():
                    yield item
        except (APIError, asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as exc:
            raise self._api_error(exc) from None

    def _api_error(self, exc: BaseException) -> APIError:
        return from_engine_error(exc, self.prompt_param)

    async def _outputs_of(self, index: int) -> AsyncIterator[RequestOutput]:
        try:
            first = await self._first[index]
        except StopAsyncIteration:
            return
        self._observe(index, first)
        yield first
        if first.finished:
            return
        async for out in self._streams[index]:
            self._observe(index, out)
            yield out

    async def _merged(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

        async def pump(index: int) -> None:
            try:
                async for out in self._outputs_of(index):
                    await queue.put((index, out))
            except Exception as exc:  # noqa: BLE001 - handed to the consumer
                await queue.put((index, exc))
            finally:
                await queue.put((index, None))

        tasks = [asyncio.create_task(pump(i)) for i in range(len(self._streams))]
        try:
            running = len(tasks)
            while running:
                index, item = await queue.get()
                if item is None:
                    running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()

    # ----- accounting ------------------------------------------------------------------------
    def _observe(self, index: int, out: RequestOutput) -> None:
        now = time.monotonic()
        new_tokens = out.num_output_tokens - self._per_prompt_output[index]
        self._per_prompt_output[index] = out.num_output_tokens
        self._per_prompt_cached[index] = out.num_cached_tokens
        self.num_output_tokens = sum(self._per_prompt_output)
        self.num_cached_tokens = sum(self._per_prompt_cached)
        if new_tokens > 0:
            if self.first_token_at is None:
                self.first_token_at = now
                self.metrics.ttft.observe(now - self.arrival)
            elif self.last_output_at is not None:
                self.metrics.itl.observe(now - self.last_output_at)
            self.last_output_at = now
        for delta in out.deltas:
            if delta.finish_reason:
                self.finish_reasons.append(delta.finish_reason)

    def log(self, status: int, finish_reasons: list[str] | None = None, error: str | None = None) -> None:
        """Record the request's metrics and write its one log line."""
        now = time.monotonic()
        self.metrics.requests.labels(self.route, str(status)).inc()
        self.metrics.prompt_tokens.inc(self.num_prompt_tokens)
        self.metrics.generation_tokens.inc(self.num_output_tokens)
        reasons = finish_reasons if finish_reasons is not None else self.finish_reasons
        for reason in reasons:
            self.metrics.finished.labels(reason).inc()
        ttft = None if self.first_token_at is None else self.first_token_at - self.arrival
        if self.first_token_at is not None:
            self.metrics.e2e.observe(now - self.arrival)
            if self.num_output_tokens > 1 and self.last_output_at is not None:
                self.metrics.tpot.observe((self.last_output_at - self.first_token_at) / (self.num_output_tokens - 1))
        request_log.info(
            "%s %s status=%d prompt_tokens=%d completion_tokens=%d cached_tokens=%d ttft=%s total=%.3fs finish=%s%s",
            self.request_id, self.route, status, self.num_prompt_tokens, self.num_output_tokens,
            self.num_cached_tokens, "-" if ttft is None else f"{ttft:.3f}s", now - self.arrival,
            ",".join(reasons) or "-", f" error={error!r}" if error else "")


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Run `work` (a coroutine) unless the client goes away first; then cancel it and raise
    ClientDisconnected. Non-streaming responses need this: nothing else notices the disconnect."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    try:
        await task
    except BaseException:  # noqa: BLE001 - cancelled on purpose
        pass
    raise ClientDisconnected()


def log_rejected(metrics: ServerMetrics, route: str, request_id: str, error: APIError) -> None:
    """The log line and count of a request refused before it reached the engine."""
    metrics.requests.labels(route, str(error.status)).inc()
    request_log.info("%s %s status=%d error=%r", request_id, route, error.status, error.message)
