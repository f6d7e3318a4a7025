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

Where "auto" runs float32 (CPUs without fast bf16 matmuls), the decode weights are the checkpoint's own
blocks: layers on a 4-bit grid (Q4_1) and an LM head on an int8 grid (Q8_0) go through the C++ float32
kernel (`kernels/native/block_gemv.cpp`), which multiplies by the dense float32 weight's own values, so
decoding reads an eighth or a quarter of the bytes and computes what the dense weights would.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from engine.config import CpuMatmul, CpuProductInputs
from engine.model.layers import ColumnParallelLinear, DecodeWeight, HasWeight, ParallelLMHead, RowParallelLinear
from kernels.gemm.int4_cpu import GROUP_SIZE, Int4Weight, can_pack, int4_linear, on_int4_grid, pack_int4, quantize_int4
from kernels.gemm.int8_blocks import quantize_int8_blocks
from kernels.gemm.int8_cpu import Int8Weight, int8_linear, pack_int8
from kernels.native import block_gemv, int4_gemv
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
# The float32 block kernel reads each weight once for all its rows (at most block_gemv.MAX_ROWS a call).
BLOCK_MAX_TOKENS = 8


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


class BlockDecodeWeight(DecodeWeight):
    """A weight on a 4-bit or int8 block grid through the C++ float32 kernel: the dense weight's own values
    (`int16_inputs`: its inputs rounded to 16 bits per group first)."""

    def __init__(self, packed: block_gemv.BlockWeight, max_tokens: int = BLOCK_MAX_TOKENS,
                 int16_inputs: bool = False) -> None:
        self.packed = packed
        self.max_tokens = max_tokens
        self.int16_inputs = int16_inputs

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = in_row_groups(lambda rows: block_gemv.block_gemv(rows, self.packed, int16_inputs=self.int16_inputs),
                            x.float(), block_gemv.MAX_ROWS)
        return out if out.dtype == x.dtype else out.to(x.dtype)


def in_row_groups(product: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, max_rows: int) -> torch.Tensor:
    """product(x) for a kernel that takes at most `max_rows` rows a call (more: prompts scored through the
    decode weights, in tests)."""
    if x.shape[0] <= max_rows:
        return product(x)
    return torch.cat([product(part) for part in x.split(max_rows)])


def native_product(x: torch.Tensor, weight: int4_gemv.NativeInt4Weight) -> torch.Tensor:
    """x [M, K] -> x·Wᵀ in x's dtype through the C++ kernel, `int4_gemv.MAX_ROWS` rows a call."""
    bf16 = x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)
    out = in_row_groups(lambda rows: int4_gemv.int4_gemv(rows, weight), bf16, int4_gemv.MAX_ROWS)
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


def block_kernel_unsupported(cpu_matmul: CpuMatmul) -> str | None:
    """Why float32 decode products stay dense (`[backend] cpu_matmul`), or None for the C++ block kernel;
    "native" where it cannot run raises."""
    if cpu_matmul == "torch":
        return 'cpu_matmul = "torch" (torch\'s int4 / int8 kernels are slower than dense float32 on float32 rows)'
    try:
        block_gemv.rows_per_tile()
        reason = None
    except NativeBuildError as err:
        reason = str(err).splitlines()[0]
    if reason is not None and cpu_matmul == "native":
        raise ValueError(f'[backend] cpu_matmul = "native": the C++ block kernel cannot run here: {reason}')
    return reason


# A block weight stands in for the dense one only where it gives the same numbers: every weight within this
# much (relative to the largest) of the dense float32 value, i.e. float32 rounding.
LOSSLESS_TOLERANCE = 1e-6
_CHECK_ROWS = 4096   # rows compared at a time (float64 copies of the LM head would be ~0.2 GB at once)


def _blocks_of(weight: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes u, d, c) with w ~ d u + c per group: 4-bit with Q4_1's d and min, or 8-bit as d (q + 128) - 128 d."""
    if bits == 4:
        codes, scale, zero = quantize_int4(weight, GROUP_SIZE)
        return codes, scale, zero - 8 * scale
    codes, scale = quantize_int8_blocks(weight, GROUP_SIZE)
    return codes + 128, scale, -128 * scale


