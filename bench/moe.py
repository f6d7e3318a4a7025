"""Fused MoE on the GPU at Qwen3-30B-A3B's expert shape (128 experts, top-8, hidden 2048, intermediate
768, bf16): the tuned config table (`--tune`, what `fdserve tune --moe` writes), the layer against the
float32 torch reference for M in 1..4096 (`--check`), and the fused kernels against a per-expert loop
of cuBLAS GEMMs, the way transformers runs experts (`--bench`).

    python bench/moe.py --tune --check --bench --out bench/results/moe

Timings: the loop needs the host to see the routing (which experts, how many rows), so it runs
eagerly; the fused call is timed eagerly too (the same CUDA events around both) and, as the engine
runs decode, as a replayed CUDA graph. Each call is routed afresh (16 routings cycled) so expert
weights come from HBM. `floor_us` is the distinct experts' weight bytes at 4.8 TB/s (H200 HBM3e).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # `python bench/moe.py` from anywhere

from engine.tools.tune import GraphTimer  # noqa: E402
from engine.tools.tune_moe import DEFAULT_MOE_MS, ROUTINGS, tune_moe  # noqa: E402
from kernels.moe import fused_moe, moe_reference, route_topk, route_topk_ref  # noqa: E402
from kernels.moe.config import MoeConfig, MoeTable, moe_config, table_file_name  # noqa: E402

SHAPE = (128, 8, 2048, 768)        # experts, top-k, hidden, intermediate
BENCH_MS = (1, 8, 64, 512, 4096)
HBM_BYTES_PER_S = 4.8e12


def operands(m: int, gen: torch.Generator) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    experts, top_k, hidden, _ = SHAPE
    x = torch.randn(m, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    routes = [route_topk_ref(torch.randn(m, experts, device="cuda", generator=gen), top_k, True)
              for _ in range(ROUTINGS)]
    return x, routes


def floor_us(routes: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    experts, _, hidden, inter = SHAPE
    distinct = statistics.mean(int(torch.unique(ids).numel()) for _, ids in routes)
    return distinct * 3 * hidden * inter * 2 / HBM_BYTES_PER_S * 1e6


def eager_us(fn: Any, reps: int = 20) -> float:
    for i in range(3):
        fn(i % ROUTINGS)
    torch.cuda.synchronize()
    times = []
    for r in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(r % ROUTINGS)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times)


def config_for(table: MoeTable | None, m: int) -> MoeConfig:
    found = table.lookup(SHAPE, m) if table is not None else None
    experts, top_k, hidden, inter = SHAPE
    return found or moe_config(m, experts, top_k, hidden, inter, torch.device("cuda"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tune", action="store_true", help="tune the configs first (the table the rest uses)")
    p.add_argument("--quick", action="store_true", help="the tuner's smaller grid")
    p.add_argument("--check", action="store_true")
    p.add_argument("--bench", action="store_true")
    p.add_argument("--out", type=Path, default=Path("bench/results/moe"))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    experts, top_k, hidden, inter = SHAPE
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    w2 = (torch.randn(experts, hidden, inter, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    table: MoeTable | None = None
    result: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": SHAPE}
    if args.tune:
        table, failures = tune_moe(SHAPE, list(DEFAULT_MOE_MS), torch.bfloat16, quick=args.quick)
        (args.out / table_file_name(table.gpu)).write_text(json.dumps(table.to_json(), indent=1))
        result["tune_failures"] = failures
    summary: list[str] = []
    if args.check:
        rows: list[dict[str, Any]] = []
        for m in (1, 2, 3, 4, 8, 16, 17, 32, 64, 128, 256, 512, 1000, 1024, 2048, 4096):
            x, routes = operands(m, gen)
            logits = torch.randn(m, experts, device="cuda", generator=gen)   # float32: no ties
            weights, ids = route_topk(logits.to(torch.bfloat16), top_k, True)
            ref = moe_reference(x, w13, w2, weights, ids, compute_dtype=torch.float32)
            cfg = config_for(table, m)
            out = fused_moe(x, w13, w2, weights, ids, cfg)
            err = float((out.float() - ref).norm() / ref.norm())
            route_w, route_ids = route_topk(logits, top_k, True)
            ref_w, ref_ids = route_topk_ref(logits, top_k, True)
            rows.append({"m": m, "impl": cfg.impl, "rel_err": err,
                         "routing_ids_equal": bool(torch.equal(route_ids, ref_ids)),
                         "routing_weight_err": float((route_w - ref_w).abs().max())})
        result["check"] = rows
        worst = max(float(r["rel_err"]) for r in rows)
        same_routes = all(r["routing_ids_equal"] for r in rows)
        summary.append(f"check: worst rel err {worst:.2e} over M 1..4096 (goal < 1e-2): "
                       f"{'PASS' if worst < 1e-2 else 'FAIL'}; routing ids as torch.topk: {same_routes}")
    if args.bench:
        timer = GraphTimer(reps=10)
        timed: list[dict[str, Any]] = []
        for m in BENCH_MS:
            x, routes = operands(m, gen)
            cfg = config_for(table, m)

            def fused(i: int, x: torch.Tensor = x, routes: list = routes, cfg: MoeConfig = cfg) -> torch.Tensor:
                weights, ids = routes[i]
                return fused_moe(x, w13, w2, weights, ids, cfg)

            def loop(i: int, x: torch.Tensor = x, routes: list = routes) -> torch.Tensor:
                weights, ids = routes[i]
                return moe_reference(x, w13, w2, weights, ids)

            row: dict[str, Any] = {"m": m, "impl": cfg.impl, "config": cfg.to_dict(), "loop_us": eager_us(loop),
                   "fused_eager_us": eager_us(fused), "fused_graph_us": timer(fused, ROUTINGS),
                   "floor_us": floor_us(routes)}
            row["speedup_eager"] = row["loop_us"] / row["fused_eager_us"]
            timed.append(row)
        result["bench"] = timed
        summary.append("  M  impl   loop µs  fused µs (graph)  floor µs  fused/loop")
        for r in timed:
            summary.append(f"{r['m']:>4} {r['impl']:>5} {r['loop_us']:9.1f} {r['fused_eager_us']:9.1f} "
                           f"({r['fused_graph_us']:7.1f}) {r['floor_us']:9.1f}   x{r['speedup_eager']:.2f}")
    (args.out / "moe.json").write_text(json.dumps(result, indent=1))
    print("\n".join(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
