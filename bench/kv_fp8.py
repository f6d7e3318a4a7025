"""FP8 KV pages on the GPU: every decode variant and the paged prefill against a float32 oracle over
the dequantized caches (`--check`), and one layer's decode time over bf16 vs FP8 pages (`--bench`,
each timed as a replayed CUDA graph, as the engine runs decode).

Llama-3.1-8B attention shapes (32 query heads, 8 KV heads, head_dim 128, 16-token pages), bf16
queries, K/V drawn with a different magnitude per KV head and quantized with per-head scales.
`--check` covers B in {1, 8, 32} x L in {1K .. 128K} where B * L <= 1M tokens (the oracle's fp32
copy of the cache must fit beside it), and prefill chunks of 2K rows after cached prefixes.

    python bench/kv_fp8.py --check --bench --out bench/results/kv_fp8
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # `python bench/kv_fp8.py` from anywhere

from kernels import decode_attention, prefill_attention  # noqa: E402
from kernels.attention.fdpp import new_stats  # noqa: E402
from kernels.attention.kv_quant import dequantize_kv, fp8_max, quantize_kv  # noqa: E402

HQ, HKV, D, PAGE = 32, 8, 128, 16
SCALE = D ** -0.5
VARIANTS = ("standard", "flash", "fdpp")
LENGTHS = (1024, 4096, 16384, 32768, 65536, 131072)
MAX_TOKENS = 1 << 20
BENCH_DTYPES = (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)   # the first is the anchor


def make_pages(total_tokens: int, kv_dtype: torch.dtype, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """K/V pages for `total_tokens` tokens (+1 spare page): the FP8 codes and their per-head scales
    (or the bf16 values when `kv_dtype` is bf16)."""
    blocks = -(-total_tokens // PAGE) + 1
    magnitude = (torch.rand(HKV, generator=gen, device="cuda") * 8 + 0.5)
    out: dict[str, torch.Tensor] = {}
    for name in ("k", "v"):
        values = torch.randn(blocks, PAGE, HKV, D, generator=gen, device="cuda", dtype=torch.bfloat16)
        values.mul_(magnitude.to(torch.bfloat16)[:, None])
        if kv_dtype == torch.bfloat16:
            out[name] = values
            continue
        scale = values.float().abs().amax(dim=(0, 1, 3)) / fp8_max(kv_dtype)
        out[name] = quantize_kv(values, scale, kv_dtype)
        out[f"{name}_scale"] = scale
        del values
    return out


def tables_for(batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """Each sequence's pages: a shuffled permutation of all pages, so no two rows share a page."""
    per_seq = -(-length // PAGE)
    perm = torch.randperm(batch * per_seq, generator=gen, device="cuda").to(torch.int32)
    return perm.view(batch, per_seq)


def oracle_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tables: torch.Tensor, length: int) -> torch.Tensor:
    """float32 softmax(q k^T) v of each sequence over its `length` dequantized tokens."""
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for b in range(q.shape[0]):
        keys = k[tables[b].long()].reshape(-1, HKV, D)[:length]
        values = v[tables[b].long()].reshape(-1, HKV, D)[:length]
        qg = q[b].float().view(HKV, HQ // HKV, D)
        probs = torch.softmax(torch.einsum("hgd,lhd->hgl", qg, keys) * SCALE, dim=-1)
        out[b] = torch.einsum("hgl,lhd->hgd", probs, values).reshape(HQ, D)
    return out


def oracle_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """float32 causal attention of the last q.shape[0] positions of one sequence, 256 rows at a time."""
    keys = k[table.long()].reshape(-1, HKV, D)[:length].repeat_interleave(HQ // HKV, dim=1)
    values = v[table.long()].reshape(-1, HKV, D)[:length].repeat_interleave(HQ // HKV, dim=1)
    first = length - q.shape[0]
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for lo in range(0, q.shape[0], 256):
        rows = q[lo:lo + 256].float()
        scores = torch.einsum("qhd,lhd->hql", rows, keys) * SCALE
        positions = first + lo + torch.arange(rows.shape[0], device=q.device)
        scores.masked_fill_(torch.arange(length, device=q.device)[None, :] > positions[:, None], float("-inf"))
        out[lo:lo + 256] = torch.einsum("hql,lhd->qhd", torch.softmax(scores, dim=-1), values)
    return out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).norm() / ref.norm())


def check(kv_dtypes: list[torch.dtype]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for kv_dtype in kv_dtypes:
        for batch in (1, 8, 32):
            for length in LENGTHS:
                if batch * length > MAX_TOKENS:
                    continue
                pages = make_pages(batch * length, kv_dtype, gen)
                tables = tables_for(batch, length, gen)
                seq_lens = torch.full((batch,), length - 3, dtype=torch.int32, device="cuda")  # off a page edge
                q = torch.randn(batch, HQ, D, generator=gen, device="cuda", dtype=torch.bfloat16)
                exact_k = dequantize_kv(pages["k"], pages["k_scale"])
                exact_v = dequantize_kv(pages["v"], pages["v_scale"])
                oracle = oracle_decode(q, exact_k, exact_v, tables, length - 3)
                for variant in VARIANTS:
                    stats = new_stats(q.device) if variant == "fdpp" else None
                    options: dict[str, Any] = {"stats": stats} if stats is not None else {}
                    out = decode_attention(q, pages["k"], pages["v"], tables, seq_lens, scale=SCALE, variant=variant,
                                           k_scale=pages["k_scale"], v_scale=pages["v_scale"], **options)
                    rows.append({"what": "decode", "variant": variant, "kv_dtype": str(kv_dtype), "batch": batch,
                                 "len": length - 3, "rel_err": rel_err(out, oracle),
                                 "fdpp_fallback_rows": int(stats[0]) if stats is not None else None})
                    print(rows[-1], flush=True)
                del pages, exact_k, exact_v
                torch.cuda.empty_cache()
        for length in (4096 + 5, 32768 + 1, 131072 - 7):   # a 2K-row chunk after a cached prefix of many pages
            pages = make_pages(length, kv_dtype, gen)
            table = tables_for(1, length, gen)
            q = torch.randn(2048, HQ, D, generator=gen, device="cuda", dtype=torch.bfloat16)
            qsl = torch.tensor([0, 2048], dtype=torch.int32, device="cuda")
            seq_lens = torch.tensor([length], dtype=torch.int32, device="cuda")
            out = prefill_attention(q, pages["k"], pages["v"], table, seq_lens, qsl, scale=SCALE, max_query_len=2048,
                                    k_scale=pages["k_scale"], v_scale=pages["v_scale"])
            oracle = oracle_prefill(q, dequantize_kv(pages["k"], pages["k_scale"]),
                                    dequantize_kv(pages["v"], pages["v_scale"]), table[0], length)
            rows.append({"what": "prefill", "variant": "prefill", "kv_dtype": str(kv_dtype), "batch": 1,
                         "len": length, "rel_err": rel_err(out, oracle)})
            print(rows[-1], flush=True)
            del pages
            torch.cuda.empty_cache()
    return rows


def time_decode(batch: int, length: int, kv_dtype: torch.dtype, variant: str, iters: int = 100) -> dict[str, Any]:
    gen = torch.Generator(device="cuda").manual_seed(1)
    pages = make_pages(batch * length, kv_dtype, gen)
    tables = tables_for(batch, length, gen)
    seq_lens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, HQ, D, generator=gen, device="cuda", dtype=torch.bfloat16)
    options: dict[str, Any] = {"k_scale": pages["k_scale"], "v_scale": pages["v_scale"]} if "k_scale" in pages else {}
    if variant == "fdpp":
        options["stats"] = new_stats(q.device)

    def step() -> torch.Tensor:
        return decode_attention(q, pages["k"], pages["v"], tables, seq_lens, scale=SCALE, variant=variant, **options)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                 # warm-up: compile, plan, allocate the workspaces
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()                # replayed: the kernels alone, as the engine's decode graphs
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    us = start.elapsed_time(end) / iters * 1e3
    kv_bytes = 2 * batch * length * HKV * D * pages["k"].element_size()
    return {"variant": variant, "kv_dtype": str(kv_dtype), "batch": batch, "len": length, "us": us,
            "kv_GBps": kv_bytes / us / 1e3}


def bench() -> list[dict[str, Any]]:
    rows = []
    for batch, length in ((1, 100_000), (32, 16_384)):
        for variant in VARIANTS:
            timed = [time_decode(batch, length, dtype, variant) for dtype in BENCH_DTYPES]
            for row in timed[1:]:
                row["vs_bf16"] = row["us"] / timed[0]["us"]
            rows += timed
            print(timed, flush=True)
            torch.cuda.empty_cache()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--bench", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("bench/results/kv_fp8"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    if args.check:
        result["check"] = check([torch.float8_e4m3fn, torch.float8_e5m2])
    if args.bench:
        result["bench"] = bench()
    (args.out / "kv_fp8.json").write_text(json.dumps(result, indent=1))
    worst = max((r["rel_err"] for r in result.get("check", [])), default=0.0)
    print(f"\nworst rel. error {worst:.2e} over {len(result.get('check', []))} checks")
    print("| variant | B | L | KV dtype | us (CUDA graph) | vs bf16 | KV GB/s |\n|---|---|---|---|---|---|---|")
    for row in result.get("bench", []):
        print(f"| {row['variant']} | {row['batch']} | {row['len']} | {row['kv_dtype'].removeprefix('torch.')} | "
              f"{row['us']:.1f} | {row.get('vs_bf16', 1.0):.3f} | {row['kv_GBps']:.0f} |")
    return 0 if worst < 1e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
