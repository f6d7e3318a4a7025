"""Request bodies over `server.max_body_bytes` get 413 before anything reads them."""
from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.anthropic.errors import anthropic_error_json
from server.anthropic.paths import is_messages_path
from server.core.errors import error_body


async def _too_large(send: Send, limit: int, path: str) -> None:
    message = f"request body exceeds the limit of {limit} bytes (server.max_body_bytes)"
    body = (anthropic_error_json(413, message) if is_messages_path(path)
            else json.dumps(error_body(message, "invalid_request_error", None, "request_too_large")).encode())
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                size = self.max_bytes + 1
            if size > self.max_bytes:
                await _too_large(send, self.max_bytes, scope["path"])
                return
            await self.app(scope, receive, send)  # the server enforces the declared length
            return
        # Chunked upload: read it here, up to the limit, then replay it to the app.
        chunks, total = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                await self.app(scope, _replay([message], receive), send)
                return
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > self.max_bytes:
                await _too_large(send, self.max_bytes, scope["path"])
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        whole: Message = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([whole], receive), send)


def _replay(messages: list[Message], receive: Receive) -> Receive:
    pending = list(messages)

    async def replayed() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed
