"""The HTTP routes. Mounted twice by app.py, at / and at /v1, so either base URL works."""
from __future__ import annotations

import json
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from server import __version__
from server.core.errors import APIError, bad_request, error_body, validation_error
from server.core.generation import log_rejected
from server.core.metrics import CONTENT_TYPE
from server.core.openapi import request_body
from server.core.state import ServerState
from server.openai.chat import create_chat_completion
from server.openai.completions import create_completion
from server.openai.prompts import encode_prompt, render_chat
from server.openai.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from server.openai.tools import plan_tools, template_info

router = APIRouter()
Body = TypeVar("Body", bound=BaseModel)


def _state(request: Request) -> ServerState:
    state: ServerState = request.app.state.fdserve
    return state


async def parse_body(request: Request, model: type[Body], route: str) -> Body:
    """JSON body → model; anything wrong is a 400 naming the field (never FastAPI's 422)."""
    try:
        raw = await request.body()
        try:
            data = json.loads(raw) if raw else None
        except ValueError as exc:
            raise bad_request(f"the request body is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise bad_request("the request body must be a JSON object")
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            raise validation_error(exc) from None
    except APIError as exc:
        log_rejected(_state(request).metrics, route, "-", exc)
        raise


@router.post("/chat/completions", openapi_extra=request_body(ChatCompletionRequest))
async def chat_completions(request: Request) -> Response:
    req = await parse_body(request, ChatCompletionRequest, "chat")
    return await create_chat_completion(request, _state(request), req)


@router.post("/completions", openapi_extra=request_body(CompletionRequest))
async def completions(request: Request) -> Response:
    req = await parse_body(request, CompletionRequest, "completions")
    return await create_completion(request, _state(request), req)


def _model_card(state: ServerState) -> dict[str, Any]:
    engine = state.ready_engine()
    return {"id": engine.served_model_name, "object": "model", "created": int(state.started),
            "owned_by": "fdserve", "root": engine.served_model_name, "parent": None,
            # clients size their context window from one of these (vLLM's and LM Studio's names)
            "max_model_len": engine.max_context_len, "context_length": engine.max_context_len,
            "max_output_tokens": engine.max_new_tokens}


@router.get("/models")
async def list_models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [_model_card(_state(request))]}


@router.get("/models/{model_id:path}")
async def retrieve_model(request: Request, model_id: str) -> dict[str, Any]:
    state = _state(request)
    state.check_model(model_id)
    return _model_card(state)


@router.get("/health")
async def health(request: Request) -> Response:
    state = _state(request)
    if state.phase == "ready":
        return JSONResponse({"status": "ok"})
    messages = {"loading": ("the model is loading", "model_loading"),
                "draining": ("the server is shutting down", "shutting_down"),
                "failed": (f"the engine is not available: {state.load_error}", "engine_unavailable")}
    message, code = messages.get(state.phase, ("unavailable", "unavailable"))
    return JSONResponse({"status": state.phase, **error_body(message, "service_unavailable_error", None, code)},
                        status_code=503, headers={"Retry-After": "1"})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE)


@router.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
async def root() -> dict[str, str]:
    """Reachability probe (no key needed): the server's name and version."""
    return {"name": "fdserve", "version": __version__}


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": __version__}


@router.post("/tokenize", openapi_extra=request_body(TokenizeRequest))
async def tokenize(request: Request) -> dict[str, Any]:
    req = await parse_body(request, TokenizeRequest, "tokenize")
    state = _state(request)
    engine = state.ready_engine()
    state.check_model(req.model)
    if req.messages is not None:
        probe = ChatCompletionRequest(messages=req.messages, tools=req.tools)
        plan = plan_tools(probe, template_info(engine.tokenizer))
        tokens = encode_prompt(engine, render_chat(engine, req.messages, plan, req.add_generation_prompt))
    elif req.prompt is not None:
        tokens = engine.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    else:
        raise bad_request("send either prompt or messages", "prompt")
    return {"count": len(tokens), "max_model_len": engine.max_context_len, "tokens": tokens}


@router.post("/detokenize", openapi_extra=request_body(DetokenizeRequest))
async def detokenize(request: Request) -> dict[str, Any]:
    req = await parse_body(request, DetokenizeRequest, "detokenize")
    state = _state(request)
    engine = state.ready_engine()
    state.check_model(req.model)
    vocab_size = engine.tokenizer.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(f"token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})", "tokens")
    return {"prompt": engine.tokenizer.decode(req.tokens)}
