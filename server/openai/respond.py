"""What chat and legacy completions share: running a prepared request and answering it."""
from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from engine.request.outputs import CompletionDelta
from server.core.errors import APIError
from server.core.generation import ClientDisconnected, Generation, log_rejected, until_disconnected
from server.core.state import ServerState
from server.core.streaming import SSEResponse

T = TypeVar("T")

CLIENT_CLOSED = 499  # logged and counted, never sent: nobody is listening any more
# How long a stream waits for its first output before opening: enough for the engine to accept
# or refuse the request (refusals are then HTTP errors); a request that is merely queued longer
# gets its stream (and role chunk) and waits there.
STREAM_OPEN_GRACE_S = 1.0


class Run(Protocol):
    id: str

    async def prepare(self) -> Generation: ...
    def events(self, gen: Generation) -> AsyncIterator[str]: ...
    async def collect(self, gen: Generation) -> dict[str, Any]: ...


def usage(gen: Generation) -> dict[str, Any]:
    return {"prompt_tokens": gen.num_prompt_tokens, "completion_tokens": gen.num_output_tokens,
            "total_tokens": gen.num_prompt_tokens + gen.num_output_tokens,
            "prompt_tokens_details": {"cached_tokens": gen.num_cached_tokens}}


def choice_error(delta: CompletionDelta, error: str | None) -> APIError | None:
    """An engine finish that is no answer: the request was aborted or failed inside the engine."""
    if delta.finish_reason == "error":
        return APIError(500, error or "the engine failed while generating", "server_error", None, "internal_error")
    if delta.finish_reason == "abort":
        return APIError(503, "the request was aborted by the server", "service_unavailable_error", None,
                        "request_aborted")
    return None


async def _unless_disconnected(request: Request, gen: Generation,
                               work: Awaitable[T]) -> T | Response:
    """The result, or the response for a client that left; API errors are logged, re-raised."""
    try:
        return await until_disconnected(request, work)
    except ClientDisconnected:
        gen.log(CLIENT_CLOSED, error="client disconnected")
        return Response(status_code=CLIENT_CLOSED)
    except APIError as exc:
        gen.log(exc.status, error=exc.message)
        raise


def choice_finish_reasons(body: dict[str, Any]) -> list[str]:
    return [c["finish_reason"] for c in body["choices"]]


async def respond(request: Request, state: ServerState, run: Run, route: str, stream: bool,
                  finish_reasons: Callable[[dict[str, Any]], list[str]] = choice_finish_reasons) -> Response:
    """Validate and start (errors are HTTP errors), then stream or collect the answer; `finish_reasons`
    reads the logged finish reasons off a collected body."""
    try:
        gen = await run.prepare()
    except APIError as exc:
        log_rejected(state.metrics, route, run.id, exc)
        raise
    started = await _unless_disconnected(request, gen, gen.start(STREAM_OPEN_GRACE_S if stream else None))
    if isinstance(started, Response):
        return started
    if stream:
        return SSEResponse(run.events(gen), on_close=gen.aclose)
    try:
        body = await _unless_disconnected(request, gen, run.collect(gen))
    finally:
        await gen.aclose()
    if isinstance(body, Response):
        return body
    gen.log(200, finish_reasons(body))
    return JSONResponse(body)
