"""`[backend] cpu_weight_dtype`: explicit choices are kept, "auto" follows the startup matmul probe,
`[model] dtype` overrides both, and GPUs are untouched."""
from __future__ import annotations

import pytest
import torch

from engine.worker import cpu_probe, device
from engine.worker.cpu_probe import MIN_SPEEDUP, faster_dtype
from engine.worker.device import select_dtype

CPU, GPU = torch.device("cpu"), torch.device("cuda")


def test_bfloat16_only_when_clearly_faster():
    assert faster_dtype(MIN_SPEEDUP * 1.0, 1.0) == torch.bfloat16
    assert faster_dtype(MIN_SPEEDUP * 0.99, 1.0) == torch.float32
    assert faster_dtype(1.0, 4.0) == torch.float32          # emulated bf16: slower than float32


def test_the_probe_measures_this_cpu():
    chosen = cpu_probe.probe_cpu_dtype()
    fp32, bf16 = cpu_probe._best_seconds(torch.float32), cpu_probe._best_seconds(torch.bfloat16)
    assert chosen in (torch.float32, torch.bfloat16) and fp32 > 0 and bf16 > 0


@pytest.mark.parametrize("probed", [torch.float32, torch.bfloat16])
def test_auto_follows_the_probe_and_explicit_choices_win(monkeypatch, probed):
    monkeypatch.setattr(device, "probe_cpu_dtype", lambda: probed)
    assert select_dtype("auto", CPU, None) == probed
    assert select_dtype("auto", CPU, None, cpu_weight_dtype="float32") == torch.float32
    assert select_dtype("auto", CPU, None, cpu_weight_dtype="bfloat16") == torch.bfloat16
    assert select_dtype("float16", CPU, None, cpu_weight_dtype="bfloat16") == torch.float16   # [model] dtype
    assert select_dtype("auto", GPU, torch.float16, cpu_weight_dtype="float32") == torch.float16


def test_unknown_values_are_config_errors():
    from engine.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="cpu_weight_dtype"):
        load_config(None, {"backend.cpu_weight_dtype": "int3"})
    with pytest.raises(ConfigError, match="cpu_attention"):
        load_config(None, {"backend.cpu_attention": "fast"})


def test_bfloat16_pages_for_a_float32_model_on_the_cpu_only():
    """`kv_cache_dtype = "bfloat16"`: a bf16 model's own pages anywhere, a float32 model's on the CPU; a GPU's
    kernels read pages in the model's dtype, so a float16 or float32 model there is refused at startup."""
    from engine.config import ConfigError, load_config
    from engine.worker.device import select_kv_dtype

    assert select_kv_dtype("bfloat16", torch.float32, "cpu") == torch.bfloat16
    assert select_kv_dtype("bfloat16", torch.bfloat16, "nvidia") == torch.bfloat16
    assert select_kv_dtype("auto", torch.float32, "cpu") == torch.float32
    for dtype, vendor in ((torch.float16, "nvidia"), (torch.float32, "amd"), (torch.float16, "cpu")):
        with pytest.raises(ConfigError, match='kv_cache_dtype = "bfloat16"'):
            select_kv_dtype("bfloat16", dtype, vendor)
    assert load_config(None, {"backend.kv_cache_dtype": "bfloat16"}).backend.kv_cache_dtype == "bfloat16"
