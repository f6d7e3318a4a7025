"""`[flashdecoding]` -> the attention backend the engine runs.

  enable = false, or kernel = "flash"  -> DenseBackend (standard / flash / fdpp)
  kernel = "ffd"                       -> FFDBackend, compact K cache
  kernel = "auto"                      -> FFDBackend with a Flash-Decoding DenseBackend for steps below
                                          the crossover; DenseBackend alone where FFD was measured never faster
"""
from __future__ import annotations

import logging

import torch

from engine.attention.backend import AttentionBackend
from engine.attention.dense import DenseBackend
from engine.attention.ffd import NEVER, FFDBackend, check_ffd_device, crossover_for
from engine.config import BackendConfig, CpuAttention, FlashDecodingConfig, KvCacheDtype, PrefillPrefix
from kernels.vendor import check_vendor

logger = logging.getLogger(__name__)

_LIMITS = BackendConfig()


def make_attention_backend(fd: FlashDecodingConfig, device: torch.device, gpu_vendor: str, *,
                           max_num_seqs: int = _LIMITS.max_num_seqs,
                           max_num_batched_tokens: int = _LIMITS.max_num_batched_tokens,
                           calibration_path: str | None = None, crossover: int | None = None,
                           cpu_attention: CpuAttention = _LIMITS.cpu_attention,
                           kv_cache_dtype: KvCacheDtype = _LIMITS.kv_cache_dtype,
                           prefill_prefix: PrefillPrefix = _LIMITS.prefill_prefix) -> AttentionBackend:
    """Build the backend for `fd` on `device` with `[backend] gpu_vendor`; `max_num_seqs` and
    `max_num_batched_tokens` size FFD's pool of exact K pages; `crossover` overrides the stored
    FFD crossover (tests); `cpu_attention` picks the CPU's dense attention (`DenseBackend`);
    `kv_cache_dtype` other than "auto" (FP8 or bf16 pages) is read by the dense kernels only; `prefill_prefix`
    says whether the dense prefill attends long cached prefixes through cuDNN first.

    Raises ValueError for a vendor the hardware contradicts, a vendor that contradicts the
    device, a kernel this GPU cannot run (FFD on AMD), an "auto" crossover measured nowhere, or
    fixed_max_value = true without a calibration file.
    """
    vendor = check_vendor(gpu_vendor)
    if (device.type == "cuda") != (vendor in ("nvidia", "amd")):
        raise ValueError(f"gpu_vendor {vendor!r} does not match the device {device}")
    if not (fd.enable and fd.kernel in ("ffd", "auto")):
        return DenseBackend(fd, device, vendor, calibration_path=calibration_path, cpu_attention=cpu_attention,
                            prefill_prefix=prefill_prefix)
    check_ffd_device(device, vendor, fd.kernel)
    if kv_cache_dtype != "auto":
        raise ValueError(f"[backend] kv_cache_dtype = {kv_cache_dtype!r} is read by the dense kernels only; "
                         f"[flashdecoding] kernel = {fd.kernel!r} (FFD) keeps its own 2-bit key format: set "
                         "kv_cache_dtype = \"auto\" or kernel = \"flash\"")
    min_len, dense = 0, None
    if fd.kernel == "auto":
        min_len = crossover if crossover is not None else crossover_for(device, fd.ffd_crossover_tokens)
        flash = fd.model_copy(update={"kernel": "flash"})
        if min_len >= NEVER:   # measured: FFD never wins here, so "auto" is plain Flash-Decoding
            logger.info("[flashdecoding] kernel = \"auto\": FFD was never faster than Flash-Decoding on this GPU "
                        "when measured (kernels/ffd/crossover.json); running kernel = \"flash\"")
            return DenseBackend(flash, device, vendor, cpu_attention=cpu_attention, prefill_prefix=prefill_prefix)
        dense = DenseBackend(flash.model_copy(update={"async_softmax": False}), device, vendor,
                             cpu_attention=cpu_attention, prefill_prefix=prefill_prefix)
    backend = FFDBackend(fd, device, min_ffd_len=min_len, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=max_num_batched_tokens, dense=dense)
    logger.info("attention: %s", backend.name)
    return backend
