"""Host values onto the device without waiting for it.

`torch.tensor(values, device="cuda")` copies from pageable memory, and torch then synchronizes the
stream: the host waits for every kernel already queued, so the GPU idles while the host builds the
next step. Staged through pinned memory, the copy is queued behind those kernels instead (torch's
pinned allocator keeps the staging buffer until the copy has run).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence[int] | Sequence[Sequence[int]], dtype: torch.dtype, device: torch.device,
              asynchronous: bool = True) -> torch.Tensor:
    """`values` as a tensor on `device`: through pinned memory without a stream sync when that is a CUDA
    device and `asynchronous`, else the plain (synchronizing) copy."""
    if device.type != "cuda" or not asynchronous:
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def host_to_device(tensor: torch.Tensor, device: torch.device, asynchronous: bool = True) -> torch.Tensor:
    """A host tensor on `device`, as `to_device` does it (a pinned `tensor` is not staged again)."""
    if device.type != "cuda" or not asynchronous:
        return tensor.to(device)
    return (tensor if tensor.is_pinned() else tensor.pin_memory()).to(device, non_blocking=True)
