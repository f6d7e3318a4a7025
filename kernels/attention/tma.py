"""TMA bulk copies of K/V tiles on NVIDIA Hopper and later: whether the GPU has them, and the caches'
tensor descriptors. A tile is `block_n` consecutive rows of one page, so a descriptor over the caches
viewed as [blocks * PAGE, Hkv * D] rows reaches any page's tile by its first row."""
from __future__ import annotations

import functools
import weakref

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


DescriptorPair = tuple[TensorDescriptor, TensorDescriptor]

# A layer's caches are the same tensors every step: their descriptors are made once (a layer call would
# otherwise spend ~10 us building them), by the K cache tensor's identity, and dropped with it.
_MADE: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor, int, DescriptorPair]] = {}


def _rows_of(cache: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """The contiguous cache as [rows, width] over its storage, without a reference to the cache tensor itself
    (a view would keep it, and with it the entry of `_MADE`, alive)."""
    flat = torch.empty(0, dtype=cache.dtype, device=cache.device)
    return flat.set_(cache.untyped_storage(), cache.storage_offset(), (rows, width), (width, 1))


def tma_descriptors(k_cache: torch.Tensor, v_cache: torch.Tensor, block_n: int,
                    enabled: bool) -> DescriptorPair | None:
    """Tensor descriptors [blocks * PAGE, Hkv * D] of the caches when the config asks for TMA and
    the layout allows it: KV tiles that never straddle a page, contiguous caches, and a GPU with
    the copy engine (compute capability 9.0+) or the interpreter."""
    page, num_kv_heads, head_dim = k_cache.shape[1:]
    if not enabled or page % block_n or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return None
    if not has_tma(k_cache.device):
        return None
    made = _MADE.get(id(k_cache))
    if made is not None and made[0]() is k_cache and made[1] is v_cache and made[2] == block_n:
        return made[3]
    rows, width = k_cache.shape[0] * page, num_kv_heads * head_dim
    pair: DescriptorPair = tuple(  # type: ignore[assignment]
        TensorDescriptor(_rows_of(c, rows, width), [rows, width], [width, 1], [block_n, head_dim])
        for c in (k_cache, v_cache))
    _MADE[id(k_cache)] = (weakref.ref(k_cache), v_cache, block_n, pair)
    weakref.finalize(k_cache, _MADE.pop, id(k_cache), None)
    return pair
