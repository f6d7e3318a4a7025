"""The loop of every rank but 0: receive rank 0's message, do what it says on this rank's shard, repeat.

A forward that raises here is recorded, not fatal: rank 0's forward raised too when the cause is the
request's data, and its `CheckStep` asks every rank. A message this rank cannot follow, or a collective that
fails (rank 0 is gone), ends the loop with an exception and the process exits non-zero.
"""
from __future__ import annotations

import logging

import torch

from engine.distributed.group import broadcast_object, broadcast_tensor, sum_over_ranks
from engine.parallel.messages import CheckStep, ExecuteStep, Heartbeat, Message, PromptLogits, Stop
from engine.parallel.seq_sync import SeqMirror
from engine.worker.model_runner import ModelRunner, PromptHidden

logger = logging.getLogger(__name__)


class RankLoop:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.mirror = SeqMirror()
        self.step_id = -1
        self.prompt_hidden: dict[int, list[PromptHidden]] = {}   # this step's, by execute serial
        self.last_failed = False

    def run(self) -> None:
        """Until rank 0 says Stop."""
        while True:
            message: Message = broadcast_object(None)
            if isinstance(message, Stop):
                return
            self.handle(message)

    def handle(self, message: Message) -> None:
        if isinstance(message, ExecuteStep):
            self._execute(message)
        elif isinstance(message, PromptLogits):
            serial, index = message.origin
            self.runner.prompt_logits(self.prompt_hidden[serial][index], message.lo, message.hi)
        elif isinstance(message, CheckStep):
            sum_over_ranks(int(self.last_failed))
        elif isinstance(message, Heartbeat):
            sum_over_ranks(0)
        else:
            raise RuntimeError(f"unexpected message from rank 0: {message!r}")

    def _execute(self, message: ExecuteStep) -> None:
        if message.released_pages:
            self.runner.release_pages(message.released_pages)
        if message.step_id != self.step_id:
            self.step_id, self.prompt_hidden = message.step_id, {}
        seqs = self.mirror.apply(message.seqs)
        input_ids = None
        if message.has_input_ids:
            input_ids = broadcast_tensor(torch.empty(len(seqs), dtype=torch.long, device=self.runner.device))
        try:
            result = self.runner.execute(seqs, input_ids)
        except Exception as exc:  # noqa: BLE001 - rank 0 asks whether every rank failed alike
            logger.warning("a forward of %d sequences raised on this rank: %s: %s", len(seqs), type(exc).__name__, exc)
            self.last_failed = True
            return
        self.last_failed = False
        if result.prompt_hidden:
            self.prompt_hidden[message.serial] = result.prompt_hidden
