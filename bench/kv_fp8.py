"""FP8 KV pages on the GPU: every decode variant and the paged prefill against a float32 oracle over
the dequantized caches (`--check`), and one layer's decode time over bf16 vs FP8 pages (`--bench`,
each timed as a replayed CUDA graph, as the engine runs decode).

Llama-3.1-8B attention shapes (32 query heads, 8 KV heads, head_dim 128, 16-token pages), bf16
queries, K/V drawn with a different magnitude per KV head and quantized with per-head scales.
`--check` covers B in {1, 8, 32} x L in {1K .. 128K} where B * L <= 1M tokens (the oracle's fp32
copy of the cache must fit beside it), and prefill chunks of 2K rows after cached prefixes.

    python bench/kv_fp8.py --check --bench --out bench/results/kv_fp8

`--sweep` times the flash kernel over bf16 and e4m3 pages under each launch shape of `SWEEP`
(tile, warps, pipelining, splits) at B x L = 1 x 100K and 32 x 16K, each against the same float32
oracle, so a config is kept per KV byte width only from one run's side-by-side numbers. `--spread`
times the vendor's launch shapes over the same ~200 MB of pages cut into 1 .. 16 sequences, beside the
copy bandwidth of the same run: whether a B = 1 rate comes from too few programs or from the kernel.
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # `python bench/kv_fp8.py` from anywhere

from bench.kernels import copy_bandwidth  # noqa: E402
from kernels import decode_attention, prefill_attention  # noqa: E402
from kernels.attention.fdpp import new_stats  # noqa: E402
from kernels.attention.flash_decoding import flash_decode  # noqa: E402
from kernels.attention.kv_quant import dequantize_kv, fp8_max, quantize_kv  # noqa: E402
from kernels.vendor import DecodeConfig, vendor_configs  # noqa: E402

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


# name -> DecodeConfig fields (the rest as DecodeConfig's defaults)
SWEEP: dict[str, dict[str, Any]] = {
    "default": {},
    "ctas4": {"ctas_per_sm": 4},
    "ctas6": {"ctas_per_sm": 6},
    "ctas8": {"ctas_per_sm": 8},
    "ctas12": {"ctas_per_sm": 12},
    "prefetch_s1": {"prefetch": True, "num_stages": 1},
    "prefetch_s2": {"prefetch": True, "num_stages": 2},
    "prefetch_s1_ctas6": {"prefetch": True, "num_stages": 1, "ctas_per_sm": 6},
    "window8_s2": {"page_window": 8, "num_stages": 2},
    "window16_s3": {"page_window": 16, "num_stages": 3},
    "window16_s4": {"page_window": 16, "num_stages": 4},
    "window32_s3": {"page_window": 32, "num_stages": 3},
    "window16_s3_ctas6": {"page_window": 16, "num_stages": 3, "ctas_per_sm": 6},
    "n64": {"block_n": 64},
    "n64_ctas8": {"block_n": 64, "ctas_per_sm": 8},
    "n64_w2_ctas12": {"block_n": 64, "num_warps": 2, "ctas_per_sm": 12},
    "n256_w4": {"block_n": 256},
    "n256_w8": {"block_n": 256, "num_warps": 8},
    "n256_w8_ctas4": {"block_n": 256, "num_warps": 8, "ctas_per_sm": 4},
    "w8": {"num_warps": 8},
    "w2": {"num_warps": 2},
    "w2_ctas12": {"num_warps": 2, "ctas_per_sm": 12},
    "n64_w2": {"block_n": 64, "num_warps": 2},
    "n64_w2_ctas16": {"block_n": 64, "num_warps": 2, "ctas_per_sm": 16},
    "n64_w2_ctas24": {"block_n": 64, "num_warps": 2, "ctas_per_sm": 24},
    "n64_w2_s2_ctas12": {"block_n": 64, "num_warps": 2, "num_stages": 2, "ctas_per_sm": 12},
    "n64_w2_s4_ctas12": {"block_n": 64, "num_warps": 2, "num_stages": 4, "ctas_per_sm": 12},
    "n64_w1_ctas16": {"block_n": 64, "num_warps": 1, "ctas_per_sm": 16},
    "n64_w1_ctas32": {"block_n": 64, "num_warps": 1, "ctas_per_sm": 32},
    "n32_w1_ctas32": {"block_n": 32, "num_warps": 1, "ctas_per_sm": 32},
    "n32_w1_ctas16": {"block_n": 32, "num_warps": 1, "ctas_per_sm": 16},
    "n32_w1_ctas48": {"block_n": 32, "num_warps": 1, "ctas_per_sm": 48},
    "n16_w1_ctas32": {"block_n": 16, "num_warps": 1, "ctas_per_sm": 32},
    "n32_w2_ctas16": {"block_n": 32, "num_warps": 2, "ctas_per_sm": 16},
    "n128_w2_ctas8": {"num_warps": 2, "ctas_per_sm": 8},
    "n64_w4_ctas12": {"block_n": 64, "ctas_per_sm": 12},
    # whole tiles by TMA copies (compute 9.0+; elsewhere the same shape through pointer loads)
    "tma_n16_w1_s2_ctas32": {"block_n": 16, "num_warps": 1, "num_stages": 2, "ctas_per_sm": 32, "tma": True},
    "tma_n16_w1_s2_ctas64": {"block_n": 16, "num_warps": 1, "num_stages": 2, "ctas_per_sm": 64, "tma": True},
    "tma_n16_w1_s6_ctas32": {"block_n": 16, "num_warps": 1, "num_stages": 6, "ctas_per_sm": 32, "tma": True},
    "tma_n16_w1_s6_ctas64": {"block_n": 16, "num_warps": 1, "num_stages": 6, "ctas_per_sm": 64, "tma": True},
    "tma_n16_w2_s6_ctas64": {"block_n": 16, "num_warps": 2, "num_stages": 6, "ctas_per_sm": 64, "tma": True},
}
FDPP_SWEEP = ("default", "n64_w2_ctas12")   # also timed through the FD++ kernel


def graph_time(step: Any, iters: int = 50) -> float:
    """us per replay of `step` captured as a CUDA graph (after three eager warm-up calls)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters * 1e3


