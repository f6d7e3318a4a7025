"""Paged prefill attention on the GPU: correctness, launch-config sweep, and the whole prompt's
attention against torch SDPA on contiguous K/V (what transformers runs), in one call.

    python bench/prefill_kernels.py --check --sweep --prompt --out DIR

Llama-3.1-8B heads (32 query over 8 KV, D=128), bf16, pages of 16 (and 64 where named).
--check   the kernel at the vendor config against float32 SDPA over the gathered pages: odd chunk
          lengths, chunks after cached prefixes of 0, 1 and many pages, GQA 1/4/8, D 64/128.
--sweep   launch configs at chunk shapes (a cold 16K chunk; 2K chunks after 30K and 126K tokens;
          a 16K chunk after 112K): median ms (do_bench) and TFLOP/s of the causal FLOPs.
--prompt  one prompt's attention, all of it, as the engine runs it (chunks of --chunk tokens, each
          over the pages of everything before it) against SDPA on the whole prompt (is_causal, GQA),
          per prompt length; FLOPs = 4·D·Hq·L²/2. `ours_cudnn_prefix` is the engine's
          `prefill_prefix = "auto"`: cuDNN over each chunk's long cached prefix, then the kernel.
--prefix-sweep  one 2048-token chunk after 1K..64K cached tokens: the kernel alone against cuDNN over
          the whole prefix + the kernel, and the cuDNN part alone (where `prefix_min_keys` comes from).
Writes DIR/prefill_kernels.json and prints the tables last.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import importlib
import itertools
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels import prefill_attention  # noqa: E402
from kernels.attention.prefix import PrefixPlan, plan_prefix, prefix_seed, prefix_spans  # noqa: E402
from kernels.vendor import PrefillConfig, vendor_configs  # noqa: E402

HQ, HKV, D = 32, 8, 128
K = 1024


def causal_flops(prefix: int, chunk: int, heads: int = HQ, head_dim: int = D) -> float:
    """QK^T and PV of `chunk` new tokens over `prefix` cached ones plus their own causal triangle."""
    return 4.0 * head_dim * heads * (chunk * prefix + chunk * (chunk + 1) / 2)


def paged_case(prefix: int, chunk: int, page: int, gen: torch.Generator, heads=(HQ, HKV), head_dim=D):
    """q of the chunk, and bf16 pages of prefix + chunk tokens in shuffled order."""
    length = prefix + chunk
    pages = math.ceil(length / page)
    k = torch.randn(pages + 1, page, heads[1], head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(pages + 1, page, heads[1], head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    table = torch.randperm(pages + 1, device="cuda", generator=gen)[:pages].to(torch.int32)[None]
    q = torch.randn(chunk, heads[0], head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    seq_lens = torch.tensor([length], dtype=torch.int32, device="cuda")
    qsl = torch.tensor([0, chunk], dtype=torch.int32, device="cuda")
    return q, k, v, table, seq_lens, qsl


def reference_fp32(q, k, v, table, length):
    """float32 SDPA over the gathered pages, bottom-right causal (the chunk is the last tokens)."""
    page, hkv = k.shape[1], k.shape[2]
    idx = table[0, :math.ceil(length / page)].long()
    kk = k[idx].flatten(0, 1)[:length].float().transpose(0, 1)
    vv = v[idx].flatten(0, 1)[:length].float().transpose(0, 1)
    qq = q.float().transpose(0, 1)
    chunk = q.shape[0]
    mask = torch.arange(length, device="cuda")[None, :] <= torch.arange(length - chunk, length, device="cuda")[:, None]
    group = q.shape[1] // hkv
    out = F.scaled_dot_product_attention(qq, kk.repeat_interleave(group, 0), vv.repeat_interleave(group, 0),
                                         attn_mask=mask, scale=q.shape[2] ** -0.5)
    return out.transpose(0, 1)


def run_checks(gen: torch.Generator) -> list[dict[str, Any]]:
    rows = []
    cases = [(0, 4096 + 7, (32, 8), 128), (16, 2048, (32, 8), 128), (16 * 300 + 5, 2048 - 3, (32, 8), 128),
             (32768 + 1, 2048, (32, 8), 128), (0, 999, (32, 32), 128), (4096 - 16, 777, (32, 4), 128),
             (1000, 1500, (16, 16), 64), (0, 3001, (32, 4), 64), (5000, 1024 + 1, (24, 8), 128)]
    for prefix, chunk, heads, head_dim in cases:
        q, k, v, table, seq_lens, qsl = paged_case(prefix, chunk, 16, gen, heads, head_dim)
        out = prefill_attention(q, k, v, table, seq_lens, qsl, scale=head_dim ** -0.5, max_query_len=chunk)
        ref = reference_fp32(q, k, v, table, prefix + chunk)
        err = float((out.float() - ref).norm() / ref.norm())
        rows.append({"prefix": prefix, "chunk": chunk, "heads": list(heads), "head_dim": head_dim,
                     "rel_err": err, "nan": bool(out.isnan().any())})
    return rows


SWEEP_CASES = [(0, 16 * K), (30 * K, 2 * K), (126 * K, 2 * K), (112 * K, 16 * K)]


def sweep_configs() -> list[PrefillConfig]:
    return [PrefillConfig(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages, pack=pack)
            for bm, bn, warps, stages, pack in itertools.product((64, 128), (64, 128), (4, 8), (2, 3, 4), (1, 4))]


def time_ms(fn, rep_ms: int = 100) -> float:
    return float(triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))


def run_sweep(gen: torch.Generator, pages: tuple[int, ...]) -> list[dict[str, Any]]:
    """Every config at the first page size; the six best of those at the others."""
    rows: list[dict[str, Any]] = []
    for page in pages:
        configs = sweep_configs() if not rows else best_configs(rows, pages[0], top=6)
        for prefix, chunk in SWEEP_CASES:
            q, k, v, table, seq_lens, qsl = paged_case(prefix, chunk, page, gen)
            flops = causal_flops(prefix, chunk)
            for cfg in configs:
                row = {"page": page, "prefix": prefix, "chunk": chunk, **cfg.__dict__}
                try:
                    ms = time_ms(functools.partial(prefill_attention, q, k, v, table, seq_lens, qsl,
                                                   scale=D ** -0.5, max_query_len=chunk, config=cfg))
                    row.update(ms=ms, tflops=flops / ms / 1e9)
                except Exception as exc:  # noqa: BLE001 - a config that does not compile is a row
                    row.update(ms=None, error=f"{type(exc).__name__}: {str(exc)[:200]}")
                rows.append(row)
            del q, k, v
            torch.cuda.empty_cache()
    return rows


def best_configs(sweep: list[dict[str, Any]], page: int, top: int = 3) -> list[PrefillConfig]:
    """Configs ranked by the geometric mean of their TFLOP/s over the sweep's cases."""
    scores: dict[tuple, list[float]] = {}
    for r in sweep:
        if r["page"] != page:
            continue
        key = (r["block_m"], r["block_n"], r["num_warps"], r["num_stages"], r["pack"])
        scores.setdefault(key, []).append(r.get("tflops") or 0.0)
    ranked = sorted((k for k, v in scores.items() if all(v)),
                    key=lambda k: -math.prod(scores[k]) ** (1 / len(scores[k])))
    return [PrefillConfig(block_m=k[0], block_n=k[1], num_warps=k[2], num_stages=k[3], pack=k[4])
            for k in ranked[:top]]


