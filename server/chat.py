"""POST /v1/chat/completions: validate everything, start the engine, answer (JSON or SSE).

Stream shape (what Cline, CC Switch and the openai SDK read): one role chunk per choice,
content / tool-call deltas, a separate last chunk per choice with its finish_reason, the
usage chunk (`choices: []`) only when stream_options.include_usage is true, then [DONE].
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from engine.outputs import CompletionDelta
from server.constraints import constraint_processors
from server.errors import APIError, bad_request
from server.generation import Generation
from server.logprobs import TokenTexts, chat_logprobs
from server.prompts import encode_prompt, render_chat
from server.protocol import ChatCompletionRequest
from server.respond import CLIENT_CLOSED, choice_error, respond, usage
from server.sampling import build_params, max_tokens_for
from server.state import ServerState
from server.streaming import DONE, sse, sse_error
from server.tool_parser import ToolCallParser
from server.tools import ToolPlan, plan_tools, template_info


def _top_logprobs(req: ChatCompletionRequest) -> int | None:
    if req.logprobs:
        return req.top_logprobs or 0
    if req.top_logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    return None


def finish_reason(engine_reason: str, has_tool_calls: bool) -> str:
    if engine_reason == "stop" and has_tool_calls:
        return "tool_calls"
    return engine_reason


@dataclass
class _Choice:
    index: int
    parser: ToolCallParser | None
    content: list[str] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None

    def feed(self, delta: CompletionDelta) -> tuple[str, list[dict[str, Any]]]:
        if self.parser is None:
            return delta.text, []
        text, calls = self.parser.feed(delta.text)
        if delta.finish_reason:
            more_text, more_calls = self.parser.finish()
            text, calls = text + more_text, calls + more_calls
        return text, calls

    @property
    def has_tool_calls(self) -> bool:
        return self.parser is not None and self.parser.has_calls


class ChatRun:
    """One chat request from validated body to response."""

    def __init__(self, state: ServerState, req: ChatCompletionRequest) -> None:
        self.state = state
        self.req = req
        self.engine: Any = None
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.plan: ToolPlan | None = None
        self.texts: TokenTexts | None = None

    async def prepare(self) -> Generation:
        req = self.req
        engine = self.engine = self.state.ready_engine()
        self.texts = self.state.token_texts
        self.state.check_model(req.model)
        self.plan = plan_tools(req, template_info(engine.tokenizer))
        if self.plan.forced and req.response_format is not None and req.response_format.type != "text":
            raise bad_request("response_format cannot be combined with a forced tool_choice", "response_format")
        prompt = encode_prompt(engine, render_chat(engine, req.messages, self.plan,
                                                   template_kwargs=req.chat_template_kwargs))
        wanted, param = ((req.max_completion_tokens, "max_completion_tokens") if req.max_completion_tokens is not None
                         else (req.max_tokens, "max_tokens"))
        max_tokens = max_tokens_for(wanted, param, len(prompt), engine.max_context_len, engine.max_new_tokens, None)
        params = build_params(req, engine=engine, max_tokens=max_tokens, logprobs=_top_logprobs(req),
                              rename={"max_tokens": param})
        processors = await constraint_processors(engine, req.response_format, self.plan)
        if processors:
            params.logits_processors = processors
        return Generation(engine, self.state.metrics, "chat", self.id, [prompt], params)

    def _choices(self, n: int) -> list[_Choice]:
        parse = self.plan is not None and self.plan.parse_calls
        return [_Choice(i, ToolCallParser(self.plan.style) if parse else None) for i in range(n)]

    # ----- non-streaming ---------------------------------------------------------------------
    async def collect(self, gen: Generation) -> dict[str, Any]:
        choices = self._choices(gen.params.n)
        async for _, out in gen.outputs():
            for delta in out.deltas:
                choice = choices[delta.index]
                text, _ = choice.feed(delta)
                choice.content.append(text)
                if self.req.logprobs:
                    choice.logprobs.extend(chat_logprobs(delta.logprobs, self.texts))
                if delta.finish_reason:
                    failure = choice_error(delta, out.error)
                    if failure is not None:
                        raise failure
                    choice.finish_reason = finish_reason(delta.finish_reason, choice.has_tool_calls)
        return {"id": self.id, "object": "chat.completion", "created": self.created,
                "model": self.engine.served_model_name,
                "choices": [self._message_choice(c) for c in choices], "usage": usage(gen)}

    def _message_choice(self, choice: _Choice) -> dict[str, Any]:
        content = "".join(choice.content)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if choice.has_tool_calls:
            message["tool_calls"] = [c.as_message_call() for c in choice.parser.calls]
            message["content"] = content or None
        logprobs = {"content": choice.logprobs} if self.req.logprobs else None
        return {"index": choice.index, "message": message, "logprobs": logprobs,
                "finish_reason": choice.finish_reason or "stop"}

    # ----- streaming -------------------------------------------------------------------------
    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.engine.served_model_name, "choices": choices, **extra}

    def _delta_chunks(self, choice: _Choice, delta: CompletionDelta) -> list[dict[str, Any]]:
        text, calls = choice.feed(delta)
        logprobs = chat_logprobs(delta.logprobs, self.texts) if self.req.logprobs and delta.logprobs else None
        chunks = []
        if text or calls or logprobs:
            body: dict[str, Any] = {}
            if text:
                body["content"] = text
            if calls:
                body["tool_calls"] = calls
            chunks.append(self._chunk([{"index": choice.index, "delta": body,
                                        "logprobs": {"content": logprobs} if logprobs else None,
                                        "finish_reason": None}]))
        if delta.finish_reason:
            choice.finish_reason = finish_reason(delta.finish_reason, choice.has_tool_calls)
            chunks.append(self._chunk([{"index": choice.index, "delta": {}, "logprobs": None,
                                        "finish_reason": choice.finish_reason}]))
        return chunks

    async def events(self, gen: Generation) -> AsyncIterator[str]:
        choices = self._choices(gen.params.n)
        status, error = CLIENT_CLOSED, None
        try:
            for choice in choices:
                yield sse(self._chunk([{"index": choice.index, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}]))
            async for _, out in gen.outputs():
                for delta in out.deltas:
                    failure = choice_error(delta, out.error) if delta.finish_reason else None
                    if failure is not None:
                        raise failure
                    for chunk in self._delta_chunks(choices[delta.index], delta):
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
            gen.log(status, [c.finish_reason for c in choices if c.finish_reason], error)


async def create_chat_completion(request: Request, state: ServerState, req: ChatCompletionRequest) -> Response:
    return await respond(request, state, ChatRun(state, req), "chat", bool(req.stream))
