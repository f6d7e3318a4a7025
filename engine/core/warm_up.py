"""Run the GPU's prefill path once at startup, so that the first long prompt does not pay for it.

The first step that reaches a prefill code path on a GPU pays for it then: Triton compiles each
kernel variant the first time it runs (1.3-2.3 s apiece with an empty cache on an H100), and cuDNN
builds a graph per shape (bench/RESULTS.md). Two prompts of random token ids, one after the other,
reach the paths a long prompt takes: a chunk over a prefix of at least two chunks and at least the
backend's `prefill_prefix_keys` (the cuDNN prefix, then the kernel seeded by it), once with a whole
chunk of rows and once with a row count that is not a multiple of 16 (as in a step shared with
decodes). Chunks are at most `MAX_CHUNK` tokens while it runs, so the prompts stay short whatever the
configured token budget (the kernels' variants do not depend on the chunk's length past a tile). The
counters the engine reports are reset afterwards.
"""
from __future__ import annotations

import logging
import random
import time
from typing import TYPE_CHECKING

from engine.request.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.core.llm_engine import LLMEngine

logger = logging.getLogger("fdserve.engine")

ODD_ROWS = 100   # a last chunk of this many rows: not a multiple of 16, above the prefix path's minimum
MAX_CHUNK = 2048


class WarmUpError(RuntimeError):
    """A warm-up prompt failed: the prefill path does not run on this machine."""


def warm_up_prompt_lens(chunk: int, prefix_keys: int, limit: int) -> list[int]:
    """The warm-up prompts' lengths, each below `limit` (others are left out): their last chunk sits
    over a prefix of at least two chunks and `prefix_keys` tokens, with `chunk` rows or `ODD_ROWS`."""
    prefix = max(2 * chunk, -(-prefix_keys // chunk) * chunk)
    return [n for n in (prefix + chunk, prefix + min(ODD_ROWS, chunk - 1)) if n < limit]


def warm_up_prefill(engine: LLMEngine) -> list[int]:
    """Run the warm-up prompts through `engine` one at a time; their lengths. Raises `WarmUpError`
    if one fails."""
    scheduler = engine.scheduler
    budget = scheduler.max_num_batched_tokens
    chunk = min(budget, MAX_CHUNK)
    limit = min(engine.max_context_len, engine.capacity_tokens // 2)
    lens = warm_up_prompt_lens(chunk, engine.backend.prefill_prefix_keys, limit)
    rng = random.Random(0)
    start = time.perf_counter()
    scheduler.max_num_batched_tokens = chunk
    try:
        for index, length in enumerate(lens):
            request_id = f"fdserve-warm-up-{index}"
            engine.add_request(request_id, [rng.randrange(engine.vocab_size) for _ in range(length)],
                               SamplingParams(temperature=0.0, max_tokens=1))
            while engine.has_unfinished():
                for output in engine.step():
                    if output.error is not None:
                        raise WarmUpError(f"the {length}-token warm-up prompt failed: {output.error}")
    finally:
        scheduler.max_num_batched_tokens = budget
    engine.reset_counters()
    if lens:
        logger.info("prefill path warmed up with prompts of %s tokens in %.2f s",
                    ", ".join(map(str, lens)), time.perf_counter() - start)
    return lens
