"""Rank 0's runner under tensor parallelism: every call the engine makes is first broadcast to the other
ranks, which run the same forward on their shards (engine/parallel/worker_loop.py), then run here.

The forward's collectives keep the ranks in lockstep. A forward that raises here raised on every rank when
its cause is the request's data (the same code on the same inputs); `CheckStep` confirms that before the
engine treats it as one request's fault. Anything else (a rank died, a collective timed out, the ranks
disagree about a failure) is a `RankFailure`, which ends the engine. While the engine is idle a heartbeat
keeps the other ranks' waits short and finds a dead or hung rank.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import NoReturn, TypeVar

import torch

from engine.distributed.group import (
    RankFailure,
    TensorParallelGroup,
    broadcast_object,
    broadcast_tensor,
    sum_over_ranks,
)
from engine.parallel.messages import CheckStep, ExecuteStep, Heartbeat, Message, PromptLogits, Stop
from engine.parallel.seq_sync import SeqEncoder
from engine.request.sequence import Sequence
from engine.worker.model_runner import ExecuteResult, ModelRunner, PromptHidden

logger = logging.getLogger(__name__)

HEARTBEAT_PERIOD_S = 1.0
T = TypeVar("T")

# Returns a line naming each rank process of this node that has exited, or None while all run.
RankWatch = Callable[[], str | None]


class TensorParallelDriver:
    def __init__(self, runner: ModelRunner, group: TensorParallelGroup, watch: RankWatch,
                 on_close: Callable[[bool], None]) -> None:
        """`on_close(clean)`: stop the ranks; `clean` when they were told to (else they are killed sooner)."""
        self.runner = runner
        self.group = group
        self._watch = watch
        self._on_close = on_close
        self._encoder = SeqEncoder()
        self._lock = threading.Lock()      # one message (and its forward) at a time: the step or the heartbeat
        self._serial = 0
        self._step_id = 0
        self._released: list[int] = []
        self._failure: str | None = None
        self._closed = False
        self._last_message = time.monotonic()
        self._stop_heartbeat = threading.Event()
        self._heartbeat = threading.Thread(target=self._beat, name="fdserve-tp-heartbeat", daemon=True)
        self._heartbeat.start()

    # ----- StepRunner ------------------------------------------------------------------------------
    def execute(self, seqs: list[Sequence], input_ids: torch.Tensor | None = None) -> ExecuteResult:
        with self._lock:
            self._serial += 1
            serial = self._serial
            message = ExecuteStep(serial, self._step_id, self._encoder.encode(seqs), self._released,
                                  has_input_ids=input_ids is not None)
            self._released = []
            self._send(message)
            if input_ids is not None:   # int64 on every rank: the others allocate it so
                input_ids = input_ids.to(self.runner.device, torch.long)
                ids = input_ids
                self._collective(lambda: broadcast_tensor(ids))
            try:
                result = self.runner.execute(seqs, input_ids)
            except Exception as exc:  # noqa: BLE001 - the same on every rank, or the group is broken
                self._confirm_everyone_failed(exc)
                raise
            for index, part in enumerate(result.prompt_hidden):
                part.origin = (serial, index)
            return result

    def prompt_logits(self, part: PromptHidden, lo: int, hi: int) -> torch.Tensor:
        assert part.origin is not None, "prompt rows of a driver's execute carry their origin"
        with self._lock:
            self._send(PromptLogits(part.origin, lo, hi))
            return self._collective(lambda: self.runner.prompt_logits(part, lo, hi))

    def release_pages(self, pages: list[int]) -> None:
        self.runner.release_pages(pages)
        self._released.extend(pages)

    def begin_step(self) -> None:
        self._step_id += 1

    def check_health(self) -> None:
        if self._failure is not None:
            raise RankFailure(self._failure)
        exited = self._watch()
        if exited is not None:
            self._fail(exited)

    def close(self) -> None:
        """Tell the other ranks to exit (when the group still works), then stop them."""
        if self._closed:
            return
        self._closed = True
        self._stop_heartbeat.set()
        if self._failure is None:
            try:
                with self._lock:
                    self._send(Stop())
            except RankFailure:
                pass
        self._on_close(self._failure is None)

    # ----- messages --------------------------------------------------------------------------------
    def _send(self, message: Message) -> None:
        self.check_health()
        self._collective(lambda: broadcast_object(message))
        self._last_message = time.monotonic()

    def _collective(self, call: Callable[[], T]) -> T:
        try:
            return call()
        except RankFailure:
            raise
        except Exception as exc:  # noqa: BLE001 - a collective that fails leaves the group unusable
            exited = self._watch()
            self._fail(f"{exited or 'a collective between ranks failed'}: {type(exc).__name__}: {exc}")

    def _confirm_everyone_failed(self, exc: Exception) -> None:
        """After this rank's forward raised: every rank's must have, or the ranks are out of step."""
        self._send(CheckStep())
        failed = self._collective(lambda: sum_over_ranks(1))
        if failed != self.group.world_size:
            self._fail(f"the forward raised on {failed} of {self.group.world_size} ranks "
                       f"({type(exc).__name__}: {exc}); the ranks are out of step")

    def _fail(self, why: str) -> NoReturn:
        if self._failure is None:
            self._failure = why
            logger.error("tensor parallelism: %s", why)
        raise RankFailure(self._failure)

    # ----- heartbeat -------------------------------------------------------------------------------
    def _beat(self) -> None:
        while not self._stop_heartbeat.wait(HEARTBEAT_PERIOD_S / 2):
            if self._failure is not None:
                return
            if time.monotonic() - self._last_message < HEARTBEAT_PERIOD_S or not self._lock.acquire(blocking=False):
                continue
            try:
                if not self._stop_heartbeat.is_set():
                    self._send(Heartbeat())
                    self._collective(lambda: sum_over_ranks(0))
            except RankFailure:
                return   # recorded in _failure: the engine's next check raises it
            finally:
                self._lock.release()
