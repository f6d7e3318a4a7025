"""`fdserve bench`: how much faster each attention variant makes generation, measured end to end.

    latency      one long request, not streamed: per-token decode latency
                 ((total - TTFT) / (tokens - 1)), TTFT and total, per attention variant
    concurrency  N requests at once: generated tokens/s in total, per attention variant
    prefill      time to the first token per prompt length, per variant (bench/ttft.py)
    serve        a sweep against a running server over HTTP (see bench/serve.py)

Every engine variant is a fresh `LLM(config, **overrides)` (the engine reads [flashdecoding]
at construction) in a process of its own (bench/own_process.py), on the same model, prompts and
settings; only the variant's keys differ.
A variant the engine refuses on this machine is reported "unavailable: <reason>", never
skipped. Prompts are random token ids from a seeded generator, different per request so no
request hits another's prefix cache. Output: a table, JSON (`--out`) and a PNG next to it.

    python -m bench.e2e latency --context-len 512 --max-tokens 32 --variants standard,flash,fdpp

A variant may name a KV cache dtype after a "+" (`flash+fp8_e4m3`: `[backend] kv_cache_dtype`);
such a row is also compared with the same variant on the model-dtype cache (`speedup_vs_auto_kv`).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from bench.decode_budget import decode_warnings
from bench.own_process import in_own_process

# [flashdecoding] keys per variant; everything else comes from the config and --set.
VARIANTS: dict[str, dict[str, Any]] = {
    "standard": {"flashdecoding.enable": False},
    "flash": {"flashdecoding.enable": True, "flashdecoding.kernel": "flash", "flashdecoding.async_softmax": False},
    "fdpp": {"flashdecoding.enable": True, "flashdecoding.kernel": "flash", "flashdecoding.async_softmax": True},
    "ffd": {"flashdecoding.enable": True, "flashdecoding.kernel": "ffd"},
    "auto": {"flashdecoding.enable": True, "flashdecoding.kernel": "auto"},
}
BASELINE = "standard"
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")   # what may follow a variant's "+"


def variant_overrides(variant: str) -> dict[str, Any]:
    """The config keys of `variant` ("flash", or "flash+fp8_e4m3" for an FP8 KV cache)."""
    name, _, kv_dtype = variant.partition("+")
    return {**VARIANTS[name], **({"backend.kv_cache_dtype": kv_dtype} if kv_dtype else {})}
# What an engine raises for a setting it cannot run here (a ConfigError is a ValueError).
UNAVAILABLE_ERRORS = (ValueError, NotImplementedError, ImportError)


@dataclass
class RequestTiming:
    ttft_s: float
    total_s: float
    tokens: int
    # (seconds since submission, tokens) of every step that produced tokens for this request
    events: list[tuple[float, int]] = field(default_factory=list)

    @property
    def tpot_ms(self) -> float | None:
        """Per-token decode latency: the time after the first token, per later token."""
        if self.tokens < 2:
            return None
        return (self.total_s - self.ttft_s) / (self.tokens - 1) * 1e3


# ----- running requests through the engine -----------------------------------------------------

def random_prompt(vocab_size: int, excluded: set[int], length: int, seed: str) -> list[int]:
    """`length` token ids, deterministic in `seed`, avoiding special tokens (EOS, BOS, ...).

    The seed is a string because `random.Random(-n)` equals `random.Random(n)`: integer
    seeds for warm-up and measured rounds would collide and hit the prefix cache.
    """
    rng = random.Random(seed)
    ids: list[int] = []
    while len(ids) < length:
        token = rng.randrange(vocab_size)
        if token not in excluded:
            ids.append(token)
    return ids


def run_requests(engine: Any, prompts: list[list[int]], max_tokens: int,
                 on_tokens: Callable[[int], None] = lambda n: None) -> tuple[list[RequestTiming], float]:
    """Submit all prompts at once (greedy, ignore_eos), step the engine until they finish.

    Times are taken when `step()` returns, i.e. when the token ids are on the host.
    """
    from engine.request.sampling_params import SamplingParams

    start = time.perf_counter()
    ids = [f"bench-{start:.6f}-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                              ignore_eos=True))
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    tokens = dict.fromkeys(ids, 0)
    events: dict[str, list[tuple[float, int]]] = {i: [] for i in ids}
    while engine.has_unfinished():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            new = sum(len(d.token_ids) for d in out.deltas)
            if new:
                first.setdefault(out.request_id, now)
                tokens[out.request_id] += new
                events[out.request_id].append((now - start, new))
                on_tokens(new)
            if out.finished:
                last[out.request_id] = now
    wall = time.perf_counter() - start
    return [RequestTiming(first[i] - start, last[i] - start, tokens[i], events[i]) for i in ids], wall


def steady_decode_tok_s(timings: list[RequestTiming]) -> float | None:
    """Generated tokens/s once every request has its first token (no prefill left in the batch):
    tokens produced after the last first token, over the time from then to the last finish."""
    since = max(t.ttft_s for t in timings)
    end = max(t.total_s for t in timings)
    produced = sum(n for t in timings for at, n in t.events if at > since)
    return produced / (end - since) if end > since and produced else None


def build_llm(config: Any, variant: str) -> Any:
    from engine.core.offline import LLM

    return LLM(config, **variant_overrides(variant))


def free_memory() -> None:
    """Return a dropped variant's weights and KV cache before the next one allocates its own."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ----- the two engine modes ---------------------------------------------------------------------

