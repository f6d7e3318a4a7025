"""Server-sent events as OpenAI streams them: `data: {json}\\n\\n` chunks, then `data: [DONE]`.

An error after the stream opened goes out as a `data: {"error": {...}}` chunk followed by
[DONE] (the openai SDK raises APIError on it). `SSEResponse` always runs its `on_close` hook,
however the stream ends (finished, failed, or the client went away mid-stream), so the
request is aborted and its KV blocks freed.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from server.core.errors import APIError

DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(payload: dict[str, Any]) -> str:
    return "data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")) + "\n\n"


def sse_event(name: str, payload: dict[str, Any]) -> str:
    """A named event (`event:` line, then its data), as the Messages and Responses streams send them."""
    return f"event: {name}\n" + sse(payload)


def sse_error(error: APIError) -> str:
    return sse(error.body())


class SSEResponse(StreamingResponse):
    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], Awaitable[None]]) -> None:
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # Starlette cancels the body task when the client disconnects; the generator may be
            # left suspended at a yield, so close it and abort the request here, exactly once.
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()
                except Exception:  # noqa: BLE001 - closing is best effort; the abort below is what matters
                    pass
            await self._on_close()
