"""Mixture-of-experts kernels: router logits, top-k routing, expert alignment and the fused expert GEMMs.

`route_topk` + `fused_moe` run a sparse MoE block on the GPU (with `router_logits` in
front at decode batch sizes); `route_topk_ref` + `moe_reference` are the same functions in torch (the
CPU path and the kernels' oracle).
"""
from kernels.moe.align import AlignedPairs, align_pairs, max_aligned_blocks
from kernels.moe.config import MoeConfig, moe_config
from kernels.moe.fused import fused_moe
from kernels.moe.reference import moe_reference, route_topk_ref
from kernels.moe.router import RouterConfig, router_logits, router_logits_ref
from kernels.moe.routing import route_topk

__all__ = ["AlignedPairs", "align_pairs", "max_aligned_blocks", "MoeConfig", "moe_config", "fused_moe",
           "moe_reference", "route_topk_ref", "RouterConfig", "router_logits",
           "router_logits_ref", "route_topk"]
