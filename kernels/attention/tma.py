"""TMA bulk copies of K/V tiles on NVIDIA Hopper and later: whether the GPU has them, and the caches'
tensor descriptors. A tile is `block_n` consecutive rows of one page, so a descriptor over the caches
viewed as [blocks * PAGE, Hkv * D] rows reaches any page's tile by its first row."""
from __future__ import annotations

import functools

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels.vendor import interpreting


@functools.cache
def _has_tma(device_index: int | None) -> bool:
    """An NVIDIA GPU of compute capability 9.0+ (asked once per device, not per layer call)."""
    return not torch.version.hip and torch.cuda.get_device_capability(device_index)[0] >= 9


def has_tma(device: torch.device) -> bool:
    """Whether kernels on `device` can take TMA descriptors: a compute 9.0+ NVIDIA GPU, or the interpreter."""
    return interpreting() or (device.type == "cuda" and _has_tma(device.index))


def tma_descriptors(k_cache: torch.Tensor, v_cache: torch.Tensor, block_n: int,
                    enabled: bool) -> tuple[TensorDescriptor, TensorDescriptor] | None:
    """Tensor descriptors [blocks * PAGE, Hkv * D] of the caches when the config asks for TMA and
    the layout allows it: KV tiles that never straddle a page, contiguous caches, and a GPU with
    the copy engine (compute capability 9.0+) or the interpreter."""
    page, num_kv_heads, head_dim = k_cache.shape[1:]
    if not enabled or page % block_n or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return None
    if not has_tma(k_cache.device):
        return None
    rows = k_cache.shape[0] * page
    return tuple(TensorDescriptor(c.view(rows, num_kv_heads * head_dim), [rows, num_kv_heads * head_dim],
                                  [num_kv_heads * head_dim, 1], [block_n, head_dim])
                 for c in (k_cache, v_cache))  # type: ignore[return-value]
