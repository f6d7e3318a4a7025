"""The K and V scales of FP8 KV pages, one per (layer, KV head).

`fdserve calibrate` records each head's largest |K| and |V| over real text in the calibration file
(`kv_amax`); a head's scale is then amax / the format's largest value, so the calibration text's
extremes map to the largest code. Without that record every scale is 1.0: values are stored as
they are and saturate at the format's limit (448 for e4m3, 57344 for e5m2), which leaves the
K/V magnitudes of the usual models (|x| up to a few tens) well inside the range.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.distributed.group import tp_rank_and_size
from kernels.attention.kv_quant import fp8_max

DEFAULT_SCALE = 1.0


@dataclass(frozen=True)
class KVScales:
    """k / v: float32 [num_layers, num_kv_heads] on the cache's device; `source` says where they came from."""

    k: torch.Tensor
    v: torch.Tensor
    source: str


def read_kv_amax(path: str | Path) -> dict[str, list[list[float]]] | None:
    """The calibration file's per-layer, per-head {"k": ..., "v": ...} maxima, or None when it has none."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read the calibration file {path}: {exc}") from exc
    amax = data.get("kv_amax") if isinstance(data, dict) else None
    if amax is None:
        return None
    ok = isinstance(amax, dict) and all(
        isinstance(amax.get(name), list) and all(
            isinstance(layer, list) and all(isinstance(x, (int, float)) and math.isfinite(x) and x >= 0
                                            for x in layer) for layer in amax[name]) for name in ("k", "v"))
    if not ok:
        raise ValueError(f"{path}: 'kv_amax' must hold 'k' and 'v' lists of per-head maxima per layer "
                         "(re-run `fdserve calibrate`)")
    return {"k": amax["k"], "v": amax["v"]}


def rank_kv_heads(total: int, num_kv_heads: int) -> slice | None:
    """The model's KV heads this tensor-parallel rank holds (`num_kv_heads` of `total`; one head on each of
    tp / total ranks when there are fewer heads than ranks), as QKVParallelLinear splits them; None when
    `total` heads are not what this rank's share comes from."""
    rank, tp_size = tp_rank_and_size()
    split = num_kv_heads * tp_size == total
    replicated = num_kv_heads == 1 and tp_size > total and tp_size % total == 0
    if tp_size == 1 or not (split or replicated):
        return None
    first = (rank // max(1, tp_size // total)) * num_kv_heads
    return slice(first, first + num_kv_heads)


def kv_scales(dtype: torch.dtype, num_layers: int, num_kv_heads: int, device: torch.device,
              calibration_path: str | None) -> KVScales:
    """The scales of `dtype` pages: from the calibration file's `kv_amax` when it has them, else 1.0.
    The file holds every KV head of the model; a tensor-parallel rank takes its own heads' columns."""
    amax = read_kv_amax(calibration_path) if calibration_path else None
    if amax is None:
        ones = torch.full((num_layers, num_kv_heads), DEFAULT_SCALE, dtype=torch.float32, device=device)
        where = f"{calibration_path} has no kv_amax" if calibration_path else "no calibration file"
        return KVScales(ones, ones.clone(), f"scales {DEFAULT_SCALE:g} ({where})")
    tensors = []
    for name in ("k", "v"):
        values = torch.tensor(amax[name], dtype=torch.float32)
        heads = rank_kv_heads(values.shape[1], num_kv_heads) if values.dim() == 2 else None
        if heads is not None:
            values = values[:, heads]
        if values.shape != (num_layers, num_kv_heads):
            raise ValueError(f"{calibration_path}: kv_amax.{name} is {tuple(values.shape)}, this model has "
                             f"{num_layers} layers x {num_kv_heads} KV heads (re-run `fdserve calibrate`)")
        # a head that never saw a nonzero value keeps scale 1 rather than 0 (which would divide by zero)
        scale = torch.where(values > 0, values / fp8_max(dtype), torch.ones_like(values))
        tensors.append(scale.to(device))
    return KVScales(tensors[0], tensors[1], f"scales per (layer, KV head) from {calibration_path}")
