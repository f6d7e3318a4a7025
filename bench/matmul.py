"""Decode-GEMM correctness and speed on the GPU: flat GEMM, GEMV and adaptive vs cuBLAS (F.linear).

    python bench/matmul.py [--m 1,2,...] [--table FILE] [--out DIR] [--quick-tune]

Llama-3.1-8B's five decode products in bf16 (qkv 4096→6144, o 4096→4096, gate_up 4096→28672,
down 14336→4096, lm_head 4096→128256) at M = 1..16, 32, 64, 128, 256:
1. every variant against the fp32 product on fresh random data, before any timing;
2. CUDA-graph timing (engine.tools.tune.GraphTimer: many calls per graph cycling through weight copies
   that exceed 3× the L2, so W always comes from HBM), median of replays, and the fraction of the
   weight-read floor (weight + x + y bytes at the copy bandwidth measured in the same run). The
   variants of one (shape, M) are timed in ROUNDS interleaved rounds and each keeps its median,
   because timings of the same call drift between runs taken seconds apart.
Variants: cublas, flat and gemv (M ≤ 8) with their default configs, adaptive (the table at --table,
else the one the server reads for this GPU; with neither, the five shapes are tuned first, and it
says so). Writes DIR/matmul.json; prints the table and the goal checks last.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.kernels import copy_bandwidth  # noqa: E402
from engine.tools.tune import DEFAULT_MS, GraphTimer, tune_shapes  # noqa: E402
from kernels.gemm.dispatch import AdaptiveMatmul, MatmulTable, find_table_path, load_table  # noqa: E402
from kernels.gemm.matmul import GEMV_MAX_M, flat_gemm, gemv  # noqa: E402

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096),
          "lm_head": (4096, 128256)}
DEFAULT_M = sorted({*range(1, 17), *DEFAULT_MS})
MAX_REL_ERR = 1e-2
GOAL_SPEEDUP = 1.3            # flat/adaptive vs cuBLAS on qkv and o at M <= 16
GOAL_ADAPTIVE_SLOWDOWN = 1.03  # adaptive / cuBLAS at every M <= 256
ROUNDS = 3
Product = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]   # (x [M, K], weight [N, K]) -> x · weightᵀ


def get_table(path: str | None, quick: bool) -> tuple[MatmulTable, str]:
    table_path = Path(path) if path else find_table_path(torch.cuda.get_device_name())
    table = load_table(table_path)
    if table is not None:
        return table, str(table_path)
    print(f"no matmul table at {table_path}: tuning the five shapes first (engine.tools.tune)", flush=True)
    table, failures = tune_shapes({f"{k}_proj" if k != "lm_head" else k: s for k, s in SHAPES.items()},
                                  list(DEFAULT_MS), torch.bfloat16, True, quick=quick)
    if failures:
        print("tuning found kernel errors:\n  " + "\n  ".join(failures), flush=True)
    return table, "tuned in this run"


def variants(m: int, adaptive: AdaptiveMatmul) -> dict[str, Product]:
    fns: dict[str, Product] = {"cublas": F.linear, "flat": flat_gemm, "adaptive": adaptive}
    if m <= GEMV_MAX_M:
        fns["gemv"] = gemv
    return fns


def _on_copy(fn: Product, x: torch.Tensor, weights: list[torch.Tensor]) -> Callable[[int], torch.Tensor]:
    """What GraphTimer calls with a copy index i: fn on x and the i-th weight copy."""
    return lambda i: fn(x, weights[i])


def run(ms: list[int], adaptive: AdaptiveMatmul, copy_bw: float, seed: int) -> list[dict]:
    timer, rows = GraphTimer(reps=10), []
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for name, (k, n) in SHAPES.items():
        w0 = (torch.randn(n, k, device="cuda", generator=gen) * k ** -0.5).to(torch.bfloat16)
        copies = timer.copies_for(w0.numel() * 2)
        weights = [w0] + [w0.clone() for _ in range(copies - 1)]
        for m in ms:
            x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
            ref = F.linear(x.float(), w0.float())
            row: dict[str, Any] = {"shape": name, "K": k, "N": n, "M": m,
                                   "adaptive_choice": adaptive.choose(m, n, k).impl,
                                   "floor_us": 2 * (n * k + m * k + m * n) / copy_bw * 1e6}
            timed: dict[str, Product] = {}
            for vname, fn in variants(m, adaptive).items():
                out = fn(x, w0)
                err = float((out.float() - ref).norm() / ref.norm())
                row[f"{vname}_err"] = err
                row[f"{vname}_us"] = None        # never time a wrong result
                if err <= MAX_REL_ERR:
                    timed[vname] = fn
            samples: dict[str, list[float]] = {v: [] for v in timed}
            for _ in range(ROUNDS):
                for vname, fn in timed.items():
                    samples[vname].append(timer(_on_copy(fn, x, weights), copies))
            for vname, ts in samples.items():
                row[f"{vname}_us"] = statistics.median(ts)
                row[f"{vname}_rounds_us"] = ts
            rows.append(row)
            print(_line(row), flush=True)
        weights.clear()
        torch.cuda.empty_cache()
    return rows


def _line(r: dict) -> str:
    def cell(v: str) -> str:
        t = r.get(f"{v}_us")
        if f"{v}_err" not in r:
            return f"{'-':>16}"
        if t is None:
            return f"{'WRONG':>16}"
        return f"{t:7.2f} ({r['floor_us'] / t:4.0%})"

    speed = {v: r["cublas_us"] / r[f"{v}_us"] for v in ("flat", "gemv", "adaptive")
             if r.get(f"{v}_us") and r.get("cublas_us")}
    return (f"{r['shape']:>8} M={r['M']:<4}" + "".join(cell(v) for v in ("cublas", "flat", "gemv", "adaptive"))
            + f"  adaptive={r['adaptive_choice']:<6} x flat {speed.get('flat', 0):.2f}"
            f" gemv {speed.get('gemv', 0):.2f} adaptive {speed.get('adaptive', 0):.2f}")


def goals(rows: list[dict]) -> list[str]:
    """The targets, as measured here: pass/fail lines."""
    lines, wrong = [], [r for r in rows for v in ("cublas", "flat", "gemv", "adaptive")
                         if f"{v}_err" in r and r[f"{v}_us"] is None]
    lines.append(f"correctness: {len(wrong)} (shape, M, variant) results above rel err {MAX_REL_ERR}")
    small = [r for r in rows if r["shape"] in ("qkv", "o") and r["M"] <= 16 and r["cublas_us"]]
    for v in ("flat", "adaptive"):
        ratios = [r["cublas_us"] / r[f"{v}_us"] for r in small if r.get(f"{v}_us")]
        if ratios:
            lines.append(f"{v} vs cuBLAS on qkv/o at M<=16: min x{min(ratios):.2f}, median "
                         f"x{sorted(ratios)[len(ratios) // 2]:.2f} (goal >= x{GOAL_SPEEDUP}: "
                         f"{'PASS' if min(ratios) >= GOAL_SPEEDUP else 'FAIL'})")
    slow = [(r["adaptive_us"] / r["cublas_us"], r["shape"], r["M"]) for r in rows
            if r.get("adaptive_us") and r.get("cublas_us")]
    if slow:
        worst = max(slow)
        lines.append(f"adaptive / cuBLAS worst {worst[0]:.3f} at {worst[1]} M={worst[2]} (goal <= "
                     f"{GOAL_ADAPTIVE_SLOWDOWN}: {'PASS' if worst[0] <= GOAL_ADAPTIVE_SLOWDOWN else 'FAIL'})")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", default=",".join(map(str, DEFAULT_M)), help="batch sizes M")
    parser.add_argument("--table", help="matmul table for the adaptive variant (default: the server's)")
    parser.add_argument("--quick-tune", action="store_true", help="if tuning is needed, use the small grid")
    parser.add_argument("--seed", type=int, default=int(time.time()))
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/matmul.py times GPU kernels; this machine has no GPU", file=sys.stderr)
        return 1
    import triton

    args.out.mkdir(parents=True, exist_ok=True)
    table, source = get_table(args.table, args.quick_tune)
    adaptive = AdaptiveMatmul(table, gpu=torch.cuda.get_device_name(), dtype=torch.bfloat16, double_buffer=True,
                              source=source)
    print(adaptive.describe(), flush=True)
    copy_bw = copy_bandwidth()
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s (read + write)", flush=True)
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "command": " ".join(sys.argv), "seed": args.seed, "copy_bw": copy_bw, "table": source,
            "adaptive": adaptive.describe()}
    rows = run(sorted({int(v) for v in args.m.split(",")}), adaptive, copy_bw, args.seed)
    summary = goals(rows)
    (args.out / "matmul.json").write_text(json.dumps({"meta": meta, "rows": rows, "goals": summary,
                                                      "table": table.to_json()}, indent=1))
    print(f"\n{'shape':>8} {'M':<5}" + "".join(f"{v + ' µs (floor)':>16}" for v in
                                                ("cublas", "flat", "gemv", "adaptive")))
    for r in rows:
        print(_line(r))
    print("\n" + "\n".join(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
