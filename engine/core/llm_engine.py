"""The engine: requests in, forward steps out as token deltas. Called from one thread; a decode
step may be launched before the previous one is read back (engine/core/inflight.py).

A failure inside a step ends only the requests it belongs to (engine/core/step_isolation.py): they
finish with reason "error" and the message in `RequestOutput.error`, their KV blocks are freed,
and the step goes on for the others. `EngineUnrecoverable` (engine/core/faults.py) propagates.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.attention.backend import AttentionBackend
from engine.core.block_manager import BlockManager
from engine.config import ConfigError, FdserveConfig
from engine.text.detokenizer import IncrementalDetokenizer
from engine.worker.device import select_device, select_dtype
from engine.request.errors import ContextLengthExceeded
from engine.core.faults import STAGE_NO_TOKEN, STAGE_OUTPUT, EngineUnrecoverable, describe, raise_if_unrecoverable
from engine.core.inflight import PLACEHOLDER, InFlightStep, copy_to_host, drop_placeholder
from engine.model.layers import configure_matmul, linear_shapes
from engine.model.loader import load_model, resolve_model_dir
from engine.worker.model_runner import ModelRunner, PromptHidden
from engine.request.outputs import CompletionDelta, EngineStats, RequestOutput
from engine.worker.sampler import Sampler, SampleResult
from engine.request.sampling_params import SamplingParams, SamplingParamsError
from engine.core.scheduler import Scheduler
from engine.request.sequence import FinishReason, Sequence
from engine.core.step_isolation import StepIsolation
from engine.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass
class _Choice:
    seq: Sequence
    detokenizer: IncrementalDetokenizer
    sent_tokens: int = 0  # output tokens already reported
    sent_logprobs: int = 0
    reported_finish: bool = False
    stop_reason: str | int | None = None


@dataclass
class _Request:
    request_id: str
    choices: list[_Choice]
    num_prompt_tokens: int
    arrival_time: float = field(default_factory=time.monotonic)
    sent_prompt_logprobs: bool = False
    error: str | None = None   # set when the request failed inside the engine


# This many requests failing inside the engine in a row, none finishing in between, is no request's
# fault but the engine's: it stops rather than live on without serving.
FAILURES_IN_A_ROW_LIMIT = 32
PROMPT_LOGITS_ROWS = 256   # prompt positions turned into [rows, vocab] logits at once (prompt logprobs)


def _model_context_len(hf_config) -> int:
    return int(getattr(hf_config, "max_position_embeddings", 0) or 2048)


class LLMEngine:
    def __init__(self, config: FdserveConfig) -> None:
        self.config = config
        self.device, self.vendor = select_device(config.backend.gpu_vendor)
        torch.manual_seed(config.model.seed)  # the sampler's draws for requests without a seed
        if config.backend.cpu_threads and self.device.type == "cpu":
            torch.set_num_threads(config.backend.cpu_threads)
        self.model_dir: Path = resolve_model_dir(config.model.name)
        self.tokenizer = Tokenizer.from_pretrained(self.model_dir)
        from transformers import AutoConfig
        hf_config = AutoConfig.from_pretrained(self.model_dir)
        self.dtype = select_dtype(config.model.dtype, self.device, getattr(hf_config, "torch_dtype", None))
        self.max_context_len = self._resolve_context_len(hf_config)
        self.max_new_tokens = config.model.max_new_tokens
        self.served_model_name = config.model.served_model_name or _default_served_name(config, self.model_dir)
        self.backend = self._make_backend()
        self.model = load_model(self.model_dir, self.dtype, self.device, config.model.rope_scaling, self.max_context_len)
        # Decode-phase linears: cuBLAS, or our flat GEMM / GEMV per shape from the tuned table.
        configure_matmul(config.flashdecoding, self.device, self.dtype, linear_shapes(self.model))
        block_size = self.backend.page_size(config.backend.block_size)
        if block_size != config.backend.block_size:
            logger.info("kernel = %r: KV pages of %d tokens (backend.block_size = %d applies to the dense kernels)",
                        config.flashdecoding.kernel, block_size, config.backend.block_size)
        self.runner = ModelRunner(self.model, self.device, self.dtype, block_size, self.backend)
        num_blocks = self._num_kv_blocks()
        self.runner.allocate_kv_cache(num_blocks)
        self.graphs_text = self._capture_graphs()
        self.decode_path = self.graphs_text + ("; asynchronous scheduling" if config.backend.async_scheduling
                                               else "; synchronous scheduling")
        self.block_manager = BlockManager(num_blocks, block_size, config.backend.enable_prefix_caching,
                                          on_free=self.backend.release)
        self.scheduler = Scheduler(self.block_manager, config.backend.max_num_seqs,
                                   config.backend.max_num_batched_tokens)
        self.sampler = Sampler(self.tokenizer.eos_token_ids, self.tokenizer.vocab_size)
        self.isolation = StepIsolation(self.runner, self.sampler, self._fail_seq)
        self.requests: dict[str, _Request] = {}
        self.failed: dict[str, _Request] = {}   # failed since the last step's report
        self.internal_errors: dict[str, int] = {}   # requests failed inside the engine, by stage
        self.failures_in_a_row = 0
        self.vocab_size = min(self.tokenizer.vocab_size, int(hf_config.vocab_size))
        self.attention_counters: dict[str, float] = {}
        self.async_scheduling = config.backend.async_scheduling
        self.in_flight: InFlightStep | None = None   # a decode step launched, not yet read back
        self.num_generated_tokens = 0
        self.num_forwarded_tokens = 0  # tokens run through the model (prefix-cache hits are not)
        logger.info("model %s (%s) on %s, %s; context %d; KV cache %d blocks x %d tokens; attention: %s; "
                    "decode: %s", self.served_model_name, self.model_dir, self.device, self.dtype,
                    self.max_context_len, num_blocks, block_size, self.backend.name, self.graphs_text)

    # ----- construction helpers -------------------------------------------------------------
    def _resolve_context_len(self, hf_config) -> int:
        """The model's own length; with [model] rope_scaling, up to factor x the original length
        (the default then), past what the checkpoint was trained for, with a warning."""
        own = _model_context_len(hf_config)
        wanted = self.config.model.max_context_len
        scaling = self.config.model.rope_scaling
        if scaling is None:
            if wanted is not None and wanted > own:  # RoPE as trained is only defined up to max_position_embeddings
                raise ConfigError(f"model.max_context_len: {wanted} is above what this model supports "
                                  f"({own}, its max_position_embeddings); set max_context_len <= {own}, remove it, "
                                  f"or set model.rope_scaling to stretch the positions")
            return wanted or own
        original = scaling.original_max_position_embeddings or own
        limit = int(scaling.factor * original)
        if wanted is not None and wanted > limit:
            raise ConfigError(f"model.max_context_len: {wanted} is above what model.rope_scaling reaches "
                              f"({scaling.factor:g} x {original} = {limit}); raise rope_scaling.factor or lower "
                              f"max_context_len")
        length = wanted or limit
        if length > own:
            logger.warning("model.rope_scaling (%s, factor %g over %d positions): context %d is beyond the %d tokens "
                           "this checkpoint was trained for; output quality may drop", scaling.type, scaling.factor,
                           original, length, own)
        return length

    def _make_backend(self) -> AttentionBackend:
        from engine.attention.select import make_attention_backend
        limits = self.config.backend
        return make_attention_backend(self.config.flashdecoding, self.device, self.vendor,
                                      max_num_seqs=limits.max_num_seqs,
                                      max_num_batched_tokens=limits.max_num_batched_tokens)

    def _capture_graphs(self) -> str:
        backend = self.config.backend
        if not backend.cuda_graphs:
            return "eager (backend.cuda_graphs = false)"
        if self.device.type != "cuda":
            return f"eager (backend.cuda_graphs applies to CUDA devices; this runs on {self.device.type})"
        max_batch = min(backend.cuda_graph_max_batch, backend.max_num_seqs)
        self.runner.capture_decode_graphs(max_batch, self.max_context_len)
        return f"CUDA graphs for batch sizes up to {max_batch}, eager above and for prefill"

    def _num_kv_blocks(self) -> int:
        backend = self.config.backend
        if backend.num_kv_blocks:
            return backend.num_kv_blocks
        if self.device.type == "cuda":
            # kv_cache_ratio of what is free once the weights are in and a full step's
            # activations (measured by a profiling forward) are set aside.
            peak = self.runner.profile_peak_bytes(backend.max_num_batched_tokens)
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int((free - peak) * backend.kv_cache_ratio)
        else:
            budget = int(backend.cpu_kv_cache_bytes * backend.kv_cache_ratio)
        # More than every running sequence at full context could ever use is wasted memory.
        useful = backend.max_num_seqs * -(-self.max_context_len // backend.block_size)
        num_blocks = min(self.runner.num_blocks_for_budget(budget), useful)
        if num_blocks < 2:
            raise ConfigError("backend.kv_cache_ratio / cpu_kv_cache_bytes leave no room for the KV cache "
                              f"({budget} bytes); raise them or set backend.num_kv_blocks")
        return num_blocks

    # ----- requests --------------------------------------------------------------------------
    @property
    def capacity_tokens(self) -> int:
        return self.block_manager.num_blocks * self.block_manager.block_size

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        num_prompt = len(prompt_token_ids)
        if num_prompt == 0:
            raise SamplingParamsError("the prompt is empty", "prompt")
        limit = min(self.max_context_len, self.capacity_tokens)
        if num_prompt >= limit:
            raise ContextLengthExceeded(limit, num_prompt)
        lowest, highest = min(prompt_token_ids), max(prompt_token_ids)
        if lowest < 0 or highest >= self.vocab_size:
            bad = lowest if lowest < 0 else highest
            raise SamplingParamsError(f"token id {bad} is outside the vocabulary (size {self.vocab_size})", "prompt")
        params.validate_for_vocab(self.vocab_size)
        # max_new_tokens is both the default and the cap; the context limit is enforced per step.
        params.max_tokens = self.max_new_tokens if params.max_tokens is None else min(params.max_tokens,
                                                                                       self.max_new_tokens)
        choices = []
        for index in range(params.n):
            seq = Sequence(request_id, prompt_token_ids, params, choice_index=index, arrival_time=time.monotonic())
            seq.max_total_tokens = limit
            detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.stop,
                                           skip_special_tokens=params.skip_special_tokens,
                                           include_stop_str_in_output=params.include_stop_str_in_output)
            choices.append(_Choice(seq, detok))
            self.scheduler.add(seq)
        self.requests[request_id] = _Request(request_id, choices, num_prompt)

    def abort(self, request_id: str) -> RequestOutput | None:
        request = self.requests.get(request_id)
        if request is None:
            return None
        for choice in request.choices:
            if not choice.seq.is_finished:
                drop_placeholder(choice.seq)   # its step in flight is dropped when read
                self._finish(choice.seq, FinishReason.ABORT)
        self.failed.pop(request_id, None)
        return self._report(request)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        seq.finish(reason)
        self.scheduler.finish(seq)
        self.sampler.release(seq.seq_id)

    # ----- failures --------------------------------------------------------------------------
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
                drop_placeholder(choice.seq)
                self._finish(choice.seq, FinishReason.ERROR)
        self.failed[request_id] = request

    def _fail_seq(self, seq: Sequence, stage: str, message: str) -> None:
        self.fail_request(seq.request_id, stage, message)

    def take_failed(self) -> list[RequestOutput]:
        """Reports of the requests failed since the last step's report."""
        failed, self.failed = self.failed, {}
        return [self._report(request) for request in failed.values()]

    def _report(self, request: _Request) -> RequestOutput:
        """`_collect`, or the request's error report when collecting is what fails."""
        try:
            return self._collect(request)
        except Exception as exc:  # noqa: BLE001 - e.g. a detokenizer fault: this request's alone
            raise_if_unrecoverable(exc, 1)
            self.fail_request(request.request_id, STAGE_OUTPUT, describe(exc))
            self.failed.pop(request.request_id, None)
            return self._collect(request)

    def _accept(self, seq: Sequence, result: SampleResult | None) -> None:
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

    # ----- the step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.in_flight is not None:
            return self._step_in_flight()
        out = self.scheduler.schedule()
        if not out.scheduled:
            return self.take_failed()
        if self._overlappable(out.scheduled):
            launched = self._try_launch(out.scheduled)
            if launched is not None:
                self.in_flight = launched
                self._append_placeholders(launched)
                return self.take_failed()
        touched: dict[str, _Request] = {}
        for part in self.isolation.forward(out.scheduled):
            self._record_prompt_logprobs(part.prompt_hidden)
            for seq in part.seqs:
                self.num_forwarded_tokens += seq.num_scheduled_tokens
                seq.num_computed_tokens += seq.num_scheduled_tokens
                self.block_manager.register_full_blocks(seq)
            self._add_counters(part.counters)
            if part.sampled:
                for seq, result in zip(part.sampled, self.isolation.sample(part.logits, part.sampled)):
                    self._accept(seq, result)
                    touched[seq.request_id] = self.requests[seq.request_id]
        for request_id in self.failed:
            touched.pop(request_id, None)
        return [self._report(r) for r in touched.values()] + self.take_failed()

    def _record_prompt_logprobs(self, prompt_hidden: list[PromptHidden]) -> None:
        """Score the prompt tokens a forward predicted, for sequences that ask (a recomputed
        prefix after preemption is not scored twice)."""
        for part in prompt_hidden:
            seq, k = part.seq, part.seq.params.prompt_logprobs
            for lo in range(0, part.hidden.shape[0], PROMPT_LOGITS_ROWS):
                logits = self.runner.model.compute_logits(part.hidden[lo:lo + PROMPT_LOGITS_ROWS])
                first = part.first + lo
                targets = seq.token_ids[first:first + logits.shape[0]]
                for pos, entry in enumerate(self.sampler.token_logprobs(logits, targets, k), start=first):
                    if pos == len(seq.prompt_logprobs):
                        seq.prompt_logprobs.append(entry)

    def _add_counters(self, counters: dict[str, float]) -> None:
        for key, value in counters.items():
            self.attention_counters[key] = self.attention_counters.get(key, 0.0) + value

    # ----- overlapped decode (backend.async_scheduling, engine/core/inflight.py) ---------------------
    def sync(self) -> list[RequestOutput]:
        """Read back the step in flight, if any, launching nothing after it."""
        current, self.in_flight = self.in_flight, None
        return self._resolve(current) if current is not None else []

    def _overlappable(self, seqs: list[Sequence]) -> bool:
        """A decode step whose every row can be sampled before the previous token is on the host,
        while no waiting request could be admitted instead."""
        return (self.async_scheduling and not self._admission_possible() and
                all(seq.num_scheduled_tokens == 1 and seq.num_computed_tokens + 1 == len(seq)
                    and not Sampler.needs_history(seq.params) for seq in seqs))

    def _admission_possible(self) -> bool:
        """A waiting request could join the batch now: run the scheduler rather than step ahead."""
        scheduler = self.scheduler
        return bool(scheduler.waiting) and len(scheduler.running) < scheduler.max_num_seqs

    def _try_launch(self, seqs: list[Sequence], input_ids: torch.Tensor | None = None) -> InFlightStep | None:
        """`_launch`, or None when it raised (nothing was changed then): the step then runs
        synchronously, where a failure is traced to its request."""
        checkpoint = self.sampler.checkpoint(seqs)
        try:
            return self._launch(seqs, input_ids)
        except Exception as exc:  # noqa: BLE001 - retried synchronously
            raise_if_unrecoverable(exc, len(seqs))
            logger.warning("an overlapped decode step of %d sequences failed (%s); running it synchronously",
                           len(seqs), describe(exc))
            self.sampler.restore(checkpoint)
            return None

    def _launch(self, seqs: list[Sequence], input_ids: torch.Tensor | None = None) -> InFlightStep:
        logits, sampled, counters = self.runner.execute(seqs, input_ids)
        assert len(sampled) == len(seqs), "every row of an overlapped decode step samples"
        assert not self.runner.prompt_hidden, "an overlapped step scores no prompt token"
        draw = self.sampler.sample_on_device(logits, seqs)
        host, ready = copy_to_host(draw.tensors())
        self.num_forwarded_tokens += len(seqs)
        for seq in seqs:
            seq.num_computed_tokens += 1
        self._add_counters(counters)
        return InFlightStep(list(seqs), draw.token_ids, host, ready)

    @staticmethod
    def _append_placeholders(step: InFlightStep) -> None:
        for seq in step.seqs:
            if not seq.is_finished:
                seq.append_token(PLACEHOLDER)

    def _may_follow(self, seq: Sequence) -> bool:
        """Whether `seq` may still be running after its token in flight (a length limit is known now;
        EOS and stop strings are not, and cost one dropped row)."""
        return not seq.is_finished and not self._at_length_limit(seq)

    def _step_in_flight(self) -> list[RequestOutput]:
        """Launch the next decode step on the device-side tokens of the one in flight, then read
        that one back and report it while the next runs."""
        current = self.in_flight
        assert current is not None
        following = [seq for seq in current.seqs if self._may_follow(seq)]
        bm = self.block_manager
        launch = (following and not self._admission_possible() and
                  sum(bm.blocks_needed(seq, 1) for seq in following) <= bm.num_free_blocks)
        following_step = None
        if launch:
            row = {id(seq): i for i, seq in enumerate(current.seqs)}
            rows = [row[id(seq)] for seq in following]
            for seq in following:
                bm.allocate_slots(seq, 1)
                seq.num_scheduled_tokens = 1
            ids = current.tokens if len(rows) == len(current.seqs) else \
                current.tokens[torch.tensor(rows, device=current.tokens.device)]
            following_step = self._try_launch(following, ids)   # None: scheduled again next step
        outputs = self._resolve(current)
        if following_step is not None and any(not seq.is_finished for seq in following_step.seqs):
            self._append_placeholders(following_step)
            self.in_flight = following_step
        else:
            self.in_flight = None
        return outputs

    def _resolve(self, step: InFlightStep) -> list[RequestOutput]:
        """Put the step's sampled tokens in place of the placeholders and report them."""
        touched: dict[str, _Request] = {}
        for seq, result in zip(step.seqs, self.sampler.results(step.read(), step.seqs)):
            if seq.is_finished:   # aborted, or ended by the step before (this row is dropped)
                continue
            if seq.token_ids[-1] != PLACEHOLDER:
                raise RuntimeError(f"sequence {seq.seq_id} lost its in-flight token")
            seq.token_ids.pop()
            self._accept(seq, result)
            if not seq.is_finished:
                self.block_manager.register_full_blocks(seq)
            touched[seq.request_id] = self.requests[seq.request_id]
        for request_id in self.failed:
            touched.pop(request_id, None)
        return [self._report(r) for r in touched.values()] + self.take_failed()

    def _on_token(self, seq: Sequence, result) -> None:
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

    def _at_length_limit(self, seq: Sequence) -> bool:
        """max_tokens generated, or the context (model or KV capacity) full."""
        limit = self.max_new_tokens if seq.params.max_tokens is None else seq.params.max_tokens
        return (seq.num_output_tokens >= limit
                or (seq.max_total_tokens is not None and len(seq) >= seq.max_total_tokens))

    def _choice_of(self, seq: Sequence) -> _Choice:
        return self.requests[seq.request_id].choices[seq.choice_index]

    def _collect(self, request: _Request) -> RequestOutput:
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
            finish = seq.finish_reason.value if seq.is_finished else None
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

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_waiting=len(self.scheduler.waiting), num_running=len(self.scheduler.running),
            num_total_blocks=bm.num_blocks, num_free_blocks=bm.num_free_blocks,
            prefix_cache_queries=bm.prefix_cache_queries, prefix_cache_hits=bm.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions, attention_path=self.backend.name,
            attention_counters={k: float(v) for k, v in self.attention_counters.items()},
            decode_path=self.decode_path,
            num_graph_steps=self.runner.num_graph_steps,
            internal_errors=dict(self.internal_errors))


def _default_served_name(config: FdserveConfig, model_dir: Path) -> str:
    from engine.model.loader import EMBEDDED_DEFAULT_ID
    if not config.model.name or config.model.name in (EMBEDDED_DEFAULT_ID, EMBEDDED_DEFAULT_ID.split("/")[-1]):
        return EMBEDDED_DEFAULT_ID.split("/")[-1]
    return Path(config.model.name).name.removesuffix(".gguf")
