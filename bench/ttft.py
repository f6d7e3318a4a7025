"""`fdserve bench prefill`: time to the first token of one prompt per length, per variant, beside
transformers `generate` (`--transformers`, SDPA attention) on the same model, dtype and device.

Each variant is one engine, built once and warmed up at the shortest length, then given one fresh
random prompt per length and repeat (no prefix-cache hits: the row records the hit count). The
request generates `--max-tokens` tokens, so the row also carries the decode latency at each length
((total - TTFT) / (tokens - 1)). transformers' TTFT is a `generate` of one token.

    python -m bench.e2e prefill --model synthetic:llama-3.1-8b --variants flash --transformers \\
        --context-lens 4096,16384,32768,65536,131072
"""
from __future__ import annotations

import argparse
import statistics
from typing import Any

from bench.e2e import (
    UNAVAILABLE_ERRORS,
    base_config,
    build_llm,
    free_memory,
    machine_info,
    random_prompt,
    run_requests,
    variant_overrides,
)


def _lengths(text: str) -> list[int]:
    try:
        lengths = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"context lengths must be integers: {text!r}") from exc
    if not lengths or lengths[0] < 1:
        raise argparse.ArgumentTypeError(f"need one or more positive context lengths; got {text!r}")
    return lengths


def add_prefill_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--context-lens", type=_lengths, default=_lengths("4096,16384,32768,65536,131072"),
                   help="prompt lengths, comma-separated (default 4096,16384,32768,65536,131072)")
    p.add_argument("--transformers", action="store_true",
                   help="add transformers `generate` (SDPA) on the same model, dtype and device")


def _prompt(engine_or_tokenizer: Any, length: int, seed: str) -> list[int]:
    tok = engine_or_tokenizer
    excluded = set(tok.eos_token_ids) | set(getattr(tok.hf, "all_special_ids", []))
    return random_prompt(tok.vocab_size, excluded, length, seed)


def measure_engine(config: Any, variant: str, args: argparse.Namespace) -> dict[str, Any]:
    try:
        llm = build_llm(config, variant)
    except UNAVAILABLE_ERRORS as exc:
        return {"name": variant, "available": False, "reason": f"{type(exc).__name__}: {exc}"}
    try:
        engine = llm.engine
        for w in range(args.warmup):   # compilation and allocator growth stay out of the numbers
            run_requests(engine, [_prompt(engine.tokenizer, args.context_lens[0], f"{args.seed}/warm/{w}")], 2)
        points = []
        for length in args.context_lens:
            runs = []
            for r in range(args.repeat):
                timings, _ = run_requests(engine, [_prompt(engine.tokenizer, length, f"{args.seed}/{length}/{r}")],
                                          args.max_tokens)
                runs.append({"ttft_ms": timings[0].ttft_s * 1e3, "tpot_ms": timings[0].tpot_ms})
            points.append(_point(length, runs))
        return {"name": variant, "available": True, "attention": engine.backend.name,
                "overrides": variant_overrides(variant), "kv_cache_tokens": engine.capacity_tokens,
                "prefix_cache_hits": engine.block_manager.prefix_cache_hits, "points": points}
    finally:
        del llm
        free_memory()


def _point(length: int, runs: list[dict[str, Any]]) -> dict[str, Any]:
    ttfts = [r["ttft_ms"] for r in runs]
    tpots = [r["tpot_ms"] for r in runs if r.get("tpot_ms") is not None]
    return {"context_len": length, "ttft_ms": statistics.median(ttfts), "ttft_ms_range": [min(ttfts), max(ttfts)],
            "tpot_ms": statistics.median(tpots) if tpots else None, "runs": runs}


