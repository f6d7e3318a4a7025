"""CPU decode and prefill of the embedded default under two values of one `[backend]` setting:
`cpu_attention` = fused against native (the default), or `cpu_matmul` = torch against native.

Both engines live in one process and take turns, `--rounds` times, on fresh random-token prompts: the
time to the first token of each prompt, then the decode rate after it (1 + N tokens less 1, the prompt
from the prefix cache, as `bench.cpu_engine` measures it). Medians per (threads, context, variant):
    python -m bench.cpu_attention_ab --threads 1,2 --contexts 512,5700 --out bench/results/cpu_attention_ab.json
    python -m bench.cpu_attention_ab --setting cpu_matmul --variants torch,native --out bench/results/cpu_matmul_ab.json
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

SETTINGS = ("cpu_attention", "cpu_matmul")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--contexts", default="512,5700")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--setting", choices=SETTINGS, default="cpu_attention")
    parser.add_argument("--variants", default="fused,native", help="the baseline value, then the one compared")
    parser.add_argument("--out", type=Path, default=Path("bench/results/cpu_attention_ab.json"))
    args = parser.parse_args()
    base, other = args.variants.split(",")
    variants = (base, other)
    llms = {variant: LLM(**{args.setting: variant}) for variant in variants}
    for variant, llm in llms.items():
        print(f"{variant}: {llm.engine.backend.name}; {llm.engine.cpu_weights_text}")
    rows: list[dict[str, Any]] = []
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for length in (int(c) for c in args.contexts.split(",")):
            runs: dict[str, list[dict[str, float]]] = {variant: [] for variant in variants}
            for round_idx in range(args.rounds):
                for variant, llm in llms.items():
                    seed = 1000 * round_idx + 10 * length + threads + (7 if variant == other else 0)
                    runs[variant].append(long_ours(llm, length, args.decode_tokens, seed))
            row: dict[str, Any] = {"threads": threads, "context": length}
            for variant in variants:
                for key in ("ttft_s", "prefill_tok_s", "decode_tok_s"):
                    row[f"{variant}_{key}"] = statistics.median(run[key] for run in runs[variant])
            row["decode_ratio"] = row[f"{other}_decode_tok_s"] / row[f"{base}_decode_tok_s"]
            rows.append(row)
            print(f"threads {threads} context {length}: decode tok/s {base} {row[f'{base}_decode_tok_s']:.1f}, "
                  f"{other} {row[f'{other}_decode_tok_s']:.1f} ({row['decode_ratio']:.2f}x); prefill tok/s "
                  f"{base} {row[f'{base}_prefill_tok_s']:.0f}, {other} {row[f'{other}_prefill_tok_s']:.0f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"date": date.today().isoformat(), "machine": machine_info(), "rounds": args.rounds,
                                    "setting": args.setting,
                                    "backends": {v: llm.engine.backend.name for v, llm in llms.items()},
                                    "cpu_weights": {v: llm.engine.cpu_weights_text for v, llm in llms.items()},
                                    "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
