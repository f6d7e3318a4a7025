"""Errors in OpenAI's nested shape: {"error": {"message", "type", "param", "code"}}.

Every failure leaves the server through `APIError`, so clients see one shape with the right
status. Input that can never succeed is a 4xx: the openai SDK retries 408/409/429/5xx, and a
500 on bad input would make it send the same failing request again.
"""
from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.request.errors import ContextLengthExceeded, EngineDead, EngineOverloaded, RequestTimedOut
from engine.request.sampling_params import SamplingParamsError

logger = logging.getLogger("fdserve.server")

RETRY_AFTER_SECONDS = 1


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def model_not_found(model: str, served: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist. This server serves `{served}`.",
                    "invalid_request_error", "model", "model_not_found")


def unavailable(message: str, code: str) -> APIError:
    # Retry-After: the SDK honours it, and the condition (loading, a full queue) is temporary.
    return APIError(503, message, "service_unavailable_error", None, code,
                    {"Retry-After": str(RETRY_AFTER_SECONDS)})


class ContextLengthError(APIError):
    """A prompt that does not fit the context; keeps the numbers for protocols that word it their way."""

    def __init__(self, max_context_len: int, num_prompt_tokens: int) -> None:
        # Cline recognises code context_length_exceeded and "maximum context length" and then trims.
        super().__init__(400, str(ContextLengthExceeded(max_context_len, num_prompt_tokens)), "invalid_request_error",
                         "messages", "context_length_exceeded")
        self.max_context_len = max_context_len
        self.num_prompt_tokens = num_prompt_tokens


def context_length_error(max_context_len: int, num_prompt_tokens: int) -> APIError:
    return ContextLengthError(max_context_len, num_prompt_tokens)


def from_engine_error(exc: BaseException, prompt_param: str = "messages") -> APIError:
    """Map an exception raised by `engine.generate` (before or while streaming) to an APIError."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ContextLengthExceeded):
        return context_length_error(exc.max_context_len, exc.num_prompt_tokens)
    if isinstance(exc, SamplingParamsError):
        param = prompt_param if exc.param == "prompt" else exc.param
        return bad_request(str(exc), param)
    if isinstance(exc, EngineOverloaded):
        return unavailable(str(exc) or "the server is overloaded; retry later", "server_overloaded")
    if isinstance(exc, RequestTimedOut):
        # Not retried by the SDK (x-should-retry): the same request would most likely time out again.
        return APIError(504, str(exc), "timeout_error", None, "request_timeout", {"x-should-retry": "false"})
    if isinstance(exc, EngineDead):
        return APIError(500, str(exc), "server_error", None, "engine_dead")
    logger.exception("unexpected error while serving a request", exc_info=exc)
    return APIError(500, f"internal server error: {type(exc).__name__}", "server_error", None, "internal_error")


_UNION_TAGS = {"str", "int", "float", "bool", "none", "dict", "list", "literal"}


def param_from_loc(loc: tuple[Any, ...] | list[Any]) -> str | None:
    """pydantic's ("messages", 0, "content") → "messages[0].content"; drops the "body" prefix and
    the names pydantic gives union branches ("str", "list[TextPart]"), which mean nothing to a client."""
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        elif part == "body" or part in _UNION_TAGS or any(c in str(part) for c in "[(-"):
            continue
        else:
            text += f".{part}" if text else str(part)
    return text or None


def validation_error(exc: ValidationError | RequestValidationError) -> APIError:
    # Of a union's failed branches, the deepest location is the most specific complaint.
    first = max(exc.errors(), key=lambda e: len([p for p in e.get("loc", ()) if str(p) not in _UNION_TAGS]))
    param = param_from_loc(first.get("loc", ()))
    message = first.get("msg", "invalid request")
    where = f"{param}: " if param else ""
    return bad_request(f"{where}{message}", param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()  # FastAPI's 422 → OpenAI's 400

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = f"no route {request.method} {request.url.path}" if exc.status_code in (404, 405) else str(exc.detail)
        return APIError(exc.status_code, message, kind, None, None, dict(exc.headers or {})).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        error = from_engine_error(exc)
        if error.status >= 500:
            request.app.state.fdserve.metrics.server_errors.labels(type(exc).__name__).inc()
        return error.response()