def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def measure_variant(config: Any, variant: str, args: argparse.Namespace) -> dict[str, Any]:
    """One variant: build it, warm it up, run the mode's requests `--repeat` times (row["process"]: the pid)."""
    return {**_measure_variant(config, variant, args), "process": os.getpid()}


def _measure_variant(config: Any, variant: str, args: argparse.Namespace) -> dict[str, Any]:
    try:
        llm = build_llm(config, variant)
        try:
            prompts = _prompt_maker(llm.engine, args)
            # Warm-up at the measured length: kernel compilation and allocator growth stay out
            # of the numbers, and a kernel that refuses this shape shows up here.
            for w in range(args.warmup):
                run_requests(llm.engine, prompts(-1 - w)[:1], min(4, args.max_tokens))
            return _measure(llm.engine, variant, prompts, args)
        finally:
            llm.engine.close()   # a tensor-parallel variant's ranks stop before the next variant starts its own
            del llm
            free_memory()
    except UNAVAILABLE_ERRORS as exc:
        return {"name": variant, "available": False, "reason": f"{type(exc).__name__}: {exc}"}


def measure_hf_baseline(config: Any, args: argparse.Namespace) -> dict[str, Any]:
    """transformers `generate` on the engine's model folder, dtype and device, same prompts."""
    from types import SimpleNamespace

    from transformers import AutoConfig

    from bench.hf_generate import measure_transformers
    from engine.model.loader import resolve_model_dir
    from engine.text.tokenizer import Tokenizer
    from engine.worker.device import select_device, select_dtype

    model_dir = resolve_model_dir(config.model.name)
    device, _ = select_device(config.backend.gpu_vendor)
    checkpoint_dtype = getattr(AutoConfig.from_pretrained(model_dir), "torch_dtype", None)
    dtype = select_dtype(config.model.dtype, device, checkpoint_dtype,
                         cpu_weight_dtype=config.backend.cpu_weight_dtype)
    prompts = _prompt_maker(SimpleNamespace(tokenizer=Tokenizer.from_pretrained(model_dir)), args)
    return measure_transformers(model_dir, dtype, device, [prompts(r)[0] for r in range(args.repeat)],
                                args.max_tokens)


