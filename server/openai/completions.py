"""POST /v1/completions (legacy): a prompt string, a batch of them, or token ids.

Choice index i*n + j is choice j of prompt i, as OpenAI numbers them. Streams end like chat
streams: a last chunk per choice with its finish_reason, the usage chunk only when asked, [DONE].
"""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from engine.request.sequence import TokenLogprob
from server.core.engine_client import EngineClient
from server.core.errors import APIError, bad_request
from server.core.generation import Generation
from server.core.state import ServerState
from server.core.streaming import DONE, sse, sse_error
from server.core.token_texts import TokenTexts
from server.openai.constraints import constraint_processors
from server.openai.logprobs import CompletionLogprobs, merge_completion_logprobs
from server.openai.protocol import CompletionRequest
from server.openai.respond import CLIENT_CLOSED, choice_error, respond, usage
from server.openai.sampling import build_params, max_tokens_for

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for this endpoint


class CompletionRun:
    def __init__(self, state: ServerState, req: CompletionRequest) -> None:
        self.state = state
        self.req = req
        self.engine: EngineClient           # set by prepare()
        self.texts: TokenTexts
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.prompt_texts: list[str] = []

    def _prompts(self) -> list[list[int]]:
        prompt, tokenizer = self.req.prompt, self.engine.tokenizer
        if isinstance(prompt, str):
            batch: list[Any] = [prompt]
        elif prompt and all(isinstance(p, int) for p in prompt):
            batch = [prompt]
        else:
            batch = list(prompt)
        if not batch:
            raise bad_request("prompt must not be empty", "prompt")
        ids = []
        for item in batch:
            # raw text prompts get the model's BOS, as the model saw in training
            tokens = tokenizer.encode(item, add_special_tokens=True) if isinstance(item, str) else list(item)
            if any(not 0 <= t < tokenizer.vocab_size for t in tokens):
                raise bad_request("prompt contains a token id outside the vocabulary", "prompt")
            ids.append(tokens)
            self.prompt_texts.append(item if isinstance(item, str) else tokenizer.decode(tokens))
        return ids

    async def prepare(self) -> Generation:
        req = self.req
        engine = self.engine = self.state.ready_engine()
        self.texts = self.state.ready_token_texts()
        self.state.check_model(req.model)
        if req.suffix:
            raise bad_request("suffix (fill-in-the-middle) is not supported", "suffix")
        n = 1 if req.n is None else req.n
        if req.best_of is not None and req.best_of != n:
            raise bad_request("best_of other than n is not supported", "best_of")
        prompts = self._prompts()
        longest = max(len(p) for p in prompts)
        max_tokens = max_tokens_for(req.max_tokens, "max_tokens", longest, engine.max_context_len,
                                    engine.max_new_tokens, DEFAULT_MAX_TOKENS, allow_zero=bool(req.echo),
                                    zero_hint="only with echo, which scores the prompt")
        # echo with logprobs: the prompt's tokens get theirs too, as OpenAI's legacy endpoint gives them
        scored = {"prompt_logprobs": req.logprobs} if req.echo and req.logprobs is not None else None
        params = build_params(req, engine=engine, max_tokens=max_tokens, logprobs=req.logprobs, extra=scored,
                              rename={"top_logprobs": "logprobs", "prompt_logprobs": "logprobs"})
        processors = await constraint_processors(engine, req.response_format)
        if processors:
            params.logits_processors = processors
        return Generation(engine, self.state.metrics, "completions", self.id, prompts, params,
                          prompt_param="prompt")

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.engine.served_model_name, "choices": choices, **extra}

    async def _choice_pieces(self, gen: Generation
                             ) -> AsyncIterator[tuple[int, str, dict[str, Any] | None, str | None]]:
        """(choice index, text, logprobs piece, finish_reason) per delta; echo comes first."""
        n = gen.params.n
        trackers: dict[int, CompletionLogprobs] = {}
        echoed: set[int] = set()
        prompt_logprobs: dict[int, list[TokenLogprob | None]] = {}
        async for prompt_index, out in gen.outputs():
            if out.prompt_logprobs is not None:   # in the first report with deltas (the engine holds them)
                prompt_logprobs[prompt_index] = out.prompt_logprobs
            for delta in out.deltas:
                index = prompt_index * n + delta.index
                failure = choice_error(delta, out.error) if delta.finish_reason else None
                if failure is not None:
                    raise failure
                text = delta.text
                echo = self.req.echo and index not in echoed
                if echo:
                    echoed.add(index)
                    text = self.prompt_texts[prompt_index] + text
                logprobs = None
                if self.req.logprobs is not None:
                    if index not in trackers:   # text_offset counts in the returned text, echo included
                        start = len(self.prompt_texts[prompt_index]) if self.req.echo else 0
                        trackers[index] = CompletionLogprobs(self.texts, offset=start)
                    logprobs = trackers[index].piece(delta.logprobs)
                    if echo:   # the prompt's tokens first, text_offset from the start of the text
                        scored = CompletionLogprobs(self.texts).tokens_piece(
                            gen.prompts[prompt_index], prompt_logprobs[prompt_index])
                        logprobs = merge_completion_logprobs([scored, logprobs])
                yield index, text, logprobs, delta.finish_reason

    async def collect(self, gen: Generation) -> dict[str, Any]:
        total = len(gen.prompts) * gen.params.n
        texts: list[list[str]] = [[] for _ in range(total)]
        logprobs: list[list[dict[str, Any]]] = [[] for _ in range(total)]
        reasons: list[str | None] = [None] * total
        async for index, text, piece, reason in self._choice_pieces(gen):
            texts[index].append(text)
            if piece is not None:
                logprobs[index].append(piece)
            reasons[index] = reason or reasons[index]
        choices = [{"index": i, "text": "".join(texts[i]),
                    "logprobs": merge_completion_logprobs(logprobs[i]) if self.req.logprobs is not None else None,
                    "finish_reason": reasons[i] or "stop"} for i in range(total)]
        return self._chunk(choices, usage=usage(gen))

    async def events(self, gen: Generation) -> AsyncIterator[str]:
        status, error, reasons = CLIENT_CLOSED, None, []
        try:
            async for index, text, piece, reason in self._choice_pieces(gen):
                if text or (piece and piece["tokens"]):
                    yield sse(self._chunk([{"index": index, "text": text, "logprobs": piece, "finish_reason": None}]))
                if reason:
                    reasons.append(reason)
                    yield sse(self._chunk([{"index": index, "text": "", "logprobs": None, "finish_reason": reason}]))
            if self.req.include_usage:
                yield sse(self._chunk([], usage=usage(gen)))
            status = 200
            yield DONE
        except APIError as exc:
            status, error = exc.status, exc.message
            yield sse_error(exc)
            yield DONE
        finally:
            gen.log(status, reasons, error)


async def create_completion(request: Request, state: ServerState, req: CompletionRequest) -> Response:
    return await respond(request, state, CompletionRun(state, req), "completions", bool(req.stream))
