"""int4 and int8 decode weights on the CPU (`[backend] cpu_weight_dtype`): "int4" packs every linear
layer; "auto", when it runs bf16, packs the layers whose weights are already 4-bit per group (a Q4
GGUF such as the embedded default's), where packing loses nothing but bf16's rounding of each group's
scale and zero. The LM head gets int8 (a scale per vocabulary row), not int4: quantized to int4 it
moved the embedded default's teacher-forced next token on 12 % of positions of real text.

A CPU decode step reads every weight once per token, so its time is the weights' bytes; int4 is a
quarter of bf16. Prefill chunks are compute-bound, where oneDNN's bf16 matmul is faster than the
int4 kernel (which dequantizes as it goes), so they keep the dense weight: the layer holds both.

`[backend] cpu_matmul` picks the decode products' kernel: our C++ one (`kernels/native/int4_gemv.cpp`,
AVX512-BF16; the int8 LM head as two 4-bit planes) or torch's (`_weight_int4pack_mm_for_cpu`,
`_weight_int8pack_mm`).
"""
from __future__ import annotations

import logging

import torch

from engine.config import CpuMatmul
from engine.model.layers import ColumnParallelLinear, DecodeWeight, HasWeight, ParallelLMHead, RowParallelLinear
from kernels.gemm.int4_cpu import GROUP_SIZE, Int4Weight, can_pack, int4_linear, on_int4_grid, pack_int4, quantize_int4
from kernels.gemm.int8_cpu import Int8Weight, int8_linear, pack_int8
from kernels.native import int4_gemv
from kernels.native.build import NativeBuildError

logger = logging.getLogger(__name__)

# Rows up to which the int4 kernel beats bf16 oneDNN on a 576x1536 projection (2 threads, AVX512-BF16):
# 0.06 vs 0.12 ms at 1 row, even at 8.
INT4_MAX_TOKENS = 8
# The int8 kernel's time grows with the rows (it does not reuse a weight across them): for the embedded
# default's LM head 0.97 / 1.72 / 3.4 ms at 1 / 4 / 8 rows against bf16's 2.2-2.4.
INT8_HEAD_MAX_TOKENS = 4
# The C++ kernel reads the weight once for all its rows: the head takes 0.81 / 1.11 / 2.41 ms at 1 / 4 / 8
# rows against bf16's 3.1 / 3.6 / 4.0 (2 threads, AVX512-BF16).
NATIVE_HEAD_MAX_TOKENS = 8


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


class NativeInt4DecodeWeight(DecodeWeight):
    """The int4 weight of `Int4DecodeWeight` (same codes, scales and zeros) through the C++ kernel."""

    def __init__(self, weight: torch.Tensor, max_tokens: int = INT4_MAX_TOKENS) -> None:
        codes, scale, zero = quantize_int4(weight.detach(), GROUP_SIZE)
        self.packed = int4_gemv.pack(codes, scale, zero, GROUP_SIZE)
        self.max_tokens = max_tokens

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return native_product(x, self.packed)


class NativeInt8DecodeWeight(DecodeWeight):
    """The int8 weight of `Int8DecodeWeight` (same codes and row scales) as two 4-bit planes over [x, x]."""

    def __init__(self, weight: torch.Tensor, max_tokens: int = NATIVE_HEAD_MAX_TOKENS) -> None:
        int8 = pack_int8(weight)
        self.packed = int4_gemv.pack_int8_as_planes(int8.codes, int8.scales)
        self.max_tokens = max_tokens

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return native_product(torch.cat([x, x], dim=-1), self.packed).to(x.dtype)


def native_product(x: torch.Tensor, weight: int4_gemv.NativeInt4Weight) -> torch.Tensor:
    """x [M, K] -> x·Wᵀ in x's dtype through the C++ kernel, `int4_gemv.MAX_ROWS` rows a call."""
    bf16 = x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)
    if bf16.shape[0] <= int4_gemv.MAX_ROWS:
        out = int4_gemv.int4_gemv(bf16, weight)
    else:   # prompts scored through the decode weights (tests)
        out = torch.cat([int4_gemv.int4_gemv(part, weight) for part in bf16.split(int4_gemv.MAX_ROWS)])
    return out if out.dtype == x.dtype else out.to(x.dtype)


