"""The dense decode variants of `[flashdecoding]` ("standard", "flash", "fdpp") as one backend.

The switches map one to one onto a decode variant; nothing falls back silently to another
algorithm:

  enable = false                          -> "standard": one pass over each sequence's KV
  kernel = "flash", async_softmax = false -> "flash": split-KV + exact log-sum-exp merge
  kernel = "flash", async_softmax = true  -> "fdpp": unified max φ, partials summed
      fixed_max_value = true   φ per layer from the `fdserve calibrate` file
      fixed_max_value = <num>  φ forced to that number (scaled-score units) for every layer
      fixed_max_value = false  φ estimated per step from the sink + local-window tokens

On a GPU every choice runs our Triton kernels; a prefill chunk over a long cached prefix attends that
prefix through cuDNN first where `[backend] prefill_prefix = "auto"` allows (`kernels.attention.prefix`).
On the CPU `[backend] cpu_attention` picks:
"fused" runs prefill through torch SDPA and "standard" / "flash" decode as one exact pass
(`kernels.attention.cpu`: split-KV is a GPU parallelisation, its merge is exact, so the result is
the same softmax); "native" decodes through the C++ paged kernel instead (`kernels.native`, built
for this CPU when the cache is allocated; its splits are merged exactly too), and prefills through
the C++ kernels (bf16 pages on AVX512-BF16, float32 pages on AVX2 or AVX-512), and for a bf16 or
float32 model sets `fuse_rope_store` (RoPE and the KV store as one C++ call); "auto" (default) is
native where the kernel builds and takes the pages, else fused, and logs why. "fdpp" keeps its
unified-max reference, whose arithmetic differs. "reference" runs the torch reference of every
algorithm (split and merge, unified max). `backend.name` says exactly which.

Per step, `plan` makes one decode plan (`kernels.plan_decode`: split count, workspaces) for a
decode-only step on the GPU; each layer's `decode` runs it (`kernels.run_decode`).

FP8 pages (`[backend] kv_cache_dtype`) hold codes with a K and a V scale per (layer, KV head)
(`engine.attention.kv_scales`), which every store, decode and prefill of the layer is given.

FD++ range checks go into the step's `counters` (summed by the engine, exported by /metrics):
`fdpp_rows_checked` (a float) and `fdpp_fallback_rows`. On the GPU the latter is a 0-d device
tensor the kernels add to atomically, zeroed at layer 0 of each step: reading it never syncs
inside the step, and a captured CUDA graph keeps both the zeroing and the counting.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict

import torch

from engine.attention.backend import AttentionBackend
from engine.attention.kv_cache_spec import KVCacheSpec
from engine.attention.kv_scales import KVScales, kv_scales
from engine.attention.metadata import AttentionPlan, StepShape
from engine.attention.phi_file import load_phi
from engine.config import CpuAttention, FlashDecodingConfig, PrefillPrefix
from kernels import DecodePlan, plan_decode, prefill_attention, run_decode, store_kv
from kernels.attention import cpu, reference
from kernels.attention.decode_host import check_shapes
from kernels.attention.flash_decoding import decode_config
from kernels.attention.kv_quant import is_fp8
from kernels.attention.prefix import (
    PrefixPlan,
    PrefixSeed,
    cudnn_prefix_available,
    plan_prefix,
    prefix_seed,
    prefix_spans,
    warm_up_cudnn,
)
from kernels.attention.tma import has_tma
from kernels.native import rope_store as native_rope
from kernels.native.build import NativeBuildError
from kernels.native.paged_decode import NativeDecodePlan, isa, paged_decode_attention, plan_native_decode
from kernels.native.paged_decode import unsupported as native_unsupported
from kernels.native.paged_prefill import kernel_name as native_prefill_name
from kernels.native.paged_prefill import paged_prefill_attention
from kernels.native.paged_prefill import unsupported as native_prefill_unsupported
from kernels.vendor import DecodeConfig, PrefillConfig, vendor_configs

if TYPE_CHECKING:
    from engine.attention.metadata import AttentionMetadata

logger = logging.getLogger(__name__)

# CPU stand-in for the GPU's wave heuristic: enough splits that "flash" really splits.
CPU_MAX_SPLITS = 8

PhiFor = Callable[[int], "float | None"]   # layer_idx -> φ, or None to estimate it per step

TITLES = {"standard": "standard attention (one pass, no split)",
          "flash": "Flash-Decoding split-KV + log-sum-exp merge",
          "fdpp": "FlashDecoding++ async softmax (unified max)"}


class LayerScales(TypedDict, total=False):
    """The keyword arguments that give a kernel one layer's FP8 scales (empty for other pages)."""

    k_scale: torch.Tensor
    v_scale: torch.Tensor


