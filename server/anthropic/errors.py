"""Errors in Anthropic's shape, for the Messages routes: {"type": "error", "error": {"type", "message"}}.

The pipeline raises `APIError` (OpenAI's vocabulary); here its HTTP status picks Anthropic's
error type, and a context overflow gets Anthropic's own wording, "prompt is too long: N tokens
> M maximum", which Claude Code reads to decide to compact the conversation.
"""
from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse

from server.core.errors import APIError, ContextLengthError

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
               500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}


def error_type(status: int) -> str:
    if status in ERROR_TYPES:
        return ERROR_TYPES[status]
    return "invalid_request_error" if status < 500 else "api_error"


def error_message(error: APIError) -> str:
    if isinstance(error, ContextLengthError):
        return f"prompt is too long: {error.num_prompt_tokens} tokens > {error.max_context_len} maximum"
    return error.message


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def anthropic_error_json(status: int, message: str) -> bytes:
    return json.dumps(anthropic_error_body(status, message)).encode()


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(anthropic_error_body(error.status, error_message(error)), status_code=error.status,
                        headers=error.headers)
