"""A decode step through every decoder layer of a Llama-family model in one C++ call (`decode_stack.cpp`).

The layer is the plain Llama one: RMSNorm with the residual carried beside it, fused q/k/v, RoPE over the
first `rotary_dim` features of each head (GPT-NeoX halves), paged attention over float32 or bfloat16 pages,
the output projection, RMSNorm, fused gate/up, SiLU(gate) * up, down; no biases, no q/k norms, no experts.
The four products take `block_gemv` weights, with float32 inputs or (`int16_inputs`) inputs rounded to 16 bits
per group. `DecodeStack` holds the pointers to every layer's weights and
pages, made once; `run` takes a step's rows.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache

import torch

from kernels.native.block_gemv import BlockWeight
from kernels.native.build import FLAGS, NativeBuildError, load
from kernels.native.pages import host_tables


class _BlockMatrix(ctypes.Structure):
    _fields_ = [("codes", ctypes.c_void_p), ("scale_bias", ctypes.c_void_p), ("bits", ctypes.c_int32),
                ("out_features", ctypes.c_int32), ("in_features", ctypes.c_int32), ("group_size", ctypes.c_int32)]


class _StackLayer(ctypes.Structure):
    _fields_ = [("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("qkv", _BlockMatrix),
                ("o", _BlockMatrix), ("gate_up", _BlockMatrix), ("down", _BlockMatrix),
                ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p)]


class _StackModel(ctypes.Structure):
    _fields_ = [("num_layers", ctypes.c_int32), ("hidden", ctypes.c_int32), ("num_heads", ctypes.c_int32),
                ("num_kv_heads", ctypes.c_int32), ("head_dim", ctypes.c_int32), ("rotary_dim", ctypes.c_int32),
                ("intermediate", ctypes.c_int32), ("block_size", ctypes.c_int32), ("bf16_pages", ctypes.c_int32),
                ("int16_inputs", ctypes.c_int32),
                ("eps", ctypes.c_float),
                ("attn_scale", ctypes.c_float), ("cos_cache", ctypes.c_void_p), ("sin_cache", ctypes.c_void_p),
                ("max_position", ctypes.c_int64), ("num_slots", ctypes.c_int64), ("final_norm", ctypes.c_void_p),
                ("layers", ctypes.POINTER(_StackLayer))]


_REFUSALS = {-1: "rows outside 1..8", -2: "a weight the product kernel does not take",
             -3: "a position outside the RoPE tables", -4: "a slot outside the pages",
             -5: "a length other than position + 1"}


@cache
def library(flags: tuple[str, ...] = FLAGS) -> ctypes.CDLL:
    """The kernel built for this CPU (raises `NativeBuildError`)."""
    lib = load("decode_stack", flags)
    lib.decode_stack.restype = ctypes.c_int
    lib.decode_stack.argtypes = [ctypes.POINTER(_StackModel), ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                 ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    return lib


def int16_inputs_available() -> bool:
    """Whether this build's products can round their inputs to 16 bits (`block_gemv_i16.h`: AVX2 with F16C)."""
    try:
        return bool(library().decode_stack_int16_inputs_available())
    except NativeBuildError:   # no compiler, or the source did not build: nothing is available
        return False


def max_rows() -> int:
    """Rows (sequences) a step may have."""
    return int(library().decode_stack_max_rows())


