"""Fused MoE on the GPU: the active experts' gate_up and down products in two kernels each way.

Three paths over the same weights (`w13` [E, 2I, H]: gate rows then up rows; `w2` [E, H, I]),
chosen per batch size by the tuned table (`kernels/moe/config.py`):
- pair GEMV (few tokens, decode): one program per (pair, N tile) streams its expert's rows with
  K-contiguous loads and reduces in fp32, so only the routed experts' weights are read and no
  sorting is needed; gate and up share the pass and SiLU(gate)·up is stored; the down kernel
  walks each token's k pairs and sums them with their routing weights, so the output needs no
  further reduction.
- grouped GEMM (prefill): pairs aligned by expert (`align_pairs`), one program per
  (block of `block_m` rows of one expert, N tile) on tensor cores, fp32 accumulation; the gate_up
  epilogue applies SiLU·up, the down epilogue the routing weight; the k rows of a token are then
  summed by a small kernel in fp32.
- per-pair GEMM (one token): the grouped GEMM with each pair its own block, so the alignment
  launch is skipped; a token's k experts are distinct, so each is still read once.
Both launch grids depend on the batch shape only, so a decode step captures into a CUDA graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.moe.align import align_pairs
from kernels.moe.config import MoeConfig, moe_config
from kernels.vendor import check_launch_options, interpreting

SUM_BLOCK = 1024   # hidden features per program of the top-k sum


@triton.jit
def _gemv_gate_up_kernel(X, W13, IDS, INTER, H, INTER_SIZE, stride_xm, stride_we, stride_wn, stride_im,
                         TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         EVEN_K: tl.constexpr):
    pair = tl.program_id(0)
    token = pair // TOP_K
    expert = tl.load(IDS + pair).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < INTER_SIZE
    offs_k = tl.arange(0, BLOCK_K)
    gate_ptrs = W13 + expert * stride_we + offs_n[:, None] * stride_wn + offs_k[None, :]
    up_ptrs = gate_ptrs + INTER_SIZE * stride_wn
    x_ptrs = X + token * stride_xm + offs_k
    acc_gate = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs).to(tl.float32)
            w_gate = tl.load(gate_ptrs, mask=n_mask[:, None], other=0.0)
            w_up = tl.load(up_ptrs, mask=n_mask[:, None], other=0.0)
        else:
            k_mask = offs_k < H - k0
            x = tl.load(x_ptrs, mask=k_mask, other=0.0).to(tl.float32)
            w_mask = n_mask[:, None] & k_mask[None, :]
            w_gate = tl.load(gate_ptrs, mask=w_mask, other=0.0)
            w_up = tl.load(up_ptrs, mask=w_mask, other=0.0)
        acc_gate += tl.sum(w_gate.to(tl.float32) * x[None, :], axis=1)
        acc_up += tl.sum(w_up.to(tl.float32) * x[None, :], axis=1)
        x_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
    hidden = acc_gate * tl.sigmoid(acc_gate) * acc_up
    tl.store(INTER + pair * stride_im + offs_n, hidden.to(INTER.dtype.element_ty), mask=n_mask)


@triton.jit
def _gemv_down_kernel(INTER, W2, IDS, WEIGHTS, OUT, H, INTER_SIZE, stride_im, stride_we, stride_wn, stride_om,
                      TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    token = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    k_tiles = tl.cdiv(INTER_SIZE, BLOCK_K)
    # One flat loop over (slot, K tile), so the software pipeline runs across the k experts too.
    for step in range(TOP_K * k_tiles):
        pair = token * TOP_K + step // k_tiles
        k0 = (step % k_tiles) * BLOCK_K
        expert = tl.load(IDS + pair).to(tl.int64)
        weight = tl.load(WEIGHTS + pair)
        h_ptrs = INTER + pair * stride_im + k0 + offs_k
        w_ptrs = W2 + expert * stride_we + offs_n[:, None] * stride_wn + (k0 + offs_k)[None, :]
        if EVEN_K:
            h = tl.load(h_ptrs).to(tl.float32)
            w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)
        else:
            k_mask = offs_k < INTER_SIZE - k0
            h = tl.load(h_ptrs, mask=k_mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc += weight * tl.sum(w.to(tl.float32) * h[None, :], axis=1)
    tl.store(OUT + token * stride_om + offs_n, acc.to(OUT.dtype.element_ty), mask=n_mask)


@triton.jit
def _grouped_gemm_kernel(A, W, SORTED, BLOCK_EXPERT, NUM_BLOCKS, WEIGHTS, OUT, N, K, num_pairs,
                         stride_am, stride_we, stride_wn, stride_om, TOP_K: tl.constexpr,
                         GATE_UP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr,
                         PRECISION: tl.constexpr, PER_PAIR: tl.constexpr):
    pid_b = tl.program_id(0)
    if PER_PAIR:   # no alignment: block b is pair b alone (BLOCK_EXPERT holds the routed ids)
        expert = tl.load(BLOCK_EXPERT + pid_b).to(tl.int64)
        rows = pid_b + tl.arange(0, BLOCK_M)
        valid = rows == pid_b
    else:
        if pid_b >= tl.load(NUM_BLOCKS):
            return
        expert = tl.load(BLOCK_EXPERT + pid_b).to(tl.int64)
        rows = tl.load(SORTED + pid_b * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = rows < num_pairs
    a_rows = rows // TOP_K if GATE_UP else rows   # gate_up reads tokens, down reads pairs
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = A + a_rows.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    w_ptrs = W + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
    up_ptrs = w_ptrs + N * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=n_mask[None, :], other=0.0)
        else:
            k_mask = offs_k < K - k0
            a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if UPCAST:   # the interpreter mis-computes bf16 products
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        if GATE_UP:
            if EVEN_K:
                w_up = tl.load(up_ptrs, mask=n_mask[None, :], other=0.0)
            else:
                w_up = tl.load(up_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            if UPCAST:
                w_up = w_up.to(tl.float32)
            acc_up = tl.dot(a, w_up, acc_up, input_precision=PRECISION)
            up_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if GATE_UP:
        out = acc * tl.sigmoid(acc) * acc_up
    else:
        out = acc * tl.load(WEIGHTS + rows, mask=valid, other=0.0)[:, None]
    out_ptrs = OUT + rows.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, out.to(OUT.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


@triton.jit
def _sum_pairs_kernel(PAIR_OUT, OUT, H, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
    token = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = offs < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for slot in tl.static_range(TOP_K):
        acc += tl.load(PAIR_OUT + (token * TOP_K + slot) * H + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + token * H + offs, acc.to(OUT.dtype.element_ty), mask=mask)


def _check(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
           topk_ids: torch.Tensor) -> None:
    num_experts, two_i, hidden = w13.shape
    if x.dim() != 2 or x.shape[1] != hidden or two_i % 2:
        raise ValueError(f"fused_moe: x {tuple(x.shape)} does not match w13 {tuple(w13.shape)}")
    if tuple(w2.shape) != (num_experts, hidden, two_i // 2):
        raise ValueError(f"fused_moe: w2 {tuple(w2.shape)} should be {(num_experts, hidden, two_i // 2)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"fused_moe: routing {tuple(topk_ids.shape)}/{tuple(topk_weights.shape)} "
                         f"for {x.shape[0]} tokens")
    if topk_ids.dtype != torch.int32 or topk_weights.dtype != torch.float32:
        raise ValueError("fused_moe: expert ids must be int32 and routing weights float32")
    for name, t in (("x", x), ("w13", w13), ("w2", w2), ("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if t.stride(-1) != 1 or not (t.dim() < 3 or t.is_contiguous()):
            raise ValueError(f"fused_moe: {name} must be contiguous in its last dimension")


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, config: MoeConfig | None = None) -> torch.Tensor:
    """x [M, H] -> [M, H]: `moe_reference` on the GPU (or under the Triton interpreter)."""
    _check(x, w13, w2, topk_weights, topk_ids)
    num_tokens, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    out = torch.empty_like(x)
    if num_tokens == 0:
        return out
    cfg = config or moe_config(num_tokens, num_experts, top_k, hidden, inter, x.device, x.dtype)
    check_launch_options(cfg.extra, x.device)
    ids, weights = topk_ids.contiguous(), topk_weights.contiguous()
    hidden_states = torch.empty(num_tokens * top_k, inter, dtype=x.dtype, device=x.device)
    launch = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages, **cfg.extra}
    if cfg.impl == "gemv":
        _gemv_gate_up_kernel[(num_tokens * top_k, triton.cdiv(inter, cfg.block_n))](
            x, w13, ids, hidden_states, hidden, inter, x.stride(0), w13.stride(0), w13.stride(1),
            hidden_states.stride(0), TOP_K=top_k, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            EVEN_K=hidden % cfg.block_k == 0, **launch)
        _gemv_down_kernel[(num_tokens, triton.cdiv(hidden, cfg.down_block_n))](
            hidden_states, w2, ids, weights, out, hidden, inter, hidden_states.stride(0), w2.stride(0),
            w2.stride(1), out.stride(0), TOP_K=top_k, BLOCK_N=cfg.down_block_n, BLOCK_K=cfg.block_k,
            EVEN_K=inter % cfg.block_k == 0, **launch)
        return out
    num_pairs = num_tokens * top_k
    if cfg.impl == "pairs":   # one block per pair: no alignment launch (experts read once per pair)
        sorted_ids = block_expert = num_blocks = ids
        max_blocks = num_pairs
    else:
        aligned = align_pairs(ids, num_experts, cfg.block_m)
        sorted_ids, block_expert, num_blocks = aligned.sorted_pair_ids, aligned.block_expert, aligned.num_blocks
        max_blocks = aligned.max_blocks
    common = {"TOP_K": top_k, "BLOCK_M": cfg.block_m, "BLOCK_K": cfg.block_k, "PER_PAIR": cfg.impl == "pairs",
              "UPCAST": interpreting() and x.dtype != torch.float32,   # the interpreter mis-computes bf16
              "PRECISION": "ieee" if x.dtype == torch.float32 else "tf32",   # float32 models get float32 products
              **launch}
    _grouped_gemm_kernel[(max_blocks, triton.cdiv(inter, cfg.block_n))](
        x, w13, sorted_ids, block_expert, num_blocks, weights, hidden_states, inter, hidden, num_pairs,
        x.stride(0), w13.stride(0), w13.stride(1), hidden_states.stride(0), GATE_UP=True,
        BLOCK_N=cfg.block_n, EVEN_K=hidden % cfg.block_k == 0, **common)
    pair_out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    _grouped_gemm_kernel[(max_blocks, triton.cdiv(hidden, cfg.down_block_n))](
        hidden_states, w2, sorted_ids, block_expert, num_blocks, weights, pair_out, hidden, inter, num_pairs,
        hidden_states.stride(0), w2.stride(0), w2.stride(1), pair_out.stride(0), GATE_UP=False,
        BLOCK_N=cfg.down_block_n, EVEN_K=inter % cfg.block_k == 0, **common)
    _sum_pairs_kernel[(num_tokens, triton.cdiv(hidden, SUM_BLOCK))](pair_out, out, hidden, TOP_K=top_k,
                                                                    BLOCK_H=SUM_BLOCK, num_warps=4)
    return out
