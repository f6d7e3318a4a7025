"""Sparse mixture-of-experts feed-forward (Qwen3-MoE, Mixtral): router, top-k, stacked experts.

Checkpoints store experts one by one (`mlp.experts.<e>.gate_proj.weight`, Mixtral's
`block_sparse_moe.experts.<e>.w1/w3/w2.weight`) or already stacked (`mlp.experts.gate_up_proj`
[E, 2I, H], `mlp.experts.down_proj` [E, H, I]); both load into one `w13` [E, 2I, H] (gate rows,
then up rows) and one `w2` [E, H, I], the layout the fused kernels read. Tensor parallelism
splits each expert's intermediate features across ranks, as for a dense MLP.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from engine.model.checkpoint_slice import CheckpointTensor
from engine.model.layers import (
    HasWeight,
    check_and_copy,
    check_shape,
    default_weight_loader,
    divide,
    get_tp_rank_and_size,
    new_param,
    tensor_parallel_all_reduce,
)
from kernels.moe import fused_moe, moe_reference, route_topk, route_topk_ref, router_logits
from kernels.moe.router import MAX_TOKENS as ROUTER_MAX_TOKENS

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# Checkpoint roles of one expert's projections: (w13 gate rows | w13 up rows | w2).
_ROLE = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.)mlp\.experts\.(?P<expert>\d+)\."
                         r"(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
_STACKED = re.compile(r"^(?P<prefix>.*\.)mlp\.experts\.(?P<proj>gate_up_proj|down_proj)$")
# A whole stacked tensor: every shard of its parameter at once.
ALL_EXPERTS = "all experts"


@dataclass(frozen=True)
class MoeSpec:
    num_experts: int
    top_k: int
    intermediate_size: int     # per expert
    renormalize: bool          # divide the chosen k probabilities by their sum


def moe_spec(cfg: PretrainedConfig, layer_idx: int) -> MoeSpec | None:
    """The sparse block of layer `layer_idx`, or None where the layer has a dense MLP."""
    if cfg.model_type == "mixtral":
        return MoeSpec(int(cfg.num_local_experts), int(cfg.num_experts_per_tok), int(cfg.intermediate_size), True)
    if cfg.model_type == "qwen3_moe":
        num_experts = int(getattr(cfg, "num_experts", 0) or 0)
        step = int(getattr(cfg, "decoder_sparse_step", 1) or 1)
        dense = layer_idx in set(getattr(cfg, "mlp_only_layers", None) or ())
        if num_experts == 0 or dense or (layer_idx + 1) % step:
            return None
        return MoeSpec(num_experts, int(cfg.num_experts_per_tok), int(cfg.moe_intermediate_size),
                       bool(getattr(cfg, "norm_topk_prob", True)))
    return None


def moe_checkpoint_name(ckpt_name: str) -> str:
    """Mixtral's `block_sparse_moe.` block is our `mlp.` (its router `gate` and its experts)."""
    return ckpt_name.replace(".block_sparse_moe.", ".mlp.")


def expert_param_name(name: str) -> tuple[str, Any] | None:
    """Expert tensor (named as `moe_checkpoint_name` gives it) -> (our parameter name, shard id);
    None for any other tensor."""
    if (m := _PER_EXPERT.match(name)) is not None:
        role = _ROLE[m["proj"]]
        param = "w2_weight" if role == "down" else "w13_weight"
        return f"{m['prefix']}mlp.experts.{param}", (role, int(m["expert"]))
    if (m := _STACKED.match(name)) is not None:
        param = "w13_weight" if m["proj"] == "gate_up_proj" else "w2_weight"
        return f"{m['prefix']}mlp.experts.{param}", ALL_EXPERTS
    return None


class Router(HasWeight):
    """Router logits [T, E] = x · Wᵀ (replicated on every rank)."""

    def __init__(self, hidden_size: int, num_experts: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = new_param((num_experts, hidden_size), dtype, default_weight_loader)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.shape[0] <= ROUTER_MAX_TOKENS:   # decode: one launch, not the matmul table's split-K pair
            return router_logits(x, self.weight)
        return self.product(x)


class FusedExperts(nn.Module):
    """All experts of one layer, stacked; forward runs the routed (token, expert) pairs."""

    def __init__(self, spec: MoeSpec, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank_and_size()
        self.num_experts = spec.num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = spec.intermediate_size
        inter = divide(spec.intermediate_size, self.tp_size, "expert intermediate size")
        self.w13_weight = new_param((spec.num_experts, 2 * inter, hidden_size), dtype, self.weight_loader)
        self.w2_weight = new_param((spec.num_experts, hidden_size, inter), dtype, self.weight_loader)

    def expected_shards(self) -> dict[str, set[Any]]:
        """Shard ids each parameter needs from a per-expert checkpoint (suffix -> ids)."""
        experts = range(self.num_experts)
        return {"w13_weight": {(role, e) for e in experts for role in ("gate", "up")},
                "w2_weight": {("down", e) for e in experts}}

    def weight_loader(self, param: nn.Parameter, loaded_weight: CheckpointTensor, shard_id: Any = None) -> None:
        inter = param.shape[1] // 2 if param is self.w13_weight else param.shape[2]
        offset = self.tp_rank * inter
        full = self.intermediate_size
        if shard_id == ALL_EXPERTS:
            if param is self.w13_weight:
                check_shape(loaded_weight, (self.num_experts, 2 * full, self.hidden_size), "stacked gate_up")
                for half in range(2):
                    check_and_copy(param.narrow(1, half * inter, inter),
                                    loaded_weight.narrow(1, half * full + offset, inter), "stacked gate_up")
            else:
                check_shape(loaded_weight, (self.num_experts, self.hidden_size, full), "stacked down")
                check_and_copy(param, loaded_weight.narrow(2, offset, inter), "stacked down")
            return
        if not (isinstance(shard_id, tuple) and len(shard_id) == 2 and 0 <= shard_id[1] < self.num_experts):
            raise ValueError(f"expert weights need a (role, expert < {self.num_experts}) shard, got {shard_id!r}")
        role, expert = shard_id
        if role == "down":
            check_shape(loaded_weight, (self.hidden_size, full), f"expert {expert} down")
            check_and_copy(param[expert], loaded_weight.narrow(1, offset, inter), f"expert {expert} down")
            return
        check_shape(loaded_weight, (full, self.hidden_size), f"expert {expert} {role}")
        rows = param[expert].narrow(0, 0 if role == "gate" else inter, inter)
        check_and_copy(rows, loaded_weight.narrow(0, offset, inter), f"expert {expert} {role}")

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            return fused_moe(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids)
        return moe_reference(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids)


class SparseMoeBlock(nn.Module):
    """out = Σ over the top-k experts of softmax weight · expert(x), per token."""

    def __init__(self, spec: MoeSpec, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.top_k = spec.top_k
        self.renormalize = spec.renormalize
        self.gate = Router(hidden_size, spec.num_experts, dtype)
        self.experts = FusedExperts(spec, hidden_size, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        route = route_topk if x.is_cuda else route_topk_ref
        topk_weights, topk_ids = route(logits, self.top_k, self.renormalize)
        return tensor_parallel_all_reduce(self.experts(x, topk_weights, topk_ids))
