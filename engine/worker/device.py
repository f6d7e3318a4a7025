"""Which device and dtype the engine runs on, from `[backend] gpu_vendor` and `[model] dtype`."""
from __future__ import annotations

import torch

from engine.config import ConfigError
from engine.worker.cpu_probe import probe_cpu_dtype
from kernels.vendor import detect_vendor


def select_device(gpu_vendor: str) -> tuple[torch.device, str]:
    """The device for `gpu_vendor`; a vendor the hardware contradicts is a startup error."""
    found = detect_vendor()
    if gpu_vendor == "auto":
        gpu_vendor = found
    if gpu_vendor != found and gpu_vendor != "cpu":
        raise ConfigError(f"backend.gpu_vendor: '{gpu_vendor}' was requested but this machine has "
                          f"{'no GPU' if found == 'cpu' else 'a ' + found + ' GPU'}; "
                          f"set gpu_vendor = \"auto\" or \"{found}\"")
    return (torch.device("cuda") if gpu_vendor in ("nvidia", "amd") else torch.device("cpu")), gpu_vendor


def select_dtype(requested: str, device: torch.device, model_dtype: torch.dtype | None, *,
                 cpu_weight_dtype: str = "auto") -> torch.dtype:
    """`[model] dtype` when set; on CPU otherwise `[backend] cpu_weight_dtype` ("auto": bfloat16 where
    the startup probe finds its matmuls fast, else float32; "int4": bf16 activations for the int4 decode
    weights); on GPU the model's half type, bf16 by default."""
    if requested != "auto":
        return getattr(torch, requested)
    if device.type == "cpu":
        if cpu_weight_dtype == "auto":
            return probe_cpu_dtype()
        return torch.bfloat16 if cpu_weight_dtype == "int4" else getattr(torch, cpu_weight_dtype)
    return torch.float16 if model_dtype == torch.float16 else torch.bfloat16


# `[backend] kv_cache_dtype` -> the pages' dtype: OCP FP8 on NVIDIA and the CPU, the fnuz
# variants (no negative zero, bias one higher) that MI300-class GPUs compute in on AMD.
_FP8 = {("fp8_e4m3", False): torch.float8_e4m3fn, ("fp8_e5m2", False): torch.float8_e5m2,
        ("fp8_e4m3", True): torch.float8_e4m3fnuz, ("fp8_e5m2", True): torch.float8_e5m2fnuz}


def select_kv_dtype(kv_cache_dtype: str, dtype: torch.dtype, vendor: str) -> torch.dtype:
    """The KV pages' dtype: the model's `dtype` for "auto"; bfloat16 (a bf16 model's own, or a float32 model's
    on the CPU, whose kernels widen pages as they read them); else the FP8 format for `vendor`."""
    if kv_cache_dtype == "auto":
        return dtype
    if kv_cache_dtype == "bfloat16":
        if dtype != torch.bfloat16 and not (dtype == torch.float32 and vendor == "cpu"):
            raise ConfigError(f'backend.kv_cache_dtype = "bfloat16" takes a bfloat16 model, or a float32 one on '
                              f'the CPU; this model runs {str(dtype).removeprefix("torch.")} on {vendor}: set '
                              '"auto"')
        return torch.bfloat16
    return _FP8[(kv_cache_dtype, vendor == "amd")]