@dataclass
class DecodeCase:
    """One layer's decode inputs at B x L, full-length sequences, with the float32 oracle's output."""
    q: torch.Tensor
    pages: dict[str, torch.Tensor]
    tables: torch.Tensor
    seq_lens: torch.Tensor
    oracle: torch.Tensor
    kv_bytes: int

    def flash_step(self, cfg: DecodeConfig) -> Callable[[], torch.Tensor]:
        return functools.partial(flash_decode, self.q, self.pages["k"], self.pages["v"], self.tables, self.seq_lens,
                                 scale=SCALE, config=cfg, k_scale=self.pages.get("k_scale"),
                                 v_scale=self.pages.get("v_scale"))


def decode_case(batch: int, length: int, kv_dtype: torch.dtype, seed: int) -> DecodeCase:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pages = make_pages(batch * length, kv_dtype, gen)
    tables = tables_for(batch, length, gen)
    seq_lens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, HQ, D, generator=gen, device="cuda", dtype=torch.bfloat16)
    oracle = oracle_decode(q, dequantize_kv(pages["k"], pages.get("k_scale")),
                           dequantize_kv(pages["v"], pages.get("v_scale")), tables, length)
    torch.cuda.empty_cache()
    return DecodeCase(q, pages, tables, seq_lens, oracle, 2 * batch * length * HKV * D * pages["k"].element_size())


def sweep() -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for batch, length in ((1, 100_000), (32, 16_384)):
        for kv_dtype in (torch.bfloat16, torch.float8_e4m3fn):
            case = decode_case(batch, length, kv_dtype, seed=2)
            for name, fields in SWEEP.items():
                cfg = DecodeConfig(**fields)
                row: dict[str, Any] = {"config": name, "kv_dtype": str(kv_dtype), "batch": batch, "len": length}
                try:
                    step = case.flash_step(cfg)
                    row["rel_err"] = rel_err(step(), case.oracle)
                    row["us"] = graph_time(step)
                    row["kv_GBps"] = case.kv_bytes / row["us"] / 1e3
                except Exception as exc:   # a launch shape the compiler rejects is a row, not the end of the sweep
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                rows.append(row)
                print(json.dumps(row), flush=True)
            for name in FDPP_SWEEP:
                cfg = DecodeConfig(**SWEEP[name])
                stats = new_stats(case.q.device)
                step = functools.partial(decode_attention, case.q, case.pages["k"], case.pages["v"], case.tables,
                                         case.seq_lens, scale=SCALE, variant="fdpp", config=cfg, stats=stats,
                                         k_scale=case.pages.get("k_scale"), v_scale=case.pages.get("v_scale"))
                row = {"config": f"fdpp_{name}", "kv_dtype": str(kv_dtype), "batch": batch, "len": length,
                       "rel_err": rel_err(step(), case.oracle), "us": graph_time(step)}
                row["kv_GBps"] = case.kv_bytes / row["us"] / 1e3
                rows.append(row)
                print(json.dumps(row), flush=True)
            del case
            torch.cuda.empty_cache()
    return rows


