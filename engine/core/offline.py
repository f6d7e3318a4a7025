"""The offline API for scripts and checks: `LLM(...).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from engine.config import ConfigError, FdserveConfig, load_config
from engine.core.llm_engine import LLMEngine
from engine.request.sampling_params import SamplingParams
from engine.request.sequence import TokenLogprob


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class GenerationResult:
    """Per prompt: the first choice's text/token_ids/finish_reason, all choices in `outputs`."""

    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    # with SamplingParams.prompt_logprobs: one per prompt token, None for the first
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


def overrides_to_dotted(overrides: dict[str, Any]) -> dict[str, str | Any]:
    """Accept `section.key`, `section__key`, a field name unique across sections, or `model`."""
    sections = FdserveConfig.model_fields
    dotted: dict[str, Any] = {}
    for key, value in overrides.items():
        if key == "model":
            key = "model.name"
        key = key.replace("__", ".")
        if "." not in key:
            # f.annotation is Optional in pydantic's types, but every FdserveConfig field is a section model
            owners = [s for s, f in sections.items() if key in f.annotation.model_fields]  # type: ignore[union-attr]
            if len(owners) != 1:
                raise ConfigError(f"{key}: {'ambiguous' if owners else 'unknown'} setting; "
                                  f"write it as section.key (sections: {', '.join(sections)})")
            key = f"{owners[0]}.{key}"
        dotted[key] = str(value) if isinstance(value, Path) else value
    return dotted


class LLM:
    def __init__(self, config: FdserveConfig | str | Path | None = None, **overrides: Any) -> None:
        if isinstance(config, FdserveConfig):
            if overrides:
                config = load_config(None, {**_flatten(config), **overrides_to_dotted(overrides)})
        else:
            config = load_config(config, overrides_to_dotted(overrides))
        self.config = config
        self.engine = LLMEngine(config)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts: str | Seq[str] | Seq[int] | Seq[Seq[int]],
                 params: SamplingParams | None = None) -> list[GenerationResult]:
        params = params or SamplingParams()
        batch: Seq[str | Seq[int]]
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            batch = [cast("str | Seq[int]", prompts)]   # one prompt
        else:
            batch = cast("Seq[str | Seq[int]]", prompts)
        token_lists = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in batch]
        return self._run(token_lists, params)

    def chat(self, messages_list: list[dict[str, Any]] | list[list[dict[str, Any]]],
             params: SamplingParams | None = None, tools: list[dict[str, Any]] | None = None) -> list[GenerationResult]:
        conversations: list[list[dict[str, Any]]]
        if messages_list and isinstance(messages_list[0], dict):
            conversations = [messages_list]   # one conversation
        else:
            conversations = cast("list[list[dict[str, Any]]]", messages_list)
        token_lists = [self.tokenizer.encode(self.tokenizer.apply_chat_template(m, tools=tools))
                       for m in conversations]
        return self._run(token_lists, params or SamplingParams())

    def _run(self, token_lists: list[list[int]], params: SamplingParams) -> list[GenerationResult]:
        results: dict[str, GenerationResult] = {}
        order: list[str] = []
        for tokens in token_lists:
            request_id = f"offline-{next(self._ids)}"
            self.engine.add_request(request_id, tokens, _copy(params))
            results[request_id] = GenerationResult(tokens, [CompletionOutput(i) for i in range(params.n)])
            order.append(request_id)
        while self.engine.has_unfinished():
            for output in self.engine.step():
                result = results[output.request_id]
                result.num_cached_tokens = output.num_cached_tokens
                if output.prompt_logprobs is not None:
                    result.prompt_logprobs = output.prompt_logprobs
                for delta in output.deltas:
                    choice = result.outputs[delta.index]
                    choice.text += delta.text
                    choice.token_ids.extend(delta.token_ids)
                    choice.logprobs.extend(delta.logprobs)
                    choice.finish_reason = delta.finish_reason or choice.finish_reason
        return [results[r] for r in order]


def _copy(params: SamplingParams) -> SamplingParams:
    from dataclasses import replace
    return replace(params)


def _flatten(config: FdserveConfig) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for section, model in config:
        for key, value in model:
            flat[f"{section}.{key}"] = value
    return flat
