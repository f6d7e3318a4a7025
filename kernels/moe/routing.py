"""Top-k softmax routing in one launch: router logits [M, E] -> (weights [M, k], expert ids [M, k]).

One program per token holds its E logits in registers, takes the softmax in float32 and picks the
k largest by repeated arg-max (lowest index first on ties, as `torch.topk` on distinct values).
Renormalised weights are the softmax over the chosen k alone.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _route_topk_kernel(LOGITS, WEIGHTS, IDS, E, stride_lm, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr,
                       BLOCK_E: tl.constexpr, RENORMALIZE: tl.constexpr):
    token = tl.program_id(0)
    offs = tl.arange(0, BLOCK_E)
    valid = offs < E
    logits = tl.load(LOGITS + token * stride_lm + offs, mask=valid, other=-float("inf")).to(tl.float32)
    peak = tl.max(logits, axis=0)
    exps = tl.where(valid, tl.exp(logits - peak), 0.0)
    total = tl.sum(exps, axis=0)
    remaining = tl.where(valid, exps, -1.0)
    slots = tl.arange(0, BLOCK_K)
    picked = tl.zeros([BLOCK_K], dtype=tl.float32)
    picked_ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    for slot in tl.static_range(TOP_K):
        best = tl.max(remaining, axis=0)
        index = tl.min(tl.where(remaining == best, offs, BLOCK_E), axis=0)
        picked = tl.where(slots == slot, best, picked)
        picked_ids = tl.where(slots == slot, index, picked_ids)
        remaining = tl.where(offs == index, -1.0, remaining)
    denominator = tl.sum(picked, axis=0) if RENORMALIZE else total
    keep = slots < TOP_K
    tl.store(WEIGHTS + token * TOP_K + slots, picked / denominator, mask=keep)
    tl.store(IDS + token * TOP_K + slots, picked_ids, mask=keep)


def route_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """As `route_topk_ref`: float32 weights and int32 expert ids, [M, top_k] each."""
    num_tokens, num_experts = router_logits.shape
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k = {top_k} must be in [1, {num_experts}] (the expert count)")
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=router_logits.device)
    if num_tokens:
        _route_topk_kernel[(num_tokens,)](
            router_logits, weights, ids, num_experts, router_logits.stride(0), TOP_K=top_k,
            BLOCK_K=triton.next_power_of_2(top_k), BLOCK_E=triton.next_power_of_2(num_experts),
            RENORMALIZE=renormalize, num_warps=1 if num_experts <= 64 else 2)
    return weights, ids
