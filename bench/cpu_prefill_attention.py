"""One layer's prefill attention on the CPU, as the engine runs a prompt: chunks of --chunk tokens, each over
the pages of everything before it, through our C++ kernel (`kernels.native.paged_prefill`) and through the
SDPA path it replaces (`kernels.attention.cpu.prefill_attention_cpu`), taking turns, best of --repeat, per
thread count; GFLOP/s over the causal FLOPs 4·D·Hq·L²/2. Fresh random float32 (or --kv-dtype bfloat16)
pages under a shuffled block table; each side's relative error against float64 on the last chunk.

    python -m bench.cpu_prefill_attention --threads 1,2 --out bench/results/cpu_prefill_attention.json
"""
from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from datetime import date
from pathlib import Path
from typing import Any

import torch

from bench.e2e import machine_info
from kernels.attention.cpu import prefill_attention_cpu
from kernels.attention.reference import prefill_attention_ref
from kernels.native.paged_prefill import kernel_name, paged_prefill_attention

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def prompt_pages(length: int, heads: int, kv_heads: int, dim: int, block_size: int, kv_dtype: torch.dtype,
                 seed: int = 0) -> tuple[torch.Tensor, ...]:
    """q [L, Hq, D] float32 and the prompt's K/V pages under a shuffled table (one spare page)."""
    gen = torch.Generator().manual_seed(seed)
    pages = (length + block_size - 1) // block_size
    k = torch.randn(pages + 1, block_size, kv_heads, dim, generator=gen).to(kv_dtype)
    v = torch.randn(pages + 1, block_size, kv_heads, dim, generator=gen).to(kv_dtype)
    tables = torch.randperm(pages + 1, generator=gen)[None, :pages].to(torch.int32)
    q = torch.randn(length, heads, dim, generator=gen)
    return q, k, v, tables


def chunked(attend: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            tables: torch.Tensor, chunk: int, scale: float) -> torch.Tensor:
    """The prompt's attention a chunk at a time; returns the last chunk's rows."""
    out = q
    for begin in range(0, q.shape[0], chunk):
        end = min(q.shape[0], begin + chunk)
        out = attend(q[begin:end], k, v, tables, torch.tensor([end], dtype=torch.int32),
                     torch.tensor([0, end - begin], dtype=torch.int32), scale=scale)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--length", type=int, default=5700)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--heads", default="9,3,64", help="query heads, KV heads, head_dim")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("bench/results/cpu_prefill_attention.json"))
    args = parser.parse_args()
    heads, kv_heads, dim = (int(x) for x in args.heads.split(","))
    q, k, v, tables = prompt_pages(args.length, heads, kv_heads, dim, args.block_size, DTYPES[args.kv_dtype])
    scale = dim ** -0.5
    sides: dict[str, Callable[..., torch.Tensor]] = {"ours": paged_prefill_attention, "sdpa": prefill_attention_cpu}
    tail = (args.length - 1) // args.chunk * args.chunk
    expected = prefill_attention_ref(q[tail:].double(), k.double(), v.double(), tables,
                                     torch.tensor([args.length], dtype=torch.int32),
                                     torch.tensor([0, args.length - tail], dtype=torch.int32), scale=scale)
    errors = {name: float((chunked(fn, q, k, v, tables, args.chunk, scale).double() - expected).norm()
                          / expected.norm()) for name, fn in sides.items()}
    flops = 4 * dim * heads * args.length ** 2 / 2
    rows: list[dict[str, Any]] = []
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        best = {name: float("inf") for name in sides}
        for _ in range(args.repeat):
            for name, fn in sides.items():
                start = time.perf_counter()
                chunked(fn, q, k, v, tables, args.chunk, scale)
                best[name] = min(best[name], time.perf_counter() - start)
        row = {"threads": threads, **{f"{name}_ms": best[name] * 1e3 for name in sides},
               **{f"{name}_gflops": flops / best[name] / 1e9 for name in sides},
               "speedup": best["sdpa"] / best["ours"]}
        rows.append(row)
        print(json.dumps(row))
    result = {"date": date.today().isoformat(), "machine": machine_info(), "kernel": kernel_name(torch.float32),
              "args": {k: str(v) for k, v in vars(args).items()}, "relative_error": errors, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{kernel_name(torch.float32)}; relative error vs float64: ours {errors['ours']:.2e}, "
          f"SDPA {errors['sdpa']:.2e}")
    print("threads   ours ms  SDPA ms  ours GFLOP/s  SDPA GFLOP/s  speedup")
    for row in rows:
        print(f"{row['threads']:7d} {row['ours_ms']:9.1f} {row['sdpa_ms']:8.1f} {row['ours_gflops']:13.1f} "
              f"{row['sdpa_gflops']:13.1f} {row['speedup']:8.2f}")


if __name__ == "__main__":
    main()
