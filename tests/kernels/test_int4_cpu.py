"""The CPU int4 weight-only matmul against its float32 reference: odd token counts, K of several
groups, weights already on a 4-bit grid (their codes come back exactly) and weights that are not."""
from __future__ import annotations

import pytest
import torch

from kernels.gemm.int4_cpu import (
    GROUP_SIZE,
    can_pack,
    dequantize_int4,
    int4_linear,
    int4_linear_ref,
    on_int4_grid,
    pack_int4,
    quantize_int4,
)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def four_bit_weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q4_1-style weight d * q + m per group of 32 (q in [0, 15], both ends present, m near the
    group's -7.5 d as a quantizer of centred weights writes it), and its q."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen)
    q[:, ::GROUP_SIZE], q[:, 1::GROUP_SIZE] = 0, 15
    d = torch.rand(n, k // GROUP_SIZE, 1, generator=gen) * 0.01 + 1e-3
    m = -(7.5 + 0.5 * torch.randn(n, k // GROUP_SIZE, 1, generator=gen)) * d
    w = (d * q.reshape(n, -1, GROUP_SIZE).float() + m).reshape(n, k)
    return w, q


@pytest.mark.parametrize("tokens", [1, 3, 8, 33])
@pytest.mark.parametrize("shape", [(96, 64), (208, 576)])
def test_int4_linear_matches_its_reference(tokens, shape):
    n, k = shape
    gen = torch.Generator().manual_seed(tokens)
    weight = torch.randn(n, k, generator=gen) * 0.05
    codes, _, _ = quantize_int4(weight)
    packed = pack_int4(weight)
    x = torch.randn(tokens, k, generator=gen).bfloat16()
    out = int4_linear(x, packed)
    ref = int4_linear_ref(x, packed, codes)
    assert out.shape == (tokens, n) and out.dtype == torch.bfloat16
    err = rel_err(out, ref)
    assert err < 1e-2, f"rel. error {err:.2e}"
    # The reference is the quantized weight, not the original: int4 rounding is visible against it.
    assert rel_err(ref, x.float() @ weight.t()) > 1e-2


def test_four_bit_weights_keep_their_codes():
    weight, q = four_bit_weight(64, 128, seed=1)
    codes, scale, zero = quantize_int4(weight)
    assert torch.equal(codes, q.to(torch.int32))
    assert on_int4_grid(weight) and on_int4_grid(weight.bfloat16())
    assert not on_int4_grid(torch.randn(64, 128))
    packed = pack_int4(weight)
    back = dequantize_int4(packed, codes)
    assert rel_err(back, weight) < 1e-2          # only scale and zero round to bf16


def test_shapes_the_kernel_cannot_take():
    assert can_pack(torch.zeros(16, 64)) and not can_pack(torch.zeros(16, 40)) and not can_pack(torch.zeros(64))
    assert not can_pack(torch.zeros(8, 64))
    with pytest.raises(ValueError, match="groups of 32"):
        pack_int4(torch.zeros(16, 40))
