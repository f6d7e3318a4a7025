"""Symmetric int8 weights per group of inputs (GGUF Q8_0's form): w ≈ d · q, q in [-127, 127], d = max |w| / 127
of the group. A weight that came from a Q8_0 tensor (the embedded default's tied embedding and LM head) comes
back with its own codes, and d within float32 rounding of the file's.
"""
from __future__ import annotations

import torch

GROUP_SIZE = 32
MAX_CODE = 127


def quantize_int8_blocks(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (codes [N, K] int32 in [-127, 127], d [N, K / group_size] float32)."""
    if weight.dim() != 2 or weight.shape[1] % group_size:
        raise ValueError(f"int8 blocks: weight {tuple(weight.shape)} needs K in groups of {group_size}")
    n, k = weight.shape
    groups = weight.detach().float().reshape(n, k // group_size, group_size)
    scale = groups.abs().amax(-1) / MAX_CODE
    safe = torch.where(scale > 0, scale, 1.0)
    codes = torch.round(groups / safe[..., None]).clamp_(-MAX_CODE, MAX_CODE)
    return codes.to(torch.int32).reshape(n, k), scale
