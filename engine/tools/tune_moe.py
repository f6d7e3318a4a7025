"""`fdserve tune --moe`: time the fused-MoE launch configs at the model's MoE shape on this GPU and
write the table `kernels.moe.config` reads (`moe_table-<gpu>.json`).

Per token count M: the pair GEMV and the per-pair GEMM over small grids (M ≤ GEMV_MAX_TUNE_M) and
the grouped GEMM over another, each checked against the float32 torch reference first; the fastest correct config wins.
Timing as `fdserve tune`'s (one CUDA graph of many calls, median over replays), each call routed
to different experts so the weights come from HBM as in a decode step.
torch, Triton and the kernels are imported inside the functions: `fdserve --help` imports this module.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from itertools import product
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from kernels.moe.config import MoeConfig, MoeShape, MoeTable

DEFAULT_MOE_MS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
GEMV_MAX_TUNE_M = 16
MAX_REL_ERR = 1e-2          # vs the float32 reference; bf16 hidden and output roundings are ~4e-3
ROUTINGS = 16               # distinct routings cycled through per timing


def model_moe_shape(hf_config: Any) -> MoeShape | None:
    """(experts, top-k, hidden, intermediate) of the model's sparse layers, None for a dense model."""
    from engine.model.moe import moe_spec

    for layer in range(int(hf_config.num_hidden_layers)):
        spec = moe_spec(hf_config, layer)
        if spec is not None:
            return spec.num_experts, spec.top_k, int(hf_config.hidden_size), spec.intermediate_size
    return None


def candidate_configs(m: int, quick: bool = False) -> list[MoeConfig]:
    from kernels.moe.config import MoeConfig

    found: list[MoeConfig] = []
    if m <= GEMV_MAX_TUNE_M:
        for bn, dbn, bk, warps in product((16, 32), (8, 16, 32), (128, 256), (4,) if quick else (4, 8)):
            found.append(MoeConfig("gemv", block_n=bn, down_block_n=dbn, block_k=bk, num_warps=warps, num_stages=3))
        for bn, bk, warps in product((32, 64, 128), (64, 128, 256), (4,) if quick else (4, 8)):
            found.append(MoeConfig("pairs", block_m=16, block_n=bn, down_block_n=bn, block_k=bk, num_warps=warps,
                                   num_stages=3))
    block_ms = (16, 32) if m <= 256 else (32, 64) if m <= 1024 else (64, 128)
    for bm, bn, bk, warps, stages in product(block_ms, (64, 128), (64, 128), (4, 8), (3,) if quick else (3, 4)):
        if bm * bn >= 128 * 128 and warps == 4:
            continue   # a 128x128 fp32 accumulator pair needs 8 warps' registers
        found.append(MoeConfig("gemm", block_m=bm, block_n=bn, down_block_n=bn, block_k=bk, num_warps=warps,
                               num_stages=stages))
    return found


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def tune_moe(shape: MoeShape, ms: list[int], dtype: torch.dtype, *, reps: int = 10, quick: bool = False,
             log: Callable[[str], None] = print) -> tuple[MoeTable, list[str]]:
    """Measure every candidate at every M; returns the table and the correctness failures."""
    import torch
    from triton.errors import TritonError

    from engine.tools.tune import GraphTimer
    from kernels.moe import fused_moe, moe_reference, route_topk_ref
    from kernels.moe.config import MoeTable

    num_experts, top_k, hidden, inter = shape
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, device=device, generator=gen) * 0.02).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, device=device, generator=gen) * 0.02).to(dtype)
    table = MoeTable(torch.cuda.get_device_name(device), str(dtype).removeprefix("torch."))
    failures: list[str] = []
    timer = GraphTimer(reps=reps)
    for m in ms:
        x = torch.randn(m, hidden, device=device, generator=gen).to(dtype)
        routes = [route_topk_ref(torch.randn(m, num_experts, device=device, generator=gen), top_k, True)
                  for _ in range(ROUTINGS)]
        ref = moe_reference(x, w13, w2, *routes[0], compute_dtype=torch.float32)
        times: dict[str, float] = {}
        best: tuple[float, MoeConfig | None] = (math.inf, None)
        for cfg in candidate_configs(m, quick):
            try:
                err = _rel_err(fused_moe(x, w13, w2, *routes[0], config=cfg), ref)
            except (TritonError, RuntimeError, ValueError) as exc:   # e.g. OutOfResources
                log(f"  skip M={m} {cfg}: {type(exc).__name__}: {str(exc)[:120]}")
                continue
            if not err <= MAX_REL_ERR:
                failures.append(f"M={m} {cfg}: rel err {err:.2e}")
                continue

            def run(i: int, c: MoeConfig = cfg, x: torch.Tensor = x,
                    routes: list[tuple[torch.Tensor, torch.Tensor]] = routes) -> torch.Tensor:
                return fused_moe(x, w13, w2, *routes[i], config=c)

            t = timer(run, ROUTINGS)
            times[cfg.impl] = min(times.get(cfg.impl, math.inf), t)
            if t < best[0]:
                best = (t, cfg)
        if best[1] is None:
            failures.append(f"M={m}: no candidate ran")
            continue
        table.entries.setdefault(shape, {})[m] = best[1]
        table.timings.setdefault(shape, {})[m] = {k: round(v, 2) for k, v in times.items()}
        c = best[1]
        log(f"MoE {shape} M={m:<5} " + "  ".join(f"{k} {v:8.1f}" for k, v in times.items())
            + f" µs -> {c.impl} BM {c.block_m} BN {c.block_n}/{c.down_block_n} BK {c.block_k} "
            f"warps {c.num_warps} stages {c.num_stages}")
    return table, failures
