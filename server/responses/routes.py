"""POST /v1/responses and /v1/responses/input_tokens (mounted at / and /v1 by app.py, as the others).

Errors take OpenAI's shape, as on the chat routes, with the Responses field names in `param`.
Codex's `/responses/compact` is not served (404): clients then keep their own history.
"""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from server.core.errors import APIError
from server.core.generation import log_rejected
from server.core.openapi import request_body
from server.core.state import ServerState
from server.openai.chat import ChatRun
from server.openai.respond import respond
from server.openai.routes import parse_body
from server.responses.protocol import InputTokensRequest, ResponsesRequest
from server.responses.run import ROUTE, ResponsesRun, in_responses_terms
from server.responses.translate import prompt_request

router = APIRouter()
INPUT_TOKENS_ROUTE = "input_tokens"


def _state(request: Request) -> ServerState:
    state: ServerState = request.app.state.fdserve
    return state


@router.post("/responses", openapi_extra=request_body(ResponsesRequest))
async def create_response(request: Request) -> Response:
    state = _state(request)
    req = await parse_body(request, ResponsesRequest, ROUTE)
    run = ResponsesRun(state, req)
    return await respond(request, state, run, ROUTE, bool(req.stream), finish_reasons=lambda _body: run.finish_reasons)


@router.post("/responses/input_tokens", openapi_extra=request_body(InputTokensRequest))
async def count_input_tokens(request: Request) -> Response:
    state = _state(request)
    req = await parse_body(request, InputTokensRequest, INPUT_TOKENS_ROUTE)
    try:
        prompt = ChatRun(state, prompt_request(req).chat, route=INPUT_TOKENS_ROUTE).render()
    except APIError as exc:
        log_rejected(state.metrics, INPUT_TOKENS_ROUTE, "-", exc)
        raise in_responses_terms(exc) from None
    body: dict[str, Any] = {"object": "response.input_tokens", "input_tokens": len(prompt)}
    return JSONResponse(body)
