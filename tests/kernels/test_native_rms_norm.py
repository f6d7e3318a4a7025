"""The C++ bf16 RMSNorm against the torch form it replaces on the CPU (`engine.model.layers.RMSNorm`):
the residual sum bit for bit, the output nearly always equal and otherwise off by the weight times
one bf16 step of x / rms (the sum of squares is ordered differently): within two steps of the output."""
from __future__ import annotations

import pytest
import torch

from kernels.native.rms_norm import rms_norm_bf16, takes


def torch_form(x, weight, eps, residual=None):
    if residual is not None:
        x = x + residual
    xf = x.float()
    out = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return out if residual is None else (out, x)


def within_two_steps(a: torch.Tensor, b: torch.Tensor) -> bool:
    step = torch.finfo(torch.bfloat16).eps * torch.maximum(a.float().abs(), b.float().abs())
    step = 2 * step
    return bool(((a.float() - b.float()).abs() <= step).all())


@pytest.mark.parametrize("rows", [1, 7, 63, 64, 300])
@pytest.mark.parametrize("hidden", [576, 64, 100])
def test_matches_the_torch_form(rows, hidden):
    gen = torch.Generator().manual_seed(rows * 1000 + hidden)
    wide = (torch.randn(rows, hidden + 32, generator=gen) * 3).bfloat16()
    x = wide[:, 16:16 + hidden]                       # a strided view, as a fused projection's slice is
    residual = torch.randn(rows, hidden, generator=gen).bfloat16()
    weight = torch.randn(hidden, generator=gen).bfloat16()
    out, summed = rms_norm_bf16(x, weight, 1e-5, residual)
    expected, expected_sum = torch_form(x, weight, 1e-5, residual)
    assert torch.equal(summed, expected_sum)
    assert within_two_steps(out, expected) and float((out != expected).float().mean()) < 1e-2
    alone = rms_norm_bf16(x, weight, 1e-5)
    assert within_two_steps(alone, torch_form(x, weight, 1e-5))


def test_refuses_what_it_does_not_take():
    x = torch.randn(2, 64)
    assert not takes(x, torch.ones(64)) and not takes(x.bfloat16().t(), torch.ones(2).bfloat16())
    with pytest.raises(ValueError, match="bf16"):
        rms_norm_bf16(x, torch.ones(64), 1e-5)
    with pytest.raises(ValueError, match="residual"):
        rms_norm_bf16(x.bfloat16(), torch.ones(64).bfloat16(), 1e-5, torch.ones(3, 64).bfloat16())
