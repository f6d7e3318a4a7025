"""Fused MoE kernels (routing, alignment, pair GEMV, grouped GEMM) against float64 torch.

Without a GPU they run in Triton's interpreter at small odd shapes: token counts that fill no
block evenly, hidden/intermediate sizes off the K tile, experts that receive no token, top-k 1,
2 and 8 over 8, 64 and 128 experts. Speed is `bench/moe.py`'s job.
"""
from __future__ import annotations

import pytest
import torch

from kernels.moe import (
    MoeConfig,
    RouterConfig,
    align_pairs,
    fused_moe,
    max_aligned_blocks,
    moe_config,
    moe_reference,
    route_topk,
    route_topk_ref,
    router_logits,
    router_logits_ref,
)
from kernels.moe.config import MoeTable, default_config

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp32 in the interpreter is exact up to summation order; bf16 adds the output and hidden roundings.
TOL = {torch.float32: 1e-5 if DEVICE == "cpu" else 5e-3, torch.bfloat16: 1e-2}
SMALL = {impl: MoeConfig(impl, block_m=16, block_n=16, down_block_n=16, block_k=32, num_stages=1)
         for impl in ("gemv", "gemm", "pairs")}


def operands(m: int, experts: int, hidden: int, inter: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter ** 0.5
    logits = torch.randn(m, experts, generator=gen) * 2
    return [t.to(dtype).to(DEVICE) for t in (x, w13, w2)] + [logits.to(DEVICE)]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


@pytest.mark.parametrize("experts,top_k", [(8, 1), (8, 2), (64, 8), (128, 8), (12, 3)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_routing_matches_torch(experts: int, top_k: int, renormalize: bool) -> None:
    logits = torch.randn(37, experts, generator=torch.Generator().manual_seed(experts + top_k)).to(DEVICE)
    weights, ids = route_topk(logits, top_k, renormalize)   # float32 logits: no ties
    ref_w, ref_ids = route_topk_ref(logits, top_k, renormalize)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, atol=1e-6, rtol=1e-5)
    if renormalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(37, device=DEVICE))


def test_routing_ties_go_to_the_lower_expert() -> None:
    logits = torch.tensor([[0.5, 2.0, 0.5, 2.0, -1.0]], device=DEVICE).to(torch.bfloat16)
    weights, ids = route_topk(logits, 3, renormalize=False)
    assert ids.tolist() == [[1, 3, 0]]
    torch.testing.assert_close(weights, route_topk_ref(logits, 3, False)[0])


def test_routing_rejects_bad_top_k() -> None:
    with pytest.raises(ValueError, match="top_k"):
        route_topk(torch.zeros(2, 4, device=DEVICE), 5, True)


@pytest.mark.parametrize("tokens,experts,top_k,block_m", [(1, 8, 2, 16), (33, 8, 2, 16), (7, 128, 8, 16),
                                                          (70, 64, 8, 32), (300, 8, 1, 64)])
def test_alignment_groups_every_pair_once(tokens: int, experts: int, top_k: int, block_m: int) -> None:
    gen = torch.Generator().manual_seed(tokens)
    # Skewed routing: a few experts get most pairs, most get none.
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    ids = torch.where(torch.rand(ids.shape, generator=gen) < 0.5, ids % 3, ids).to(torch.int32)
    ids = torch.stack([row if row.unique().numel() == top_k else torch.randperm(experts, generator=gen)[:top_k]
                       for row in ids]).to(torch.int32)
    aligned = align_pairs(ids.to(DEVICE), experts, block_m)
    num_pairs = ids.numel()
    sorted_ids = aligned.sorted_pair_ids.cpu()
    block_expert = aligned.block_expert.cpu()
    num_blocks = int(aligned.num_blocks.item())
    counts = torch.bincount(ids.reshape(-1).long(), minlength=experts)
    assert aligned.max_blocks == max_aligned_blocks(num_pairs, experts, block_m)
    assert num_blocks == int(((counts + block_m - 1) // block_m).sum()) <= aligned.max_blocks
    used = sorted_ids[: num_blocks * block_m]
    real = used[used < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))          # each pair exactly once
    assert bool((sorted_ids[num_blocks * block_m:] == num_pairs).all())  # the rest is padding
    assert bool((block_expert[num_blocks:] == experts).all())
    flat = ids.reshape(-1)
    for b in range(num_blocks):
        rows = used[b * block_m:(b + 1) * block_m]
        rows = rows[rows < num_pairs]
        assert rows.numel() > 0 and bool((flat[rows.long()] == block_expert[b]).all())
    starts = torch.nonzero(block_expert[:num_blocks].diff()).flatten()
    assert torch.equal(block_expert[:num_blocks], block_expert[:num_blocks].sort().values)  # experts ascend
    assert starts.numel() == int((counts > 0).sum()) - 1


@pytest.mark.parametrize("impl", ["gemv", "gemm", "pairs"])
@pytest.mark.parametrize("tokens,experts,top_k,hidden,inter", [
    (1, 8, 2, 64, 48), (3, 8, 1, 96, 32), (17, 64, 8, 64, 40), (33, 128, 8, 64, 32), (5, 8, 2, 80, 48)])
def test_fused_moe_matches_float64(impl: str, tokens: int, experts: int, top_k: int, hidden: int,
                                   inter: int) -> None:
    x, w13, w2, logits = operands(tokens, experts, hidden, inter, torch.float32, seed=tokens * experts)
    weights, ids = route_topk(logits, top_k, renormalize=top_k > 1)
    ref = moe_reference(x, w13, w2, weights, ids, compute_dtype=torch.float64)
    out = fused_moe(x, w13, w2, weights, ids, SMALL[impl])
    assert out.shape == x.shape and out.dtype == x.dtype
    assert rel_err(out, ref) < TOL[torch.float32], rel_err(out, ref)
    if tokens * top_k < experts:
        assert torch.unique(ids).numel() < experts   # some experts really were empty


@pytest.mark.parametrize("impl", ["gemv", "gemm"])
def test_fused_moe_bf16(impl: str) -> None:
    x, w13, w2, logits = operands(9, 64, 64, 48, torch.bfloat16, seed=5)
    weights, ids = route_topk(logits, 8, renormalize=True)
    ref = moe_reference(x.double(), w13.double(), w2.double(), weights, ids)
    out = fused_moe(x, w13, w2, weights, ids, SMALL[impl])
    assert out.dtype == torch.bfloat16 and rel_err(out, ref) < TOL[torch.bfloat16]


@pytest.mark.skipif(torch.cuda.is_available() and not torch.version.hip,
                    reason="AMD launch options run on AMD GPUs or in the interpreter")
@pytest.mark.parametrize("tokens", [1, 9])
def test_amd_default_configs_run(tokens: int) -> None:
    cfg = default_config(tokens, 8, 2, "amd")
    assert cfg.extra and cfg.impl == ("pairs" if tokens == 1 else "gemm")
    x, w13, w2, logits = operands(tokens, 8, 64, 48, torch.float32, seed=tokens)
    weights, ids = route_topk(logits, 2, renormalize=True)
    ref = moe_reference(x, w13, w2, weights, ids, compute_dtype=torch.float64)
    assert rel_err(fused_moe(x, w13, w2, weights, ids, cfg), ref) < TOL[torch.float32]


@pytest.mark.parametrize("tokens,experts,hidden", [(1, 128, 96), (3, 12, 200), (8, 64, 64), (5, 7, 1000)])
@pytest.mark.parametrize("block_e,block_k", [(4, 64), (1, 512), (8, 128)])
def test_router_logits_match_float64(tokens: int, experts: int, hidden: int, block_e: int, block_k: int) -> None:
    gen = torch.Generator().manual_seed(tokens * experts + hidden)
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE)
    weight = (torch.randn(experts, hidden, generator=gen) / hidden ** 0.5).to(DEVICE)
    out = router_logits(x, weight, RouterConfig(block_e=block_e, block_k=block_k))
    want = x.double() @ weight.double().T
    assert out.shape == (tokens, experts) and out.dtype == x.dtype
    assert rel_err(out, want) < TOL[torch.float32], rel_err(out, want)
    assert rel_err(out, router_logits_ref(x, weight)) < TOL[torch.float32]


def test_router_logits_bf16_are_rounded_like_the_linear_layer() -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 160, generator=gen).to(torch.bfloat16).to(DEVICE)
    weight = (torch.randn(24, 160, generator=gen) / 12).to(torch.bfloat16).to(DEVICE)
    out = router_logits(x, weight, RouterConfig(block_e=4, block_k=64))
    assert out.dtype == torch.bfloat16
    assert rel_err(out, x.double() @ weight.double().T) < TOL[torch.bfloat16]
    with pytest.raises(ValueError, match="router"):
        router_logits(x, weight[:, :100])


