"""`fdserve bench serve`: a serving sweep against a running OpenAI-compatible server.

At each concurrency level C, C workers each send `--rounds` streamed chat completions one
after another (random prompts of about `--prompt-len` tokens, `max_tokens` with
`"ignore_eos": true`, greedy). Per request: TTFT (first content chunk), ITL (gaps between
content chunks), TPOT ((latency - TTFT) / (tokens - 1)), with the token count taken from the
usage chunk (`stream_options.include_usage`), not from the chunk count, since one chunk may
carry several tokens. Per level: p50/p99 of each and output tokens/s over the level's wall time.

The prompt length is calibrated once through the server itself (two short non-streamed
requests give the template overhead and tokens per word), so it holds for any tokenizer.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from bench.decode_budget import decode_warnings

WORDS = ("time year people way day man thing woman life child world school state family student group "
         "country problem hand part place case week company system program question work government number "
         "night point home water room mother area money story fact month lot right study book eye job word "
         "business issue side kind head house service friend father power hour game line end member law car "
         "city community name president team minute idea kid body information back parent face others level "
         "office door health person art war history party result change morning reason research girl guy "
         "moment air teacher force education").split()


class ServerUnreachable(RuntimeError):
    """The sweep could not start: no server, wrong URL or key, or no model listed."""


@dataclass
class RequestRecord:
    ok: bool
    ttft_s: float = 0.0
    latency_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        if self.completion_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.completion_tokens - 1)


def make_prompt(num_words: int, seed: int) -> str:
    """Random words; the seed leads, so no two prompts share a prefix-cache block."""
    rng = random.Random(seed)
    return f"{seed}: " + " ".join(rng.choice(WORDS) for _ in range(num_words))


def _body(model: str, prompt: str, max_tokens: int, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": prompt}],
                            "max_tokens": max_tokens, "temperature": 0.0, "stream": stream,
                            "ignore_eos": True}  # an extra field: servers that do not know it ignore it
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def stream_one(client: Any, model: str, prompt: str, max_tokens: int) -> RequestRecord:
    start = time.perf_counter()
    last: float | None = None
    record = RequestRecord(ok=False)
    try:
        async with client.stream("POST", "chat/completions", json=_body(model, prompt, max_tokens, True)) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                return RequestRecord(ok=False, error=f"HTTP {resp.status_code}: {text[:200]}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("error"):
                    return RequestRecord(ok=False, error=str(chunk["error"])[:200])
                now = time.perf_counter()
                if any((c.get("delta") or {}).get("content") or (c.get("delta") or {}).get("reasoning_content")
                       for c in chunk.get("choices") or []):
                    if last is None:
                        record.ttft_s = now - start
                    else:
                        record.itl_s.append(now - last)
                    last = now
                usage = chunk.get("usage")
                if usage:
                    record.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    record.completion_tokens = int(usage.get("completion_tokens") or 0)
    except Exception as exc:  # network errors and bad chunks count as failed requests, with the reason
        return RequestRecord(ok=False, error=f"{type(exc).__name__}: {exc}")
    record.latency_s = time.perf_counter() - start
    if last is None or record.completion_tokens == 0:
        record.error = "no content chunk or no usage chunk (does the server honour stream_options.include_usage?)"
        return record
    record.ok = True
    return record


async def _prompt_tokens(client: Any, model: str, num_words: int) -> int:
    resp = await client.post("chat/completions", json=_body(model, make_prompt(num_words, 0), 1, False))
    resp.raise_for_status()
    return int(resp.json()["usage"]["prompt_tokens"])


async def words_for_tokens(client: Any, model: str, target: int) -> int:
    """How many words make a prompt of about `target` tokens on this server (template included)."""
    small, large = 8, 8 + max(target, 16)
    t_small, t_large = await _prompt_tokens(client, model, small), await _prompt_tokens(client, model, large)
    per_word = max((t_large - t_small) / (large - small), 1e-3)
    overhead = t_small - per_word * small
    return max(1, round((target - overhead) / per_word))


async def served_model(client: Any) -> str:
    resp = await client.get("models")
    resp.raise_for_status()
    models = resp.json().get("data") or []
    if not models:
        raise ServerUnreachable("GET /models lists no model; pass --served-model")
    return str(models[0]["id"])


def _pct(values: list[float], q: float) -> float | None:
    """q-th percentile in ms (seconds in)."""
    import numpy as np  # here, not at import: `fdserve --help` imports this module

    return float(np.percentile(values, q)) * 1e3 if values else None


def summarise_level(concurrency: int, records: list[RequestRecord], wall_s: float) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    ttft = [r.ttft_s for r in ok]
    tpot = [r.tpot_s for r in ok if r.tpot_s is not None]
    itl = [gap for r in ok for gap in r.itl_s]
    out_tokens = sum(r.completion_tokens for r in ok)
    errors = [r.error for r in records if not r.ok]
    return {
        "concurrency": concurrency, "requests": len(records), "failed": len(errors),
        "first_error": errors[0] if errors else None, "wall_s": wall_s,
        "output_tok_s": out_tokens / wall_s if wall_s > 0 else 0.0, "request_s": len(ok) / wall_s,
        "output_tokens": out_tokens,
        "mean_prompt_tokens": sum(r.prompt_tokens for r in ok) / len(ok) if ok else None,
        "ttft_ms_p50": _pct(ttft, 50), "ttft_ms_p99": _pct(ttft, 99),
        "tpot_ms_p50": _pct(tpot, 50), "tpot_ms_p99": _pct(tpot, 99),
        "itl_ms_p50": _pct(itl, 50), "itl_ms_p99": _pct(itl, 99),
        "latency_ms_p50": _pct([r.latency_s for r in ok], 50),
    }


async def run_level(client: Any, model: str, concurrency: int, rounds: int, num_words: int, max_tokens: int,
                    seed: int, bar: Any) -> dict[str, Any]:
    async def worker(w: int) -> list[RequestRecord]:
        records = []
        for r in range(rounds):
            record = await stream_one(client, model, make_prompt(num_words, seed + w * rounds + r), max_tokens)
            records.append(record)
            bar.update(1)
        return records

    start = time.perf_counter()
    per_worker = await asyncio.gather(*(worker(w) for w in range(concurrency)))
    wall = time.perf_counter() - start
    return summarise_level(concurrency, [r for rs in per_worker for r in rs], wall)


async def sweep(args: argparse.Namespace) -> dict[str, Any]:
    import httpx
    from tqdm import tqdm

    warnings = decode_warnings(args.max_tokens)
    for text in warnings:
        print(f"warning: {text}", file=sys.stderr)

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=max(args.concurrency) + 4)
    async with httpx.AsyncClient(base_url=args.url.rstrip("/") + "/", headers=headers, limits=limits,
                                 timeout=httpx.Timeout(args.timeout)) as client:
        try:
            model = args.served_model or await served_model(client)
            num_words = await words_for_tokens(client, model, args.prompt_len)  # also warms the server up
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            raise ServerUnreachable(f"{args.url}: {type(exc).__name__}: {exc}") from exc
        levels = []
        total = sum(c * args.rounds for c in args.concurrency)
        with tqdm(total=total, desc="serve sweep", unit="req", leave=False, file=sys.stderr,
                  disable=None) as bar:  # None: no bar when stderr is not a terminal
            for i, c in enumerate(args.concurrency):
                seed = args.seed + 1_000_000 * (i + 1)
                levels.append(await run_level(client, model, c, args.rounds, num_words, args.max_tokens, seed, bar))
    return {"mode": "serve", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "url": args.url, "model": model,
            "settings": {"prompt_len": args.prompt_len, "words_per_prompt": num_words, "max_tokens": args.max_tokens,
                         "rounds": args.rounds, "concurrency": args.concurrency, "seed": args.seed},
            "warnings": warnings, "levels": levels}


def run_serve(args: argparse.Namespace) -> dict[str, Any]:
    return asyncio.run(sweep(args))


def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def format_serve_table(result: dict[str, Any]) -> str:
    s = result["settings"]
    head = ["conc", "req", "failed", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99",
            "ITL p50", "ITL p99", "prompt tok"]
    lines = [f"{result['url']} model {result['model']}: prompt ~{s['prompt_len']} tokens, {s['max_tokens']} "
             f"generated, {s['rounds']} requests per worker; times in ms",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for lv in result["levels"]:
        cells = [str(lv["concurrency"]), str(lv["requests"]), str(lv["failed"]), _fmt(lv["output_tok_s"]),
                 *(_fmt(lv[k]) for k in ("ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99",
                                         "itl_ms_p50", "itl_ms_p99", "mean_prompt_tokens"))]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [f"level {lv['concurrency']}: first error: {lv['first_error']}" for lv in result["levels"] if lv["failed"]]
    return "\n".join(lines)


def _levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError("concurrency levels must be integers >= 1")
    return levels


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000/v1", help="the server's base URL (with /v1)")
    p.add_argument("--api-key", default=os.environ.get("FDSERVE_API_KEY"),
                   help="bearer key (default: $FDSERVE_API_KEY)")
    p.add_argument("--served-model", help="model id to send (default: the first of GET /models)")
    p.add_argument("--concurrency", type=_levels, default=[1, 2, 4, 8, 16, 32, 64],
                   help="comma-separated levels (default: 1,2,4,8,16,32,64)")
    p.add_argument("--prompt-len", type=int, default=512, help="prompt tokens per request (approximate)")
    p.add_argument("--max-tokens", type=int, default=128, help="generated tokens per request (ignore_eos)")
    p.add_argument("--rounds", type=int, default=2, help="requests each worker sends, one after another")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
