"""The C++ int4 decode product (`kernels/native/int4_gemv.cpp`) against float64 over its dequantized weight:
fresh random codes, scales and inputs, 1 to 8 rows, row counts that leave partial tile blocks, K of one to
many blocks, groups of 32 to a whole row; its layout against torch's int4 weights; the int8 LM head as two
4-bit planes; and what it refuses."""
from __future__ import annotations

import platform

import pytest
import torch

from kernels.gemm.int4_cpu import dequantize_int4, pack_int4, quantize_int4
from kernels.gemm.int8_cpu import pack_int8
from kernels.native import int4_gemv
from kernels.native.build import NativeBuildError


def _reason() -> str | None:
    try:
        return int4_gemv.unsupported(16, 32, 32)
    except NativeBuildError as err:
        return str(err)


pytestmark = pytest.mark.skipif(_reason() is not None, reason=f"C++ int4 kernel: {_reason()}")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def random_weight(n: int, k: int, group_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen)
    scale = torch.rand(n, k // group_size, generator=gen) * 0.02 + 1e-3
    zero = torch.randn(n, k // group_size, generator=gen) * 0.01
    return codes, scale, zero


def expected_weight(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int) -> torch.Tensor:
    s = scale.bfloat16().double().repeat_interleave(group_size, dim=1)
    z = zero.bfloat16().double().repeat_interleave(group_size, dim=1)
    return (codes.double() - 8) * s + z


@pytest.mark.parametrize("n, k, group_size", [(16, 32, 32), (48, 96, 32), (208, 576, 32), (960, 576, 32),
                                              (80, 1536, 64), (64, 576, 576)])
def test_matches_float64_over_its_weight(n, k, group_size):
    codes, scale, zero = random_weight(n, k, group_size, seed=n + k)
    weight = int4_gemv.pack(codes, scale, zero, group_size)
    ref_weight = expected_weight(codes, scale, zero, group_size)
    assert torch.equal(int4_gemv.dequantize(weight).double(), ref_weight)
    errors = []
    for rows in range(1, int4_gemv.MAX_ROWS + 1):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
        ref = x.double() @ ref_weight.T
        out = int4_gemv.int4_gemv(x, weight, out_dtype=torch.float32)
        errors.append(rel_err(out, ref))
        # the bf16 output is the float32 result rounded to nearest
        assert torch.equal(int4_gemv.int4_gemv(x, weight), out.bfloat16())
    print(f"[{n} x {k}, groups of {group_size}] rel. error over 1..8 rows: {min(errors):.2e} .. {max(errors):.2e}")
    assert max(errors) < 1e-5


def test_rows_with_a_stride_are_read_in_place():
    codes, scale, zero = random_weight(32, 64, 32, seed=3)
    weight = int4_gemv.pack(codes, scale, zero, 32)
    wide = torch.randn(3, 100).bfloat16()
    x = wide[:, 10:74]
    assert x.stride(0) == 100
    assert torch.equal(int4_gemv.int4_gemv(x, weight), int4_gemv.int4_gemv(x.contiguous(), weight))


def test_same_weight_as_torchs_int4_kernel():
    """Packing the codes, scales and zeros that `int4_cpu` quantizes to gives the weight torch's kernel reads."""
    w = torch.randn(96, 576, generator=torch.Generator().manual_seed(5))
    codes, scale, zero = quantize_int4(w)
    ours = int4_gemv.dequantize(int4_gemv.pack(codes, scale, zero, 32))
    assert torch.equal(ours, dequantize_int4(pack_int4(w), codes))


def test_int8_weight_as_two_planes_is_exact():
    w = torch.randn(64, 192, generator=torch.Generator().manual_seed(7))
    int8 = pack_int8(w)
    planes = int4_gemv.pack_int8_as_planes(int8.codes, int8.scales)
    k = w.shape[1]
    deq = int4_gemv.dequantize(planes).double()
    assert torch.equal(deq[:, :k] + deq[:, k:], int8.codes.double() * int8.scales.double()[:, None])
    x = torch.randn(2, k).bfloat16()
    ref = x.double() @ (int8.codes.double() * int8.scales.double()[:, None]).T
    out = int4_gemv.int4_gemv(torch.cat([x, x], dim=1), planes, out_dtype=torch.float32)
    assert rel_err(out, ref) < 1e-5


def test_refuses_what_it_cannot_take():
    codes, scale, zero = random_weight(32, 64, 32, seed=1)
    weight = int4_gemv.pack(codes, scale, zero, 32)
    with pytest.raises(ValueError, match="rows a call"):
        int4_gemv.int4_gemv(torch.zeros(9, 64, dtype=torch.bfloat16), weight)
    with pytest.raises(ValueError, match="bf16 CPU x"):
        int4_gemv.int4_gemv(torch.zeros(1, 64), weight)
    with pytest.raises(ValueError, match="bf16 CPU x"):
        int4_gemv.int4_gemv(torch.zeros(1, 32, dtype=torch.bfloat16), weight)
    with pytest.raises(ValueError, match="output features"):
        int4_gemv.pack(codes[:24], scale[:24], zero[:24], 32)
    with pytest.raises(ValueError, match="groups of"):
        int4_gemv.pack(codes[:, :48], scale[:, :1], zero[:, :1], 48)
    with pytest.raises(ValueError, match=r"\[0, 15\]"):
        int4_gemv.pack(codes + 1, scale, zero, 32)


@pytest.mark.skipif(platform.machine() != "x86_64", reason="an x86 instruction-set level")
def test_without_avx512_bf16_the_build_says_so():
    lib = int4_gemv.library(("-O2", "-march=x86-64-v3", "-fopenmp", "-std=c++17", "-shared", "-fPIC"))
    assert lib.int4_gemv_available() == 0