def load_transformers(config: Any) -> tuple[Any, Any]:
    """(transformers model, our tokenizer) for the configured model, on the engine's device and dtype."""
    from transformers import AutoConfig

    from bench.hf_generate import load_hf_model
    from engine.model.loader import resolve_model_dir
    from engine.text.tokenizer import Tokenizer
    from engine.worker.device import select_device, select_dtype

    model_dir = resolve_model_dir(config.model.name)
    device, _ = select_device(config.backend.gpu_vendor)
    checkpoint_dtype = getattr(AutoConfig.from_pretrained(model_dir), "torch_dtype", None)
    dtype = select_dtype(config.model.dtype, device, checkpoint_dtype, cpu_weight_dtype=config.backend.cpu_weight_dtype)
    return load_hf_model(model_dir, dtype, device), Tokenizer.from_pretrained(model_dir)


def measure_transformers_ttft(config: Any, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from bench.hf_generate import time_generate

    model, tokenizer = load_transformers(config)
    device, dtype = model.device, model.dtype
    try:
        for w in range(args.warmup):
            time_generate(model, _prompt(tokenizer, args.context_lens[0], f"{args.seed}/warm/{w}"), 1)
        points = [_point(length, [{"ttft_ms": 1e3 * time_generate(
                      model, _prompt(tokenizer, length, f"{args.seed}/{length}/{r}"), 1)} for r in range(args.repeat)])
                  for length in args.context_lens]
    finally:
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    import transformers
    return {"name": "transformers", "available": True,
            "attention": f"transformers {transformers.__version__} generate, sdpa ({dtype}, {device})",
            "overrides": {}, "points": points}


def add_ttft_ratios(rows: list[dict[str, Any]]) -> None:
    """Each engine point's TTFT over transformers' at the same length (< 1 is faster)."""
    hf = next((r for r in rows if r["name"] == "transformers" and r["available"]), None)
    if hf is None:
        return
    by_len = {p["context_len"]: p["ttft_ms"] for p in hf["points"]}
    for row in rows:
        if row["available"] and row is not hf:
            for p in row["points"]:
                p["ttft_vs_transformers"] = p["ttft_ms"] / by_len[p["context_len"]]


def run_prefill_bench(args: argparse.Namespace) -> dict[str, Any]:
    from datetime import datetime, timezone

    config = base_config(args)
    rows = [measure_engine(config, v, args) for v in args.variants]
    if args.transformers:
        rows.append(measure_transformers_ttft(config, args))
    add_ttft_ratios(rows)
    settings = {k: getattr(args, k) for k in ("context_lens", "max_tokens", "repeat", "warmup", "seed")}
    return {"mode": "prefill", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": machine_info(), "model": config.model.name or "embedded default", "settings": settings,
            "config": {s: getattr(config, s).model_dump() for s in ("model", "backend")}, "warnings": [],
            "variants": rows}


def format_prefill_table(result: dict[str, Any]) -> str:
    lengths = result["settings"]["context_lens"]
    lines = ["| variant | " + " | ".join(f"TTFT ms @ {n}" for n in lengths) + " |", "|---|" + "---|" * len(lengths)]
    for r in result["variants"]:
        if not r["available"]:
            lines.append(f"| {r['name']} | unavailable: {r['reason']} |")
            continue
        cells = []
        for p in r["points"]:
            ratio = p.get("ttft_vs_transformers")
            cells.append(f"{p['ttft_ms']:.1f}" + (f" ({ratio:.2f}x)" if ratio else ""))
        lines.append(f"| {r['name']} | " + " | ".join(cells) + " |")
    decode = [r for r in result["variants"] if r["available"] and any(p.get("tpot_ms") for p in r["points"])]
    for r in decode:
        lines.append(f"{r['name']} decode ms/token: " +
                     ", ".join(f"{p['context_len']}: {p['tpot_ms']:.2f}" for p in r["points"] if p.get("tpot_ms")))
    s = result["settings"]
    head = (f"prefill (TTFT), one request per length, median of {s['repeat']}; (x) = over transformers; "
            f"{result['machine']['device']}; model {result['model']}")
    notes = [f"{r['name']}: {r['attention']}" for r in result["variants"] if r["available"]]
    return "\n".join([head, *lines, *notes])
