"""POST /v1/chat/completions: validate everything, start the engine, answer (JSON or SSE).

Stream shape (what Cline, CC Switch and the openai SDK read): one role chunk per choice,
reasoning deltas (`reasoning_content`, also as `reasoning`) before content / tool-call deltas,
a separate last chunk per choice with its finish_reason, the usage chunk (`choices: []`) only
when stream_options.include_usage is true, then [DONE].
"""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from server.core.engine_client import EngineClient
from server.core.errors import APIError, bad_request
from server.core.generation import Generation
from server.core.state import ServerState
from server.core.streaming import DONE, sse, sse_error
from server.core.token_texts import TokenTexts
from server.openai.chat_stream import ChatDecoder, ChoiceDelta, ToolCallDelta
from server.openai.constraints import constraint_processors
from server.openai.logprobs import chat_logprobs
from server.openai.prompts import encode_prompt, render_chat
from server.openai.protocol import ChatCompletionRequest
from server.openai.reasoning import ReasoningSplit, reasoning_split
from server.openai.respond import CLIENT_CLOSED, respond, usage
from server.openai.sampling import build_params, max_tokens_for
from server.openai.tools import ToolPlan, plan_tools, template_info


def _top_logprobs(req: ChatCompletionRequest) -> int | None:
    if req.logprobs:
        return req.top_logprobs or 0
    if req.top_logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    return None


@dataclass
class _Choice:
    """A choice's answer as it is collected (non-streaming)."""

    index: int
    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    calls: list[ToolCallDelta] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None