@dataclass(frozen=True)
class StackLayerWeights:
    """One layer's tensors: float32 norms [hidden], block weights, pages [blocks, block_size, Hkv, D] of float32
    or bfloat16."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: BlockWeight
    o: BlockWeight
    gate_up: BlockWeight
    down: BlockWeight
    k_cache: torch.Tensor
    v_cache: torch.Tensor


@dataclass(frozen=True)
class StackShape:
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    intermediate: int
    eps: float
    attn_scale: float


def _matrix(weight: BlockWeight, out_features: int, in_features: int, what: str) -> _BlockMatrix:
    if (weight.out_features, weight.in_features) != (out_features, in_features):
        raise ValueError(f"decode stack: {what} is [{weight.out_features}, {weight.in_features}], "
                         f"[{out_features}, {in_features}] expected")
    return _BlockMatrix(weight.codes.data_ptr(), weight.scale_bias.data_ptr(), weight.bits, weight.out_features,
                        weight.in_features, weight.group_size)


def _float32_vector(t: torch.Tensor, size: int, what: str) -> int:
    if t.dtype != torch.float32 or tuple(t.shape) != (size,) or not t.is_contiguous() or not t.is_cpu:
        raise ValueError(f"decode stack: {what} must be a contiguous float32 CPU vector of {size}")
    return t.data_ptr()


class DecodeStack:
    """The pointers `decode_stack.cpp` reads, for one model and its KV cache; the tensors stay referenced
    here, so the pointers stay valid while this lives."""

    def __init__(self, shape: StackShape, layers: list[StackLayerWeights], final_norm: torch.Tensor,
                 cos_cache: torch.Tensor, sin_cache: torch.Tensor, *, int16_inputs: bool = False) -> None:
        s = shape
        if int16_inputs and not int16_inputs_available():
            raise ValueError("decode stack: this build has no 16-bit input products (they need AVX2 and F16C)")
        if s.num_heads % s.num_kv_heads or s.rotary_dim % 2 or not 0 < s.rotary_dim <= s.head_dim or not layers:
            raise ValueError(f"decode stack: unsupported shape {s}")
        half = s.rotary_dim // 2
        for table in (cos_cache, sin_cache):
            if table.dtype != torch.float32 or table.dim() != 2 or table.shape[1] != half or not table.is_contiguous():
                raise ValueError(f"decode stack: cos/sin tables of [positions, {half}] float32 expected")
        cache_shape, page_dtype = tuple(layers[0].k_cache.shape), layers[0].k_cache.dtype
        if page_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"decode stack: pages of float32 or bfloat16, not {page_dtype}")
        if len(cache_shape) != 4 or cache_shape[2:] != (s.num_kv_heads, s.head_dim):
            raise ValueError(f"decode stack: pages of [blocks, block_size, {s.num_kv_heads}, {s.head_dim}], "
                             f"got {cache_shape}")
        q_out = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
        structs = (_StackLayer * len(layers))()
        for i, layer in enumerate(layers):
            for pages in (layer.k_cache, layer.v_cache):
                if (tuple(pages.shape) != cache_shape or pages.dtype != page_dtype or not pages.is_contiguous()
                        or not pages.is_cpu):
                    raise ValueError(f"decode stack: layer {i}: contiguous {page_dtype} CPU pages of {cache_shape} "
                                     "expected")
            structs[i] = _StackLayer(
                _float32_vector(layer.input_norm, s.hidden, f"layer {i} input norm"),
                _float32_vector(layer.post_norm, s.hidden, f"layer {i} post-attention norm"),
                _matrix(layer.qkv, q_out, s.hidden, f"layer {i} qkv"),
                _matrix(layer.o, s.hidden, s.num_heads * s.head_dim, f"layer {i} o"),
                _matrix(layer.gate_up, 2 * s.intermediate, s.hidden, f"layer {i} gate_up"),
                _matrix(layer.down, s.hidden, s.intermediate, f"layer {i} down"),
                layer.k_cache.data_ptr(), layer.v_cache.data_ptr())
        self.shape = shape
        self.int16_inputs = int16_inputs
        self.num_layers = len(layers)
        self.num_blocks, self.block_size = cache_shape[0], cache_shape[1]
        self._tensors = (layers, final_norm, cos_cache, sin_cache)
        self._layers = structs
        self._model = _StackModel(len(layers), s.hidden, s.num_heads, s.num_kv_heads, s.head_dim, s.rotary_dim,
                                  s.intermediate, self.block_size, int(page_dtype == torch.bfloat16),
                                  int(int16_inputs), s.eps, s.attn_scale, cos_cache.data_ptr(), sin_cache.data_ptr(),
                                  cos_cache.shape[0], self.num_blocks * self.block_size,
                                  _float32_vector(final_norm, s.hidden, "final norm"), structs)
        self.max_rows = max_rows()

    def run(self, hidden: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            block_tables: torch.Tensor, seq_lens: torch.Tensor, num_threads: int | None = None) -> torch.Tensor:
        """hidden [M, H] float32 (the rows' embeddings) -> the final norm's output [M, H]; each row is one
        sequence's next token at `positions` (seq_lens = positions + 1), its K/V stored at `slot_mapping`
        (-1: not stored), attending over its pages through `block_tables`."""
        m = hidden.shape[0]
        shape_ok = tuple(hidden.shape) == (m, self.shape.hidden) and 1 <= m <= self.max_rows
        if hidden.dtype != torch.float32 or not shape_ok:
            raise ValueError(f"decode stack: float32 rows [1..{self.max_rows}, {self.shape.hidden}] expected, got "
                             f"{hidden.dtype} {tuple(hidden.shape)}")
        tables, lens = host_tables(block_tables, seq_lens, self.block_size, self.num_blocks, "decode stack")
        pos = positions.to(torch.int64).contiguous()
        slots = slot_mapping.to(torch.int64).contiguous()
        if pos.shape != (m,) or slots.shape != (m,) or lens.shape != (m,):
            raise ValueError("decode stack: one position, slot and length per row")
        out = hidden.contiguous().clone()
        status = library().decode_stack(ctypes.byref(self._model), out.data_ptr(), m, pos.data_ptr(),
                                        slots.data_ptr(), tables.data_ptr(), tables.stride(0), lens.data_ptr(),
                                        num_threads or torch.get_num_threads())
        if status != 0:
            raise ValueError(f"decode stack: {_REFUSALS.get(status, f'status {status}')}")
        return out