PREFIX_SWEEP = (1024, 2048, 4096, 8192, 16384, 32768, 65536)


def prefix_case_ms(prefix: int, chunk: int, page: int, gen: torch.Generator) -> dict[str, Any]:
    """One chunk after `prefix` cached tokens: the kernel alone, cuDNN over the whole prefix then the kernel,
    and the cuDNN part (gather + attention) alone; ms, and the two outputs' relative difference."""
    q, k, v, table, lens, qsl = paged_case(prefix, chunk, page, gen)
    plan = plan_prefix(prefix_spans([prefix + chunk], [0, chunk], min_keys=1, min_rows=1, align=128), 1, q.device)
    alone = functools.partial(prefill_attention, q, k, v, table, lens, qsl, scale=D ** -0.5, max_query_len=chunk)
    cudnn_part = functools.partial(prefix_seed, q, k, v, table, plan, D ** -0.5)

    def seeded() -> torch.Tensor:
        return alone(seed=cudnn_part())
    diff = float((seeded().float() - alone().float()).norm() / alone().float().norm())
    return {"page": page, "prefix": prefix, "chunk": chunk, "kernel_ms": time_ms(alone),
            "cudnn_prefix_ms": time_ms(seeded), "cudnn_part_ms": time_ms(cudnn_part), "rel_diff": diff}


