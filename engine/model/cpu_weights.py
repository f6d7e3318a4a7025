"""int4 and int8 decode weights on the CPU (`[backend] cpu_weight_dtype`): "int4" packs every linear
layer; "auto", when it runs bf16, packs the layers whose weights are already 4-bit per group (a Q4
GGUF such as the embedded default's), where packing loses nothing but bf16's rounding of each group's
scale and zero. The LM head gets int8 (a scale per vocabulary row), not int4: quantized to int4 it
moved the embedded default's teacher-forced next token on 12 % of positions of real text.

A CPU decode step reads every weight once per token, so its time is the weights' bytes; int4 is a
quarter of bf16. Prefill chunks are compute-bound, where oneDNN's bf16 matmul is faster than the
int4 kernel (which dequantizes as it goes), so they keep the dense weight: the layer holds both.
"""
from __future__ import annotations

import logging

import torch

from engine.model.layers import ColumnParallelLinear, DecodeWeight, HasWeight, ParallelLMHead, RowParallelLinear
from kernels.gemm.int4_cpu import GROUP_SIZE, Int4Weight, can_pack, int4_linear, on_int4_grid, pack_int4
from kernels.gemm.int8_cpu import Int8Weight, int8_linear, pack_int8

logger = logging.getLogger(__name__)

# Rows up to which the int4 kernel beats bf16 oneDNN on a 576x1536 projection (2 threads, AVX512-BF16):
# 0.06 vs 0.12 ms at 1 row, even at 8.
INT4_MAX_TOKENS = 8
# The int8 kernel's time grows with the rows (it does not reuse a weight across them): for the embedded
# default's LM head 0.97 / 1.72 / 3.4 ms at 1 / 4 / 8 rows against bf16's 2.2-2.4.
INT8_HEAD_MAX_TOKENS = 4


class Int4DecodeWeight(DecodeWeight):
    def __init__(self, weight: torch.Tensor, max_tokens: int = INT4_MAX_TOKENS) -> None:
        self.int4: Int4Weight = pack_int4(weight.detach(), GROUP_SIZE)
        self.max_tokens = max_tokens

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return int4_linear(x, self.int4)


class Int8DecodeWeight(DecodeWeight):
    def __init__(self, weight: torch.Tensor, max_tokens: int = INT8_HEAD_MAX_TOKENS) -> None:
        self.int8: Int8Weight = pack_int8(weight)
        self.max_tokens = max_tokens

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return int8_linear(x, self.int8)


def pack_int8_lm_head(model: torch.nn.Module, max_tokens: int = INT8_HEAD_MAX_TOKENS) -> str:
    """Give the LM head an int8 decode weight (2.2 -> 1.0 ms a token for the embedded default's
    49152 x 576 head on 2 cores); return what runs."""
    heads = [m for m in model.modules() if isinstance(m, ParallelLMHead)]
    for head in heads:
        head.decode_weight = Int8DecodeWeight(head.weight, max_tokens)
    return f"int8 LM head for products of <= {max_tokens} rows" if heads else "no LM head"


def pack_int4_decode_weights(model: torch.nn.Module, *, lossless_only: bool,
                             max_tokens: int = INT4_MAX_TOKENS) -> str:
    """Give the linear layers int4 decode weights (with `lossless_only`, only those already on a 4-bit
    grid); return what runs, for the startup log."""
    packed, dense = 0, []
    for name, module in model.named_modules():
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            continue
        layer: HasWeight = module
        if not can_pack(layer.weight, GROUP_SIZE) or (lossless_only and not on_int4_grid(layer.weight, GROUP_SIZE)):
            dense.append(name)
            continue
        layer.decode_weight = Int4DecodeWeight(layer.weight, max_tokens)
        packed += 1
    text = f"int4 (groups of {GROUP_SIZE}) for products of <= {max_tokens} rows in {packed} layers"
    if dense:
        why = "not 4-bit already" if lossless_only else f"N not a multiple of 16 or K of {GROUP_SIZE}"
        shown = ", ".join(dense[:3]) + (f" and {len(dense) - 3} more" if len(dense) > 3 else "")
        text += f"; dense in {len(dense)} ({why}: {shown})"
    return text + "; dense weights for prefill"


def configure_cpu_weights(model: torch.nn.Module, cpu_weight_dtype: str, dtype: torch.dtype) -> str:
    """Apply `[backend] cpu_weight_dtype` to a CPU model loaded in `dtype`; return what runs."""
    if cpu_weight_dtype == "int4":
        text = pack_int4_decode_weights(model, lossless_only=False) + "; " + pack_int8_lm_head(model)
    elif cpu_weight_dtype == "auto" and dtype == torch.bfloat16:
        text = pack_int4_decode_weights(model, lossless_only=True) + "; " + pack_int8_lm_head(model)
    else:
        text = f"dense {dtype} weights"
    logger.info("cpu weights (cpu_weight_dtype = %r): %s", cpu_weight_dtype, text)
    return text
