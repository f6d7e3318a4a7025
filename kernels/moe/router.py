"""Router logits for a few tokens in one launch: x [M, H] · W [E, H]ᵀ -> [M, E] in x's dtype.

The router matrix is small (E x H, 0.5 MB at Qwen3-30B-A3B's shape), so at decode batch sizes
its product is bound by launch and latency, not bytes: one program per (token, block of experts)
reads whole rows of W with no split-K and no reduction launch behind it. The logits are rounded
to x's dtype, as the linear layer they replace returns them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MAX_TOKENS = 8   # measured faster than the matmul table up to here (bench/RESULTS.md); larger batches keep the table


@dataclass(frozen=True)
class RouterConfig:
    """Experts per program, K tile, warps."""

    block_e: int = 2
    block_k: int = 2048
    num_warps: int = 8


@triton.jit
def _router_kernel(X, W, OUT, E, K, stride_xm, stride_we, stride_om,
                   BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    experts = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    e_mask = experts < E
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_E], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(X + token * stride_xm + k0 + offs_k).to(tl.float32)
            w = tl.load(W + experts[:, None] * stride_we + (k0 + offs_k)[None, :], mask=e_mask[:, None], other=0.0)
        else:
            k_mask = k0 + offs_k < K
            x = tl.load(X + token * stride_xm + k0 + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            w = tl.load(W + experts[:, None] * stride_we + (k0 + offs_k)[None, :],
                        mask=e_mask[:, None] & k_mask[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    tl.store(OUT + token * stride_om + experts, acc.to(OUT.dtype.element_ty), mask=e_mask)


def router_logits_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The same product in float32, rounded to x's dtype."""
    return torch.nn.functional.linear(x.float(), weight.float()).to(x.dtype)


def router_logits(x: torch.Tensor, weight: torch.Tensor, config: RouterConfig | None = None) -> torch.Tensor:
    """x [M, H], weight [E, H] (both contiguous in H) -> logits [M, E] in x's dtype, fp32 accumulation."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"router_logits: x {tuple(x.shape)} does not match the router {tuple(weight.shape)}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("router_logits: x and the router weight must be contiguous in their last dimension")
    cfg = config or RouterConfig()
    num_tokens, hidden = x.shape
    num_experts = weight.shape[0]
    out = torch.empty(num_tokens, num_experts, dtype=x.dtype, device=x.device)
    if num_tokens:
        block_k = min(cfg.block_k, triton.next_power_of_2(hidden))
        _router_kernel[(num_tokens, triton.cdiv(num_experts, cfg.block_e))](
            x, weight, out, num_experts, hidden, x.stride(0), weight.stride(0), out.stride(0),
            BLOCK_E=cfg.block_e, BLOCK_K=block_k, EVEN_K=hidden % block_k == 0, num_warps=cfg.num_warps)
    return out
