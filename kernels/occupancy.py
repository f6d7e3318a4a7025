"""How many CTAs of a compiled Triton kernel fit on one SM (registers, shared memory, threads).

The split heuristic aims to fill every SM with as many CTAs as can be resident at once; that
number is a property of the compiled kernel (the FD++ kernel with its φ estimate needs more
registers than the flash kernel, so fewer of its CTAs fit). Measured once per specialisation.
"""
from __future__ import annotations

from typing import Any

import torch

_CACHE: dict[tuple, int] = {}
REG_ALLOC_UNIT = 256        # registers are handed out per warp in units of 256 (sm_80 / sm_90)
SMEM_RESERVED = 1024        # bytes the driver reserves per CTA


def resident_ctas(kernel: Any, key: tuple, args: tuple, kwargs: dict[str, Any], device: torch.device) -> int:
    """CTAs of `kernel` (compiled for `args`/`kwargs`) resident per SM on `device` (NVIDIA)."""
    full_key = (id(kernel), str(device), *key)
    if full_key not in _CACHE:
        compiled = kernel.warmup(*args, grid=(1,), **kwargs)
        compiled._init_handles()
        props = torch.cuda.get_device_properties(device)
        warps = compiled.metadata.num_warps
        regs_per_warp = -(-compiled.n_regs * 32 // REG_ALLOC_UNIT) * REG_ALLOC_UNIT
        by_regs = getattr(props, "regs_per_multiprocessor", 65536) // max(regs_per_warp, 1) // warps
        smem_per_sm = getattr(props, "shared_memory_per_multiprocessor", 233472)
        by_smem = smem_per_sm // (compiled.metadata.shared + SMEM_RESERVED)
        by_threads = props.max_threads_per_multi_processor // (32 * warps)
        _CACHE[full_key] = max(1, min(by_regs, by_smem, by_threads, 32))
    return _CACHE[full_key]
