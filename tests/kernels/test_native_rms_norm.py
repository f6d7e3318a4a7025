"""The C++ RMSNorm against the torch form it stands in for (`rms_norm_torch`): bit for bit on fresh random
bf16 and float32 rows (strided views, residuals, widths off the vector sizes, many rows on threads), the float32 mean of
squares equal to torch's (where a different order of the sum shows), and the startup check that picks the
order: it rejects the width whose order is not torch's."""
from __future__ import annotations

import pytest
import torch

from kernels.native import rms_norm
from kernels.native.build import NativeBuildError


def _reason() -> str | None:
    try:
        rms_norm.library()
    except NativeBuildError as err:
        return str(err)
    return None if rms_norm.torch_order_lanes() is not None else "no lane width matches this torch's sum order"


pytestmark = pytest.mark.skipif(_reason() is not None, reason=f"C++ RMSNorm: {_reason()}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 7, 63, 64, 300])
@pytest.mark.parametrize("hidden", [576, 64, 100, 2048, 5000])
def test_bit_for_bit_the_torch_form(rows, hidden, dtype):
    lanes = rms_norm.torch_order_lanes()
    gen = torch.Generator().manual_seed(rows * 1000 + hidden)
    wide = (torch.randn(rows, hidden + 32, generator=gen) * 3).to(dtype)
    x = wide[:, 16:16 + hidden]                       # a strided view, as a fused projection's slice is
    residual = torch.randn(rows, hidden, generator=gen).to(dtype)
    weight = (torch.randn(hidden, generator=gen) + 1).to(dtype)
    out, summed = rms_norm.rms_norm_rows(x, weight, 1e-5, residual, lanes=lanes)
    expected, expected_sum = rms_norm.rms_norm_torch(x, weight, 1e-5, residual)
    assert torch.equal(summed, expected_sum)
    assert torch.equal(out, expected)
    assert torch.equal(rms_norm.rms_norm_rows(x, weight, 1e-5, lanes=lanes), rms_norm.rms_norm_torch(x, weight, 1e-5))
    if dtype == torch.bfloat16:
        assert torch.equal(rms_norm.mean_of_squares(x, lanes=lanes), x.float().pow(2).mean(-1))


def test_float32_rows_in_the_other_order_differ_from_torch():
    # float32 outputs follow the sum's order too: the check that picks the order would see a wrong one.
    lanes = rms_norm.torch_order_lanes()
    other = next(w for w in rms_norm.LANE_WIDTHS if w != lanes)
    x = torch.randn(50, 576, generator=torch.Generator().manual_seed(2)) * 3
    weight = torch.ones(576)
    expected = rms_norm.rms_norm_torch(x, weight, 1e-5)
    assert torch.equal(rms_norm.rms_norm_rows(x, weight, 1e-5, lanes=lanes), expected)
    assert not torch.equal(rms_norm.rms_norm_rows(x, weight, 1e-5, lanes=other), expected)


def test_the_check_rejects_an_order_that_is_not_torchs():
    lanes = rms_norm.torch_order_lanes()
    other = next(w for w in rms_norm.LANE_WIDTHS if w != lanes)
    assert rms_norm.bit_identical(lanes) and not rms_norm.bit_identical(other)
    x = (torch.randn(50, 576, generator=torch.Generator().manual_seed(1)) * 3).bfloat16()
    mismatched = rms_norm.mean_of_squares(x, lanes=other) != x.float().pow(2).mean(-1)
    print(f"{lanes}-lane order: torch's; {other}-lane order: {int(mismatched.sum())} of 50 means differ")
    assert mismatched.any()


def test_refuses_what_it_does_not_take():
    lanes = rms_norm.torch_order_lanes()
    x = torch.randn(2, 64)
    assert not rms_norm.takes(x, torch.ones(64).bfloat16())
    assert not rms_norm.takes(x.bfloat16().t(), torch.ones(2).bfloat16())
    assert not rms_norm.takes(x.double(), torch.ones(64).double())
    with pytest.raises(ValueError, match="bf16 or float32"):
        rms_norm.rms_norm_rows(x, torch.ones(64).bfloat16(), 1e-5, lanes=lanes)
    with pytest.raises(ValueError, match="residual"):
        rms_norm.rms_norm_rows(x.bfloat16(), torch.ones(64).bfloat16(), 1e-5, torch.ones(3, 64).bfloat16(), lanes=lanes)
    with pytest.raises(ValueError, match="lanes"):
        rms_norm.rms_norm_rows(x.bfloat16(), torch.ones(64).bfloat16(), 1e-5, lanes=4)