NO_SCALES: LayerScales = {}


@dataclass(frozen=True)
class DensePlan(AttentionPlan):
    """A decode-only step's kernel plan, shared by every layer of the step; None on the CPU (the torch
    reference plans nothing) and for steps with prefill chunks."""

    decode: DecodePlan | None = None


def decode_variant(fd: FlashDecodingConfig) -> str:
    if not fd.enable:
        return "standard"
    if fd.kernel != "flash":
        raise ValueError(f"[flashdecoding] kernel = {fd.kernel!r} is not provided by this backend "
                         "(only the dense kernels are built here); set kernel = \"flash\"")
    return "fdpp" if fd.async_softmax else "flash"


def estimates_phi(fd: FlashDecodingConfig) -> bool:
    """fixed_max_value = false: φ is estimated per step (every layer's φ is None)."""
    return isinstance(fd.fixed_max_value, bool) and not fd.fixed_max_value


def phi_source(fd: FlashDecodingConfig, calibration_path: str | None) -> tuple[PhiFor, str]:
    """(layer_idx -> φ or None to estimate, description)."""
    fixed = fd.fixed_max_value
    if estimates_phi(fd):
        return (lambda layer_idx: None), "φ estimated per step from sink + local window"
    if isinstance(fixed, bool):
        path = calibration_path or fd.calibration_file
        if not path:
            raise ValueError("[flashdecoding] fixed_max_value = true needs the per-layer φ file written by "
                             "`fdserve calibrate`: set [flashdecoding] calibration_file")
        phis = load_phi(path)

        def calibrated(layer_idx: int) -> float:
            if layer_idx >= len(phis):
                raise ValueError(f"calibration file {path} has φ for {len(phis)} layers; layer {layer_idx} "
                                 "asked (re-run `fdserve calibrate` for this model)")
            return phis[layer_idx]
        return calibrated, f"φ per layer from {path} ({len(phis)} layers)"
    value = float(fixed)
    return (lambda layer_idx: value), f"φ forced to {value:g}"


def _native_rope_builds() -> bool:
    """Whether the C++ RoPE + KV store builds here; if not, RoPE and the store stay torch ops (logged)."""
    try:
        native_rope.library()
    except NativeBuildError as exc:
        logger.warning("RoPE and the KV store on the CPU through torch ops: the C++ kernel does not build (%s)", exc)
        return False
    return True


