"""What the engine hands back per request and step: token/text deltas, finish reason, usage."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.request.sequence import TokenLogprob


@dataclass
class CompletionDelta:
    """New output of one choice since the previous delta."""

    index: int  # choice index (0..n-1)
    text: str  # newly finalised text (never half a UTF-8 character, never part of a stop string)
    token_ids: list[int]
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" once finished
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it


@dataclass
class RequestOutput:
    """One step's news for one request; `finished` is true once every choice has finished."""

    request_id: str
    deltas: list[CompletionDelta]
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int  # summed over choices, so far
    finished: bool
    error: str | None = None
    # prompt token t's logprob at index t (None for the first), in the first report that has them
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class EngineStats:
    """A snapshot for /metrics and logs."""

    num_waiting: int
    num_running: int
    num_total_blocks: int
    num_free_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    attention_path: str
    attention_counters: dict[str, float]
    decode_path: str = ""          # CUDA graphs or eager; asynchronous or synchronous scheduling
    num_graph_steps: int = 0       # decode steps replayed from a CUDA graph
    internal_errors: dict[str, int] = field(default_factory=dict)   # requests failed in the engine, by stage
    kv_cache_dtype: str = ""       # the KV pages' dtype (bfloat16, float8_e4m3fn, ...)

    @property
    def kv_usage(self) -> float:
        if self.num_total_blocks == 0:
            return 0.0
        return 1.0 - self.num_free_blocks / self.num_total_blocks
