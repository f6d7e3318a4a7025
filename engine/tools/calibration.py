"""`fdserve calibrate`: per-layer φ for FlashDecoding++ from the model's real softmax inputs.

FD++ exponentiates every score against one unified max φ. A row is safe while its true max M
satisfies LO <= (M - φ)·log2(e) <= HI (`kernels.attention.reference.safe_window`). We record, per layer,
the row maxima of the scaled scores q·k·scale (every prefill query row and every decode row is
one sample), and put φ in the middle of the window that the [p0.01 %, p99.99 %] range of those
maxima must fit in. The file also says how many recorded rows would have fallen outside.

It also records, per layer and KV head, the largest |K| and |V| written to the cache (`kv_amax`),
from which FP8 pages take their scales (`engine.attention.kv_scales`).
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine.attention.backend import AttentionBackend
from engine.attention.layer import Attention, AttentionMetadata
from engine.attention.phi_file import FORMAT_VERSION
from engine.attention.torch_reference import ReferenceBackend
from kernels.attention import reference

LOW_Q, HIGH_Q = 1e-4, 1 - 1e-4


class RowMaxRecorder(ReferenceBackend):
    """The torch reference backend, also recording every row's max score and every KV head's
    largest |K| and |V| per layer."""

    def __init__(self, num_layers: int) -> None:
        super().__init__("calibration: torch reference + row-max recorder")
        self.samples: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
        self.k_amax: list[torch.Tensor | None] = [None] * num_layers
        self.v_amax: list[torch.Tensor | None] = [None] * num_layers

    def store(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
              v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        rows = slot_mapping >= 0
        if bool(rows.any()):
            for amax, x in ((self.k_amax, key), (self.v_amax, value)):
                head_max = x[rows].detach().float().abs().amax(dim=(0, 2)).cpu()
                seen = amax[layer_idx]
                amax[layer_idx] = head_max if seen is None else torch.maximum(seen, head_max)
        super().store(layer_idx, key, value, k_cache, v_cache, slot_mapping)

    def _record(self, layer_idx: int, row_max: torch.Tensor) -> None:
        self.samples[layer_idx].append(row_max.detach().float().flatten().cpu())

    def decode(self, layer_idx: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               metadata: AttentionMetadata, *, scale: float) -> torch.Tensor:
        scores, _ = reference.paged_scores(q, k_cache, v_cache, metadata.block_tables, metadata.seq_lens, scale, 64)
        self._record(layer_idx, scores.amax((-1, -2)))
        return super().decode(layer_idx, q, k_cache, v_cache, metadata, scale=scale)

    def prefill(self, layer_idx: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                metadata: AttentionMetadata, *, scale: float) -> torch.Tensor:
        starts, lens = metadata.query_start_loc.tolist(), metadata.seq_lens.tolist()
        heads, kv_heads = q.shape[1], k_cache.shape[2]
        for b, ctx in enumerate(lens):
            q_b = q[starts[b]:starts[b + 1]].float()
            if q_b.shape[0] == 0:
                continue
            k = reference.gather_kv_ref(k_cache, metadata.block_tables[b], ctx).float()
            k = k.repeat_interleave(heads // kv_heads, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q_b, k) * scale
            q_pos = torch.arange(ctx - q_b.shape[0], ctx, device=q.device)
            visible = torch.arange(ctx, device=q.device)[None, :] <= q_pos[:, None]
            self._record(layer_idx, scores.masked_fill(~visible, float("-inf")).amax(-1))
        return super().prefill(layer_idx, q, k_cache, v_cache, metadata, scale=scale)


def choose_phi(row_max: torch.Tensor, kv_dtype: torch.dtype) -> dict[str, float]:
    """φ (natural-log units) centring the window on the row maxima's [p0.01 %, p99.99 %] range."""
    lo_win, hi_win = reference.safe_window(kv_dtype)
    lo_q = float(torch.quantile(row_max, LOW_Q)) if row_max.numel() > 1 else float(row_max.min())
    hi_q = float(torch.quantile(row_max, HIGH_Q)) if row_max.numel() > 1 else float(row_max.max())
    phi = (lo_q + hi_q) / 2 - (lo_win + hi_win) / 2 / reference.LOG2E
    excess = (row_max - phi) * reference.LOG2E
    outside = int(((excess < lo_win) | (excess > hi_win)).sum())
    return {"phi": phi, "rows": int(row_max.numel()), "min": float(row_max.min()), "p0.01": lo_q,
            "median": float(row_max.median()), "p99.99": hi_q, "max": float(row_max.max()),
            "rows_outside_window": outside,
            "fits_window": (hi_q - lo_q) * reference.LOG2E <= hi_win - lo_win}


def _per_head(amax: list[torch.Tensor | None]) -> list[list[float]]:
    if any(layer is None for layer in amax):
        raise ValueError("a layer stored no K/V while calibrating: run_forward_fn ran no tokens through it")
    return [[float(x) for x in layer] for layer in amax if layer is not None]


def calibrate(model: torch.nn.Module, run_forward_fn: Callable[[AttentionBackend], None], *,
              kv_dtype: torch.dtype = torch.bfloat16, output_path: str | Path | None = None,
              model_name: str = "") -> dict[str, Any]:
    """Record softmax-input statistics while `run_forward_fn(backend)` runs the calibration
    prompts through `model` with `backend` installed (prefill and decode steps both count), and
    return (and write, if `output_path`) the φ file that `fixed_max_value = true` reads.
    """
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    if not layers:
        raise ValueError("the model has no engine.attention.layer.Attention layers to calibrate")
    recorder = RowMaxRecorder(max(m.layer_idx for m in layers) + 1)
    run_forward_fn(recorder)
    per_layer = []
    for idx, samples in enumerate(recorder.samples):
        if not samples:
            raise ValueError(f"layer {idx} saw no attention rows: run_forward_fn ran no tokens through it")
        per_layer.append(choose_phi(torch.cat(samples), kv_dtype))
    lo_win, hi_win = reference.safe_window(kv_dtype)
    result = {
        "version": FORMAT_VERSION, "model": model_name, "kv_dtype": str(kv_dtype).replace("torch.", ""),
        "units": "scaled scores q·k·scale, natural log; the kernels work in log2 = ·log2(e)",
        "window_log2": [lo_win, hi_win], "phi": [layer["phi"] for layer in per_layer], "layers": per_layer,
        "kv_amax": {"k": _per_head(recorder.k_amax), "v": _per_head(recorder.v_amax)},
    }
    if output_path is not None:
        Path(output_path).write_text(json.dumps(result, indent=1))
    return result
