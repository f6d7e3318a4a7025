"""Whether this CPU runs the model faster in bfloat16 than in float32: a matmul timed at startup.

CPUs with AVX512-BF16 or AMX run oneDNN's bf16 matmuls two to four times faster than fp32 ones;
without those units bf16 is emulated and slower. A ~0.1 s probe on one projection-sized matmul
tells the two apart, so `[backend] cpu_weight_dtype = "auto"` needs no CPU feature table.
"""
from __future__ import annotations

import logging
import time
from functools import lru_cache

import torch

logger = logging.getLogger(__name__)

MIN_SPEEDUP = 1.5                 # below this, bf16's rounding is not worth what it saves
PROBE_SHAPE = (256, 576, 1536)    # tokens x hidden x intermediate: one MLP projection of a small model
PROBE_REPEATS = 5


def faster_dtype(float32_seconds: float, bfloat16_seconds: float) -> torch.dtype:
    """bfloat16 when it is at least MIN_SPEEDUP times faster than float32, else float32."""
    return torch.bfloat16 if float32_seconds >= MIN_SPEEDUP * bfloat16_seconds else torch.float32


def _best_seconds(dtype: torch.dtype) -> float:
    tokens, hidden, out = PROBE_SHAPE
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=generator).to(dtype)
    w = torch.randn(out, hidden, generator=generator).to(dtype)
    torch.nn.functional.linear(x, w)                  # first call: oneDNN picks and caches its kernel
    best = float("inf")
    for _ in range(PROBE_REPEATS):
        start = time.perf_counter()
        torch.nn.functional.linear(x, w)
        best = min(best, time.perf_counter() - start)
    return best


@lru_cache(maxsize=1)
def probe_cpu_dtype() -> torch.dtype:
    """The faster of float32 and bfloat16 for this CPU's matmuls (measured once per process)."""
    fp32, bf16 = _best_seconds(torch.float32), _best_seconds(torch.bfloat16)
    chosen = faster_dtype(fp32, bf16)
    logger.info("cpu_weight_dtype = \"auto\": a %dx%dx%d matmul takes %.2f ms in float32, %.2f ms in bfloat16 "
                "(%.1fx); running %s", *PROBE_SHAPE, fp32 * 1e3, bf16 * 1e3, fp32 / bf16, chosen)
    return chosen
