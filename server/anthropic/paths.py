"""The Messages routes' paths, at / and /v1: errors on them take Anthropic's shape, even before routing."""
from __future__ import annotations

MESSAGES_PATHS = frozenset({"/messages", "/v1/messages", "/messages/count_tokens", "/v1/messages/count_tokens"})


def is_messages_path(path: str) -> bool:
    return path.rstrip("/") in MESSAGES_PATHS