class ChatRun:
    """One chat request from validated body to response."""

    def __init__(self, state: ServerState, req: ChatCompletionRequest, route: str = "chat",
                 request_id: str | None = None) -> None:
        self.state = state
        self.req = req
        self.route = route  # in metrics and the log line: other protocols run chat requests too
        self.engine: EngineClient           # set by render(), which checks the request against it
        self.id = request_id or f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.plan: ToolPlan | None = None
        self.reasoning: ReasoningSplit | None = None
        self.texts: TokenTexts

    def render(self) -> list[int]:
        """Check the request against the engine and return its prompt's token ids."""
        req = self.req
        engine = self.engine = self.state.ready_engine()
        self.texts = self.state.ready_token_texts()
        self.state.check_model(req.model)
        self.plan = plan_tools(req, template_info(engine.tokenizer))
        if self.plan.forced and req.response_format is not None and req.response_format.type != "text":
            raise bad_request("response_format cannot be combined with a forced tool_choice", "response_format")
        text = render_chat(engine, req.messages, self.plan, template_kwargs=req.chat_template_kwargs)
        constrained = self.plan.forced or (req.response_format is not None and req.response_format.type != "text")
        self.reasoning = reasoning_split(self.state.config.model.reasoning_parser,
                                         engine.tokenizer.chat_template_source, text, constrained)
        return encode_prompt(engine, text)

    async def prepare(self) -> Generation:
        req = self.req
        prompt = self.render()
        engine = self.engine
        wanted, param = ((req.max_completion_tokens, "max_completion_tokens") if req.max_completion_tokens is not None
                         else (req.max_tokens, "max_tokens"))
        max_tokens = max_tokens_for(wanted, param, len(prompt), engine.max_context_len, engine.max_new_tokens, None)
        params = build_params(req, engine=engine, max_tokens=max_tokens, logprobs=_top_logprobs(req),
                              rename={"max_tokens": param})
        processors = await constraint_processors(engine, req.response_format, self.plan)
        if processors:
            params.logits_processors = processors
        return Generation(engine, self.state.metrics, self.route, self.id, [prompt], params)

    def decoder(self, num_choices: int) -> ChatDecoder:
        """The parser of this request's output (tool calls, reasoning), for any protocol's writer."""
        return ChatDecoder(self.plan, num_choices, self.reasoning)

    # ----- non-streaming ---------------------------------------------------------------------
    async def collect(self, gen: Generation) -> dict[str, Any]:
        decoder = self.decoder(gen.params.n)
        choices = [_Choice(i) for i in range(gen.params.n)]
        async for delta in decoder.deltas(gen):
            choice = choices[delta.index]
            choice.content.append(delta.text)
            choice.reasoning.append(delta.reasoning)
            choice.calls.extend(delta.tool_calls)
            if self.req.logprobs:
                choice.logprobs.extend(chat_logprobs(list(delta.logprobs), self.texts))
            choice.finish_reason = delta.finish_reason or choice.finish_reason
        return {"id": self.id, "object": "chat.completion", "created": self.created,
                "model": self.engine.served_model_name,
                "choices": [self._message_choice(c) for c in choices], "usage": usage(gen)}

    def _message_choice(self, choice: _Choice) -> dict[str, Any]:
        content = "".join(choice.content)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        reasoning = "".join(choice.reasoning)
        if reasoning:
            message.update(reasoning_fields(reasoning))
        calls = assembled_calls(choice.calls)
        if calls:
            message["tool_calls"] = calls
            message["content"] = content or None
        logprobs = {"content": choice.logprobs} if self.req.logprobs else None
        return {"index": choice.index, "message": message, "logprobs": logprobs,
                "finish_reason": choice.finish_reason or "stop"}

    # ----- streaming -------------------------------------------------------------------------
    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.engine.served_model_name, "choices": choices, **extra}

    def _delta_chunks(self, delta: ChoiceDelta) -> list[dict[str, Any]]:
        logprobs = chat_logprobs(list(delta.logprobs), self.texts) if self.req.logprobs and delta.logprobs else None
        chunks = []
        if delta.reasoning:  # a chunk of its own, so that every reasoning delta precedes the content
            chunks.append(self._chunk([{"index": delta.index, "delta": reasoning_fields(delta.reasoning),
                                        "logprobs": None, "finish_reason": None}]))
        if delta.text or delta.tool_calls or logprobs:
            body: dict[str, Any] = {}
            if delta.text:
                body["content"] = delta.text
            if delta.tool_calls:
                body["tool_calls"] = [openai_call_delta(c) for c in delta.tool_calls]
            chunks.append(self._chunk([{"index": delta.index, "delta": body,
                                        "logprobs": {"content": logprobs} if logprobs else None,
                                        "finish_reason": None}]))
        if delta.finish_reason:
            chunks.append(self._chunk([{"index": delta.index, "delta": {}, "logprobs": None,
                                        "finish_reason": delta.finish_reason}]))
        return chunks

    async def events(self, gen: Generation) -> AsyncIterator[str]:
        decoder = self.decoder(gen.params.n)
        status, error = CLIENT_CLOSED, None
        try:
            for index in range(gen.params.n):
                yield sse(self._chunk([{"index": index, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}]))
            async for delta in decoder.deltas(gen):
                for chunk in self._delta_chunks(delta):
                    yield sse(chunk)
            if self.req.include_usage:
                yield sse(self._chunk([], usage=usage(gen)))
            status = 200
            yield DONE
        except APIError as exc:
            status, error = exc.status, exc.message
            yield sse_error(exc)
            yield DONE
        finally:
            gen.log(status, decoder.finish_reasons, error)


def reasoning_fields(text: str) -> dict[str, str]:
    """Reasoning under both names clients read: `reasoning_content` (most) and `reasoning` (vLLM's)."""
    return {"reasoning_content": text, "reasoning": text}


def openai_call_delta(piece: ToolCallDelta) -> dict[str, Any]:
    if piece.opens_call:
        return {"index": piece.call_index, "id": piece.id, "type": "function",
                "function": {"name": piece.name, "arguments": piece.arguments}}
    return {"index": piece.call_index, "function": {"arguments": piece.arguments}}


def assembled_calls(pieces: list[ToolCallDelta]) -> list[dict[str, Any]]:
    """A message's tool_calls from the pieces streamed for it (arguments concatenated)."""
    calls: dict[int, dict[str, Any]] = {}
    for piece in pieces:
        if piece.opens_call:
            calls[piece.call_index] = {"id": piece.id, "type": "function",
                                       "function": {"name": piece.name or "", "arguments": ""}}
        calls[piece.call_index]["function"]["arguments"] += piece.arguments
    for call in calls.values():
        call["function"]["arguments"] = call["function"]["arguments"] or "{}"
    return [calls[i] for i in sorted(calls)]


async def create_chat_completion(request: Request, state: ServerState, req: ChatCompletionRequest) -> Response:
    return await respond(request, state, ChatRun(state, req), "chat", bool(req.stream))
