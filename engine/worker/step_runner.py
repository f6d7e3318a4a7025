"""What the engine's step calls to run a forward: one process's `ModelRunner`, or a tensor-parallel driver
that has every rank run the same step (engine/parallel/driver.py)."""
from __future__ import annotations

from typing import Protocol

import torch

from engine.request.sequence import Sequence
from engine.worker.model_runner import ExecuteResult, PromptHidden


class StepRunner(Protocol):
    def execute(self, seqs: list[Sequence], input_ids: torch.Tensor | None = None) -> ExecuteResult:
        """Forward the scheduled tokens of `seqs` (ModelRunner.execute)."""

    def prompt_logits(self, part: PromptHidden, lo: int, hi: int) -> torch.Tensor:
        """float32 logits of prompt rows lo..hi of `part`."""

    def release_pages(self, pages: list[int]) -> None:
        """The block manager freed these pages."""

    def begin_step(self) -> None:
        """An engine step begins."""

    def check_health(self) -> None:
        """Raise EngineUnrecoverable when the step can no longer run (a tensor-parallel rank is gone)."""

    def close(self) -> None:
        """Stop what the runner started (other ranks); idempotent."""