def run_prefix_sweep(gen: torch.Generator, pages: tuple[int, ...], chunk: int = 2048) -> list[dict[str, Any]]:
    rows = []
    for page in pages:
        for prefix in PREFIX_SWEEP:
            rows.append(prefix_case_ms(prefix, chunk, page, gen))
            torch.cuda.empty_cache()
    return rows


def prompt_attention_ms(length: int, chunk: int, page: int, attend, gen) -> float:
    """One layer's attention over a whole prompt in engine-sized chunks, timed with events."""
    q, k, v, table, seq_lens, _ = paged_case(length - min(chunk, length), min(chunk, length), page, gen)
    qs = torch.randn(length, HQ, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    calls = []
    for start in range(0, length, chunk):
        n = min(chunk, length - start)
        calls.append((qs[start:start + n], torch.tensor([start + n], dtype=torch.int32, device="cuda"),
                      torch.tensor([0, n], dtype=torch.int32, device="cuda"), n))

    def run():
        for qc, lens, qsl, n in calls:
            attend(qc, k, v, table, lens, qsl, scale=D ** -0.5, max_query_len=n)
    run()
    return time_ms(run, rep_ms=max(200, int(length / K) * 8))


# The engine plans a step's prefix spans once from host lengths; here each timed call's plan is made on its
# first run and kept with its tensors (which the timing loop reuses, so ids stay unique), so no call syncs.
_PREFIX_PLANS: dict[int, tuple[torch.Tensor, PrefixPlan | None]] = {}


def prefill_with_cudnn_prefix(q, k, v, table, lens, qsl, *, scale: float, max_query_len: int):
    """The engine's GPU prefill under `[backend] prefill_prefix = "auto"`: cuDNN over the cached prefix,
    then the paged kernel from that softmax state."""
    if id(lens) not in _PREFIX_PLANS:
        cfg = vendor_configs("nvidia").prefill_for(q.shape[-1])
        spans = prefix_spans(lens.tolist(), qsl.tolist(), min_keys=cfg.prefix_min_keys,
                             min_rows=cfg.prefix_min_rows, align=cfg.prefix_key_bucket)
        _PREFIX_PLANS[id(lens)] = (lens, plan_prefix(spans, lens.shape[0], q.device) if spans else None)
    plan = _PREFIX_PLANS[id(lens)][1]
    seed = None if plan is None else prefix_seed(q, k, v, table, plan, scale)
    return prefill_attention(q, k, v, table, lens, qsl, scale=scale, max_query_len=max_query_len, seed=seed)


def sdpa_ms(length: int, gen: torch.Generator, backend=None) -> float:
    from torch.nn.attention import sdpa_kernel
    q = torch.randn(1, HQ, length, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(1, HKV, length, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(1, HKV, length, D, device="cuda", dtype=torch.bfloat16, generator=gen)

    def run():
        if backend is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k.repeat_interleave(HQ // HKV, 1),
                                                  v.repeat_interleave(HQ // HKV, 1), is_causal=True)
    run()
    return time_ms(run, rep_ms=max(200, int(length / K) * 8))


def run_prompt(gen, lengths: list[int], chunks: list[int], kernels: dict[str, Any],
               page: int) -> list[dict[str, Any]]:
    from torch.nn.attention import SDPBackend
    rows = []
    for length in lengths:
        flops = causal_flops(0, length)
        row: dict[str, Any] = {"length": length, "tflop": flops / 1e12}
        for name, backend in (("sdpa", None), ("sdpa_flash", SDPBackend.FLASH_ATTENTION),
                              ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
            try:
                row[f"{name}_ms"] = sdpa_ms(length, gen, backend)
            except Exception as exc:  # noqa: BLE001
                row[f"{name}_ms"] = None
                row[f"{name}_error"] = str(exc)[:200]
        for (name, attend), chunk in itertools.product(kernels.items(), chunks):
            row[f"{name}_c{chunk}_ms"] = prompt_attention_ms(length, chunk, page, attend, gen)
        rows.append(row)
        torch.cuda.empty_cache()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--prompt", action="store_true")
    parser.add_argument("--prefix-sweep", action="store_true")
    parser.add_argument("--pages", default="16,64", help="page sizes of the sweep, comma-separated")
    parser.add_argument("--lengths", default="4096,16384,32768,65536,131072")
    parser.add_argument("--chunks", default="2048,8192")
    parser.add_argument("--prompt-pages", default="16", help="page sizes of --prompt, comma-separated")
    parser.add_argument("--baseline", help="module (dotted) of an earlier prefill_attention, timed beside in --prompt")
    parser.add_argument("--seed", type=int, default=20261203)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    result: dict[str, Any] = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                              "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                              "triton": triton.__version__, "command": " ".join(sys.argv),
                              "vendor_config": dataclasses.asdict(vendor_configs("nvidia").prefill_for(D))}
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    if args.check:
        result["checks"] = run_checks(gen)
    if args.sweep:
        result["sweep"] = run_sweep(gen, tuple(int(p) for p in args.pages.split(",")))
    if args.prefix_sweep:
        result["prefix_sweep"] = run_prefix_sweep(gen, tuple(int(p) for p in args.prompt_pages.split(",")))
    (args.out / "prefill_kernels.json").write_text(json.dumps(result, indent=1))
    if args.prompt:
        configs: dict[str, PrefillConfig | None] = {"ours": None}
        if args.sweep:
            configs.update({f"top{i}": c for i, c in enumerate(best_configs(result["sweep"], 16))})
        kernels: dict[str, Any] = {name: functools.partial(prefill_attention, config=cfg)
                                   for name, cfg in configs.items()}
        kernels["ours_cudnn_prefix"] = prefill_with_cudnn_prefix
        if args.baseline:
            kernels["before"] = importlib.import_module(args.baseline).prefill_attention
        result["prompt"] = [{"page": page, **row} for page in (int(p) for p in args.prompt_pages.split(","))
                            for row in run_prompt(gen, [int(x) for x in args.lengths.split(",")],
                                                  [int(x) for x in args.chunks.split(",")], kernels, page)]
        result["prompt_configs"] = {k: (v.__dict__ if v else "vendor") for k, v in configs.items()}
    result["seconds"] = time.time() - t0
    (args.out / "prefill_kernels.json").write_text(json.dumps(result, indent=1))
    print_tables(result)
    return 0 if all(r["rel_err"] < 1e-2 and not r["nan"] for r in result.get("checks", [])) else 1


def print_tables(result: dict[str, Any]) -> None:
    for r in result.get("checks", []):
        print(f"check prefix={r['prefix']} chunk={r['chunk']} heads={r['heads']} D={r['head_dim']}: "
              f"rel_err={r['rel_err']:.2e}{' NaN' if r['nan'] else ''}")
    if "sweep" in result:
        pages = sorted({r["page"] for r in result["sweep"]})
        for page in pages:
            for cfg in best_configs(result["sweep"], page, top=6):
                cells = [f"{r['tflops']:.0f}" for r in result["sweep"] if r["page"] == page and
                         (r["block_m"], r["block_n"], r["num_warps"], r["num_stages"], r["pack"]) ==
                         (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.pack)]
                print(f"page {page} bm{cfg.block_m} bn{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages} "
                      f"p{cfg.pack}: TFLOP/s {' / '.join(cells)}")
        vendor = result["vendor_config"]
        cells = [f"{r['tflops']:.0f}" for r in result["sweep"] if r["page"] == 16 and
                 all(r[k] == vendor[k] for k in ("block_m", "block_n", "num_warps", "num_stages", "pack"))]
        print(f"vendor config: TFLOP/s {' / '.join(cells)}  (cases {SWEEP_CASES})")
    for r in result.get("prefix_sweep", []):
        print(f"page {r['page']} chunk {r['chunk']} after {r['prefix']}: kernel {r['kernel_ms']:.3f} ms, "
              f"cuDNN prefix + kernel {r['cudnn_prefix_ms']:.3f} (cuDNN part {r['cudnn_part_ms']:.3f}), "
              f"rel diff {r['rel_diff']:.1e}")
    for r in result.get("prompt", []):
        times = " ".join(f"{k[:-3]}={r[k]:.1f}" for k in r if k.endswith("_ms") and r[k])
        print(f"page {r['page']} L={r['length']} ({r['tflop']:.1f} TFLOP/layer) ms: {times}")


if __name__ == "__main__":
    sys.exit(main())
