"""The C++ float32 block-weight product (`kernels/native/block_gemv.cpp`) against float64 over its dequantized
weight: fresh random codes, scales, biases and inputs, 4-bit and 8-bit codes, 1 to 8 rows, odd tile counts, K of
one group to many, groups of 32 and 64; rows read with a stride; the build without F16C (scalar half widening);
and what it refuses."""
from __future__ import annotations

import platform

import pytest
import torch

from kernels.native import block_gemv
from kernels.native.build import FLAGS, NativeBuildError


def _reason() -> str | None:
    try:
        return block_gemv.unsupported(block_gemv.rows_per_tile(), 32, 4, 32)
    except NativeBuildError as err:
        return str(err)


pytestmark = pytest.mark.skipif(_reason() is not None, reason=f"C++ block kernel: {_reason()}")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


def random_weight(n: int, k: int, bits: int, group_size: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (n, k), generator=gen)
    scale = torch.rand(n, k // group_size, generator=gen) * 0.02 + 1e-3
    bias = torch.randn(n, k // group_size, generator=gen) * 0.05
    return codes, scale, bias


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("tiles, k, group_size", [(1, 32, 32), (3, 96, 32), (9, 576, 32), (15, 1536, 32),
                                                  (5, 192, 64), (2, 64, 64), (3, 96, 48)])
def test_matches_float64_over_its_weight(bits, tiles, k, group_size):
    n = tiles * block_gemv.rows_per_tile()
    codes, scale, bias = random_weight(n, k, bits, group_size, seed=n + k + bits)
    weight = block_gemv.pack(codes, scale, bias, bits, group_size)
    expected = (codes.double() * scale.half().double().repeat_interleave(group_size, dim=1)
                + bias.half().double().repeat_interleave(group_size, dim=1))
    assert torch.equal(block_gemv.dequantize(weight), expected)
    errors = []
    for rows in range(1, block_gemv.MAX_ROWS + 1):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        errors.append(rel_err(block_gemv.block_gemv(x, weight), x.double() @ expected.T))
    print(f"{bits}-bit [{n} x {k}], groups of {group_size}: rel. error over 1..8 rows {min(errors):.1e} .. "
          f"{max(errors):.1e}")
    assert max(errors) < 1e-5


def test_threads_give_the_same_rows():
    codes, scale, bias = random_weight(24 * block_gemv.rows_per_tile(), 256, 4, 32, seed=1)
    weight = block_gemv.pack(codes, scale, bias, 4, 32)
    x = torch.randn(3, 256)
    assert torch.equal(block_gemv.block_gemv(x, weight, num_threads=1), block_gemv.block_gemv(x, weight, num_threads=2))


def test_rows_with_a_stride_are_read_in_place():
    codes, scale, bias = random_weight(2 * block_gemv.rows_per_tile(), 64, 8, 32, seed=3)
    weight = block_gemv.pack(codes, scale, bias, 8, 32)
    x = torch.randn(3, 100)[:, 10:74]
    assert x.stride(0) == 100
    assert torch.equal(block_gemv.block_gemv(x, weight), block_gemv.block_gemv(x.contiguous(), weight))


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="an x86 instruction-set level")
def test_builds_without_f16c():
    """x86-64-v2 has no F16C (nor AVX): the half scales are widened one by one, the vectors are SSE."""
    flags = tuple("-march=x86-64-v2" if flag == "-march=native" else flag for flag in FLAGS)
    lib = block_gemv.library(flags)
    assert lib.block_gemv_isa() == b"no wide vectors" and lib.block_gemv_rows() == block_gemv.rows_per_tile()
    codes, scale, bias = random_weight(3 * block_gemv.rows_per_tile(), 128, 4, 32, seed=5)
    weight = block_gemv.pack(codes, scale, bias, 4, 32)
    x = torch.randn(2, 128)
    out = torch.empty(2, weight.out_features)
    assert lib.block_gemv(x.data_ptr(), 128, 2, 128, 4, weight.codes.data_ptr(), weight.scale_bias.data_ptr(),
                          weight.out_features, 32, out.data_ptr(), 1) == 0
    assert rel_err(out, x.double() @ block_gemv.dequantize(weight).T) < 1e-5


def test_refuses_what_it_cannot_take():
    rows = block_gemv.rows_per_tile()
    codes, scale, bias = random_weight(2 * rows, 64, 4, 32, seed=1)
    weight = block_gemv.pack(codes, scale, bias, 4, 32)
    with pytest.raises(ValueError, match="rows a call"):
        block_gemv.block_gemv(torch.zeros(9, 64), weight)
    with pytest.raises(ValueError, match="float32 CPU x"):
        block_gemv.block_gemv(torch.zeros(1, 64, dtype=torch.bfloat16), weight)
    with pytest.raises(ValueError, match="float32 CPU x"):
        block_gemv.block_gemv(torch.zeros(1, 32), weight)
    with pytest.raises(ValueError, match="output features"):
        block_gemv.pack(codes[:rows + 1], scale[:rows + 1], bias[:rows + 1], 4, 32)
    with pytest.raises(ValueError, match="groups of"):
        block_gemv.pack(codes[:, :40], scale[:, :1], bias[:, :1], 4, 40)
    with pytest.raises(ValueError, match=r"\[0, 15\]"):
        block_gemv.pack(codes + 1, scale, bias, 4, 32)
    with pytest.raises(ValueError, match="4 or 8"):
        block_gemv.pack(codes, scale, bias, 3, 32)


def int16_rounded(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """x as the 16-bit input kernel rounds it: per group, the largest |x| to 32767 (float64 of those integers)."""
    groups = x.float().reshape(x.shape[0], -1, group_size)
    largest = groups.abs().amax(-1, keepdim=True)
    levels = torch.full_like(largest, 32767.0)
    inverse = torch.where(largest > 0, levels / largest, torch.zeros_like(largest))   # a float32 division
    return (torch.round(groups * inverse).double() * (largest / levels).double()).reshape(x.shape)


int16_only = pytest.mark.skipif(not block_gemv.int16_inputs_available(), reason="no AVX2 / F16C in this build")


@int16_only
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("tiles, k, group_size", [(1, 32, 32), (3, 96, 32), (9, 576, 32), (15, 1536, 32),
                                                  (5, 192, 64), (2, 64, 64), (3, 96, 48), (2, 256, 256)])
def test_int16_inputs_match_float64_over_the_rounded_inputs(bits, tiles, k, group_size):
    """Against float64 over the same 16-bit inputs (the codes' part; c meets the float32 inputs' sum), the
    products are exact up to float32 sums; against the unrounded inputs the rounding shows (a relative step of
    2^-15 a group), so the first check is not vacuous."""
    n = tiles * block_gemv.rows_per_tile()
    codes, scale, bias = random_weight(n, k, bits, group_size, seed=3 * n + k + bits)
    weight = block_gemv.pack(codes, scale, bias, bits, group_size)
    dense = block_gemv.dequantize(weight)
    bias_part = bias.half().double().repeat_interleave(group_size, dim=1)
    errors, rounding = [], []
    for rows in range(1, block_gemv.MAX_ROWS + 1):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(100 + rows)) * 3
        out = block_gemv.block_gemv(x, weight, int16_inputs=True)
        errors.append(rel_err(out, int16_rounded(x, group_size) @ (dense - bias_part).T + x.double() @ bias_part.T))
        rounding.append(rel_err(out, x.double() @ dense.T))
    print(f"{bits}-bit [{n} x {k}], groups of {group_size}: against the rounded inputs {max(errors):.1e}, "
          f"against float32's inputs {min(rounding):.1e} .. {max(rounding):.1e}")
    assert max(errors) < 1e-6
    assert 2e-6 < min(rounding) and max(rounding) < 2e-4


@int16_only
def test_int16_inputs_keep_nan_and_zero_groups():
    """A group holding a NaN or infinity gives NaN rows, as float32 would; an all-zero group adds nothing."""
    codes, scale, bias = random_weight(2 * block_gemv.rows_per_tile(), 128, 4, 32, seed=7)
    weight = block_gemv.pack(codes, scale, bias, 4, 32)
    x = torch.randn(3, 128)
    x[1, 40], x[2, 70] = float("nan"), float("inf")
    x[0, 32:64] = 0.0
    out = block_gemv.block_gemv(x, weight, int16_inputs=True)
    assert bool(out[1:].isnan().all())
    assert rel_err(out[:1], x[:1].double() @ block_gemv.dequantize(weight).T) < 2e-4


@int16_only
def test_int16_inputs_threads_and_refusals():
    rows = block_gemv.rows_per_tile()
    codes, scale, bias = random_weight(24 * rows, 512, 8, 32, seed=11)
    weight = block_gemv.pack(codes, scale, bias, 8, 32)
    x = torch.randn(5, 512)
    assert torch.equal(block_gemv.block_gemv(x, weight, num_threads=1, int16_inputs=True),
                       block_gemv.block_gemv(x, weight, num_threads=2, int16_inputs=True))
    codes, scale, bias = random_weight(rows, 512, 8, 512, seed=12)
    too_long = block_gemv.pack(codes, scale, bias, 8, 512)   # 32-bit sums would overflow past 256 inputs
    assert block_gemv.block_gemv(x, too_long).shape == (5, rows)
    with pytest.raises(ValueError, match="refused"):
        block_gemv.block_gemv(x, too_long, int16_inputs=True)


def test_tiles_of_16_rows_as_avx512_builds_make_them():
    """AVX-512 builds tile 16 output rows; the 16-bit input kernel reads them as two runs of 8. A build with that
    tile width on this CPU (`-DBLOCKS_W=16`) checks both kernels over that layout."""
    lib = block_gemv.library((*FLAGS, "-DBLOCKS_W=16"))
    assert lib.block_gemv_rows() == 16
    for bits in (4, 8):
        codes, scale, bias = random_weight(3 * 16, 96, bits, 32, seed=20 + bits)
        weight = block_gemv.pack(codes, scale, bias, bits, 32, rows=16)
        assert weight.codes.shape[-1] == 16
        dense = block_gemv.dequantize(weight)
        bias_part = bias.half().double().repeat_interleave(32, dim=1)
        x = torch.randn(5, 96)
        entries = [(lib.block_gemv, x.double() @ dense.T, 1e-5)]
        if lib.block_gemv_int16_inputs_available():
            entries.append((lib.block_gemv_int16_inputs,
                            int16_rounded(x, 32) @ (dense - bias_part).T + x.double() @ bias_part.T, 1e-6))
        for entry, expected, tolerance in entries:
            out = torch.empty(5, weight.out_features)
            assert entry(x.data_ptr(), 96, 5, 96, bits, weight.codes.data_ptr(), weight.scale_bias.data_ptr(),
                         weight.out_features, 32, out.data_ptr(), 2) == 0
            assert rel_err(out, expected) < tolerance
