"""CPU tokens/s of our engine against transformers `generate` and llama.cpp on the embedded default.

Chat prompts at batch 1 (llama.cpp too; the two take turns `--repeat` times, medians) and N concurrent (greedy,
same prompts); then prefill and decode tokens/s of random-token prompts at each `--contexts` length, batch 1:
TTFT of a fresh prompt, and the decode rate after it (median of `--repeat`; ours and transformers: the time
of 1 + N tokens minus that of 1, ours with the prompt from the prefix cache; llama.cpp: one-token evals).
llama.cpp runs the same GGUF file through `llama-cpp-python` (optional: `pip install llama-cpp-python`) with the
same thread count. Each `--threads` value is a separate set of rows, all in one run:
    python -m bench.cpu_engine --threads 1,2 --contexts 512,6000 --out bench/results/cpu_engine.json
"""
from __future__ import annotations

import argparse
import importlib
import json
import platform
import statistics
import time
from datetime import date
from pathlib import Path
from typing import Any

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


def random_prompt(length: int, seed: int) -> list[int]:
    return torch.randint(100, 40000, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def rates(ttft_s: float, total_s: float, length: int, new_tokens: int) -> dict[str, float]:
    return {"ttft_s": ttft_s, "prefill_tok_s": length / ttft_s, "decode_tok_s": new_tokens / (total_s - ttft_s)}


def long_ours(llm: LLM, length: int, new_tokens: int, seed: int, repeat: int = 1) -> dict[str, float]:
    """TTFT of a fresh prompt; then the decode rate as transformers' is measured, the time of 1 + N tokens
    less that of 1 token, both with the prompt served from the prefix cache (but for its last partial
    page, which each run recomputes): the median of `repeat` such pairs."""
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (1, 1 + new_tokens)]
    llm.generate(random_prompt(length, seed + 2), params[0])                 # warm-up at this length
    prompt = random_prompt(length, seed)
    start = time.perf_counter()
    llm.generate(prompt, params[0])
    ttft = time.perf_counter() - start
    decode_s = []
    for _ in range(repeat):
        start = time.perf_counter()
        llm.generate(prompt, params[0])
        cached_first = time.perf_counter() - start
        start = time.perf_counter()
        llm.generate(prompt, params[1])
        decode_s.append(time.perf_counter() - start - cached_first)
    return rates(ttft, ttft + statistics.median(decode_s), length, new_tokens)


def long_transformers(model: Any, length: int, new_tokens: int, seed: int) -> dict[str, float]:
    from bench.hf_generate import time_generate

    time_generate(model, random_prompt(length, seed + 2), 1)                 # warm-up at this length
    prompt = random_prompt(length, seed)                                     # no cache across calls
    ttft = time_generate(model, prompt, 1)
    return rates(ttft, time_generate(model, prompt, 1 + new_tokens), length, new_tokens)


def long_llama_cpp(llama: Any, length: int, new_tokens: int, seed: int, repeat: int = 1) -> dict[str, float]:
    """llama.cpp's prefill (one `eval` of the prompt) and decode (`eval` of one token at a time), timed apart:
    the median of `repeat` runs of N tokens, one after the other."""
    def prefill(prompt: list[int]) -> float:
        llama.reset()                                                         # no reuse of the last prompt
        start = time.perf_counter()
        llama.eval(prompt)
        return time.perf_counter() - start

    prefill(random_prompt(length, seed))                                      # warm-up at this length
    ttft = prefill(random_prompt(length, seed + 1))
    decode_s = []
    for turn in range(repeat):
        start = time.perf_counter()
        for token in random_prompt(new_tokens, seed + 2 + turn):
            llama.eval([token])
        decode_s.append(time.perf_counter() - start)
    return rates(ttft, ttft + statistics.median(decode_s), length, new_tokens)


def chat_llama_cpp(llama: Any, tokenizer: Any, chat: list[dict], max_tokens: int) -> tuple[float, int]:
    """llama.cpp's time for the same templated chat prompt and `max_tokens` greedy tokens (its generator
    does not stop at EOS, like ours with ignore_eos)."""
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    tokens = llama.tokenize(text.encode(), add_bos=False, special=True)
    llama.reset()
    count = 0
    start = time.perf_counter()
    for _ in llama.generate(tokens, temp=0.0, reset=True):
        count += 1
        if count == max_tokens:
            break
    return time.perf_counter() - start, count