def _prompt_maker(engine: Any, args: argparse.Namespace) -> Callable[[int], list[list[int]]]:
    """round index -> that round's prompts (one for latency, --num-requests for concurrency)."""
    tok = engine.tokenizer
    excluded = set(tok.eos_token_ids) | set(getattr(tok.hf, "all_special_ids", []))
    num = 1 if args.mode == "latency" else args.num_requests

    def prompts(round_index: int) -> list[list[int]]:
        return [random_prompt(tok.vocab_size, excluded, args.context_len, f"{args.seed}/{round_index}/{i}")
                for i in range(num)]
    return prompts


def _measure(engine: Any, variant: str, prompts: Callable[[int], list[list[int]]],
             args: argparse.Namespace) -> dict[str, Any]:
    from tqdm import tqdm

    runs: list[dict[str, Any]] = []
    total = args.repeat * len(prompts(0)) * args.max_tokens
    with tqdm(total=total, desc=f"{args.mode} {variant}", unit="tok", leave=False, file=sys.stderr,
              disable=None) as bar:  # None: no bar when stderr is not a terminal
        for r in range(args.repeat):
            timings, wall = run_requests(engine, prompts(r), args.max_tokens, bar.update)
            runs.append(_summarise_run(timings, wall))
    stats = engine.stats()
    row: dict[str, Any] = {"name": variant, "available": True, "attention": engine.backend.name,
                           "decode": stats.decode_path, "graph_steps": stats.num_graph_steps,
                           "overrides": variant_overrides(variant), "counters": stats.attention_counters,
                           "kv_cache_dtype": stats.kv_cache_dtype,
                           # Must stay 0: a hit would skip prefill and shrink TTFT.
                           "prefix_cache_hits": engine.block_manager.prefix_cache_hits,
                           "kv_cache_tokens": engine.capacity_tokens}
    row.update({k: _median([run[k] for run in runs]) for k in runs[0] if k != "tokens"})
    tpots = [run["tpot_ms"] for run in runs if run["tpot_ms"] is not None]
    # The spread over repeats says how much to trust the median on a shared machine.
    row.update(tokens=runs[0]["tokens"], tpot_ms_range=[min(tpots), max(tpots)] if tpots else None, runs=runs)
    return row


def _summarise_run(timings: list[RequestTiming], wall: float) -> dict[str, Any]:
    tokens = sum(t.tokens for t in timings)
    return {"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall,
            "decode_tok_s": steady_decode_tok_s(timings),
            "ttft_ms": statistics.mean(t.ttft_s for t in timings) * 1e3,
            "total_ms": statistics.mean(t.total_s for t in timings) * 1e3,
            "tpot_ms": _median([t.tpot_ms for t in timings])}


def add_ratios(rows: list[dict[str, Any]], mode: str) -> None:
    """Speed-up over `standard` measured in the same run (>1 means faster); rows with a KV cache
    dtype also over the same variant on the model-dtype cache."""
    available = {r["name"]: r for r in rows if r["available"]}
    for row in rows:
        row["speedup_vs_standard"] = _speedup(available.get(BASELINE), row, mode)
        if "+" in row["name"]:
            row["speedup_vs_auto_kv"] = _speedup(available.get(row["name"].partition("+")[0]), row, mode)


def _speedup(base: dict[str, Any] | None, row: dict[str, Any], mode: str) -> float | None:
    if base is None or not row["available"]:
        return None
    if mode == "latency":
        return (base["tpot_ms"] / row["tpot_ms"]) if row["tpot_ms"] and base["tpot_ms"] else None
    return row["tok_s"] / base["tok_s"]


def _cpu_name() -> str:
    try:  # platform.processor() is empty on most Linux systems
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict[str, Any]:
    import torch

    cuda = torch.cuda.is_available()
    return {"device": torch.cuda.get_device_name(0) if cuda else f"CPU {_cpu_name()}",
            "torch": torch.__version__, "cpu_threads": torch.get_num_threads(), "host": platform.node()}


