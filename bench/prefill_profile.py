"""Where a long prompt's time to the first token goes, on the GPU: ours beside transformers.

    python bench/prefill_profile.py --model synthetic:llama-3.1-8b --context-len 32768 --transformers

1. engine: one fresh prompt (no prefix hit) timed without the profiler (TTFT: the request of one token);
2. the same for another fresh prompt under torch.profiler: GPU time per kernel and per class of
   kernel (matmul, attention, norms, RoPE + KV store, ...), GPU busy time against the wall time
   (the rest is the GPU waiting on the host);
3. `--transformers`: transformers `generate` of one token on the same prompt length, same table.
A warm-up prompt of the same length runs first, so compilation and cuDNN's graph builds stay out.
Writes OUT/prefill_profile_<L>.json and prints the table last.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.e2e import base_config, free_memory, random_prompt, run_requests  # noqa: E402

# First match wins; cuBLAS' Hopper kernels are named nvjet_* or sm90_xmma_*.
KERNEL_CLASSES: list[tuple[str, str]] = [
    ("attention (ours)", r"prefill|_split_kernel|_merge_kernel|decode"),
    ("attention (cuDNN / SDPA)", r"cudnn|fmha|sdpa|flash_fwd|attention"),
    ("matmul", r"nvjet|gemm|cutlass|xmma|cublas|matmul|sm90_"),
    ("norm", r"rms|norm"),
    ("rope + kv store", r"rope|rotary|kv_store|store_kv|reshape_and_cache"),
    ("activation", r"silu|act_and_mul|swiglu|gelu"),
    ("gather / copy", r"gather|index|copy|cat_|Memcpy|Memset|scatter"),
    ("sampling / softmax", r"softmax|topk|argmax|sort|sampl"),
    ("elementwise / reduce", r"elementwise|vectorized|reduce|unrolled|triton"),
]


def kernel_class(name: str) -> str:
    return next((label for label, pattern in KERNEL_CLASSES if re.search(pattern, name, re.IGNORECASE)), "other")


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals: the time at least one kernel ran."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def idle_gaps(intervals: list[tuple[float, float]], min_us: float) -> list[dict[str, float]]:
    """Stretches of at least `min_us` where no kernel ran, as (ms after the first kernel, ms long)."""
    gaps, reach = [], float("-inf")
    origin = min((start for start, _ in intervals), default=0.0)
    for start, end in sorted(intervals):
        if reach != float("-inf") and start - reach >= min_us:
            gaps.append({"at_ms": (reach - origin) / 1e3, "ms": (start - reach) / 1e3})
        reach = max(reach, end)
    return gaps


def profile_gpu(run: Callable[[], None]) -> dict[str, Any]:
    """Run once under torch.profiler: wall time, GPU busy time, per-kernel and per-class GPU time, the
    GPU's idle stretches and the host's time in CUDA runtime calls (where it waited, if it did)."""
    from torch.profiler import ProfilerActivity, profile

    _sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        run()
        _sync()
        wall_ms = (time.perf_counter() - start) * 1e3
    per_kernel: dict[str, list[float]] = defaultdict(list)
    runtime: dict[str, list[float]] = defaultdict(list)
    intervals: list[tuple[float, float]] = []
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[event.name].append(event.time_range.end - event.time_range.start)
            intervals.append((event.time_range.start, event.time_range.end))
        elif event.name.startswith("cuda"):
            runtime[event.name].append(event.time_range.end - event.time_range.start)
    kernels: list[dict[str, Any]] = sorted(
        ({"kernel": name[:120], "class": kernel_class(name), "launches": len(times), "ms": sum(times) / 1e3}
         for name, times in per_kernel.items()), key=lambda r: -r["ms"])
    classes: dict[str, float] = defaultdict(float)
    for row in kernels:
        classes[row["class"]] += row["ms"]
    return {"wall_ms": wall_ms, "gpu_busy_ms": busy_us(intervals) / 1e3,
            "kernel_ms": sum(r["ms"] for r in kernels), "launches": sum(r["launches"] for r in kernels),
            "classes": dict(sorted(classes.items(), key=lambda kv: -kv[1])), "kernels": kernels,
            "idle_gaps": idle_gaps(intervals, 200.0),
            "runtime_calls": sorted(({"call": name, "count": len(times), "ms": sum(times) / 1e3}
                                     for name, times in runtime.items()), key=lambda r: -r["ms"])}


def measure(prepare: Callable[[str], Callable[[], None]]) -> dict[str, Any]:
    """A warm-up prompt, a timed one (TTFT without the profiler) and a profiled one, each fresh; `prepare`
    makes a prompt's request (outside the timing) and returns what runs it."""
    prepare("warm")()
    timed = prepare("timed")
    _sync()
    start = time.perf_counter()
    timed()
    _sync()
    return {"ttft_ms": (time.perf_counter() - start) * 1e3, **profile_gpu(prepare("profiled"))}


