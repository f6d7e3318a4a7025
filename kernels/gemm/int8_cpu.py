"""Weight-only int8 matmul on the CPU: y = x · (codes · scale)ᵀ with one scale per output row.

A decode step reads every weight once per token; int8 reads half of bf16's bytes. torch ships the
kernel (`_weight_int8pack_mm`: int8 codes [N, K], a scale per row, bf16 activations here, since its
float32 path is several times slower than bf16 oneDNN); this module quantizes into that layout and
keeps a float reference beside it. Codes are round(w / scale) with scale = max |w| / 127 of the row.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

MAX_CODE = 127


@dataclass(frozen=True)
class Int8Weight:
    """One [N, K] weight in the CPU int8 kernel's layout."""

    codes: torch.Tensor    # [N, K] int8
    scales: torch.Tensor   # [N] bfloat16

    @property
    def out_features(self) -> int:
        return int(self.codes.shape[0])


def pack_int8(weight: torch.Tensor) -> Int8Weight:
    """Quantize `weight` [N, K] per output row for `int8_linear`."""
    if weight.dim() != 2:
        raise ValueError(f"int8: a 2-D weight is needed, got {tuple(weight.shape)}")
    w = weight.detach().float()
    scales = (w.abs().amax(1) / MAX_CODE).to(torch.bfloat16)
    safe = torch.where(scales.float() > 0, scales.float(), 1.0)
    codes = torch.round(w / safe[:, None]).clamp_(-MAX_CODE, MAX_CODE).to(torch.int8)
    return Int8Weight(codes.contiguous(), scales)


def int8_linear(x: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    """x [M, K] -> x · dequant(W)ᵀ [M, N] in x's dtype (the kernel runs on bf16 activations)."""
    out = torch._weight_int8pack_mm(x.to(torch.bfloat16).contiguous(), weight.codes, weight.scales)
    return out.to(x.dtype)


def int8_linear_ref(x: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    """`int8_linear` in float32 over the dequantized weight (the oracle)."""
    return F.linear(x.float(), weight.codes.float() * weight.scales.float()[:, None])
