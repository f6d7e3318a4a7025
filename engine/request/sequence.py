"""A sequence: one generation stream (one choice of one request) and its KV bookkeeping."""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from engine.request.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, stop token or stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"  # the client went away or the request timed out
    ERROR = "error"


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


_seq_counter = itertools.count()


class Sequence:
    """Token ids of prompt + output, sampling params, status, block table and progress.

    `num_computed_tokens` counts tokens whose K/V are in the cache; `num_cached_tokens`
    those that came from the prefix cache at admission (for usage reporting).
    `num_in_flight_tokens` counts tokens a step still running has sampled on the device (asynchronous
    scheduling, engine/core/inflight.py): they are not in `token_ids` yet, but every length
    (`len`, `num_output_tokens`, `num_uncomputed_tokens`) counts them.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 choice_index: int = 0, arrival_time: float = 0.0) -> None:
        self.seq_id = next(_seq_counter)
        self.request_id = request_id
        self.choice_index = choice_index
        self.params = params
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.block_table: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.num_scheduled_tokens = 0
        self.num_hashed_blocks = 0  # leading blocks whose hashes the block manager has published
        self.logprobs: list[TokenLogprob] = []
        # prompt token t's logprob at index t (the first token has none); only choice 0 computes them
        self.prompt_logprobs: list[TokenLogprob | None] = \
            [None] if params.prompt_logprobs is not None and choice_index == 0 else []
        self.arrival_time = arrival_time
        self.num_preemptions = 0
        self.max_total_tokens: int | None = None  # context cap set by the engine
        self.num_in_flight_tokens = 0

    def __len__(self) -> int:
        return len(self.token_ids) + self.num_in_flight_tokens

    @property
    def output_token_ids(self) -> list[int]:
        """The output tokens on the host (those in flight are not known yet)."""
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked for and not all computed yet: its prefill takes no cache hits."""
        return 0 < len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self) - self.num_computed_tokens

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def finish(self, reason: FinishReason) -> None:
        """End the sequence; a token still in flight is dropped (its row is skipped when read)."""
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.num_in_flight_tokens = 0