def native_matmul_unsupported(cpu_matmul: CpuMatmul) -> str | None:
    """Why the decode products run on torch's kernels (`[backend] cpu_matmul`), or None for the C++ one;
    "native" where it cannot run raises."""
    if cpu_matmul == "torch":
        return 'cpu_matmul = "torch"'
    try:
        reason = int4_gemv.unsupported(16, int4_gemv.BLOCK, int4_gemv.BLOCK)
    except NativeBuildError as err:
        reason = str(err).splitlines()[0]
    if reason is not None and cpu_matmul == "native":
        raise ValueError(f'[backend] cpu_matmul = "native": the C++ int4 kernel cannot run here: {reason}')
    return reason


def pack_int8_lm_head(model: torch.nn.Module, max_tokens: int = INT8_HEAD_MAX_TOKENS, *, native: bool = False) -> str:
    """Give the LM head an int8 decode weight (the embedded default's 49152 x 576 head on 2 cores: 2.2 ->
    1.0 ms a token through torch's kernel, 0.76 ms through ours); return what runs."""
    heads = [m for m in model.modules() if isinstance(m, ParallelLMHead)]
    text = "no LM head"
    for head in heads:
        n, k = head.weight.shape   # the planes are groups of a whole row over [x, x]
        why_torch = int4_gemv.unsupported(n, 2 * k, k) if native else None
        weight: DecodeWeight = (NativeInt8DecodeWeight(head.weight) if native and why_torch is None
                                else Int8DecodeWeight(head.weight, max_tokens))
        head.decode_weight = weight
        text = f"int8 LM head for products of <= {weight.max_tokens} rows"
        if why_torch is not None:
            text += f" (torch's kernel: {why_torch})"
    return text


def pack_int4_decode_weights(model: torch.nn.Module, *, lossless_only: bool,
                             max_tokens: int = INT4_MAX_TOKENS, native: bool = False) -> str:
    """Give the linear layers int4 decode weights (with `lossless_only`, only those already on a 4-bit
    grid); return what runs, for the startup log."""
    packed, on_torch, dense = 0, 0, []
    for name, module in model.named_modules():
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            continue
        layer: HasWeight = module
        if not can_pack(layer.weight, GROUP_SIZE) or (lossless_only and not on_int4_grid(layer.weight, GROUP_SIZE)):
            dense.append(name)
            continue
        n, k = layer.weight.shape
        if native and int4_gemv.unsupported(n, k, GROUP_SIZE) is None:
            layer.decode_weight = NativeInt4DecodeWeight(layer.weight, max_tokens)
        else:
            layer.decode_weight = Int4DecodeWeight(layer.weight, max_tokens)
            on_torch += native
        packed += 1
    text = f"int4 (groups of {GROUP_SIZE}) for products of <= {max_tokens} rows in {packed} layers"
    if on_torch:
        text += f" ({on_torch} of them on torch's kernel: shapes the C++ one does not take)"
    if dense:
        why = "not 4-bit already" if lossless_only else f"N not a multiple of 16 or K of {GROUP_SIZE}"
        shown = ", ".join(dense[:3]) + (f" and {len(dense) - 3} more" if len(dense) > 3 else "")
        text += f"; dense in {len(dense)} ({why}: {shown})"
    return text + "; dense weights for prefill"


def configure_cpu_weights(model: torch.nn.Module, cpu_weight_dtype: str, dtype: torch.dtype,
                          cpu_matmul: CpuMatmul = "auto") -> str:
    """Apply `[backend] cpu_weight_dtype` (and `cpu_matmul`) to a CPU model loaded in `dtype`; return what runs."""
    if cpu_weight_dtype == "int4" or (cpu_weight_dtype == "auto" and dtype == torch.bfloat16):
        why_torch = native_matmul_unsupported(cpu_matmul)
        native = why_torch is None
        text = (pack_int4_decode_weights(model, lossless_only=cpu_weight_dtype == "auto", native=native) + "; "
                + pack_int8_lm_head(model, native=native) + "; decode products: "
                + ("C++ (AVX512-BF16)" if native else f"torch's kernels ({why_torch})"))
    else:
        text = f"dense {dtype} weights"
    logger.info("cpu weights (cpu_weight_dtype = %r): %s", cpu_weight_dtype, text)
    return text
