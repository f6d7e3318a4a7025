"""Per-request sampling parameters (the OpenAI request fields the sampler obeys)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# (the sequence's output token ids, its logits row [V]) -> the row to sample from
LogitsProcessor = Callable[[list[int], "torch.Tensor"], "torch.Tensor"]


BANNED_BIAS = -100.0  # logit_bias at OpenAI's lower bound bans the token outright


class SamplingParamsError(ValueError):
    """A sampling parameter that can never be honoured; `param` names the request field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # <= 0: disabled (stored as -1); above the vocabulary: the whole vocabulary
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; k >= 0: sampled token's logprob plus top-k
    # None: off; k >= 0: each prompt token's logprob (the first has none) plus top-k, computed in the
    # prefill, which then takes no prefix-cache hits (max_tokens = 0: the prompt is only scored)
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logits_processors: list[LogitsProcessor] = field(default_factory=list, compare=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        if self.top_k <= 0:
            self.top_k = -1
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def validate(self) -> None:
        checks = [
            (self.n >= 1, "n must be at least 1", "n"),
            (self.n <= 128, "n must be at most 128", "n"),
            (0.0 <= self.temperature <= 2.0 + 1e-9, "temperature must be in [0, 2]", "temperature"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]", "top_p"),
            (0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]", "min_p"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be in [-2, 2]", "presence_penalty"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must be in [-2, 2]", "frequency_penalty"),
            (0.0 < self.repetition_penalty <= 10.0, "repetition_penalty must be in (0, 10]", "repetition_penalty"),
            (self.max_tokens is None or self.max_tokens >= 0, "max_tokens must be >= 0", "max_tokens"),
            (self.min_tokens >= 0, "min_tokens must be >= 0", "min_tokens"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "top_logprobs must be in [0, 20]", "top_logprobs"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20, "prompt_logprobs must be in [0, 20]",
             "prompt_logprobs"),
            (len(self.stop) <= 16, "at most 16 stop sequences are allowed", "stop"),
        ]
        for ok, message, param in checks:
            if not ok:
                raise SamplingParamsError(message, param)
        for token_id, bias in self.logit_bias.items():
            if not -100.0 <= float(bias) <= 100.0:
                raise SamplingParamsError(f"logit_bias for token {token_id} must be in [-100, 100]", "logit_bias")

    def validate_for_vocab(self, vocab_size: int) -> None:
        """What needs the vocabulary: a logit_bias of -100 bans a token, and banning them all
        leaves nothing to generate."""
        banned = {int(t) for t, bias in self.logit_bias.items()
                  if float(bias) <= BANNED_BIAS and 0 <= int(t) < vocab_size}
        if len(banned) >= vocab_size:
            raise SamplingParamsError(f"logit_bias bans every token of the vocabulary ({vocab_size}); "
                                      "leave at least one above -100", "logit_bias")