SPREAD = ((1, 102_400), (2, 51_200), (4, 25_600), (8, 12_800), (16, 6_400))   # same tokens, more sequences


def spread() -> dict[str, Any]:
    configs = vendor_configs("nvidia")
    shapes = {"shared": configs.decode, "fp8": configs.decode_for(torch.float8_e4m3fn),
              "fp8_tma": configs.decode_for(torch.float8_e4m3fn, tma=True)}
    rows: list[dict[str, Any]] = []
    for kv_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        for batch, length in SPREAD:
            case = decode_case(batch, length, kv_dtype, seed=3)
            for name, cfg in shapes.items():
                step = case.flash_step(cfg)
                row: dict[str, Any] = {"shape": name, "kv_dtype": str(kv_dtype), "batch": batch, "len": length,
                                       "rel_err": rel_err(step(), case.oracle), "us": graph_time(step)}
                row["kv_GBps"] = case.kv_bytes / row["us"] / 1e3
                rows.append(row)
            del case
            torch.cuda.empty_cache()
    return {"copy_GBps": copy_bandwidth() / 1e9, "rows": rows}


def print_spread(result: dict[str, Any]) -> None:
    if not result:
        return
    copy = result["copy_GBps"]
    print(f"\n| KV dtype | launch shape | B x L | us | KV GB/s | of copy ({copy:.0f} GB/s) |")
    print("|---|---|---|---|---|---|")
    for r in result["rows"]:
        print(f"| {r['kv_dtype'].removeprefix('torch.')} | {r['shape']} | {r['batch']} x {r['len']} | {r['us']:.1f} | "
              f"{r['kv_GBps']:.0f} | {r['kv_GBps'] / copy:.2f} |")


def print_sweep(rows: list[dict[str, Any]]) -> None:
    """us per config and shape, bf16 beside e4m3, and e4m3 against bf16's default."""
    if not rows:
        return
    cell = {(r["config"], r["batch"], r["kv_dtype"]): r for r in rows}
    shapes = sorted({(r["batch"], r["len"]) for r in rows})
    print("\n| config | " + " | ".join(f"{b}x{n} bf16 us | {b}x{n} e4m3 us | vs bf16 default" for b, n in shapes)
          + " |\n|---|" + "---|---|---|" * len(shapes))
    for name in (*SWEEP, *(f"fdpp_{n}" for n in FDPP_SWEEP)):
        cells = []
        for b, _ in shapes:
            bf = cell.get((name, b, str(torch.bfloat16)), {})
            f8 = cell.get((name, b, str(torch.float8_e4m3fn)), {})
            anchor = cell.get(("default", b, str(torch.bfloat16)), {}).get("us")
            ratio = f"{f8['us'] / anchor:.3f}" if "us" in f8 and anchor else "-"
            cells += [f"{bf.get('us', float('nan')):.1f}", f"{f8.get('us', float('nan')):.1f}", ratio]
        print(f"| {name} | " + " | ".join(cells) + " |")
    worst = max((r.get("rel_err", 0.0) for r in rows), default=0.0)
    print(f"sweep: worst rel. error {worst:.2e}; failed configs: "
          f"{sorted({r['config'] for r in rows if 'error' in r}) or 'none'}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--bench", action="store_true")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--spread", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("bench/results/kv_fp8"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    if args.check:
        result["check"] = check([torch.float8_e4m3fn, torch.float8_e5m2])
    if args.bench:
        result["bench"] = bench()
    if args.sweep:
        result["sweep"] = sweep()
    if args.spread:
        result["spread"] = spread()
    (args.out / "kv_fp8.json").write_text(json.dumps(result, indent=1))
    worst = max((r["rel_err"] for r in result.get("check", [])), default=0.0)
    print(f"\nworst rel. error {worst:.2e} over {len(result.get('check', []))} checks")
    print("| variant | B | L | KV dtype | us (CUDA graph) | vs bf16 | KV GB/s |\n|---|---|---|---|---|---|---|")
    for row in result.get("bench", []):
        print(f"| {row['variant']} | {row['batch']} | {row['len']} | {row['kv_dtype'].removeprefix('torch.')} | "
              f"{row['us']:.1f} | {row.get('vs_bf16', 1.0):.3f} | {row['kv_GBps']:.0f} |")
    print_sweep(result.get("sweep", []))
    print_spread(result.get("spread", {}))
    worst = max([worst, *(r["rel_err"] for r in result.get("spread", {}).get("rows", []))])
    return 0 if worst < 1e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
