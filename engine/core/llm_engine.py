"""The engine: requests in, forward steps out as token deltas. Called from one thread.

It owns the step loop: it asks the scheduler (engine/core/scheduler.py) what to run, runs it
through the model runner, and hands the sampled tokens to the output processor
(engine/core/output_processor.py), which finishes requests and builds their reports. A decode
step may be launched before the previous one is read back (engine/core/inflight.py).

A failure inside a step ends only the requests it belongs to (engine/core/step_isolation.py): they
finish with reason "error" and the message in `RequestOutput.error`, their KV blocks are freed,
and the step goes on for the others. `EngineUnrecoverable` (engine/core/faults.py) propagates.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.attention.backend import AttentionBackend
from engine.attention.metadata import AttentionCounters
from engine.config import ConfigError, FdserveConfig
from engine.core.block_manager import BlockManager
from engine.core.faults import describe, raise_if_unrecoverable
from engine.core.inflight import InFlightStep, copy_to_host
from engine.core.output_processor import OutputProcessor
from engine.core.scheduler import Scheduler
from engine.core.step_isolation import StepIsolation
from engine.core.warm_up import warm_up_prefill
from engine.model.context_len import resolve_context_len
from engine.model.loader import resolve_model_dir
from engine.model.sharding import check_tensor_parallel_sizes
from engine.request.errors import ContextLengthExceeded
from engine.request.outputs import EngineStats, RequestOutput
from engine.request.sampling_params import SamplingParams, SamplingParamsError
from engine.request.sequence import Sequence
from engine.text.tokenizer import Tokenizer
from engine.worker.model_runner import PromptHidden
from engine.worker.sampler import Sampler
from engine.worker.step_runner import StepRunner
from engine.worker.worker import Worker

if TYPE_CHECKING:
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

PROMPT_LOGITS_ROWS = 256   # prompt positions turned into [rows, vocab] logits at once (prompt logprobs)


class LLMEngine:
    def __init__(self, config: FdserveConfig) -> None:
        self.config = config
        torch.manual_seed(config.model.seed)  # the sampler's draws for requests without a seed
        self.model_dir: Path = resolve_model_dir(config.model.name)
        self.tokenizer = Tokenizer.from_pretrained(self.model_dir)
        from transformers import AutoConfig
        hf_config = AutoConfig.from_pretrained(self.model_dir)
        self.max_context_len = resolve_context_len(config.model, hf_config)
        self.max_new_tokens = config.model.max_new_tokens
        self.served_model_name = config.model.served_model_name or _default_served_name(config, self.model_dir)
        self.worker, self.step_runner = self._start_ranks(hf_config)
        worker = self.worker
        self.device, self.vendor, self.dtype = worker.device, worker.vendor, worker.dtype
        self.backend, self.model, self.runner = worker.backend, worker.model, worker.runner
        self.cpu_weights_text, self.kv_dtype = worker.cpu_weights_text, worker.kv_dtype
        self.graphs_text = worker.graphs_text
        num_blocks, block_size = worker.num_blocks, worker.block_size
        self.kv_dtype_name = str(self.kv_dtype).removeprefix("torch.")
        self.kv_cache_text = kv_cache_text(self.kv_dtype_name, self.backend)
        self.decode_path = self.graphs_text + ("; asynchronous scheduling" if config.backend.async_scheduling
                                               else "; synchronous scheduling")
        self.block_manager = BlockManager(num_blocks, block_size, config.backend.enable_prefix_caching,
                                          on_free=self.step_runner.release_pages)
        self.scheduler = Scheduler(self.block_manager, config.backend.max_num_seqs,
                                   config.backend.max_num_batched_tokens)
        self.sampler = Sampler(self.tokenizer.eos_token_ids, self.tokenizer.vocab_size)
        self.output_processor = OutputProcessor(self.tokenizer, self.scheduler, self.sampler, self.max_new_tokens)
        self.isolation = StepIsolation(self.step_runner, self.sampler, self.output_processor.fail_seq)
        self.vocab_size = min(self.tokenizer.vocab_size, int(hf_config.vocab_size))
        self.attention_counters: AttentionCounters = {}
        self.async_scheduling = config.backend.async_scheduling
        self.in_flight: InFlightStep | None = None   # a decode step launched, not yet read back
        self.num_forwarded_tokens = 0  # tokens run through the model (prefix-cache hits are not)
        tp = config.backend.tensor_parallel_size
        logger.info("model %s (%s) on %s%s, %s; context %d; KV cache %d blocks x %d tokens, %s; attention: %s; "
                    "decode: %s", self.served_model_name, self.model_dir, self.device,
                    f" x {tp} ranks (tensor parallel)" if tp > 1 else "", self.dtype, self.max_context_len,
                    num_blocks, block_size, self.kv_cache_text, self.backend.name, self.graphs_text)
        if self.device.type == "cuda":
            warm_up_prefill(self)

    # ----- construction helpers -------------------------------------------------------------
    def _start_ranks(self, hf_config: PretrainedConfig) -> tuple[Worker, StepRunner]:
        """Rank 0's worker, and the runner the step calls: the worker's own, or with
        `tensor_parallel_size > 1` a driver over the ranks this starts (engine/parallel/)."""
        config = self.config
        tp = config.backend.tensor_parallel_size
        if tp == 1:
            worker = Worker(config, self.model_dir, hf_config, self.max_context_len)
            return worker, worker.runner
        from engine.distributed.group import destroy_tensor_parallel
        from engine.parallel.driver import TensorParallelDriver
        from engine.parallel.launch import (
            FAILED_STOP_GRACE_S,
            STOP_GRACE_S,
            cpu_threads_per_rank,
            join_group,
            rank_layout,
            start_local_ranks,
        )

        check_tensor_parallel_sizes(hf_config, tp, self.served_model_name)
        layout = rank_layout(config)
        if layout.node_rank != 0:
            raise ConfigError("distributed.node_rank > 0 runs that node's ranks (`fdserve serve`), not an engine")
        ranks = start_local_ranks(config, layout, self.model_dir)

        def stop_ranks(clean: bool) -> None:
            destroy_tensor_parallel()
            ranks.stop(STOP_GRACE_S if clean else FAILED_STOP_GRACE_S)   # a rank out of step will not exit
        try:
            group = join_group(config, layout, local_rank=0)
            worker = Worker(config, self.model_dir, hf_config, self.max_context_len,
                            cpu_threads=cpu_threads_per_rank(layout))
        except BaseException:
            destroy_tensor_parallel()
            ranks.stop(grace_s=0.0)
            raise
        return worker, TensorParallelDriver(worker.runner, group, ranks.exited, stop_ranks)

    # ----- requests --------------------------------------------------------------------------
    @property
    def capacity_tokens(self) -> int:
        return self.block_manager.num_blocks * self.block_manager.block_size

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if self.output_processor.has_request(request_id):
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
        seqs = []
        for index in range(params.n):
            seq = Sequence(request_id, prompt_token_ids, params, choice_index=index, arrival_time=time.monotonic())
            seq.max_total_tokens = limit
            seqs.append(seq)
        self.output_processor.add_request(request_id, prompt_token_ids, seqs)
        for seq in seqs:
            self.scheduler.add(seq)

    def abort(self, request_id: str) -> RequestOutput | None:
        """End a request (reason "abort"); its final report, or None for an unknown request."""
        return self.output_processor.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ----- the step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; the reports of the requests it advanced or ended."""
        self.step_runner.begin_step()
        if self.in_flight is not None:
            return self._step_in_flight()
        out = self.scheduler.schedule()
        if not out.scheduled:
            return self.output_processor.take_failed()
        if self._overlappable(out.scheduled):
            launched = self._try_launch(out.scheduled)
            if launched is not None:
                self.in_flight = launched
                launched.mark_in_flight()
                return self.output_processor.take_failed()
        accepted: list[Sequence] = []
        for part in self.isolation.forward(out.scheduled):
            result = part.result
            self._record_prompt_logprobs(result.prompt_hidden)
            for seq in part.seqs:
                self.num_forwarded_tokens += seq.num_scheduled_tokens
                seq.num_computed_tokens += seq.num_scheduled_tokens
                self.block_manager.register_full_blocks(seq)
            self._add_counters(result.counters)
            if result.sampled_seqs:
                samples = self.isolation.sample(result.logits, result.sampled_seqs)
                for seq, sample in zip(result.sampled_seqs, samples, strict=True):
                    self.output_processor.accept(seq, sample)
                    accepted.append(seq)
        return self.output_processor.step_outputs(accepted)

    def _record_prompt_logprobs(self, prompt_hidden: list[PromptHidden]) -> None:
        """Score the prompt tokens a forward predicted, for sequences that ask (a recomputed
        prefix after preemption is not scored twice)."""
        for part in prompt_hidden:
            seq, k = part.seq, part.seq.params.prompt_logprobs
            assert k is not None, "only sequences asking for prompt logprobs score their prompt"
            for lo in range(0, part.hidden.shape[0], PROMPT_LOGITS_ROWS):
                logits = self.step_runner.prompt_logits(part, lo, lo + PROMPT_LOGITS_ROWS)
                first = part.first + lo
                targets = seq.token_ids[first:first + logits.shape[0]]
                for pos, entry in enumerate(self.sampler.token_logprobs(logits, targets, k), start=first):
                    if pos == len(seq.prompt_logprobs):
                        seq.prompt_logprobs.append(entry)

    def _add_counters(self, counters: AttentionCounters) -> None:
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
        return (self.async_scheduling and not self.scheduler.can_admit() and
                all(seq.num_scheduled_tokens == 1 and seq.num_computed_tokens + 1 == len(seq)
                    and not Sampler.needs_history(seq.params) for seq in seqs))

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
        result = self.step_runner.execute(seqs, input_ids)
        assert len(result.sampled_seqs) == len(seqs), "every row of an overlapped decode step samples"
        assert not result.prompt_hidden, "an overlapped step scores no prompt token"
        draw = self.sampler.sample_on_device(result.logits, seqs)
        host, ready = copy_to_host(draw.tensors())
        self.num_forwarded_tokens += len(seqs)
        for seq in seqs:
            seq.num_computed_tokens += 1
        self._add_counters(result.counters)
        return InFlightStep(list(seqs), draw.token_ids, host, ready)

    def _step_in_flight(self) -> list[RequestOutput]:
        """Launch the next decode step on the device-side tokens of the one in flight, then read
        that one back and report it while the next runs."""
        current = self.in_flight
        assert current is not None
        following = self.scheduler.schedule_decode_continuation(
            [seq for seq in current.seqs if self.output_processor.may_follow(seq)])
        following_step = None
        if following is not None:
            row = {id(seq): i for i, seq in enumerate(current.seqs)}
            rows = [row[id(seq)] for seq in following]
            ids = current.tokens if len(rows) == len(current.seqs) else \
                current.tokens[torch.tensor(rows, device=current.tokens.device)]
            following_step = self._try_launch(following, ids)   # None: scheduled again next step
        outputs = self._resolve(current)
        if following_step is not None and any(not seq.is_finished for seq in following_step.seqs):
            following_step.mark_in_flight()
            self.in_flight = following_step
        else:
            self.in_flight = None
        return outputs

    def _resolve(self, step: InFlightStep) -> list[RequestOutput]:
        """Hand the step's sampled tokens, now on the host, to the output processor and report them."""
        accepted: list[Sequence] = []
        for seq, result in zip(step.seqs, self.sampler.results(step.read(), step.seqs), strict=True):
            if seq.is_finished:   # aborted, or ended by the step before (this row is dropped)
                continue
            if seq.num_in_flight_tokens == 0:
                raise RuntimeError(f"sequence {seq.seq_id} lost its in-flight token")
            seq.num_in_flight_tokens -= 1
            self.output_processor.accept(seq, result)
            if not seq.is_finished:
                self.block_manager.register_full_blocks(seq)
            accepted.append(seq)
        return self.output_processor.step_outputs(accepted)

    def check_health(self) -> None:
        """Raise EngineUnrecoverable when steps can no longer run (a tensor-parallel rank is gone)."""
        try:
            self.step_runner.check_health()
        except Exception as exc:  # noqa: BLE001 - classified as in a step
            raise_if_unrecoverable(exc, 0)
            raise

    def close(self) -> None:
        """Stop the other ranks, if any (idempotent)."""
        self.step_runner.close()

    def reset_counters(self) -> None:
        """Zero what `stats` and the bench count (after the startup warm-up)."""
        self.block_manager.prefix_cache_queries = self.block_manager.prefix_cache_hits = 0
        self.scheduler.num_preemptions = 0
        self.num_forwarded_tokens = 0
        self.attention_counters = {}
        self.runner.num_graph_steps = 0

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_waiting=len(self.scheduler.waiting), num_running=len(self.scheduler.running),
            num_total_blocks=bm.num_blocks, num_free_blocks=bm.num_free_blocks,
            prefix_cache_queries=bm.prefix_cache_queries, prefix_cache_hits=bm.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions, attention_path=self.backend.name,
            attention_counters={k: float(v) for k, v in self.attention_counters.items()},
            decode_path=self.decode_path, kv_cache_dtype=self.kv_dtype_name,
            num_graph_steps=self.runner.num_graph_steps,
            internal_errors=dict(self.output_processor.internal_errors))


def kv_cache_text(kv_dtype_name: str, backend: AttentionBackend) -> str:
    """The pages' dtype, and for FP8 pages where their scales came from (startup line)."""
    return f"{kv_dtype_name} ({backend.kv_scales.source})" if backend.kv_scales is not None else kv_dtype_name


def _default_served_name(config: FdserveConfig, model_dir: Path) -> str:
    from engine.model.loader import EMBEDDED_DEFAULT_ID
    if not config.model.name or config.model.name in (EMBEDDED_DEFAULT_ID, EMBEDDED_DEFAULT_ID.split("/")[-1]):
        return EMBEDDED_DEFAULT_ID.split("/")[-1]
    return Path(config.model.name).name.removesuffix(".gguf")