def _reproduces(weight: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor) -> bool:
    """Whether d u + c, with d and c as the kernel stores them (float16), equals `weight` to float32 rounding."""
    limit = LOSSLESS_TOLERANCE * float(weight.abs().max())
    n, k = weight.shape
    for lo in range(0, n, _CHECK_ROWS):
        rows = slice(lo, lo + _CHECK_ROWS)
        d = scale[rows].half().float()[..., None]
        c = bias[rows].half().float()[..., None]
        u = codes[rows].reshape(-1, k // GROUP_SIZE, GROUP_SIZE)
        if float((u * d + c - weight[rows].float().reshape(u.shape)).abs().max()) > limit:
            return False
    return True


def block_weight_for(weight: torch.Tensor, int16_inputs: bool = False) -> BlockDecodeWeight | None:
    """`weight` as the checkpoint's own blocks (4-bit tried first, then int8), or None where neither gives its
    numbers back exactly or its shape does not fit the kernel."""
    w = weight.detach()
    n, k = w.shape
    for bits in (4, 8):
        if block_gemv.unsupported(n, k, bits, GROUP_SIZE) is not None or (bits == 4 and not can_pack(w, GROUP_SIZE)):
            continue
        codes, scale, bias = _blocks_of(w, bits)
        if _reproduces(w, codes, scale, bias):
            return BlockDecodeWeight(block_gemv.pack(codes, scale, bias, bits, GROUP_SIZE), int16_inputs=int16_inputs)
    return None


def product_inputs_int16(cpu_product_inputs: CpuProductInputs) -> bool:
    """Whether the block products round their inputs to 16 bits (`[backend] cpu_product_inputs`); "int16" where
    this build has no such kernel raises."""
    if cpu_product_inputs == "float32":
        return False
    available = block_gemv.int16_inputs_available()
    if cpu_product_inputs == "int16" and not available:
        raise ValueError('[backend] cpu_product_inputs = "int16": this CPU build has no 16-bit input kernel '
                         "(it needs AVX2 and F16C)")
    return available


def pack_block_decode_weights(model: torch.nn.Module, int16_inputs: bool = False) -> str:
    """Give every linear layer and LM head whose float32 weight lies on a 4-bit or int8 block grid its block
    decode weight; return what runs, for the startup log."""
    counts = {4: 0, 8: 0}
    dense: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)):
            continue
        layer: HasWeight = module
        block = block_weight_for(layer.weight, int16_inputs)
        if block is None:
            dense.append(name)
            continue
        layer.decode_weight = block
        counts[block.packed.bits] += 1
    inputs = "inputs rounded to 16 bits per group" if int16_inputs else "float32 inputs"
    text = (f"float32 with the checkpoint's own blocks for products of <= {BLOCK_MAX_TOKENS} rows "
            f"(C++, {block_gemv.isa()}, {inputs}): 4-bit in {counts[4]} layers, int8 in {counts[8]}")
    if dense:
        shown = ", ".join(dense[:3]) + (f" and {len(dense) - 3} more" if len(dense) > 3 else "")
        text += f"; dense in {len(dense)} (no 4-bit or int8 blocks give their weights back: {shown})"
    return text + "; dense weights for prefill"


def configure_cpu_weights(model: torch.nn.Module, cpu_weight_dtype: str, dtype: torch.dtype,
                          cpu_matmul: CpuMatmul = "auto", cpu_product_inputs: CpuProductInputs = "float32") -> str:
    """Apply `[backend] cpu_weight_dtype` (and `cpu_matmul`, `cpu_product_inputs`) to a CPU model loaded in
    `dtype`; return what runs."""
    if cpu_weight_dtype == "int4" or (cpu_weight_dtype == "auto" and dtype == torch.bfloat16):
        why_torch = native_matmul_unsupported(cpu_matmul)
        native = why_torch is None
        text = (pack_int4_decode_weights(model, lossless_only=cpu_weight_dtype == "auto", native=native) + "; "
                + pack_int8_lm_head(model, native=native) + "; decode products: "
                + ("C++ (AVX512-BF16)" if native else f"torch's kernels ({why_torch})"))
    elif cpu_weight_dtype == "auto" and dtype == torch.float32:
        why_dense = block_kernel_unsupported(cpu_matmul)
        text = (pack_block_decode_weights(model, product_inputs_int16(cpu_product_inputs)) if why_dense is None
                else f"dense float32 weights ({why_dense})")
    else:
        text = f"dense {dtype} weights"
    logger.info("cpu weights (cpu_weight_dtype = %r): %s", cpu_weight_dtype, text)
    return text