class DenseBackend(AttentionBackend):
    """Decode by `variant` over every exact key; paged causal prefill; the plain KV store (fused
    with RoPE on a GPU). Triton kernels on a GPU (`vendor`'s launch configs), torch on the CPU."""

    def __init__(self, fd: FlashDecodingConfig, device: torch.device, vendor: str, *,
                 calibration_path: str | None = None, cpu_attention: CpuAttention = "auto",
                 prefill_prefix: PrefillPrefix = "auto") -> None:
        self.variant = decode_variant(fd)
        self.device = device
        on_gpu = device.type == "cuda"
        self.triton = on_gpu                     # Triton kernels (GPU; the interpreter in tests)
        self.cpu_fused = not on_gpu and cpu_attention != "reference"
        self.cpu_fused_decode = self.cpu_fused and self.variant != "fdpp"
        self.cpu_attention = cpu_attention
        self.cpu_native = False                  # decode through kernels.native (`allocate` decides)
        self.cpu_native_prefill = False          # prefill through kernels.native (bf16 on AVX512-BF16, float32 on AVX2)
        if self.variant == "fdpp" and cpu_attention == "native":
            raise ValueError('[backend] cpu_attention = "native" decodes with the exact softmax; '
                             '[flashdecoding] async_softmax = true has its own arithmetic (use "auto" or "fused")')
        self.decode_layout: cpu.DecodeLayout | None = None   # this step's, from layer 0
        self.native_plan: NativeDecodePlan | None = None     # this step's, from layer 0
        self._step_slots: tuple[torch.Tensor | None, bool] = (None, False)   # (slot_mapping, any -1 in it)
        self.fuse_rope_store = on_gpu
        self.configs = vendor_configs(vendor)
        self.num_splits = fd.num_splits
        self.fallback = fd.fallback_on_overflow
        self.phi_for: PhiFor = lambda layer_idx: None
        self.estimate_phi = True                 # fdpp: every layer's φ is None (the plans' ESTIMATE)
        self.spec: KVCacheSpec | None = None     # the cache the plans are made for (`allocate`)
        self.scale_file = calibration_path or fd.calibration_file
        self.kv_scales: KVScales | None = None   # FP8 pages' scales (`allocate`)
        self.layer_scales: list[LayerScales] = []
        self.prefill_prefix = prefill_prefix
        self.cudnn_prefix = False                # cached prefixes through cuDNN before the prefill kernel (`allocate`)
        self._prefix: tuple[AttentionMetadata | None, PrefixPlan | None] = (None, None)   # the step's, from layer 0
        phi_text = ""
        if self.variant == "fdpp":
            self.phi_for, phi_text = phi_source(fd, calibration_path)
            self.estimate_phi = estimates_phi(fd)
            if not self.fallback:
                logger.warning("[flashdecoding] fallback_on_overflow = false: rows whose scores leave φ's safe "
                               "window are NOT recomputed (their output is inaccurate); they are still counted")
        elif fd.enable and (fd.fixed_max_value is not False or not self.fallback):
            logger.info("[flashdecoding] fixed_max_value / fallback_on_overflow apply to async_softmax only")
        self.step_stats = torch.zeros(1, dtype=torch.int64, device=device)   # rows flagged in this step
        if on_gpu:
            where = f"triton[{vendor}, block_n={self.configs.decode.block_n}]"
        else:
            where = "torch reference (cpu)"
        splits_text = "1 split" if self.variant == "standard" else (
            f"splits={self.num_splits}" if self.num_splits else
            ("splits=wave heuristic" if on_gpu else f"splits<={CPU_MAX_SPLITS}"))
        details = [splits_text]
        if self.variant == "fdpp":
            details += [phi_text, f"fallback={'on' if self.fallback else 'off (counted only)'}"]
        if on_gpu and self.configs.decode_fp8 is not None and self.variant == "flash":
            fp8 = self.configs.decode_for(torch.float8_e4m3fn, tma=has_tma(device))
            copies = f", TMA copies of {fp8.num_stages} tiles in flight where pages hold whole tiles" if fp8.tma else ""
            details.append(f"FP8 pages: block_n={fp8.block_n}, {fp8.num_warps} warp(s), {fp8.ctas_per_sm} CTAs/SM"
                           f"{copies}")
        decode_text = f"{where}: {TITLES[self.variant]} ({', '.join(details)})"
        if self.cpu_fused_decode:
            decode_text = f"torch one exact pass (cpu), the softmax of {TITLES[self.variant]}"
        prefill_text = "torch SDPA (cpu)" if self.cpu_fused else where
        store_text = f"{where}, fused with RoPE" if on_gpu else ("torch index copy (cpu)" if self.cpu_fused else where)
        self.name = self._name(decode_text, prefill_text, store_text)

    @staticmethod
    def _name(decode_text: str, prefill_text: str, store_text: str) -> str:
        return f"{decode_text}; prefill: {prefill_text}; kv store: {store_text}"

    def allocate(self, spec: KVCacheSpec, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        self.spec = spec
        self.device = v_cache.device   # with its index: the plans' workspaces live beside the pages
        if self.cpu_fused_decode and self.cpu_attention in ("auto", "native") and not self.cpu_native:
            self._choose_native(spec)
        min_keys = self.configs.prefill_for(spec.head_dim).prefix_min_keys
        wanted = self.triton and self.prefill_prefix == "auto" and min_keys > 0 and not self.cudnn_prefix
        if wanted and cudnn_prefix_available(spec.dtype, spec.kv_dtype, spec.head_dim, v_cache.device):
            self.cudnn_prefix = True   # allocate may run again (a new cache): the name says it once
            self.prefill_prefix_keys = min_keys
            warm_up_cudnn(spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.dtype, v_cache.device)
            dequantized = " (dequantized)" if is_fp8(spec.kv_dtype) else ""
            self.name += f"; cached prefixes of >= {min_keys} keys attended by cuDNN first{dequantized}"
        if is_fp8(spec.kv_dtype) and self.kv_scales is None:
            self.kv_scales = kv_scales(spec.kv_dtype, spec.num_layers, spec.num_kv_heads, v_cache.device,
                                       self.scale_file)
            self.name += ", FP8 codes"
            # one set of views per layer, made once: every store, decode and prefill passes them
            self.layer_scales = [{"k_scale": k, "v_scale": v} for k, v in zip(self.kv_scales.k, self.kv_scales.v,
                                                                              strict=True)]

    def _choose_native(self, spec: KVCacheSpec) -> None:
        """Decode through the C++ kernel if it builds here and takes this cache; "native" insists."""
        try:
            reason = native_unsupported(spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.kv_dtype)
        except NativeBuildError as exc:
            reason = str(exc)
        if reason is None:
            self.cpu_native = True
            if spec.dtype == spec.kv_dtype and spec.dtype in native_rope.ROW_DTYPES and _native_rope_builds():
                self.fuse_rope_store = True      # RotaryEmbedding.rotate_and_store: one C++ call on the CPU
            try:
                prefill_reason = native_prefill_unsupported(spec.num_heads, spec.num_kv_heads, spec.head_dim,
                                                            spec.dtype, spec.kv_dtype)
            except NativeBuildError as exc:
                prefill_reason = str(exc)
            self.cpu_native_prefill = prefill_reason is None
            if prefill_reason is not None:
                logger.info("CPU prefill through torch SDPA: %s", prefill_reason)
            self.name = self._name(
                f"C++ paged kernel (cpu, {isa()}), the softmax of {TITLES[self.variant]}",
                native_prefill_name(spec.dtype) if self.cpu_native_prefill else "torch SDPA (cpu)",
                "C++, fused with RoPE (cpu)" if self.fuse_rope_store else "torch index copy (cpu)")
        elif self.cpu_attention == "native":
            raise ValueError(f'[backend] cpu_attention = "native": the C++ decode kernel cannot run here: {reason}')
        else:
            logger.warning("CPU decode through torch SDPA: the C++ paged kernel cannot run here (%s)", reason)

    def _scales(self, layer_idx: int) -> LayerScales:
        """The layer's k_scale / v_scale for FP8 pages; nothing for others."""
        return self.layer_scales[layer_idx] if self.layer_scales else NO_SCALES

    def plan(self, shape: StepShape) -> DensePlan:
        """One decode plan for every layer of a decode-only step on the Triton path."""
        if not (self.triton and shape.decode_only):
            return DensePlan()
        spec = self._spec()
        return DensePlan(plan_decode(shape.num_seqs, spec.num_heads, spec.num_kv_heads, spec.head_dim,
                                     spec.block_size, shape.table_width, dtype=spec.dtype, device=self.device,
                                     variant=self.variant, kv_dtype=spec.kv_dtype, num_splits=self.num_splits or None,
                                     config=self._decode_config(spec.kv_dtype, spec.block_size),
                                     estimate_phi=self.estimate_phi,
                                     fallback=self.fallback))

    def _decode_config(self, kv_dtype: torch.dtype, block_size: int) -> DecodeConfig:
        """FD++ and standard keep the shared launch shape; flash takes the one for the page format."""
        if self.variant == "fdpp":
            return self.configs.decode
        return decode_config(self.configs, self.device, kv_dtype, block_size, one_split=self.variant == "standard")

    def _spec(self) -> KVCacheSpec:
        if self.spec is None:
            raise RuntimeError(f"{type(self).__name__}: no KV cache spec to plan for (allocate was not called)")
        return self.spec

    def store(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
              v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        scales = self._scales(layer_idx)
        if self.triton:
            store_kv(key, value, k_cache, v_cache, slot_mapping, **scales)
        elif self.cpu_fused:
            if self._step_slots[0] is not slot_mapping:   # the step's slots, checked at its first layer
                self._step_slots = (slot_mapping, cpu.slot_has_padding(slot_mapping))
            cpu.store_kv_cpu(key, value, k_cache, v_cache, slot_mapping, **scales, has_padding=self._step_slots[1])
        else:
            reference.store_kv_ref(key, value, k_cache, v_cache, slot_mapping, **scales)

    def decode(self, layer_idx: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               metadata: AttentionMetadata, *, scale: float) -> torch.Tensor:
        if self.triton:
            return self._run_plan(layer_idx, q, k_cache, v_cache, metadata, scale=scale)
        counters = metadata.counters
        if self.cpu_native:
            if layer_idx == 0 or self.native_plan is None:   # the step's block tables, once for all layers
                spec = self._spec()
                self.native_plan = plan_native_decode(metadata.block_tables, metadata.seq_lens, spec.num_heads,
                                                      spec.num_kv_heads, spec.head_dim, k_cache.shape[1],
                                                      k_cache.shape[0])
            return paged_decode_attention(q, k_cache, v_cache, metadata.block_tables, metadata.seq_lens,
                                          scale=scale, plan=self.native_plan)
        if self.cpu_fused_decode:
            if layer_idx == 0 or self.decode_layout is None:   # the step's block tables, once for all layers
                self.decode_layout = cpu.decode_layout(metadata.block_tables, metadata.seq_lens, k_cache.shape[1])
            return cpu.decode_attention_cpu(q, k_cache, v_cache, metadata.block_tables, metadata.seq_lens,
                                            scale=scale, layout=self.decode_layout, **self._scales(layer_idx))
        if self.variant == "standard":
            return reference.decode_attention_ref(q, k_cache, v_cache, metadata.block_tables, metadata.seq_lens,
                                                  scale=scale, **self._scales(layer_idx))
        extra_ref: dict[str, Any] = dict(self._scales(layer_idx))
        if self.variant == "fdpp":
            self.step_stats.zero_()
            extra_ref.update(phi=self.phi_for(layer_idx), fallback=self.fallback, stats=self.step_stats)
        out = reference.decode_reference(q, k_cache, v_cache, metadata.block_tables, metadata.seq_lens, scale=scale,
                                         variant=self.variant, num_splits=self.num_splits or CPU_MAX_SPLITS,
                                         **extra_ref)
        if self.variant == "fdpp":
            counters["fdpp_rows_checked"] = counters.get("fdpp_rows_checked", 0.0) + q.shape[0] * q.shape[1]
            counters["fdpp_fallback_rows"] = counters.get("fdpp_fallback_rows", 0.0) + float(self.step_stats[0])
        return out

    def _run_plan(self, layer_idx: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  metadata: AttentionMetadata, *, scale: float) -> torch.Tensor:
        """One layer's decode under the step's plan (Triton); layer 0 checks the step's layouts."""
        plan = metadata.plan
        if not isinstance(plan, DensePlan) or plan.decode is None:
            raise RuntimeError("DenseBackend.decode on the Triton path needs the step's DenseBackend.plan "
                               f"in its metadata; got {plan!r}")
        if layer_idx == 0:
            check_layer_inputs(self._spec(), q, k_cache, v_cache, metadata)
        phi = None
        stats = None
        if self.variant == "fdpp":
            if layer_idx == 0:
                self.step_stats.zero_()
            phi = self.phi_for(layer_idx)
            stats = self.step_stats
            counters = metadata.counters
            counters["fdpp_rows_checked"] = counters.get("fdpp_rows_checked", 0.0) + q.shape[0] * q.shape[1]
            counters["fdpp_fallback_rows"] = self.step_stats[0]
        return run_decode(plan.decode, q, k_cache, v_cache, metadata.block_tables, metadata.seq_lens, scale=scale,
                          phi=phi, stats=stats, **self._scales(layer_idx))

    def prefill(self, layer_idx: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                metadata: AttentionMetadata, *, scale: float) -> torch.Tensor:
        if self.triton:
            config = self.configs.prefill_for(q.shape[-1])
            return prefill_attention(q, k_cache, v_cache, metadata.block_tables, metadata.seq_lens,
                                     metadata.query_start_loc, scale=scale,
                                     max_query_len=metadata.max_query_len, config=config,
                                     seed=self._prefix_seed(layer_idx, q, k_cache, v_cache, metadata, scale, config),
                                     **self._scales(layer_idx))
        if self.cpu_native_prefill:
            return paged_prefill_attention(q, k_cache, v_cache, metadata.block_tables, metadata.seq_lens,
                                           metadata.query_start_loc, scale=scale)
        if self.cpu_fused:
            return cpu.prefill_attention_cpu(q, k_cache, v_cache, metadata.block_tables, metadata.seq_lens,
                                             metadata.query_start_loc, scale=scale, **self._scales(layer_idx))
        return reference.prefill_attention_ref(q, k_cache, v_cache, metadata.block_tables, metadata.seq_lens,
                                               metadata.query_start_loc, scale=scale, **self._scales(layer_idx))

    def _prefix_seed(self, layer_idx: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     metadata: AttentionMetadata, scale: float, config: PrefillConfig) -> PrefixSeed | None:
        """cuDNN over the long cached prefixes of this step's chunks (which ones: once per step)."""
        if not (self.cudnn_prefix and metadata.seq_lens_host):
            return None
        step, plan = self._prefix
        if step is not metadata:
            spans = prefix_spans(list(metadata.seq_lens_host), list(metadata.query_start_loc_host),
                                 min_keys=config.prefix_min_keys, min_rows=config.prefix_min_rows,
                                 align=config.prefix_key_bucket)
            plan = plan_prefix(spans, metadata.num_seqs, q.device, metadata.block_tables_host,
                               k_cache.shape[1]) if spans else None
            self._prefix = (metadata, plan)
        return None if plan is None else prefix_seed(q, k_cache, v_cache, metadata.block_tables, plan, scale,
                                                     k_scale=self._scales(layer_idx).get("k_scale"))


def check_layer_inputs(spec: KVCacheSpec, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       metadata: AttentionMetadata) -> None:
    """What a decode plan assumes of every layer's tensors, checked once per step (at layer 0): the
    layouts the kernels take, and the dtypes the plan was made for."""
    check_shapes(q, k_cache, v_cache, metadata.block_tables, metadata.seq_lens)
    if q.dtype != spec.dtype or k_cache.dtype != spec.kv_dtype:
        raise ValueError(f"decode: q {q.dtype} / cache {k_cache.dtype}, but the plan was made for "
                         f"{spec.dtype} / {spec.kv_dtype}")

