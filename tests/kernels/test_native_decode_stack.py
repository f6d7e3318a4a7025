"""The C++ decode step through every decoder layer (`kernels/native/decode_stack.cpp`) against a float64 reference
written out here: fresh random weights on 4-bit and 8-bit block grids, norms, RoPE tables and pages (stale rows
NaN), rows at odd lengths and on page boundaries, full and partial rotary; the K/V it stores; what it refuses."""
from __future__ import annotations

import pytest
import torch

from kernels.attention.reference import decode_attention_ref
from kernels.native import block_gemv, decode_stack
from kernels.native.build import NativeBuildError


def _reason() -> str | None:
    try:
        decode_stack.max_rows()
        return block_gemv.unsupported(block_gemv.rows_per_tile(), 32, 4, 32)
    except NativeBuildError as err:
        return str(err)


pytestmark = pytest.mark.skipif(_reason() is not None, reason=f"C++ decode stack: {_reason()}")

BLOCK_SIZE = 16
EPS = 1e-5


def block_weight(n: int, k: int, bits: int, gen: torch.Generator) -> block_gemv.BlockWeight:
    codes = torch.randint(0, 1 << bits, (n, k), generator=gen)
    scale = torch.rand(n, k // 32, generator=gen) * (0.4 / (k ** 0.5 * (1 << bits))) + 1e-4
    bias = -scale * (1 << (bits - 1)) * (1 + 0.1 * torch.randn(n, k // 32, generator=gen))
    return block_gemv.pack(codes, scale, bias, bits, 32)


class Case:
    """A random model, pages and one decode step's rows."""

    def __init__(self, shape: decode_stack.StackShape, num_layers: int, lens: list[int], seed: int,
                 page_dtype: torch.dtype = torch.float32) -> None:
        gen = torch.Generator().manual_seed(seed)
        s = self.shape = shape
        q_out = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
        pages = [(n + BLOCK_SIZE - 1) // BLOCK_SIZE for n in lens]
        num_blocks = sum(pages) + 4
        cache_shape = (num_blocks, BLOCK_SIZE, s.num_kv_heads, s.head_dim)
        self.layers = []
        for i in range(num_layers):
            bits = (4, 8)[i % 2]   # both code widths in every stack
            self.layers.append(decode_stack.StackLayerWeights(
                1 + 0.1 * torch.randn(s.hidden, generator=gen), 1 + 0.1 * torch.randn(s.hidden, generator=gen),
                block_weight(q_out, s.hidden, bits, gen),
                block_weight(s.hidden, s.num_heads * s.head_dim, bits, gen),
                block_weight(2 * s.intermediate, s.hidden, bits, gen),
                block_weight(s.hidden, s.intermediate, bits, gen),
                torch.randn(cache_shape, generator=gen).to(page_dtype),
                torch.randn(cache_shape, generator=gen).to(page_dtype)))
        self.final_norm = 1 + 0.1 * torch.randn(s.hidden, generator=gen)
        max_position = max(lens) + 8
        inv_freq = 1.0 / (10000 ** (torch.arange(0, s.rotary_dim, 2, dtype=torch.float64) / s.rotary_dim))
        angles = torch.arange(max_position, dtype=torch.float64)[:, None] * inv_freq[None, :]
        self.cos, self.sin = angles.cos().float().contiguous(), angles.sin().float().contiguous()
        order = torch.randperm(num_blocks, generator=gen)
        self.tables = torch.zeros(len(lens), max(pages) + 1, dtype=torch.int32)
        used = 0
        for b, count in enumerate(pages):
            self.tables[b, :count] = order[used:used + count].int()
            used += count
        self.lens = torch.tensor(lens, dtype=torch.int32)
        self.positions = self.lens.long() - 1
        self.slots = torch.stack([self.tables[b, p // BLOCK_SIZE].long() * BLOCK_SIZE + p % BLOCK_SIZE
                                  for b, p in enumerate(self.positions.tolist())])
        for layer in self.layers:   # rows past each sequence and blocks no sequence owns are stale
            for pages_ in (layer.k_cache, layer.v_cache):
                flat = pages_.view(num_blocks * BLOCK_SIZE, -1)
                owned = torch.zeros(num_blocks * BLOCK_SIZE, dtype=torch.bool)
                for b, n in enumerate(lens):
                    for p in range(n):
                        owned[int(self.tables[b, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE] = True
                flat[~owned] = float("nan")
        self.hidden = torch.randn(len(lens), s.hidden, generator=gen)

    def stack(self, int16_inputs: bool = False) -> decode_stack.DecodeStack:
        return decode_stack.DecodeStack(self.shape, self.layers, self.final_norm, self.cos, self.sin,
                                        int16_inputs=int16_inputs)

    def reference(self) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """float64: the final norm's rows and every layer's K and V pages after the step."""
        s = self.shape
        m = self.hidden.shape[0]

        def norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + s.eps) * w.double()

        def rope(x: torch.Tensor) -> torch.Tensor:   # [M, heads, D]
            half = s.rotary_dim // 2
            c = self.cos.double()[self.positions][:, None, :]
            sn = self.sin.double()[self.positions][:, None, :]
            x1, x2, rest = x[..., :half], x[..., half:s.rotary_dim], x[..., s.rotary_dim:]
            return torch.cat([x1 * c - x2 * sn, x2 * c + x1 * sn, rest], dim=-1)

        residual, h = self.hidden.double(), None
        k_pages, v_pages = [], []
        for layer in self.layers:
            if h is not None:
                residual = residual + h
            x = norm(residual, layer.input_norm)
            qkv = x @ block_gemv.dequantize(layer.qkv).T
            q, k, v = qkv.split([s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim,
                                 s.num_kv_heads * s.head_dim], dim=-1)
            q = rope(q.reshape(m, s.num_heads, s.head_dim))
            k = rope(k.reshape(m, s.num_kv_heads, s.head_dim))
            kc, vc = layer.k_cache.double().clone(), layer.v_cache.double().clone()
            stored = layer.k_cache.dtype   # new rows are rounded to the pages' dtype, then read back
            for row, slot in enumerate(self.slots.tolist()):
                kc.view(-1, s.num_kv_heads, s.head_dim)[slot] = k[row].to(stored).double()
                vc.view(-1, s.num_kv_heads, s.head_dim)[slot] = v[row].reshape(s.num_kv_heads, s.head_dim).to(
                    stored).double()
            k_pages.append(kc)
            v_pages.append(vc)
            attn = decode_attention_ref(q, kc, vc, self.tables, self.lens, scale=s.attn_scale)
            residual = residual + attn.reshape(m, -1) @ block_gemv.dequantize(layer.o).T
            x = norm(residual, layer.post_norm)
            gate, up = (x @ block_gemv.dequantize(layer.gate_up).T).chunk(2, dim=-1)
            h = (gate * torch.sigmoid(gate) * up) @ block_gemv.dequantize(layer.down).T
        return norm(residual + h, self.final_norm), k_pages, v_pages


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


SHAPES = [
    # hidden, heads, kv heads, head_dim, rotary_dim, intermediate: GQA groups of 2 and 3, one without GQA
    decode_stack.StackShape(64, 4, 2, 16, 16, 96, EPS, 16 ** -0.5),
    decode_stack.StackShape(96, 6, 2, 16, 8, 160, EPS, 0.2),            # partial rotary
    decode_stack.StackShape(128, 4, 4, 32, 32, 256, EPS, 32 ** -0.5),
]


@pytest.mark.parametrize("shape", SHAPES, ids=["gqa2", "gqa3-partial-rotary", "mha"])
@pytest.mark.parametrize("lens", [[37], [15, 16, 17, 33, 100, 1, 47, 64]], ids=["one-row", "eight-rows"])
@pytest.mark.parametrize("page_dtype", [torch.float32, torch.bfloat16], ids=["float32-pages", "bf16-pages"])
def test_matches_float64_reference(shape, lens, page_dtype):
    case = Case(shape, num_layers=3, lens=lens, seed=len(lens) + shape.hidden, page_dtype=page_dtype)
    expected, k_pages, v_pages = case.reference()
    out = case.stack().run(case.hidden, case.positions, case.slots, case.tables, case.lens)
    err = rel_err(out, expected)
    width = shape.num_kv_heads * shape.head_dim
    page_err = max(rel_err(layer.k_cache.view(-1, width)[case.slots], ref.view(-1, width)[case.slots])
                   for layer, ref in zip(case.layers, k_pages, strict=True))
    print(f"{shape} x {len(lens)} rows, {page_dtype} pages: hidden rel. error {err:.1e}, stored K {page_err:.1e}")
    # bf16 pages: a stored row may round the other way where float32 rounding moved it across a half step
    assert err < 1e-5 and page_err < (1e-6 if page_dtype == torch.float32 else 1e-3)
    tol = 1e-6 if page_dtype == torch.float32 else 8e-3
    for layer, kc, vc in zip(case.layers, k_pages, v_pages, strict=True):   # nothing else in the pages moved
        assert torch.allclose(layer.k_cache.double(), kc, rtol=tol, atol=tol, equal_nan=True)
        assert torch.allclose(layer.v_cache.double(), vc, rtol=tol, atol=tol, equal_nan=True)


@pytest.mark.skipif(not decode_stack.int16_inputs_available(), reason="no AVX2 / F16C in this build")
@pytest.mark.parametrize("shape", SHAPES, ids=["gqa2", "gqa3-partial-rotary", "mha"])
def test_int16_inputs_follow_the_float64_reference(shape):
    """The products' inputs rounded to 16 bits per group: the step's rows within that rounding of float64's,
    and far enough from the float32 products' rows that this is the other path."""
    lens = [15, 16, 17, 33, 100, 1, 47, 64]
    exact = Case(shape, num_layers=3, lens=lens, seed=7 + shape.hidden)
    rounded = Case(shape, num_layers=3, lens=lens, seed=7 + shape.hidden)
    expected, k_pages, _ = exact.reference()
    float32_err = rel_err(exact.stack().run(exact.hidden, exact.positions, exact.slots, exact.tables, exact.lens),
                          expected)
    out = rounded.stack(int16_inputs=True).run(rounded.hidden, rounded.positions, rounded.slots, rounded.tables,
                                               rounded.lens)
    err = rel_err(out, expected)
    width = shape.num_kv_heads * shape.head_dim
    page_err = max(rel_err(layer.k_cache.view(-1, width)[rounded.slots], ref.view(-1, width)[rounded.slots])
                   for layer, ref in zip(rounded.layers, k_pages, strict=True))
    print(f"{shape}: hidden rel. error {err:.1e} (float32 inputs {float32_err:.1e}), stored K {page_err:.1e}")
    assert err < 2e-4 and page_err < 2e-4
    assert err > 3 * float32_err and page_err > 1e-5   # float32 inputs store K within 1e-6 (the test above)


def test_threads_give_the_same_rows():
    case = Case(SHAPES[0], num_layers=2, lens=[300, 17, 700], seed=4)
    first = case.stack().run(case.hidden, case.positions, case.slots, case.tables, case.lens, num_threads=1)
    again = case.stack().run(case.hidden, case.positions, case.slots, case.tables, case.lens, num_threads=2)
    assert torch.allclose(first, again, rtol=1e-6, atol=1e-6)


def test_a_row_with_slot_minus_one_stores_nothing():
    case = Case(SHAPES[0], num_layers=2, lens=[20, 40], seed=5)
    before = [layer.k_cache.clone() for layer in case.layers]
    slots = case.slots.clone()
    slots[1] = -1
    case.stack().run(case.hidden, case.positions, slots, case.tables, case.lens)
    for layer, old in zip(case.layers, before, strict=True):
        changed = ~((layer.k_cache == old) | (layer.k_cache.isnan() & old.isnan()))
        rows = changed.any(-1).any(-1).view(-1).nonzero().flatten().tolist()
        assert rows == [int(case.slots[0])]


def test_refuses_what_it_cannot_take():
    case = Case(SHAPES[0], num_layers=1, lens=[10, 20], seed=6)
    stack = case.stack()
    run = stack.run
    short = decode_stack.DecodeStack(case.shape, case.layers, case.final_norm, case.cos[:15].contiguous(),
                                     case.sin[:15].contiguous())
    with pytest.raises(ValueError, match="position outside the RoPE tables"):
        short.run(case.hidden, case.positions, case.slots, case.tables, case.lens)
    with pytest.raises(ValueError, match="length other than position"):
        run(case.hidden, case.positions, case.slots, case.tables, case.lens - 1)
    with pytest.raises(ValueError, match="slot outside"):
        run(case.hidden, case.positions, case.slots + 10 ** 6, case.tables, case.lens)
    bad = case.tables.clone()
    bad[0, 0] = stack.num_blocks
    with pytest.raises(ValueError, match="outside"):
        run(case.hidden, case.positions, case.slots, bad, case.lens)
    with pytest.raises(ValueError, match="float32 rows"):
        run(torch.zeros(9, SHAPES[0].hidden), case.positions, case.slots, case.tables, case.lens)
    with pytest.raises(ValueError, match="qkv"):
        layer = case.layers[0]
        decode_stack.DecodeStack(SHAPES[0], [decode_stack.StackLayerWeights(
            layer.input_norm, layer.post_norm, layer.o, layer.o, layer.gate_up, layer.down, layer.k_cache,
            layer.v_cache)], case.final_norm, case.cos, case.sin)
