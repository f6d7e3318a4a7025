"""POST /v1/messages and /v1/messages/count_tokens (mounted at / and /v1 by app.py, as the others).

Every failure on these routes answers in Anthropic's error shape (errors.py): the pipeline's
APIErrors, body validation, and anything unexpected.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from server.anthropic.errors import error_response
from server.anthropic.protocol import CountTokensRequest, MessagesRequest
from server.anthropic.run import ROUTE, MessagesRun
from server.anthropic.translate import chat_request
from server.core.errors import APIError, from_engine_error
from server.core.generation import log_rejected
from server.core.openapi import request_body
from server.core.state import ServerState
from server.openai.chat import ChatRun
from server.openai.respond import respond
from server.openai.routes import parse_body

router = APIRouter()


def _state(request: Request) -> ServerState:
    state: ServerState = request.app.state.fdserve
    return state


async def _answered(work: Callable[[], Awaitable[Response]]) -> Response:
    try:
        return await work()
    except APIError as exc:
        return error_response(exc)
    except Exception as exc:  # noqa: BLE001 - logged by from_engine_error, answered as api_error
        return error_response(from_engine_error(exc))


@router.post("/messages", openapi_extra=request_body(MessagesRequest))
async def create_message(request: Request) -> Response:
    async def work() -> Response:
        state = _state(request)
        req = await parse_body(request, MessagesRequest, ROUTE)
        run = MessagesRun(state, req)
        return await respond(request, state, run, ROUTE, bool(req.stream),
                             finish_reasons=lambda _body: run.finish_reasons)
    return await _answered(work)


@router.post("/messages/count_tokens", openapi_extra=request_body(CountTokensRequest))
async def count_tokens(request: Request) -> Response:
    async def work() -> Response:
        state = _state(request)
        req = await parse_body(request, CountTokensRequest, "count_tokens")
        try:
            prompt = ChatRun(state, chat_request(req), route="count_tokens").render()
        except APIError as exc:
            log_rejected(state.metrics, "count_tokens", "-", exc)
            raise
        body: dict[str, Any] = {"input_tokens": len(prompt)}
        return JSONResponse(body)
    return await _answered(work)
