"""Torch MoE: softmax top-k routing and the expert loop (the CPU path and the kernels' oracle).

Expert weights are stacked: `w13` [E, 2I, H] holds each expert's gate rows then its up rows,
`w2` [E, H, I] its down projection. A (token, slot) pair routed to expert e contributes
`weight · w2[e] · (silu(w13[e, :I] x) ⊙ w13[e, I:] x)` to that token's output.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def route_topk_ref(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [M, E] -> (weights float32 [M, k], expert ids int32 [M, k]): softmax over all
    experts in float32, the k largest, divided by their sum when `renormalize`."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def moe_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M, H] -> [M, H] in x's dtype; each expert with tokens runs once on its tokens.

    Products run in `compute_dtype` (default x's dtype; float64 makes it an oracle); routing
    weights multiply in float32 or wider.
    """
    dtype = compute_dtype or x.dtype
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    out = torch.zeros(x.shape, dtype=torch.promote_types(dtype, torch.float32), device=x.device)
    flat_ids = topk_ids.reshape(-1).long()
    token_of_pair = torch.arange(flat_ids.numel(), device=x.device) // topk_ids.shape[1]
    pair_weights = topk_weights.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start:start + count]
        start += count
        tokens = token_of_pair[pairs]
        gate_up = F.linear(x[tokens].to(dtype), w13[expert].to(dtype))
        hidden = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        down = F.linear(hidden, w2[expert].to(dtype))
        out.index_add_(0, tokens, down.to(out.dtype) * pair_weights[pairs, None].to(out.dtype))
    return out.to(x.dtype)
