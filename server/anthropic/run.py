"""One Messages request: translated into a chat request, run by ChatRun, answered in Anthropic's shape.

Usage follows Anthropic's accounting: prompt tokens served from the prefix cache are
`cache_read_input_tokens` and not part of `input_tokens`; nothing is ever written to a cache
on request, so `cache_creation_input_tokens` is 0. A stream's message_start carries the usage
known when it opens; message_delta carries the final totals (the SDK takes them from there).

Stream: message_start, ping (and one every few seconds while nothing else is sent), then per block
content_block_start / content_block_delta* / content_block_stop, message_delta (stop_reason, stop_sequence,
usage), message_stop. A failure once the stream is open is an `error` event, and the stream ends.
"""
from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

from server.anthropic.blocks import ContentBlocks, stop_reason
from server.anthropic.errors import anthropic_error_body, error_message
from server.anthropic.protocol import MessagesRequest
from server.anthropic.translate import generation_request
from server.core.errors import APIError
from server.core.generation import Generation
from server.core.keepalive import with_keepalive
from server.core.state import ServerState
from server.core.streaming import sse_event
from server.openai.chat import ChatRun
from server.openai.chat_stream import ChatDecoder, TurnUsage
from server.openai.respond import CLIENT_CLOSED

ROUTE = "messages"


def anthropic_usage(usage: TurnUsage) -> dict[str, int]:
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens, "output_tokens": usage.output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": usage.cached_tokens}


class MessagesRun:
    def __init__(self, state: ServerState, req: MessagesRequest) -> None:
        self.state = state
        self.req = req
        self.id = f"msg_{uuid.uuid4().hex}"
        self.finish_reasons: list[str] = []  # the engine's, for the log line and metrics
        self._chat: ChatRun | None = None

    async def prepare(self) -> Generation:
        self._chat = ChatRun(self.state, generation_request(self.req), route=ROUTE, request_id=self.id)
        return await self._chat.prepare()

    def _decoder(self) -> ChatDecoder:
        assert self._chat is not None, "prepare() first"
        return self._chat.decoder(1)

    def _message(self, content: list[dict[str, Any]], reason: str | None, stop_sequence: str | None,
                 usage: TurnUsage) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.req.model,
                "content": content, "stop_reason": reason, "stop_sequence": stop_sequence,
                "usage": anthropic_usage(usage)}

    async def collect(self, gen: Generation) -> dict[str, Any]:
        blocks, decoder = ContentBlocks(), self._decoder()
        reason, stop_sequence = None, None
        async for delta in decoder.deltas(gen):
            blocks.feed(delta)
            if delta.finish_reason:
                reason, stop_sequence = stop_reason(delta.finish_reason, delta.stop_sequence), delta.stop_sequence
        blocks.close()
        self.finish_reasons = decoder.finish_reasons
        return self._message(blocks.blocks, reason or "end_turn", stop_sequence, TurnUsage.of(gen))

    async def events(self, gen: Generation) -> AsyncIterator[str]:
        blocks, decoder = ContentBlocks(), self._decoder()
        status, error = CLIENT_CLOSED, None
        reason, stop_sequence = "end_turn", None
        try:
            yield sse_event("message_start", {"type": "message_start",
                                              "message": self._message([], None, None, TurnUsage.of(gen))})
            yield sse_event("ping", {"type": "ping"})
            async for delta in with_keepalive(decoder.deltas(gen)):
                if delta is None:  # still prefilling: keep the stream alive
                    yield sse_event("ping", {"type": "ping"})
                    continue
                for name, payload in blocks.feed(delta):
                    yield sse_event(name, payload)
                if delta.finish_reason:
                    reason, stop_sequence = stop_reason(delta.finish_reason, delta.stop_sequence), delta.stop_sequence
            for name, payload in blocks.close():
                yield sse_event(name, payload)
            yield sse_event("message_delta", {"type": "message_delta",
                                              "delta": {"stop_reason": reason, "stop_sequence": stop_sequence},
                                              "usage": anthropic_usage(TurnUsage.of(gen))})
            yield sse_event("message_stop", {"type": "message_stop"})
            status = 200
        except APIError as exc:
            status, error = exc.status, exc.message
            yield sse_event("error", anthropic_error_body(exc.status, error_message(exc)))
        finally:
            gen.log(status, decoder.finish_reasons, error)