@pytest.mark.parametrize("tokens,experts,top_k,hidden,inter", [
    (1, 128, 8, 64, 48), (3, 8, 1, 96, 32), (5, 12, 3, 80, 40), (2, 64, 8, 64, 32), (1, 32, 20, 48, 24)])
def test_pairs_path_matches_float64(tokens: int, experts: int, top_k: int, hidden: int, inter: int) -> None:
    """The per-pair path, the one decode takes, on routings as the router produces them: top-k 20
    holds more pairs than a 16-row tile, unnormalised weights keep their scale."""
    x, w13, w2, logits = operands(tokens, experts, hidden, inter, torch.float32, seed=tokens + experts + top_k)
    for renormalize in (True, False):
        weights, ids = route_topk_ref(logits, top_k, renormalize)
        ref = moe_reference(x, w13, w2, weights, ids, compute_dtype=torch.float64)
        out = fused_moe(x, w13, w2, weights, ids, SMALL["pairs"])
        assert out.shape == x.shape and out.dtype == x.dtype
        assert rel_err(out, ref) < TOL[torch.float32], (renormalize, rel_err(out, ref))


def test_pairs_bf16() -> None:
    x, w13, w2, logits = operands(3, 64, 64, 48, torch.bfloat16, seed=6)
    weights, ids = route_topk_ref(logits, 8, True)
    ref = moe_reference(x.double(), w13.double(), w2.double(), weights, ids)
    out = fused_moe(x, w13, w2, weights, ids, SMALL["pairs"])
    assert out.dtype == torch.bfloat16 and rel_err(out, ref) < TOL[torch.bfloat16]