def engine_profile(args: argparse.Namespace) -> dict[str, Any]:
    from engine.core.offline import LLM

    llm = LLM(base_config(args))
    engine = llm.engine
    excluded = set(engine.tokenizer.eos_token_ids)

    def prepare(tag: str) -> Callable[[], None]:
        prompt = random_prompt(engine.tokenizer.vocab_size, excluded, args.context_len, f"prefill-profile/{tag}")
        def run() -> None:
            run_requests(engine, [prompt], 1)
        return run

    row = {"name": "fdserve", "attention": engine.backend.name, **measure(prepare)}
    return {**row, "prefix_cache_hits": engine.block_manager.prefix_cache_hits}


def transformers_profile(args: argparse.Namespace) -> dict[str, Any]:
    from bench.hf_generate import time_generate
    from bench.ttft import load_transformers

    model, tokenizer = load_transformers(base_config(args))
    excluded = set(tokenizer.eos_token_ids)

    def prepare(tag: str) -> Callable[[], None]:
        prompt = random_prompt(tokenizer.vocab_size, excluded, args.context_len, f"prefill-profile/hf/{tag}")
        def run() -> None:
            time_generate(model, prompt, 1)
        return run

    return {"name": "transformers", "attention": "sdpa", **measure(prepare)}


def format_table(rows: list[dict[str, Any]]) -> str:
    labels = [label for label, _ in KERNEL_CLASSES] + ["other"]
    lines = ["| ms | " + " | ".join(r["name"] for r in rows) + " |", "|---|" + "---|" * len(rows)]
    for key in ("ttft_ms", "wall_ms", "gpu_busy_ms"):
        lines.append(f"| {key} | " + " | ".join(f"{r[key]:.1f}" for r in rows) + " |")
    idle = " | ".join(f"{r['wall_ms'] - r['gpu_busy_ms']:.1f}" for r in rows)
    lines.append(f"| wall - busy (GPU idle) | {idle} |")
    for label in labels:
        if any(label in r["classes"] for r in rows):
            lines.append(f"| {label} | " + " | ".join(f"{r['classes'].get(label, 0.0):.1f}" for r in rows) + " |")
    lines.append("| launches | " + " | ".join(str(r["launches"]) for r in rows) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model name or path (default: config.toml's)")
    p.add_argument("--config", type=Path, default=None)
    p.add_argument("--context-len", type=int, default=32768)
    p.add_argument("--transformers", action="store_true", help="profile transformers `generate` on the same length")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    args = p.parse_args()
    rows = [engine_profile(args)]
    free_memory()   # the engine's weights and KV cache go before transformers loads its own
    if args.transformers:
        rows.append(transformers_profile(args))
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    result = {"model": args.model, "context_len": args.context_len, "device": device,
              "settings": args.set, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"prefill_profile_{args.context_len}.json"
    path.write_text(json.dumps(result, indent=2))
    for row in rows:
        print(f"{row['name']}: top kernels (ms, launches)")
        for k in row["kernels"][:12]:
            print(f"  {k['ms']:9.2f} {k['launches']:6d}  [{k['class']}] {k['kernel'][:90]}")
        print("  host in CUDA runtime calls (ms, count): " +
              ", ".join(f"{c['call']} {c['ms']:.1f} ({c['count']})" for c in row["runtime_calls"][:6]))
        gaps = row["idle_gaps"]
        print(f"  GPU idle >= 0.2 ms: {len(gaps)} stretches, {sum(g['ms'] for g in gaps):.1f} ms; longest: " +
              ", ".join(f"{g['ms']:.2f} at {g['at_ms']:.0f}" for g in sorted(gaps, key=lambda g: -g["ms"])[:8]))
    print(f"L={args.context_len} {result['device']} {' '.join(args.set)}")
    print(format_table(rows))
    print(f"JSON: {path}")


if __name__ == "__main__":
    main()
