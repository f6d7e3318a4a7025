"""Errors the engine raises for requests; the server maps each to an HTTP status."""
from __future__ import annotations


class EngineError(Exception):
    """Base class for request-level engine errors."""


class ContextLengthExceeded(EngineError, ValueError):
    """The prompt (plus the tokens requested) does not fit the model's context."""

    def __init__(self, max_context_len: int, num_prompt_tokens: int) -> None:
        super().__init__(
            f"This model's maximum context length is {max_context_len} tokens. However, your "
            f"messages resulted in {num_prompt_tokens} tokens. Please reduce the length of the messages.")
        self.max_context_len = max_context_len
        self.num_prompt_tokens = num_prompt_tokens


class EngineOverloaded(EngineError):
    """Too many requests are waiting; try again later."""


class EngineDead(EngineError):
    """The engine loop stopped after an internal error; new requests cannot be served."""


class RequestTimedOut(EngineError):
    """The request ran past `server.request_timeout`."""
