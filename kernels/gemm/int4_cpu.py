"""Weight-only int4 matmul on the CPU: y = x · dequant(W)ᵀ with 4-bit codes in groups along K.

Decode on a CPU is a read of every weight per token, so bytes are time: int4 reads a quarter of
bf16's bytes. torch ships the kernel (`_weight_int4pack_mm_for_cpu`: bf16 activations, bf16 scales
and zeros per group of `group_size` input features, fp32 accumulation); this module quantizes
into its layout and keeps a float reference beside it.

A group of weights w becomes codes q in [0, 15] with w ≈ (q - 8) · scale + zero, scale =
(max - min) / 15 and zero = min + 8 · scale (round to nearest). Weights that were 4-bit to begin
with (a GGUF Q4_1 block is d · q + m over 32 weights with both q = 0 and q = 15 present) come back
with the same codes; only scale and zero round to bf16.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

GROUP_SIZE = 32
LEVELS = 15


@dataclass(frozen=True)
class Int4Weight:
    """One [N, K] weight in the CPU int4 kernel's layout."""

    packed: torch.Tensor             # [N, K / 2] uint8, torch's CPU int4 packing
    scales_and_zeros: torch.Tensor   # [K / group_size, N, 2] bfloat16
    group_size: int

    @property
    def out_features(self) -> int:
        return int(self.packed.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.packed.shape[1]) * 2


def can_pack(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> bool:
    """The kernel's shape rules: a 2-D weight whose K splits into whole groups of an even size and
    whose N is a multiple of 16."""
    return (weight.dim() == 2 and group_size % 2 == 0 and weight.shape[1] % group_size == 0
            and weight.shape[0] % 16 == 0)


def quantize_int4(weight: torch.Tensor, group_size: int = GROUP_SIZE
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (codes [N, K] int32 in [0, 15], scale [N, K/g], zero [N, K/g]) in float32."""
    if not can_pack(weight, group_size):
        raise ValueError(f"int4: weight {tuple(weight.shape)} needs N % 16 == 0 and K in groups of {group_size}")
    n, k = weight.shape
    groups = weight.float().reshape(n, k // group_size, group_size)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = (high - low) / LEVELS
    safe = torch.where(scale > 0, scale, 1.0)
    codes = torch.round((groups - low[..., None]) / safe[..., None]).clamp_(0, LEVELS)
    zero = low + 8 * scale
    return codes.to(torch.int32).reshape(n, k), scale, zero


def on_int4_grid(weight: torch.Tensor, group_size: int = GROUP_SIZE, tolerance: float = 0.1) -> bool:
    """Whether `weight` is already 4-bit per group (a dequantized Q4 GGUF tensor, perhaps rounded to
    bf16): every weight within `tolerance` steps of its code, so packing it keeps its codes. bf16
    rounding moves a 4-bit weight by < 0.04 steps (the embedded default); other weights sit up to
    half a step away."""
    if not can_pack(weight, group_size):
        return False
    codes, scale, zero = quantize_int4(weight, group_size)
    n, k = weight.shape
    steps = ((codes.float().reshape(n, -1, group_size) - 8) * scale[..., None] + zero[..., None]
             - weight.float().reshape(n, -1, group_size)).abs() / torch.where(scale > 0, scale, 1.0)[..., None]
    return bool(steps.max() <= tolerance)


def pack_int4(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> Int4Weight:
    """Quantize and pack `weight` [N, K] for `int4_linear`."""
    codes, scale, zero = quantize_int4(weight, group_size)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    scales_and_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()
    return Int4Weight(packed, scales_and_zeros, group_size)


def dequantize_int4(weight: Int4Weight, codes: torch.Tensor) -> torch.Tensor:
    """The float32 [N, K] that `weight` multiplies by, from the `codes` it was packed from."""
    scale = weight.scales_and_zeros[..., 0].t().float().repeat_interleave(weight.group_size, dim=1)
    zero = weight.scales_and_zeros[..., 1].t().float().repeat_interleave(weight.group_size, dim=1)
    return (codes.float() - 8) * scale + zero


def int4_linear(x: torch.Tensor, weight: Int4Weight) -> torch.Tensor:
    """x [M, K] -> x · dequant(W)ᵀ [M, N] in x's dtype (the kernel runs on bf16 activations)."""
    bf16 = x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)   # a decode step makes 120 of these calls
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(bf16, weight.packed, weight.group_size, weight.scales_and_zeros)
    return out if out.dtype == x.dtype else out.to(x.dtype)


def int4_linear_ref(x: torch.Tensor, weight: Int4Weight, codes: torch.Tensor) -> torch.Tensor:
    """`int4_linear` in float32 over the dequantized weight (the oracle)."""
    return F.linear(x.float(), dequantize_int4(weight, codes))
