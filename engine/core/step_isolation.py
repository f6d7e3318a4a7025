"""Runs a step's forward and draw so that one request's failure ends only that request.

When the batched call raises, halves of the batch are tried on their own until the failing
rows are single sequences; those requests fail (the `fail` callback) and the rest run again
together, as they would have without the culprit. When no part fails alone (a failure that
needs the whole batch, such as running out of memory), the halves' results are used as they
are. Re-running a forward is safe: it writes the same K/V slots again, and nothing is counted
as computed until a forward succeeds. Re-running a draw restores the random state first, so
seeded rows draw what they would have drawn.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.core.faults import STAGE_FORWARD, STAGE_SAMPLING, describe, raise_if_unrecoverable
from engine.request.sequence import Sequence
from engine.worker.model_runner import ExecuteResult
from engine.worker.sampler import Sampler, SampleResult
from engine.worker.step_runner import StepRunner

logger = logging.getLogger(__name__)

# (the failing sequence, the failure stage, a one-line description) -> ends its whole request
FailRequest = Callable[[Sequence, str, str], None]


@dataclass
class ForwardPart:
    """One successful forward over `seqs`: what ModelRunner.execute returned for them."""

    seqs: list[Sequence]
    result: ExecuteResult


class StepIsolation:
    def __init__(self, runner: StepRunner, sampler: Sampler, fail: FailRequest) -> None:
        self.runner = runner
        self.sampler = sampler
        self.fail = fail

    # ----- forward -----------------------------------------------------------------------------
    def forward(self, seqs: list[Sequence]) -> list[ForwardPart]:
        """Forwards covering every sequence that did not fail (usually one part: the batch)."""
        try:
            return [self._forward(seqs)]
        except Exception as exc:  # noqa: BLE001 - one request's fault must not end the others
            raise_if_unrecoverable(exc, len(seqs))
            if len(seqs) == 1:
                self.fail(seqs[0], STAGE_FORWARD, describe(exc))
                return []
            logger.warning("a forward of %d sequences failed (%s); looking for the request it belongs to",
                           len(seqs), describe(exc))
        culprits = self._find(seqs, self._probe_forward)
        for seq, error in culprits:
            self.fail(seq, STAGE_FORWARD, error)
        rest = [seq for seq in seqs if not seq.is_finished]
        if culprits:
            return self.forward(rest) if rest else []
        mid = len(rest) // 2
        return self.forward(rest[:mid]) + self.forward(rest[mid:])

    def _forward(self, seqs: list[Sequence]) -> ForwardPart:
        return ForwardPart(seqs, self.runner.execute(seqs))

    def _probe_forward(self, seqs: list[Sequence]) -> None:
        self.runner.execute(seqs)

    # ----- draw --------------------------------------------------------------------------------
    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[SampleResult | None]:
        """One result per row; None where the row's request failed while drawing."""
        checkpoint = self.sampler.checkpoint(seqs)
        try:
            return list(self.sampler(logits, seqs))
        except Exception as exc:  # noqa: BLE001 - as in forward
            raise_if_unrecoverable(exc, len(seqs))
            if len(seqs) == 1:
                self.fail(seqs[0], STAGE_SAMPLING, describe(exc))
                return [None]
            logger.warning("a draw of %d rows failed (%s); looking for the request it belongs to",
                           len(seqs), describe(exc))
        rows = {id(seq): i for i, seq in enumerate(seqs)}

        def probe(part: list[Sequence]) -> None:
            self.sampler.restore(checkpoint)
            self.sampler(_rows(logits, [rows[id(s)] for s in part]), part)

        culprits = self._find(seqs, probe)
        for seq, error in culprits:
            self.fail(seq, STAGE_SAMPLING, error)
        self.sampler.restore(checkpoint)
        keep = [i for i, seq in enumerate(seqs) if not seq.is_finished]
        out: list[SampleResult | None] = [None] * len(seqs)
        if not keep:
            return out
        parts = [keep] if culprits else [keep[:len(keep) // 2], keep[len(keep) // 2:]]
        for part in parts:
            for i, result in zip(part, self.sample(_rows(logits, part), [seqs[i] for i in part]), strict=True):
                out[i] = result
        return out

    # ----- finding the failing rows --------------------------------------------------------------
    def _find(self, seqs: list[Sequence], probe: Callable[[list[Sequence]], None]) -> list[tuple[Sequence, str]]:
        """(sequence, error) for each single sequence on which `probe` raises, by bisection."""
        found: list[tuple[Sequence, str]] = []
        mid = len(seqs) // 2
        for half in (seqs[:mid], seqs[mid:]):
            if not half:
                continue
            try:
                probe(half)
            except Exception as exc:  # noqa: BLE001 - that is what is being looked for
                raise_if_unrecoverable(exc, len(half))
                found.extend([(half[0], describe(exc))] if len(half) == 1 else self._find(half, probe))
        return found


def _rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    return t if rows == list(range(t.shape[0])) else t[torch.tensor(rows, device=t.device)]