def test_experts_without_tokens_and_a_single_busy_expert() -> None:
    x, w13, w2, _ = operands(21, 8, 64, 32, torch.float32, seed=3)
    ids = torch.full((21, 1), 5, dtype=torch.int32, device=DEVICE)   # every token to expert 5
    weights = torch.rand(21, 1, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    ref = moe_reference(x, w13, w2, weights, ids, compute_dtype=torch.float64)
    for impl in SMALL:
        assert rel_err(fused_moe(x, w13, w2, weights, ids, SMALL[impl]), ref) < TOL[torch.float32]


def test_reference_equals_an_explicit_sum() -> None:
    """The oracle itself, against the definition written out per token."""
    x, w13, w2, logits = operands(4, 8, 16, 8, torch.float64, seed=9)
    weights, ids = route_topk_ref(logits, 2, True)
    want = torch.zeros_like(x)
    for t in range(4):
        for j in range(2):
            e = int(ids[t, j])
            gate, up = (w13[e] @ x[t]).chunk(2)
            want[t] += weights[t, j].double() * (w2[e] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(moe_reference(x, w13, w2, weights, ids), want)


def test_fused_moe_rejects_mismatched_shapes() -> None:
    x, w13, w2, logits = operands(2, 8, 64, 32, torch.float32, seed=0)
    weights, ids = route_topk(logits, 2, True)
    with pytest.raises(ValueError, match="w2"):
        fused_moe(x, w13, w2[:, :, :16].contiguous(), weights, ids)
    with pytest.raises(ValueError, match="int32"):
        fused_moe(x, w13, w2, weights, ids.long())


def test_default_configs_and_table_lookup() -> None:
    assert default_config(1, 128, 8, "cpu").impl == "gemv" and default_config(9, 128, 8, "cpu").impl == "gemm"
    assert default_config(1, 128, 8, "nvidia").impl == "pairs" and default_config(2, 128, 8, "nvidia").block_m == 16
    big = default_config(4096, 128, 8, "nvidia")
    assert big.impl == "gemm" and big.block_m == 64 and big.block_k == 64
    assert default_config(4096, 128, 8, "nvidia", element_bytes=4).block_k == 32
    amd = default_config(4096, 128, 8, "amd")
    assert amd.num_stages == 1 and amd.extra["waves_per_eu"] == 2
    table = MoeTable("gpu", "bfloat16")
    shape = (128, 8, 2048, 768)
    table.entries[shape] = {1: SMALL["gemv"], 64: SMALL["gemm"]}
    assert table.lookup(shape, 1) == SMALL["gemv"]
    assert table.lookup(shape, 2) == SMALL["gemm"] and table.lookup(shape, 5000) == SMALL["gemm"]
    assert table.lookup((8, 2, 64, 32), 1) is None
    again = MoeTable.from_json(table.to_json())
    assert again.entries == table.entries
    assert moe_config(1, 128, 8, 2048, 768, torch.device("cpu")).impl == "gemv"
    with pytest.raises(ValueError, match="block_m"):
        MoeConfig("gemm", block_m=8)


def test_tuner_shapes_and_candidates() -> None:
    import transformers as tf

    from engine.tools.tune_moe import candidate_configs, model_moe_shape

    qwen = tf.Qwen3MoeConfig(hidden_size=64, num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
                             moe_intermediate_size=48, mlp_only_layers=[0])
    assert model_moe_shape(qwen) == (8, 2, 64, 48)
    assert model_moe_shape(tf.LlamaConfig(num_hidden_layers=2)) is None
    small, large = candidate_configs(1, quick=True), candidate_configs(512, quick=True)
    assert {c.impl for c in small} == {"gemv", "pairs", "gemm"} and {c.impl for c in large} == {"gemm"}
    assert all(c.block_m >= 32 for c in large) and len({repr(c) for c in small}) == len(small)
