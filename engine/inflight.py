"""A decode step launched but not yet read back: the pieces of overlapped (asynchronous) scheduling.

With `backend.async_scheduling`, the engine launches decode step N+1 before it reads step N's
sampled tokens: N+1 takes them as input straight from the device, so the GPU is never idle while
the host turns step N's tokens into text, checks stops and schedules. Each sequence in flight
carries a placeholder as its last token until its sampled id arrives; a sequence that step N
finishes (EOS, a stop string, length) simply has its step N+1 row dropped.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from engine.sequence import Sequence

PLACEHOLDER = -1   # the token a step in flight is sampling; no real token id is negative


@dataclass
class InFlightStep:
    seqs: list[Sequence]            # row i sampled tokens[i]; still-running rows end in PLACEHOLDER
    tokens: torch.Tensor            # [B] sampled ids, on the device
    host: torch.Tensor              # [B] their copy on the host, complete once `ready` has passed
    ready: Any = None               # CUDA event after that copy; None when the copy was synchronous
    counters: dict[str, Any] = field(default_factory=dict)

    def token_ids(self) -> list[int]:
        """Wait for this step (only this one: a later step may already be running) and read its ids."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()


def copy_to_host(tokens: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """(host tensor, event) for an asynchronous device-to-host copy of `tokens`."""
    if not tokens.is_cuda:
        return tokens, None
    host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
    host.copy_(tokens, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return host, ready


def drop_placeholder(seq: Sequence) -> None:
    """Remove the in-flight token of a sequence that ends before its step is read."""
    if seq.token_ids and seq.token_ids[-1] == PLACEHOLDER:
        seq.token_ids.pop()
