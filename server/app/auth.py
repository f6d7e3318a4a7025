"""API keys ([api] api_key): `Authorization: Bearer <key>` (or `x-api-key`) on every API route;
the 401 is in Anthropic's shape on the Messages routes, in OpenAI's elsewhere.

Keys are compared as SHA-256 digests with `hmac.compare_digest`, against every configured key
without stopping at a match, so the time taken says nothing about a key. Keys are never logged.
"""
from __future__ import annotations

import hashlib
import hmac
import json

from starlette.types import ASGIApp, Receive, Scope, Send

from server.anthropic.errors import anthropic_error_json
from server.anthropic.paths import is_messages_path
from server.core.errors import error_body

# "/" answers reachability probes (GET or HEAD) with the server's name and version.
OPEN_PATHS = frozenset({"/", "/health", "/v1/health", "/metrics", "/v1/metrics", "/version", "/v1/version",
                        "/openapi.json", "/docs"})


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def presented_key(headers: dict[bytes, bytes]) -> str | None:
    authorization = headers.get(b"authorization", b"").decode("latin-1").strip()
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    api_key = headers.get(b"x-api-key", b"").decode("latin-1").strip()
    return api_key or None


class KeyChecker:
    def __init__(self, keys: list[str]) -> None:
        self._digests = [_digest(k) for k in keys]

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def accepts(self, key: str | None) -> bool:
        candidate = _digest(key or "")
        matched = False
        for digest in self._digests:
            matched |= hmac.compare_digest(candidate, digest)
        return matched and key is not None


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, keys: list[str]) -> None:
        self.app = app
        self.checker = KeyChecker(keys)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.checker.enabled or scope["path"] in OPEN_PATHS \
                or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        key = presented_key(dict(scope["headers"]))
        if self.checker.accepts(key):
            await self.app(scope, receive, send)
            return
        message = ("missing API key: send it as 'Authorization: Bearer <key>'" if key is None
                   else "invalid API key")
        if is_messages_path(scope["path"]):
            body = anthropic_error_json(401, message)
        else:
            body = json.dumps(error_body(message, "authentication_error", None, "invalid_api_key")).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
