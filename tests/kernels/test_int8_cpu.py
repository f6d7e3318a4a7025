"""The CPU int8 weight-only matmul against its float32 reference: odd token counts, rows of very
different magnitudes and an all-zero row; the codes are the weight to within half a step."""
from __future__ import annotations

import pytest
import torch

from kernels.gemm.int8_cpu import MAX_CODE, int8_linear, int8_linear_ref, pack_int8


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def weight(n: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * torch.logspace(-3, 1, n)[:, None]   # row scales 1e-3 .. 10
    w[n // 2] = 0.0
    return w


@pytest.mark.parametrize("shape", [(96, 64), (208, 576), (49, 33)])
def test_codes_are_the_weight_to_half_a_step(shape):
    w = weight(*shape, seed=shape[0])
    packed = pack_int8(w)
    assert packed.codes.dtype == torch.int8 and int(packed.codes.abs().max()) <= MAX_CODE
    step = packed.scales.float()[:, None]
    error = (packed.codes.float() * step - w).abs()
    assert bool((error <= 0.5 * step + 1e-6 * w.abs()).all())
    assert not packed.codes[shape[0] // 2].any()


@pytest.mark.parametrize("tokens", [1, 3, 4, 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_matches_its_reference(tokens, dtype):
    w = weight(208, 576, seed=tokens)
    packed = pack_int8(w)
    x = torch.randn(tokens, 576, generator=torch.Generator().manual_seed(100 + tokens)).to(dtype)
    out = int8_linear(x, packed)
    assert out.dtype == dtype and out.shape == (tokens, 208)
    err = rel_err(out, int8_linear_ref(x, packed))
    assert err < 1e-2, f"rel. error {err:.2e}"   # bf16 activations and outputs: ~2e-3
    dense = torch.nn.functional.linear(x.float(), w)
    assert rel_err(out, dense) < 2e-2            # and the quantization itself: about 1 % of a row's max
