"""CPU tokens/s of our engine against transformers `generate` on the embedded default model.

Batch 1 (one request) and N concurrent requests, greedy, same prompts, same run.
    python -m bench.cpu_engine --tokens 64 --concurrency 8 --threads 1 --out bench/results/cpu_engine.json
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import date
from pathlib import Path

import torch

from engine import LLM, SamplingParams

PROMPTS = [
    "Explain in a few sentences why the sky is blue.",
    "Write a short poem about the sea.",
    "List three uses of a paperclip.",
    "What is the capital of France, and what is it known for?",
    "Describe how a bicycle works.",
    "Give me a recipe for pancakes.",
    "What are the planets of the solar system?",
    "Summarise the plot of Romeo and Juliet.",
]


def time_ours(llm: LLM, prompts: list[list[dict]], max_tokens: int) -> tuple[float, int]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    results = llm.chat(prompts, params)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(r.token_ids) for r in results)


def time_transformers(model, tokenizer, prompts: list[list[dict]], max_tokens: int) -> tuple[float, int]:
    texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    tokenizer.padding_side = "left"
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**batch, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    elapsed = time.perf_counter() - start
    return elapsed, (out.shape[1] - batch["input_ids"].shape[1]) * len(prompts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path("bench/results/cpu_engine.json"))
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads for both engines (default: torch's choice); 1 is "
                             "steadier on a shared machine, where oversubscribed threads spin")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    llm = LLM()
    model_dir = llm.engine.model_dir
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hf_tok = AutoTokenizer.from_pretrained(model_dir)
    if hf_tok.pad_token is None:
        hf_tok.pad_token = hf_tok.eos_token
    chats = [[{"role": "user", "content": p}] for p in PROMPTS[:args.concurrency]]
    time_ours(llm, chats[:1], 4)  # warm-up both
    time_transformers(hf_model, hf_tok, chats[:1], 4)
    rows = []
    for label, batch in (("batch 1", chats[:1]), (f"{len(chats)} concurrent", chats)):
        ours_s, ours_n = time_ours(llm, batch, args.tokens)
        hf_s, hf_n = time_transformers(hf_model, hf_tok, batch, args.tokens)
        rows.append({"case": label, "fdserve_tok_s": ours_n / ours_s, "transformers_tok_s": hf_n / hf_s,
                     "ratio": (ours_n / ours_s) / (hf_n / hf_s), "tokens": ours_n})
    result = {"date": date.today().isoformat(), "machine": platform.processor() or platform.machine(),
              "threads": torch.get_num_threads(), "max_tokens": args.tokens, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"{'case':<16}{'fdserve tok/s':>15}{'transformers tok/s':>20}{'ratio':>8}")
    for r in rows:
        print(f"{r['case']:<16}{r['fdserve_tok_s']:>15.1f}{r['transformers_tok_s']:>20.1f}{r['ratio']:>8.2f}")


if __name__ == "__main__":
    main()