def run_engine_bench(args: argparse.Namespace) -> dict[str, Any]:
    config = base_config(args)
    warnings = decode_warnings(args.max_tokens)
    for text in warnings:
        print(f"warning: {text}", file=sys.stderr)
    rows = [in_own_process(measure_variant, config, v, args) for v in args.variants]
    if getattr(args, "transformers", False):
        rows.append(in_own_process(measure_hf_baseline, config, args))
    add_ratios(rows, args.mode)
    settings = {k: getattr(args, k) for k in ("context_len", "max_tokens", "repeat", "warmup", "seed")}
    if args.mode == "concurrency":
        settings["num_requests"] = args.num_requests
    return {"mode": args.mode, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": machine_info(), "model": config.model.name or "embedded default",
            "settings": settings, "config": {s: getattr(config, s).model_dump() for s in ("model", "backend")},
            "warnings": warnings, "variants": rows}


# ----- config, table, CLI -------------------------------------------------------------------

def base_config(args: argparse.Namespace) -> Any:
    """--config (else $FDSERVE_CONFIG or ./config.toml, as `fdserve serve`), then --set, --model."""
    from engine.config import find_default_config, load_config, parse_overrides

    overrides = parse_overrides(args.set)
    if args.model:
        overrides["model.name"] = args.model
    return load_config(args.config or find_default_config(), overrides)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(result: dict[str, Any]) -> str:
    latency = result["mode"] == "latency"
    head = (["variant", "ms/token", "min-max", "speedup", "TTFT ms", "total ms", "tokens"] if latency else
            ["variant", "tok/s", "decode tok/s", "speedup", "wall s", "tokens", "TTFT ms", "ms/token"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in result["variants"]:
        if not r["available"]:
            lines.append(f"| {r['name']} | unavailable: {r['reason']} |")
            continue
        speed = _fmt(r["speedup_vs_standard"], ".2f") + ("x" if r["speedup_vs_standard"] else "")
        if r.get("speedup_vs_auto_kv"):
            speed += f" ({r['speedup_vs_auto_kv']:.2f}x vs {r['name'].partition('+')[0]})"
        spread = "-" if not r.get("tpot_ms_range") else "{:.2f}-{:.2f}".format(*r["tpot_ms_range"])
        cells = ([_fmt(r["tpot_ms"], ".2f"), spread, speed, _fmt(r["ttft_ms"], ".1f"), _fmt(r["total_ms"], ".1f"),
                  str(r["tokens"])] if latency else
                 [_fmt(r["tok_s"], ".1f"), _fmt(r.get("decode_tok_s"), ".1f"), speed, _fmt(r["wall_s"], ".2f"),
                  str(r["tokens"]),
                  _fmt(r["ttft_ms"], ".1f"), _fmt(r["tpot_ms"], ".2f")])
        lines.append(f"| {r['name']} | " + " | ".join(cells) + " |")
    s = result["settings"]
    what = (f"context {s['context_len']}, {s['max_tokens']} tokens" +
            ("" if latency else f", {s['num_requests']} concurrent requests") +
            f", median of {s['repeat']}; {result['machine']['device']} ({result['machine']['cpu_threads']} "
            f"torch threads); model {result['model']}")
    notes = [f"{r['name']}: {r['attention']}" + (f"; decode: {r['decode']}" if r.get("decode") else "")
             for r in result["variants"] if r["available"]]
    return "\n".join([what, *lines, *notes, *(f"WARNING: {w}" for w in result["warnings"])])


def _variant_list(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [v for v in names if v.partition("+")[0] not in VARIANTS
               or v.partition("+")[2] not in ("", *KV_CACHE_DTYPES)]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown variant(s) {unknown}; choose from {', '.join(VARIANTS)}, "
                                         f"each optionally +{'|'.join(KV_CACHE_DTYPES)} (the KV cache dtype)")
    return names


def _add_engine_arguments(p: argparse.ArgumentParser, context_len: int | None, max_tokens: int) -> None:
    p.add_argument("--model", help="[model] name: HF folder, .gguf, synthetic:llama-3.1-8b, synthetic:tiny "
                                   "(default: the config's, else the embedded default)")
    p.add_argument("--config", help="config.toml (default: $FDSERVE_CONFIG, else ./config.toml if present)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="config override applied to every variant, e.g. --set backend.block_size=32")
    p.add_argument("--variants", type=_variant_list, default=["standard", "flash"],
                   help=f"comma-separated, from {', '.join(VARIANTS)}, each optionally +fp8_e4m3 / +fp8_e5m2 "
                        "for an FP8 KV cache (default: standard,flash)")
    if context_len is not None:
        p.add_argument("--context-len", type=int, default=context_len, help="prompt tokens per request")
    p.add_argument("--max-tokens", type=int, default=max_tokens, help="generated tokens per request (ignore_eos)")
    p.add_argument("--repeat", type=int, default=3, help="measured runs per variant; the median is reported")
    p.add_argument("--warmup", type=int, default=1, help="untimed warm-up requests per variant")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `fdserve bench` arguments: one sub-mode per measurement."""
    from bench.serve import add_serve_arguments
    from bench.ttft import add_prefill_arguments

    modes = parser.add_subparsers(dest="mode", metavar="MODE", required=True)
    latency = modes.add_parser("latency", help="per-token latency of one long request, per variant")
    _add_engine_arguments(latency, context_len=4096, max_tokens=128)
    latency.add_argument("--transformers", action="store_true",
                         help="add a row for transformers `generate` on the same model, dtype and device")
    concurrency = modes.add_parser("concurrency", help="total tokens/s of N concurrent requests, per variant")
    _add_engine_arguments(concurrency, context_len=1024, max_tokens=128)
    concurrency.add_argument("--num-requests", type=int, default=8, help="concurrent requests")
    prefill = modes.add_parser("prefill", help="time to the first token per prompt length, per variant")
    _add_engine_arguments(prefill, context_len=None, max_tokens=16)
    add_prefill_arguments(prefill)
    add_serve_arguments(modes.add_parser("serve", help="TTFT/TPOT/ITL and tok/s against a running server"))
    for sub in modes.choices.values():
        sub.add_argument("--out", type=Path, help="JSON path (default: bench/results/e2e_<mode>.json); "
                                                  "the PNG plot goes next to it")
        sub.add_argument("--no-plot", action="store_true", help="skip the PNG")


def run(args: argparse.Namespace) -> int:
    """Run the parsed `fdserve bench` command: table on stdout, JSON + PNG on disk."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # fdserve never downloads
    from bench.serve import ServerUnreachable, format_serve_table, run_serve
    from engine.config import ConfigError

    try:
        if args.mode == "serve":
            result = run_serve(args)
            table = format_serve_table(result)
        elif args.mode == "prefill":
            from bench.ttft import format_prefill_table, run_prefill_bench
            result = run_prefill_bench(args)
            table = format_prefill_table(result)
        else:
            result = run_engine_bench(args)
            table = format_table(result)
    except ConfigError as exc:
        print(f"fdserve bench: {exc}", file=sys.stderr)
        return 2
    except ServerUnreachable as exc:
        print(f"fdserve bench serve: cannot run the sweep: {exc}", file=sys.stderr)
        return 1
    out = args.out or Path("bench/results") / f"e2e_{args.mode}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(table)
    print(f"JSON: {out}")
    if not args.no_plot:
        from bench.plots import plot_result
        print(f"plot: {plot_result(result, out.with_suffix('.png'))}")
    return 0 if result_ok(result) else 1


def result_ok(result: dict[str, Any]) -> bool:
    if result["mode"] == "serve":
        return all(level["failed"] == 0 for level in result["levels"])
    return any(r["available"] for r in result["variants"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fdserve bench", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
