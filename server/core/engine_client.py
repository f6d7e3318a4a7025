"""What the server needs of an engine: requests as async streams, abort, the tokenizer, limits,
stats, lifecycle and failure listeners. AsyncEngine (engine/core/async_engine.py) provides it;
tests serve fakes. The server types against this, never against the engine's implementation.
"""
from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from typing import Protocol

from engine.request.outputs import EngineStats, RequestOutput
from engine.request.sampling_params import SamplingParams
from engine.text.tokenizer import Tokenizer

# (reason label, message): called once, from the engine's thread, when it stops on a failure
FailureListener = Callable[[str, str], None]


class EngineClient(Protocol):
    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def served_model_name(self) -> str: ...

    @property
    def max_context_len(self) -> int: ...

    @property
    def max_new_tokens(self) -> int: ...

    @property
    def attention_path(self) -> str: ...

    # ----- lifecycle -------------------------------------------------------------------------
    def start(self) -> None: ...

    async def drain(self, timeout: float) -> None:
        """Stop admitting requests and wait (up to `timeout` s) for those in flight."""
        ...

    def shutdown(self) -> None: ...

    def add_failure_listener(self, listener: FailureListener) -> None:
        """`listener(reason, message)` once the engine stops on a failure (at once if it already has)."""
        ...

    # ----- requests --------------------------------------------------------------------------
    def generate(self, request_id: str, prompt_token_ids: list[int],
                 params: SamplingParams) -> AsyncGenerator[RequestOutput, None]:
        """The request's outputs as they come; refusals (context length, overload, bad parameters)
        raise at the first `__anext__`. Closing the stream before it finishes aborts the request."""
        ...

    def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats: ...
