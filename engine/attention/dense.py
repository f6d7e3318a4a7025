"""`[flashdecoding]` -> the attention functions a step runs (`engine.attention.layer.AttentionBackend`).

The switches map one to one onto a decode variant; nothing falls back silently to another
algorithm:

  enable = false                          -> "standard": one pass over each sequence's KV
  kernel = "flash", async_softmax = false -> "flash": split-KV + exact log-sum-exp merge
  kernel = "flash", async_softmax = true  -> "fdpp": unified max φ, partials summed
      fixed_max_value = true   φ per layer from the `fdserve calibrate` file
      fixed_max_value = <num>  φ forced to that number (scaled-score units) for every layer
      fixed_max_value = false  φ estimated per step from the sink + local-window tokens

On a GPU every choice runs our Triton kernels; on the CPU the torch reference of the same
algorithm (split and merge, unified max). `backend.name` says exactly which.

FD++ range checks go into the step's `counters` (summed by the engine, exported by /metrics):
`fdpp_rows_checked` (a float) and `fdpp_fallback_rows`. On the GPU the latter is a 0-d device
tensor the kernels add to atomically, zeroed at layer 0 of each step: reading it never syncs
inside the step, and a captured CUDA graph keeps both the zeroing and the counting.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch

from engine.attention.layer import AttentionBackend
from kernels.attention import reference
from kernels.vendor import check_vendor, vendor_configs

logger = logging.getLogger(__name__)

# CPU stand-in for the GPU's wave heuristic: enough splits that "flash" really splits.
CPU_MAX_SPLITS = 8


@dataclass
class KernelAttentionBackend(AttentionBackend):
    """An AttentionBackend that also says which decode variant it runs."""

    variant: str = "standard"


def _decode_variant(fd: Any) -> str:
    if not fd.enable:
        return "standard"
    if fd.kernel != "flash":
        raise ValueError(f"[flashdecoding] kernel = {fd.kernel!r} is not provided by this backend "
                         "(only the dense kernels are built here); set kernel = \"flash\"")
    return "fdpp" if fd.async_softmax else "flash"


def _phi_source(fd: Any, calibration_path: str | None) -> tuple[Callable[[int], float | None], str]:
    """(layer_idx -> φ or None to estimate, description)."""
    fixed = fd.fixed_max_value
    if isinstance(fixed, bool) and not fixed:
        return (lambda layer_idx: None), "φ estimated per step from sink + local window"
    if isinstance(fixed, bool):
        path = calibration_path or getattr(fd, "calibration_file", None)
        if not path:
            raise ValueError("[flashdecoding] fixed_max_value = true needs the per-layer φ file written by "
                             "`fdserve calibrate`: set [flashdecoding] calibration_file")
        from engine.tools.calibration import load_phi
        phis = load_phi(path)

        def calibrated(layer_idx: int) -> float:
            if layer_idx >= len(phis):
                raise ValueError(f"calibration file {path} has φ for {len(phis)} layers; layer {layer_idx} "
                                 "asked (re-run `fdserve calibrate` for this model)")
            return phis[layer_idx]
        return calibrated, f"φ per layer from {path} ({len(phis)} layers)"
    value = float(fixed)
    return (lambda layer_idx: value), f"φ forced to {value:g}"


def make_attention_backend(fd: Any, device: torch.device, gpu_vendor: str, *,
                           calibration_path: str | None = None) -> KernelAttentionBackend:
    """Build the backend for `[flashdecoding]` (fd) on `device` with `[backend] gpu_vendor`.

    Raises ValueError for a vendor the hardware contradicts, a vendor that contradicts the
    device, an unsupported kernel, or fixed_max_value = true without a calibration file.
    """
    vendor = check_vendor(gpu_vendor)
    on_gpu = device.type == "cuda"
    if on_gpu != (vendor in ("nvidia", "amd")):
        raise ValueError(f"gpu_vendor {vendor!r} does not match the device {device}")
    # --- FFD (issue 5): kernel = "ffd" | "auto" is built by engine/attention/ffd.py ---
    if fd.enable and fd.kernel in ("ffd", "auto"):
        from engine.attention.ffd import make_ffd_backend
        return make_ffd_backend(fd, device, vendor)  # type: ignore[return-value]
    # --- end FFD ---
    variant = _decode_variant(fd)
    num_splits = int(getattr(fd, "num_splits", 0) or 0)
    fallback = bool(fd.fallback_on_overflow)
    phi_for: Callable[[int], float | None] = lambda layer_idx: None
    phi_text = ""
    if variant == "fdpp":
        phi_for, phi_text = _phi_source(fd, calibration_path)
        if not fallback:
            logger.warning("[flashdecoding] fallback_on_overflow = false: rows whose scores leave φ's safe "
                           "window are NOT recomputed (their output is inaccurate); they are still counted")
    elif fd.enable and (fd.fixed_max_value is not False or not fallback):
        logger.info("[flashdecoding] fixed_max_value / fallback_on_overflow apply to async_softmax only")

    step_stats = torch.zeros(1, dtype=torch.int64, device=device)   # rows flagged in this step
    splits_text = "1 split" if variant == "standard" else (
        f"splits={num_splits}" if num_splits else
        ("splits=wave heuristic" if on_gpu else f"splits<={CPU_MAX_SPLITS}"))

    if on_gpu:
        from kernels import decode_attention, prefill_attention, store_kv
        cfg = vendor_configs(vendor)
        options: dict[str, Any] = {"config": cfg.decode}
        if variant == "fdpp":
            options.update(fallback=fallback, stats=step_stats)

        def decode(q, k_cache, v_cache, block_tables, seq_lens, *, scale, layer_idx, counters):
            extra = {}
            if variant == "fdpp":
                if layer_idx == 0:
                    step_stats.zero_()
                extra["phi"] = phi_for(layer_idx)
                counters["fdpp_rows_checked"] = counters.get("fdpp_rows_checked", 0.0) + q.shape[0] * q.shape[1]
                counters["fdpp_fallback_rows"] = step_stats[0]
            return decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale=scale,
                                    variant=variant, num_splits=num_splits or None, **options, **extra)

        def prefill(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, *, scale):
            return prefill_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                     scale=scale, config=cfg.prefill)

        where = f"triton[{vendor}, block_n={cfg.decode.block_n}]"
        store: Callable[..., None] = store_kv
    else:
        def decode(q, k_cache, v_cache, block_tables, seq_lens, *, scale, layer_idx, counters):
            if variant == "standard":
                return reference.decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, scale=scale)
            extra: dict[str, Any] = {}
            if variant == "fdpp":
                step_stats.zero_()
                extra = {"phi": phi_for(layer_idx), "fallback": fallback, "stats": step_stats}
            out = reference.decode_reference(q, k_cache, v_cache, block_tables, seq_lens, scale=scale,
                                             variant=variant, num_splits=num_splits or CPU_MAX_SPLITS, **extra)
            if variant == "fdpp":
                counters["fdpp_rows_checked"] = counters.get("fdpp_rows_checked", 0.0) + q.shape[0] * q.shape[1]
                counters["fdpp_fallback_rows"] = counters.get("fdpp_fallback_rows", 0.0) + float(step_stats[0])
            return out

        prefill = reference.prefill_attention_ref
        store = reference.store_kv_ref
        where = "torch reference (cpu)"

    title = {"standard": "standard attention (one pass, no split)",
             "flash": "Flash-Decoding split-KV + log-sum-exp merge",
             "fdpp": "FlashDecoding++ async softmax (unified max)"}[variant]
    details = [splits_text]
    if variant == "fdpp":
        details += [phi_text, f"fallback={'on' if fallback else 'off (counted only)'}"]
    store_text = f"{where}, fused with RoPE" if on_gpu else where
    name = f"{where}: {title} ({', '.join(details)}); prefill: {where}; kv store: {store_text}"
    return KernelAttentionBackend(name=name, decode=decode, store_kv=store, prefill=prefill, variant=variant,
                                  fuse_rope_store=on_gpu)
