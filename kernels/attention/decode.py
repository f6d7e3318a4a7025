"""The decode variants behind one plan / run interface: "standard", "flash" (`kernels.attention.flash_decoding`)
and "fdpp" (`kernels.attention.fdpp`).

`plan_decode` once per step (shapes only), `run_decode` per layer; `decode_attention` is both, the
functional entry point. `kernels.attention.reference.decode_reference` is its signature in torch.
"""
from __future__ import annotations

import torch

from kernels.attention.fdpp import FdppDecodePlan, fdpp_decode, plan_fdpp_decode, run_fdpp_decode
from kernels.attention.flash_decoding import FlashDecodePlan, flash_decode, plan_flash_decode, run_flash_decode
from kernels.vendor import DecodeConfig

DecodePlan = FlashDecodePlan | FdppDecodePlan
VARIANTS = ("standard", "flash", "fdpp")


def _check_variant(variant: str) -> None:
    if variant not in VARIANTS:
        raise ValueError(f"unknown decode variant {variant!r}; expected 'standard', 'flash' or 'fdpp'")


def plan_decode(batch: int, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, max_blocks: int, *,
                dtype: torch.dtype, device: torch.device, variant: str, kv_dtype: torch.dtype | None = None,
                num_splits: int | None = None, config: DecodeConfig | None = None, estimate_phi: bool = True,
                fallback: bool = True, phi_sink: int = 4, phi_window: int = 28) -> DecodePlan:
    """The host work of one step's decode, from shapes only: q [batch, num_heads, head_dim] of `dtype`,
    pages [N, block_size, num_kv_heads, head_dim] of `kv_dtype` (default `dtype`), block tables
    [batch, max_blocks]. "standard" plans one split; "flash" and "fdpp" `num_splits` (None/0: the wave
    heuristic). `estimate_phi`, `fallback`, `phi_sink`, `phi_window` are fdpp's (`plan_fdpp_decode`)
    and unused by the other variants. Every layer of the step may run the plan: they run one after
    the other on one stream, so they share its workspaces."""
    _check_variant(variant)
    shapes = (batch, num_heads, num_kv_heads, head_dim, block_size, max_blocks)
    if variant == "fdpp":
        return plan_fdpp_decode(*shapes, dtype=dtype, device=device, kv_dtype=kv_dtype, num_splits=num_splits,
                                estimate_phi=estimate_phi, fallback=fallback, phi_sink=phi_sink,
                                phi_window=phi_window, config=config)
    return plan_flash_decode(*shapes, dtype=dtype, device=device, kv_dtype=kv_dtype,
                             num_splits=1 if variant == "standard" else num_splits, config=config)


def run_decode(plan: DecodePlan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               block_tables: torch.Tensor, seq_lens: torch.Tensor, *, scale: float, out: torch.Tensor | None = None,
               phi: float | None = None, stats: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
               v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """One layer's decode q[B,Hq,D] over paged KV -> out[B,Hq,D] under `plan` (Triton). `phi` and
    `stats` are fdpp's (`run_fdpp_decode`); a standard / flash plan takes neither. FP8 pages come with
    their per-head `k_scale` / `v_scale`. Allocates nothing but `out` when it is None."""
    if isinstance(plan, FdppDecodePlan):
        return run_fdpp_decode(plan, q, k_cache, v_cache, block_tables, seq_lens, scale=scale, phi=phi,
                               stats=stats, out=out, k_scale=k_scale, v_scale=v_scale)
    if phi is not None or stats is not None:
        raise ValueError("phi and stats apply to an fdpp plan only")
    return run_flash_decode(plan, q, k_cache, v_cache, block_tables, seq_lens, scale=scale, out=out,
                            k_scale=k_scale, v_scale=v_scale)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, *, scale: float,
                     variant: str, num_splits: int | None = None, **options) -> torch.Tensor:
    """The functional decode entry point: q[B,Hq,D] over paged KV -> out[B,Hq,D] (Triton), planned
    and run in one call.

    variant "standard": one pass over each sequence's whole KV (no split, no merge);
    "flash": split-KV with the exact log-sum-exp merge (`num_splits` None/0 = heuristic);
    "fdpp": asynchronous softmax with a unified max φ (options of `kernels.attention.fdpp.fdpp_decode`).
    `kernels.attention.reference.decode_reference` is the same signature in torch.
    """
    _check_variant(variant)
    if variant == "standard":
        return flash_decode(q, k_cache, v_cache, block_tables, seq_lens, scale=scale, num_splits=1, **options)
    if variant == "flash":
        return flash_decode(q, k_cache, v_cache, block_tables, seq_lens, scale=scale,
                            num_splits=num_splits, **options)
    return fdpp_decode(q, k_cache, v_cache, block_tables, seq_lens, scale=scale, num_splits=num_splits, **options)
