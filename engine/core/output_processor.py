"""The output processor finishes requests and reports them.

It appends each sampled token to its sequence and ends sequences: EOS, `stop_token_ids`, the
length limits (max_tokens, the context), stop strings (found by the detokenizer), abort, and a
failure inside the engine (reason "error", the message in `RequestOutput.error`). Every finish goes
through `_finish`, which releases the sequence from the scheduler and the sampler. A report turns
what is new since the previous one into `RequestOutput` deltas.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from engine.core.faults import STAGE_NO_TOKEN, STAGE_OUTPUT, EngineUnrecoverable, describe, raise_if_unrecoverable
from engine.core.scheduler import Scheduler
from engine.request.outputs import CompletionDelta, RequestOutput
from engine.request.sequence import FinishReason, Sequence
from engine.text.detokenizer import IncrementalDetokenizer
from engine.text.tokenizer import Tokenizer
from engine.worker.sampler import Sampler, SampleResult

logger = logging.getLogger(__name__)

# This many requests failing inside the engine in a row, none finishing in between, is no request's
# fault but the engine's: it stops rather than live on without serving.
FAILURES_IN_A_ROW_LIMIT = 32


@dataclass
class ChoiceState:
    """One choice of a request: its sequence, its text so far, and what has been reported."""

    seq: Sequence
    detokenizer: IncrementalDetokenizer
    sent_tokens: int = 0  # output tokens already reported
    sent_logprobs: int = 0
    reported_finish: bool = False
    stop_reason: str | int | None = None


@dataclass
class RequestState:
    request_id: str
    choices: list[ChoiceState]
    num_prompt_tokens: int
    arrival_time: float = field(default_factory=time.monotonic)
    sent_prompt_logprobs: bool = False
    error: str | None = None   # set when the request failed inside the engine


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, scheduler: Scheduler, sampler: Sampler, max_new_tokens: int) -> None:
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.sampler = sampler
        self.max_new_tokens = max_new_tokens
        self.requests: dict[str, RequestState] = {}
        self.failed: dict[str, RequestState] = {}   # failed since the last step's report
        self.internal_errors: dict[str, int] = {}   # requests failed inside the engine, by stage
        self.failures_in_a_row = 0
        self.num_generated_tokens = 0

    # ----- requests ----------------------------------------------------------------------------
    def has_request(self, request_id: str) -> bool:
        return request_id in self.requests

    def add_request(self, request_id: str, prompt_token_ids: list[int], seqs: list[Sequence]) -> None:
        """Track a new request whose choices are `seqs` (in choice order)."""
        choices = []
        for seq in seqs:
            params = seq.params
            detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.stop,
                                           skip_special_tokens=params.skip_special_tokens,
                                           include_stop_str_in_output=params.include_stop_str_in_output)
            choices.append(ChoiceState(seq, detok))
        self.requests[request_id] = RequestState(request_id, choices, len(prompt_token_ids))

    def abort(self, request_id: str) -> RequestOutput | None:
        """End the request's unfinished choices with reason "abort"; its final report (None for an
        unknown request). A row of a step in flight is dropped when that step is read."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        for choice in request.choices:
            if not choice.seq.is_finished:
                self._finish(choice.seq, FinishReason.ABORT)
        self.failed.pop(request_id, None)
        return self._report(request)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        seq.finish(reason)
        self.scheduler.finish(seq)
        self.sampler.release(seq.seq_id)

    # ----- failures ----------------------------------------------------------------------------
    def fail_request(self, request_id: str, stage: str, message: str) -> None:
        """End every choice of a request with reason "error" (its blocks freed); reported by the
        next step, or by `take_failed`."""
        request = self.requests.get(request_id)
        if request is None:
            return
        if request.error is None:
            request.error = message
            self.internal_errors[stage] = self.internal_errors.get(stage, 0) + 1
            self.failures_in_a_row += 1
            logger.error("request %s failed (%s): %s", request_id, stage, message)
            if self.failures_in_a_row >= FAILURES_IN_A_ROW_LIMIT:
                raise EngineUnrecoverable("every_request_failing", f"the last {self.failures_in_a_row} requests "
                                          f"all failed inside the engine; the last: {message}")
        for choice in request.choices:
            if not choice.seq.is_finished:
                self._finish(choice.seq, FinishReason.ERROR)
        self.failed[request_id] = request

    def fail_seq(self, seq: Sequence, stage: str, message: str) -> None:
        """`fail_request` for the request `seq` belongs to (engine/core/step_isolation.py's callback)."""
        self.fail_request(seq.request_id, stage, message)

    def take_failed(self) -> list[RequestOutput]:
        """Reports of the requests failed since the last step's report."""
        failed, self.failed = self.failed, {}
        return [self._report(request) for request in failed.values()]

    # ----- sampled tokens ----------------------------------------------------------------------
    def accept(self, seq: Sequence, result: SampleResult | None) -> None:
        """A drawn token for `seq`, or its failure (the row could not be drawn)."""
        if result is None or seq.is_finished:   # its request failed in this step
            return
        if result.error is not None:
            self.fail_request(seq.request_id, STAGE_NO_TOKEN, result.error)
            return
        try:
            self._on_token(seq, result)
        except Exception as exc:  # noqa: BLE001 - as in _report
            raise_if_unrecoverable(exc, 1)
            self.fail_request(seq.request_id, STAGE_OUTPUT, describe(exc))

    def _on_token(self, seq: Sequence, result: SampleResult) -> None:
        params = seq.params
        if params.max_tokens == 0:   # the prompt only scored: the prefill's sample is not output
            self._finish(seq, FinishReason.LENGTH)
            return
        seq.append_token(result.token_id)
        self.num_generated_tokens += 1
        if result.logprob is not None:
            seq.logprobs.append(result.logprob)
        token = result.token_id
        choice = self._choice_of(seq)
        # The sampler masks EOS and stop tokens until min_tokens are out.
        if token in params.stop_token_ids:
            choice.stop_reason = token
            self._finish(seq, FinishReason.STOP)
        elif token in self.tokenizer.eos_token_ids and not params.ignore_eos:
            self._finish(seq, FinishReason.STOP)
        elif self._at_length_limit(seq):
            self._finish(seq, FinishReason.LENGTH)

    def may_follow(self, seq: Sequence) -> bool:
        """Whether `seq` may still be running after its token in flight (a length limit is known now;
        EOS and stop strings are not, and cost one dropped row)."""
        return not seq.is_finished and not self._at_length_limit(seq)

    def _at_length_limit(self, seq: Sequence) -> bool:
        """max_tokens generated, or the context (model or KV capacity) full; tokens in flight count."""
        limit = self.max_new_tokens if seq.params.max_tokens is None else seq.params.max_tokens
        return (seq.num_output_tokens >= limit
                or (seq.max_total_tokens is not None and len(seq) >= seq.max_total_tokens))

    def _choice_of(self, seq: Sequence) -> ChoiceState:
        return self.requests[seq.request_id].choices[seq.choice_index]

    # ----- reports -----------------------------------------------------------------------------
    def step_outputs(self, seqs: Iterable[Sequence]) -> list[RequestOutput]:
        """A step's reports: one per request of `seqs` (those given a token or a failure this step),
        in order, then one per request failed since the last report."""
        touched: dict[str, RequestState] = {}
        for seq in seqs:
            touched[seq.request_id] = self.requests[seq.request_id]
        for request_id in self.failed:
            touched.pop(request_id, None)
        return [self._report(r) for r in touched.values()] + self.take_failed()

    def _report(self, request: RequestState) -> RequestOutput:
        """`_collect`, or the request's error report when collecting is what fails."""
        try:
            return self._collect(request)
        except Exception as exc:  # noqa: BLE001 - e.g. a detokenizer fault: this request's alone
            raise_if_unrecoverable(exc, 1)
            self.fail_request(request.request_id, STAGE_OUTPUT, describe(exc))
            self.failed.pop(request.request_id, None)
            return self._collect(request)

    def _collect(self, request: RequestState) -> RequestOutput:
        """Deltas since the last report; drops the request once every choice has been reported finished.
        With prompt logprobs asked for, nothing is reported before they are all computed, and the first
        report carries them."""
        first = request.choices[0].seq
        prompt_logprobs = None
        held = False
        if first.params.prompt_logprobs is not None and not request.sent_prompt_logprobs:
            held = first.needs_prompt_logprobs and not first.is_finished
            if not held:
                prompt_logprobs = list(first.prompt_logprobs)
                request.sent_prompt_logprobs = True
        deltas = []
        for choice in [] if held else request.choices:
            seq = choice.seq
            if choice.reported_finish:
                continue
            new_ids = seq.output_token_ids[choice.sent_tokens:]
            choice.sent_tokens = seq.num_output_tokens
            if request.error is not None:   # every choice ends in the error; no text: the detokenizer may have failed
                deltas.append(CompletionDelta(seq.choice_index, "", new_ids, [], FinishReason.ERROR.value))
                choice.reported_finish = True
                continue
            text_ids = [t for t in new_ids if t not in seq.params.stop_token_ids]
            step = choice.detokenizer.add_tokens(text_ids)
            text = step.text
            stop_reason = choice.stop_reason
            if step.stop_str is not None and not seq.is_finished:
                self._finish(seq, FinishReason.STOP)
            if step.stop_str is not None:
                stop_reason = step.stop_str
            elif seq.is_finished and seq.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
                text += choice.detokenizer.flush()
            logprobs = seq.logprobs[choice.sent_logprobs:]
            choice.sent_logprobs = len(seq.logprobs)
            finish = seq.finish_reason.value if seq.finish_reason is not None else None
            if not (text or new_ids or finish):
                continue
            deltas.append(CompletionDelta(choice.seq.choice_index, text, new_ids, list(logprobs), finish, stop_reason))
            if finish:
                choice.reported_finish = True
        finished = all(c.reported_finish for c in request.choices)
        if finished:
            self.requests.pop(request.request_id, None)
            if request.error is None:
                self.failures_in_a_row = 0
        return RequestOutput(
            request_id=request.request_id, deltas=deltas, num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=first.num_cached_tokens,
            num_output_tokens=sum(c.seq.num_output_tokens for c in request.choices), finished=finished,
            error=request.error, prompt_logprobs=prompt_logprobs)
