"""Which device and dtype the engine runs on, from `[backend] gpu_vendor` and `[model] dtype`."""
from __future__ import annotations

import torch

from engine.config import ConfigError
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


def select_dtype(requested: str, device: torch.device, model_dtype: torch.dtype | None) -> torch.dtype:
    """float32 on CPU (no bf16 units on most CPUs); on GPU the model's half type, bf16 by default."""
    if requested != "auto":
        return getattr(torch, requested)
    if device.type == "cpu":
        return torch.float32
    return torch.float16 if model_dtype == torch.float16 else torch.bfloat16
