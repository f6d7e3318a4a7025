"""A decode step launched but not yet read back: the pieces of overlapped (asynchronous) scheduling.

With `backend.async_scheduling`, the engine launches decode step N+1 before it reads step N's
sampled tokens: N+1 takes them as input straight from the device, so the GPU is never idle while
the host turns step N's tokens into text, checks stops and schedules. Each sequence in flight
counts its token being sampled in `Sequence.num_in_flight_tokens` until the sampled id arrives; a
sequence that step N finishes (EOS, a stop string, length) simply has its step N+1 row dropped.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.request.sequence import Sequence


@dataclass
class InFlightStep:
    seqs: list[Sequence]            # row i sampled tokens[i]; each still-running row counts it in flight
    tokens: torch.Tensor            # [B] sampled ids, on the device
    host: list[torch.Tensor]        # host copies of the draw's tensors (engine/worker/sampler.py DeviceSample)
    ready: torch.cuda.Event | None = None   # after those copies; None when they were synchronous

    def read(self) -> list[list[Any]]:
        """Wait for this step (only this one: a later step may already be running); the host
        copies as lists, in the order they were copied (a `DeviceSample.tensors()`)."""
        if self.ready is not None:
            self.ready.synchronize()
        return [t.tolist() for t in self.host]

    def mark_in_flight(self) -> None:
        """Count this step's token in flight for each sequence still running."""
        for seq in self.seqs:
            if not seq.is_finished:
                seq.num_in_flight_tokens += 1


def copy_to_host(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
    """(host tensors, event) for an asynchronous device-to-host copy of `tensors`."""
    if not tensors[0].is_cuda:
        return tensors, None
    host = []
    for tensor in tensors:
        pinned = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        pinned.copy_(tensor, non_blocking=True)
        host.append(pinned)
    ready = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch leaves Event.__init__ unannotated
    ready.record()
    return host, ready
