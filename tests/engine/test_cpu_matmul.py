"""`[backend] cpu_matmul`: which kernel the int4 / int8 decode weights run, that the C++ one computes the
products torch's kernels compute (the same codes, scales and zeros), and that "native" refuses to start where
it cannot run instead of falling back."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.config import ConfigError, load_config
from engine.model import cpu_weights
from engine.model.cpu_weights import (
    Int4DecodeWeight,
    Int8DecodeWeight,
    NativeInt4DecodeWeight,
    NativeInt8DecodeWeight,
    configure_cpu_weights,
)
from engine.model.layers import ColumnParallelLinear, ParallelLMHead, RowParallelLinear
from kernels.native import int4_gemv

NATIVE = cpu_weights.native_matmul_unsupported("auto") is None


def tiny_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.ModuleDict({"up": ColumnParallelLinear(64, 96, dtype=torch.bfloat16),
                           "down": RowParallelLinear(96, 64, dtype=torch.bfloat16),
                           "head": ParallelLMHead(160, 64, dtype=torch.bfloat16)})
    for p in model.parameters():
        p.data.copy_(torch.randn_like(p, dtype=torch.float32) * 0.05)
    return model


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_torch_is_kept_when_asked():
    model = tiny_model()
    text = configure_cpu_weights(model, "int4", torch.bfloat16, "torch")
    assert isinstance(model["up"].decode_weight, Int4DecodeWeight)
    assert isinstance(model["head"].decode_weight, Int8DecodeWeight)
    assert "torch's kernels" in text


@pytest.mark.skipif(not NATIVE, reason=f"C++ int4 kernel: {cpu_weights.native_matmul_unsupported('auto')}")
@pytest.mark.parametrize("rows", [1, 5, 8, 19])
def test_native_products_equal_torchs_kernels(rows):
    native, ours = tiny_model(), tiny_model()
    assert "C++ (AVX512-BF16)" in configure_cpu_weights(native, "int4", torch.bfloat16, "native")
    configure_cpu_weights(ours, "int4", torch.bfloat16, "torch")
    assert isinstance(native["down"].decode_weight, NativeInt4DecodeWeight)
    assert isinstance(native["head"].decode_weight, NativeInt8DecodeWeight)
    for name, k in (("up", 64), ("down", 96), ("head", 64)):
        x = torch.randn(rows, k).bfloat16()
        a, b = native[name].decode_weight, ours[name].decode_weight
        assert a is not None and b is not None
        out, ref = a(x), b(x)
        assert out.shape == ref.shape and out.dtype == x.dtype
        # both round one float32 result to bf16; they differ only in the order of the float32 sums
        assert rel_err(out, ref) < 4e-3, name
        assert rel_err(a(x.float()).bfloat16(), ref) < 4e-3


def test_native_refuses_to_start_where_it_cannot_run(monkeypatch):
    monkeypatch.setattr(int4_gemv, "unsupported", lambda *args: "the CPU has no AVX512-BF16 dot products")
    with pytest.raises(ValueError, match='cpu_matmul = "native".*AVX512-BF16'):
        configure_cpu_weights(tiny_model(), "int4", torch.bfloat16, "native")
    text = configure_cpu_weights(model := tiny_model(), "int4", torch.bfloat16, "auto")
    assert "torch's kernels (the CPU has no AVX512-BF16 dot products)" in text
    assert isinstance(model["up"].decode_weight, Int4DecodeWeight)


def test_config_rejects_an_unknown_kernel():
    assert load_config(None, {"backend.cpu_matmul": "torch"}).backend.cpu_matmul == "torch"
    with pytest.raises(ConfigError, match="cpu_matmul"):
        load_config(None, {"backend.cpu_matmul": "fast"})


@pytest.mark.skipif(not NATIVE, reason=f"C++ int4 kernel: {cpu_weights.native_matmul_unsupported('auto')}")
def test_a_head_the_kernel_cannot_tile_keeps_torchs_kernel_and_says_so():
    torch.manual_seed(0)
    model = nn.ModuleDict({"head": ParallelLMHead(259, 64, dtype=torch.bfloat16)})   # 259 rows: not tiles of 16
    text = configure_cpu_weights(model, "int4", torch.bfloat16, "native")
    assert isinstance(model["head"].decode_weight, Int8DecodeWeight)
    assert "torch's kernel: 259 output features" in text