def load_llama_cpp(threads: int, context: int) -> Any | None:
    try:   # optional, and without type stubs
        llama_cpp = importlib.import_module("llama_cpp")
    except ImportError:
        return None
    from engine.model.loader import embedded_default_gguf

    return llama_cpp.Llama(model_path=str(embedded_default_gguf()), n_ctx=context, n_threads=threads,
                           n_threads_batch=threads, n_batch=512, verbose=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per chat request")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--contexts", default="512,6000", help="prompt lengths of the prefill / decode rows")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path("bench/results/cpu_engine.json"))
    parser.add_argument("--threads", default="1,2", help="torch (and llama.cpp) CPU thread counts, one row set each")
    parser.add_argument("--no-transformers-long", action="store_true", help="skip transformers' long-prompt rows")
    parser.add_argument("--kv-cache-dtype", default="auto", help="[backend] kv_cache_dtype of our engine")
    parser.add_argument("--product-inputs", default="auto", choices=["auto", "float32", "int16"],
                        help="[backend] cpu_product_inputs of our engine")
    parser.add_argument("--repeat", type=int, default=3,
                        help="batch-1 chat runs of ours and llama.cpp (taking turns), and decode runs at each context: "
                             "medians")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    llm = LLM(kv_cache_dtype=args.kv_cache_dtype, cpu_product_inputs=args.product_inputs)
    model_dir = llm.engine.model_dir
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hf_tok = AutoTokenizer.from_pretrained(model_dir)
    if hf_tok.pad_token is None:
        hf_tok.pad_token = hf_tok.eos_token
    chats = [[{"role": "user", "content": p}] for p in PROMPTS[:args.concurrency]]
    contexts = [int(c) for c in args.contexts.split(",")]
    rows: list[dict[str, Any]] = []
    long_rows: list[dict[str, Any]] = []
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        time_ours(llm, chats[:1], 4)  # warm-up both
        time_transformers(hf_model, hf_tok, chats[:1], 4)
        llama = load_llama_cpp(threads, max(contexts) + args.repeat * args.decode_tokens + 8)
        for label, batch in (("batch 1", chats[:1]), (f"{len(chats)} concurrent", chats)):
            ours_s, ours_n = time_ours(llm, batch, args.tokens)
            hf_s, hf_n = time_transformers(hf_model, hf_tok, batch, args.tokens)
            chat_row = {"threads": threads, "case": label, "fdserve_tok_s": ours_n / ours_s,
                        "transformers_tok_s": hf_n / hf_s, "ratio": (ours_n / ours_s) / (hf_n / hf_s),
                        "tokens": ours_n}
            if llama is not None and len(batch) == 1:
                chat_llama_cpp(llama, hf_tok, batch[0], 4)                   # warm-up
                # this machine's speed drifts by 10 % within minutes: the two engines take turns
                ours_rates, cpp_rates = [ours_n / ours_s], []
                for turn in range(args.repeat):
                    cpp_s, cpp_n = chat_llama_cpp(llama, hf_tok, batch[0], args.tokens)
                    cpp_rates.append(cpp_n / cpp_s)
                    if turn + 1 < args.repeat:
                        ours_s, ours_n = time_ours(llm, batch, args.tokens)
                        ours_rates.append(ours_n / ours_s)
                ours_rate, cpp_rate = statistics.median(ours_rates), statistics.median(cpp_rates)
                chat_row.update(fdserve_tok_s=ours_rate, fdserve_samples=ours_rates, llama_cpp_tok_s=cpp_rate,
                                llama_cpp_samples=cpp_rates, ratio=ours_rate / (hf_n / hf_s),
                                ratio_llama_cpp=ours_rate / cpp_rate)
            rows.append(chat_row)
        for length in contexts:
            seed = 10 * length + threads                                     # new prompts for every row set
            row: dict[str, Any] = {"threads": threads, "context": length,
                                   "fdserve": long_ours(llm, length, args.decode_tokens, seed, args.repeat)}
            if not args.no_transformers_long:
                row["transformers"] = long_transformers(hf_model, length, args.decode_tokens, seed)
            if llama is not None:
                row["llama_cpp"] = long_llama_cpp(llama, length, args.decode_tokens, seed, args.repeat)
            long_rows.append(row)
            print(json.dumps(row), flush=True)
        del llama
    result = {"date": date.today().isoformat(), "machine": platform.processor() or platform.machine(),
              "torch": torch.__version__, "weights": llm.engine.cpu_weights_text, "dtype": str(llm.engine.dtype),
              "attention": llm.engine.backend.name, "decode": llm.engine.graphs_text,
              "kv_cache_dtype": llm.engine.kv_dtype_name, "max_tokens": args.tokens, "rows": rows,
              "long_rows": long_rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"{'threads':>7} {'case':<16}{'fdserve tok/s':>15}{'transformers tok/s':>20}{'ratio':>8}"
          f"{'llama.cpp tok/s':>17}{'ratio':>8}")
    for r in rows:
        cpp = (f"{r['llama_cpp_tok_s']:>17.1f}{r['ratio_llama_cpp']:>8.2f}" if "llama_cpp_tok_s" in r else "")
        print(f"{r['threads']:>7} {r['case']:<16}{r['fdserve_tok_s']:>15.1f}{r['transformers_tok_s']:>20.1f}"
              f"{r['ratio']:>8.2f}{cpp}")
    print(f"{'threads':>7} {'context':>7} {'engine':<13}{'prefill tok/s':>14}{'decode tok/s':>13}")
    for r in long_rows:
        for name in ("fdserve", "transformers", "llama_cpp"):
            if name in r:
                print(f"{r['threads']:>7} {r['context']:>7} {name:<13}{r[name]['prefill_tok_s']:>14.1f}"
                      f"{r[name]['decode_tok_s']:>13.1f}")


if __name__ == "__main__":
    main()
