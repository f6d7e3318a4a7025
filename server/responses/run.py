"""One Responses request: translated into a chat request, run by ChatRun, answered as a Response.

Non-stream: the Response object (status completed, or incomplete with
incomplete_details.reason max_output_tokens when the budget ran out). Stream: `event:` lines
with a `sequence_number` on every event: response.created, response.in_progress, each output
item's events (items.py), then response.completed carrying the whole Response (its status says
incomplete when it is). A failure once the stream is open is response.failed, carrying the
Response with its error, and the stream ends.

Usage: input_tokens (with input_tokens_details.cached_tokens from the prefix cache),
output_tokens (output_tokens_details.reasoning_tokens: the reasoning text's length in tokens)
and total_tokens.
"""
from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator
from typing import Any

from server.core.errors import APIError
from server.core.generation import Generation
from server.core.state import ServerState
from server.core.streaming import sse_event
from server.openai.chat import ChatRun
from server.openai.chat_stream import LENGTH, TurnUsage
from server.openai.respond import CLIENT_CLOSED
from server.responses.items import COMPLETED, IN_PROGRESS, INCOMPLETE, OutputItems, new_id
from server.responses.protocol import CustomTool, FunctionTool, NamedTool, ResponsesRequest
from server.responses.translate import Translation, generation_request

ROUTE = "responses"
FAILED = "failed"
# The chat request's field names in errors, as a Responses client knows them.
RESPONSES_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens",
                    "response_format": "text.format"}


def in_responses_terms(error: APIError) -> APIError:
    if error.param in RESPONSES_PARAMS:
        error.param = RESPONSES_PARAMS[error.param]
    return error


def responses_usage(usage: TurnUsage, reasoning_tokens: int) -> dict[str, Any]:
    return {"input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.output_tokens,
            "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, usage.output_tokens)},
            "total_tokens": usage.prompt_tokens + usage.output_tokens}


class ResponsesRun:
    def __init__(self, state: ServerState, req: ResponsesRequest) -> None:
        self.state = state
        self.req = req
        self.id = new_id("resp")
        self.created_at = int(time.time())
        self.finish_reasons: list[str] = []  # the engine's, for the log line and metrics
        self._chat: ChatRun | None = None
        self._translation: Translation | None = None
        self.model = req.model or ""

    async def prepare(self) -> Generation:
        try:
            self._translation = generation_request(self.req)
            self._chat = ChatRun(self.state, self._translation.chat, route=ROUTE, request_id=self.id)
            gen = await self._chat.prepare()
        except APIError as exc:
            raise in_responses_terms(exc) from None
        self.model = self.req.model or gen.engine.served_model_name
        return gen

    def _items(self) -> OutputItems:
        assert self._translation is not None, "prepare() first"
        return OutputItems(self._translation.custom_tools)

    def _usage(self, gen: Generation, items: OutputItems) -> dict[str, Any]:
        reasoning = items.reasoning_text
        reasoning_tokens = len(gen.engine.tokenizer.encode(reasoning)) if reasoning else 0
        return responses_usage(TurnUsage.of(gen), reasoning_tokens)

    def _response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None,
                  error: dict[str, Any] | None = None) -> dict[str, Any]:
        req = self.req
        choice = req.tool_choice
        tools = [t.model_dump(exclude_none=True) for t in req.tools or [] if isinstance(t, (FunctionTool, CustomTool))]
        text_format = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format \
            else {"type": "text"}
        reasoning = req.reasoning.model_dump() if req.reasoning is not None else {"effort": None, "summary": None}
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "error": error,
                "incomplete_details": {"reason": "max_output_tokens"} if status == INCOMPLETE else None,
                "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
                "model": self.model, "output": output,
                "parallel_tool_calls": req.parallel_tool_calls is not False, "previous_response_id": None,
                "reasoning": reasoning, "store": False,
                "temperature": 1.0 if req.temperature is None else req.temperature,
                "text": {"format": text_format},
                "tool_choice": (choice.model_dump(exclude_none=True) if isinstance(choice, NamedTool)
                                else choice or "auto"),
                "tools": tools, "top_p": 1.0 if req.top_p is None else req.top_p, "truncation": "disabled",
                "usage": usage, "user": req.user, "metadata": req.metadata or {}}

    async def collect(self, gen: Generation) -> dict[str, Any]:
        assert self._chat is not None, "prepare() first"
        items, decoder = self._items(), self._chat.decoder(1)
        reason = None
        async for delta in decoder.deltas(gen):
            items.feed(delta)
            reason = delta.finish_reason or reason
        status = INCOMPLETE if reason == LENGTH else COMPLETED
        items.close(status)
        self.finish_reasons = decoder.finish_reasons
        return self._response(status, items.items, self._usage(gen, items))

    async def events(self, gen: Generation) -> AsyncIterator[str]:
        assert self._chat is not None, "prepare() first"
        items, decoder = self._items(), self._chat.decoder(1)
        numbers = itertools.count()
        status, error = CLIENT_CLOSED, None

        def event(kind: str, payload: dict[str, Any]) -> str:
            return sse_event(kind, {"type": kind, "sequence_number": next(numbers), **payload})

        try:
            opened = self._response(IN_PROGRESS, [], None)
            yield event("response.created", {"response": opened})
            yield event("response.in_progress", {"response": opened})
            reason = None
            async for delta in decoder.deltas(gen):
                for kind, payload in items.feed(delta):
                    yield event(kind, payload)
                reason = delta.finish_reason or reason
            outcome = INCOMPLETE if reason == LENGTH else COMPLETED
            for kind, payload in items.close(outcome):
                yield event(kind, payload)
            yield event("response.completed",
                        {"response": self._response(outcome, items.items, self._usage(gen, items))})
            status = 200
        except APIError as exc:
            status, error = exc.status, exc.message
            failure = {"code": exc.code or "server_error", "message": exc.message}
            yield event("response.failed", {"response": self._response(FAILED, items.items, self._usage(gen, items),
                                                                       failure)})
        finally:
            gen.log(status, decoder.finish_reasons, error)
