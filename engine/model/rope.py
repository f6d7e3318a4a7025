"""RoPE frequencies, in one place for every path: the cos/sin tables that the CPU rotation and the
fused GPU kernels (kernels/fused.py) both read are built from `rope_frequencies`.

Scalings follow transformers' definitions of rope_scaling / rope_parameters: "linear"
(positions divided by factor), "dynamic" (NTK: a larger base), "yarn" (per-frequency blend of
interpolation and extrapolation, cos/sin scaled by an attention factor) and "llama3" (Llama 3.1).
transformers' dynamic scaling grows the base with the running sequence length; with a paged KV
cache the keys must not change once stored, so here the base is fixed for the whole table,
as transformers computes it for a sequence of the table's length.

`apply_rope_scaling` writes a `[model] rope_scaling` setting into a checkpoint's config, so that
the model is built with it and its tables cover the longer context.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from engine.config import RopeScaling

if TYPE_CHECKING:
    from transformers import PretrainedConfig

SUPPORTED = ("default", "linear", "dynamic", "yarn", "llama3")


def get_rope_parameters(hf_config: PretrainedConfig) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) from a config of transformers 4 or 5.

    transformers 5 keeps both in `rope_parameters` ({"rope_type", "rope_theta", ...});
    transformers 4 has `rope_theta` and an optional `rope_scaling` (key "rope_type" or "type").
    """
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling: dict[str, Any] | None = dict(params)
    else:
        theta = float(getattr(hf_config, "rope_theta", 10000.0))
        legacy = getattr(hf_config, "rope_scaling", None)
        scaling = dict(legacy) if legacy else None
    if scaling is not None:
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        scaling = None if rope_type == "default" else {**scaling, "rope_type": rope_type}
    return theta, scaling


def apply_rope_scaling(hf_config: PretrainedConfig, scaling: RopeScaling, max_position: int) -> None:
    """Replace the checkpoint's RoPE scaling with `scaling`; tables cover `max_position` positions."""
    theta, _ = get_rope_parameters(hf_config)
    own = int(hf_config.max_position_embeddings)
    params: dict[str, Any] = {"rope_type": scaling.type, "rope_theta": theta, "factor": scaling.factor,
                              "original_max_position_embeddings": scaling.original_max_position_embeddings or own}
    if scaling.type == "yarn":
        params.update(beta_fast=scaling.beta_fast, beta_slow=scaling.beta_slow)
        if scaling.attention_factor is not None:
            params["attention_factor"] = scaling.attention_factor
    hf_config.rope_parameters = params  # read first by get_rope_parameters, under transformers 4 and 5
    hf_config.max_position_embeddings = max(own, max_position)


def _default_inv_freq(base: float, rotary_dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency rescaling: long wavelengths slowed by `factor`, short ones kept,
    a smooth ramp in between (bounds set by low/high_freq_factor of the original context)."""
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    ramp = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return torch.where(wavelen < old_len / high, inv_freq,
                       torch.where(wavelen > old_len / low, inv_freq / factor, ramp))


def _dynamic_inv_freq(base: float, rotary_dim: int, scaling: dict[str, Any], max_position: int) -> torch.Tensor:
    factor = float(scaling["factor"])
    original = int(scaling.get("original_max_position_embeddings") or max_position)
    length = max(max_position, original)
    scaled_base = base * ((factor * length / original) - (factor - 1)) ** (rotary_dim / (rotary_dim - 2))
    return _default_inv_freq(scaled_base, rotary_dim)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inv_freq(base: float, rotary_dim: int, scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])
    beta_fast, beta_slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
                            if mscale and mscale_all_dim else _yarn_mscale(factor))

    def correction_dim(rotations: float) -> float:
        return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = _default_inv_freq(base, rotary_dim)
    interpolation = extrapolation / factor
    keep = 1 - ramp  # the share of each frequency left as trained
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


def rope_frequencies(base: float, rotary_dim: int, max_position: int,
                     scaling: dict[str, Any] | None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rotary_dim / 2], factor on cos and sin) for `scaling` (None: plain RoPE)."""
    rope_type = scaling["rope_type"] if scaling else "default"
    inv_freq = _default_inv_freq(base, rotary_dim)
    if rope_type == "default":
        return inv_freq, 1.0
    assert scaling is not None
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling), 1.0
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if rope_type == "dynamic":
        return _dynamic_inv_freq(base, rotary_dim, scaling, max_position), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(base, rotary_dim, scaling)
    raise ValueError(f"rope_type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED)})")


def cos_sin_tables(base: float, rotary_dim: int, max_position: int,
                   scaling: dict[str, Any] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos and sin [max_position, rotary_dim / 2]."""
    inv_freq, attention_factor = rope_frequencies(base, rotary_dim, max_position, scaling)
    freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return freqs.cos() * attention_factor, freqs.sin() * attention_factor
