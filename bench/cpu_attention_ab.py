"""CPU decode and prefill of the embedded default with `[backend] cpu_attention` = native against fused.

Both engines live in one process and take turns, `--rounds` times, on fresh random-token prompts: the
time to the first token of each prompt, then the decode rate after it (1 + N tokens less 1, the prompt
from the prefix cache, as `bench.cpu_engine` measures it). Medians per (threads, context, variant):
    python -m bench.cpu_attention_ab --threads 1,2 --contexts 512,5700 --out bench/results/cpu_attention_ab.json
"""
from __future__ import annotations

import argparse
import json
import statistics
from datetime import date
from pathlib import Path
from typing import Any

import torch

from bench.cpu_engine import long_ours
from bench.e2e import machine_info
from engine import LLM

VARIANTS = ("fused", "native")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--contexts", default="512,5700")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench/results/cpu_attention_ab.json"))
    args = parser.parse_args()
    llms = {variant: LLM(cpu_attention=variant) for variant in VARIANTS}
    for variant, llm in llms.items():
        print(f"{variant}: {llm.engine.backend.name}")
    rows: list[dict[str, Any]] = []
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for length in (int(c) for c in args.contexts.split(",")):
            runs: dict[str, list[dict[str, float]]] = {variant: [] for variant in VARIANTS}
            for round_idx in range(args.rounds):
                for variant, llm in llms.items():
                    seed = 1000 * round_idx + 10 * length + threads + (7 if variant == "native" else 0)
                    runs[variant].append(long_ours(llm, length, args.decode_tokens, seed))
            row: dict[str, Any] = {"threads": threads, "context": length}
            for variant in VARIANTS:
                for key in ("ttft_s", "prefill_tok_s", "decode_tok_s"):
                    row[f"{variant}_{key}"] = statistics.median(run[key] for run in runs[variant])
            row["decode_ratio"] = row["native_decode_tok_s"] / row["fused_decode_tok_s"]
            rows.append(row)
            print(f"threads {threads} context {length}: decode tok/s fused {row['fused_decode_tok_s']:.1f}, "
                  f"native {row['native_decode_tok_s']:.1f} ({row['decode_ratio']:.2f}x); prefill tok/s "
                  f"fused {row['fused_prefill_tok_s']:.0f}, native {row['native_prefill_tok_s']:.0f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"date": date.today().isoformat(), "machine": machine_info(), "rounds": args.rounds,
                                    "backends": {v: llm.engine.backend.name for v, llm in llms.items()},
                                    "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
