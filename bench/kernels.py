"""Decode-kernel correctness and speed on the GPU: standard, flash, fdpp vs torch SDPA.

    python bench/kernels.py --check --bench [--sweep] --out DIR

--check   every variant against a float32 reference at Llama-3.1-8B shapes (32 q heads, 8 KV
          heads, D=128, bf16), B in {1, 8, 32}, L in {1K .. 128K}, block sizes 16 and 64, fresh
          random data, shuffled pages, mixed odd lengths; outputs poisoned with NaN first.
--bench   CUDA-graph replay with L2 flushed (triton do_bench), B in {1, 8, 32} x L in {4K .. 128K},
          time and achieved bandwidth (KV bytes / time) as a fraction of a device-to-device copy
          bandwidth measured in the same run; SDPA on contiguous KV is the anchor.
--sweep   launch-config sweep of the flash kernel at a few shapes (what the defaults came from).
Writes DIR/kernels.json and DIR/kernels_latency.png and prints the tables last.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels import decode_attention, new_stats  # noqa: E402
from kernels.vendor import DecodeConfig, vendor_configs  # noqa: E402

HQ, HKV, D = 32, 8, 128
SCALE = D ** -0.5
K = 1024


def paged_kv(lens: list[int], page: int, gen: torch.Generator):
    """bf16 caches holding exactly the pages the lengths need, in shuffled order."""
    pages = [math.ceil(n / page) for n in lens]
    num_blocks = sum(pages)
    k = torch.randn(num_blocks, page, HKV, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(num_blocks, page, HKV, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    perm = torch.randperm(num_blocks, device="cuda", generator=gen).to(torch.int32)
    tables = torch.zeros(len(lens), max(pages), dtype=torch.int32, device="cuda")
    start = 0
    for b, n in enumerate(pages):
        tables[b, :n] = perm[start:start + n]
        start += n
    return k, v, tables, torch.tensor(lens, dtype=torch.int32, device="cuda")


def reference_fp32(q, k_cache, v_cache, tables, lens):
    """Plain float32 softmax attention, one sequence at a time (bounded memory)."""
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    page = k_cache.shape[1]
    for b, n in enumerate(lens.tolist()):
        idx = tables[b, :math.ceil(n / page)].long()
        k = k_cache[idx].reshape(-1, HKV, D)[:n].float()
        v = v_cache[idx].reshape(-1, HKV, D)[:n].float()
        qb = q[b].float().reshape(HKV, HQ // HKV, D)
        p = torch.softmax(torch.einsum("hgd,nhd->hgn", qb, k) * SCALE, dim=-1)
        out[b] = torch.einsum("hgn,nhd->hgd", p, v).reshape(HQ, D)
    return out


def rel_err(out, ref):
    return float((out.float() - ref).norm() / ref.norm())


VARIANTS: dict[str, dict[str, Any]] = {   # name -> decode_attention options
    "standard": {"variant": "standard"},
    "flash": {"variant": "flash"},
    "fdpp": {"variant": "fdpp"},                  # φ estimated per step (fixed_max_value = false)
    "fdpp_phi": {"variant": "fdpp", "phi": 0.0},  # φ forced (random data: scores ~ N(0, 1))
}


def run_checks(seed: int, cfg: DecodeConfig) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rows = []
    for page in (16, 64):
        for batch in (1, 8, 32):
            for length in (1 * K, 4 * K, 16 * K, 64 * K, 128 * K):
                # Mixed odd lengths: the first sequence is L, the others in (L/2, L].
                others = torch.randint(length // 2 + 1, length + 1, (batch - 1,), generator=gen, device="cuda")
                lens = [length] + others.tolist()
                k, v, tables, seq_lens = paged_kv(lens, page, gen)
                for name, opts in VARIANTS.items():
                    q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16, generator=gen)
                    out = torch.full_like(q, float("nan"))
                    stats = new_stats(q.device) if opts["variant"] == "fdpp" else None
                    extra: dict[str, Any] = {"stats": stats} if stats is not None else {}
                    decode_attention(q, k, v, tables, seq_lens, scale=SCALE, out=out, config=cfg, **opts, **extra)
                    ref = reference_fp32(q, k, v, tables, seq_lens)
                    err = rel_err(out, ref)
                    rows.append({"variant": name, "page": page, "B": batch, "L": length,
                                 "rel_err": err, "max_abs": float((out.float() - ref).abs().max()),
                                 "fallback_rows": int(stats[0]) if stats is not None else 0,
                                 "ok": bool(torch.isfinite(out).all()) and err < 1e-2})
                del k, v
        torch.cuda.empty_cache()
    return rows


class Timer:
    """Median µs of one CUDA-graph replay of `fn`, with L2 made cold before every replay.

    flush="clean": read a 256 MB buffer first, so L2 holds only clean, unrelated lines (as in
    a real step, where the weights of the previous GEMM sit in L2). flush="dirty": triton's
    do_bench, which zeroes 256 MB first, so ~50 MB of dirty lines must be written back to HBM
    while the timed kernel reads: every kernel pays ~10 µs of extra traffic (the reference anchors
    in bench/RESULTS.md were measured this way).
    """

    def __init__(self) -> None:
        self.buf = torch.empty(256 * 1024**2 // 4, dtype=torch.float32, device="cuda").normal_()
        self.sink = torch.empty((), dtype=torch.float32, device="cuda")

    def __call__(self, fn, flush: str = "clean", reps: int = 100) -> float:
        import triton
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        if flush == "dirty":
            return 1000 * triton.testing.do_bench(graph.replay, warmup=25, rep=100, return_mode="median")
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for i in range(reps + 5):
            torch.sum(self.buf, dim=0, out=self.sink)
            if i >= 5:
                starts[i - 5].record()
            graph.replay()
            if i >= 5:
                ends[i - 5].record()
        torch.cuda.synchronize()
        times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))
        return 1000 * times[len(times) // 2]


def copy_bandwidth() -> float:
    import triton
    src = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * src.numel() / (ms * 1e-3)


def sdpa_backends():
    from torch.nn.attention import SDPBackend
    return {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}


def time_sdpa(timer, q, k, v, flush: str = "clean", scale: float = SCALE) -> tuple[float, str]:
    """Fastest torch SDPA backend that runs GQA decode on contiguous [B, Hkv, L, D] KV."""
    from torch.nn.attention import sdpa_kernel
    best = (float("inf"), "none")
    q4 = q[:, :, None, :]
    for name, backend in sdpa_backends().items():
        if name == "math":
            continue
        def fn(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)
        try:
            best = min(best, (timer(fn, flush), name))
        except RuntimeError:
            continue
    return best


def kv_bytes(batch: int, length: int) -> int:
    return batch * length * HKV * D * 2 * 2


def run_bench(timer, seed: int, copy_bw: float, cfg: DecodeConfig, pages=(16, 64)) -> list[dict]:
    """Every variant at both page sizes with a clean cold L2; SDPA, flash and fdpp (page 16)
    also with do_bench's dirty flush, the method of the reference anchors in bench/RESULTS.md."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rows = []
    for batch in (1, 8, 32):
        for length in (4 * K, 16 * K, 64 * K, 128 * K):
            q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16, generator=gen)
            kc = torch.randn(batch, HKV, length, D, device="cuda", dtype=torch.bfloat16, generator=gen)
            vc = torch.randn_like(kc)
            row: dict[str, Any] = {"B": batch, "L": length, "kv_bytes": kv_bytes(batch, length), "copy_bw": copy_bw}
            for flush in ("clean", "dirty"):
                row[f"sdpa_{flush}_us"], row["sdpa_backend"] = time_sdpa(timer, q, kc, vc, flush)
            del kc, vc
            for page in pages:
                k, v, tables, seq_lens = paged_kv([length] * batch, page, gen)
                ref = reference_fp32(q, k, v, tables, seq_lens)
                for name, opts in VARIANTS.items():
                    out = torch.empty_like(q)
                    # timed at once, in this iteration, before k and v are deleted (a late binding is wanted)
                    fn = lambda: decode_attention(q, k, v, tables, seq_lens, scale=SCALE,  # noqa: E731, B023, F821
                                                  out=out, config=cfg, **opts)  # noqa: B023
                    flushes = ("clean", "dirty") if page == 16 and name in ("flash", "fdpp") else ("clean",)
                    for flush in flushes:
                        row[f"{name}_p{page}_{flush}_us"] = timer(fn, flush)
                    if page == 16 and name == "flash":   # the same kernel again: the run's spread
                        row["flash_p16_clean_repeat_us"] = timer(fn, "clean")
                    row[f"{name}_p{page}_err"] = rel_err(out, ref)   # after hundreds of replays
                del k, v
                torch.cuda.empty_cache()
            for key in [k for k in row if k.endswith("_us")]:
                row[key.replace("_us", "_frac")] = row["kv_bytes"] / (row[key] * 1e-6) / copy_bw
            rows.append(row)
            print(f"  B={batch} L={length // K}K sdpa {row['sdpa_clean_us']:.1f} ({row['sdpa_backend']}) "
                  + " ".join(f"{n}={row[f'{n}_p16_clean_us']:.1f}" for n in VARIANTS), flush=True)
    return rows


def pick_config(sweep: list[dict]) -> DecodeConfig:
    """The sweep config with the lowest geometric-mean flash time over the sweep shapes."""
    scores: dict[str, list[float]] = {}
    for r in sweep:
        if "us" in r:
            scores.setdefault(r["config"], []).append(math.log(r["us"]))
    best = min(scores, key=lambda c: sum(scores[c]) / len(scores[c]))
    return next(c for c in sweep_configs() if repr(c) == best)


def sweep_configs() -> list[DecodeConfig]:
    """Split size at small contexts: shorter splits (more, shorter programs at B = 1) against the
    default. Earlier sweeps (tile size, stages, occupancy, register prefetch, page ids per window,
    a merge fused into the split kernel) are in bench/RESULTS.md."""
    return [DecodeConfig(),                                      # 128-token tiles, splits >= 256 tokens
            DecodeConfig(min_chunk=128),
            DecodeConfig(block_n=64, min_chunk=64),
            DecodeConfig(block_n=64, min_chunk=128),
            DecodeConfig(min_chunk=128, max_splits=128)]


def run_sweep(timer, seed: int, copy_bw: float) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shapes = [(1, 1 * K), (1, 4 * K), (1, 16 * K), (1, 128 * K), (8, 1 * K), (8, 16 * K), (32, 16 * K)]
    rows = []
    for page in (16,):
        for batch, length in shapes:
            q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16, generator=gen)
            k, v, tables, seq_lens = paged_kv([length] * batch, page, gen)
            ref = reference_fp32(q, k, v, tables, seq_lens)
            for cfg in sweep_configs():
                out = torch.empty_like(q)
                row = {"page": page, "B": batch, "L": length, "variant": "flash", "config": repr(cfg)}
                try:
                    # timed at once, in this iteration, before k and v are deleted (a late binding is wanted)
                    us = timer(lambda: decode_attention(q, k, v, tables, seq_lens, scale=SCALE,  # noqa: B023, F821
                                                        variant="flash", out=out, config=cfg), reps=50)  # noqa: B023
                except Exception as exc:   # a config that does not compile is data too
                    rows.append({**row, "error": str(exc)[:300]})
                    continue
                rows.append({**row, "us": us, "err": rel_err(out, ref),
                             "frac": kv_bytes(batch, length) / (us * 1e-6) / copy_bw})
            del k, v
            torch.cuda.empty_cache()
    return rows


def print_sweep(rows: list[dict]) -> None:
    """One line per config: flash µs at each sweep shape."""
    shapes = sorted({(r["B"], r["L"]) for r in rows})
    print("sweep (P=16), flash µs at " + ", ".join(f"B{b} L{length // K}K" for b, length in shapes))
    for cfg in dict.fromkeys(r["config"] for r in rows):
        cells = []
        for shape in shapes:
            got = next((r for r in rows if r["config"] == cfg and (r["B"], r["L"]) == shape), {})
            cells.append(f"{got['us']:.1f}" if "us" in got else "ERR")
        short = cfg.replace("DecodeConfig", "").replace(", merge_warps=4", "").replace(", extra={}", "")
        print(f"  {short}: " + " | ".join(cells))
    errs = [r for r in rows if "error" in r]
    for r in errs[:3]:
        print("  error:", r["config"][:80], r["error"][:200])
    print(f"  worst sweep rel err {max((r['err'] for r in rows if 'err' in r), default=0):.2e}")


def plot(bench: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, batch in zip(axes, (1, 8, 32), strict=True):
        rows = [r for r in bench if r["B"] == batch]
        xs = [r["L"] // K for r in rows]
        ax.plot(xs, [r["sdpa_clean_us"] for r in rows], "k--o", label="torch SDPA (contiguous)")
        for name, style in (("standard", "s-"), ("flash", "o-"), ("fdpp", "^-"), ("fdpp_phi", "v:")):
            ax.plot(xs, [r[f"{name}_p16_clean_us"] for r in rows], style, label=f"{name} (block 16)")
        ax.plot(xs, [r["kv_bytes"] / r["copy_bw"] * 1e6 for r in rows], "g:", label="copy-bandwidth floor")
        ax.set(xscale="log", yscale="log", xlabel="context L (K tokens)", ylabel="µs per layer",
               title=f"B={batch}: 32 q / 8 KV heads, D=128, bf16, clean cold L2")
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def table(bench: list[dict], page: int, flush: str) -> str:
    head = ("| B | L | floor µs | SDPA µs (frac) | standard µs | flash µs (frac) | fdpp µs (frac) "
            "| fdpp φ fixed µs | flash/SDPA | flash/fdpp |\n|---|---|---|---|---|---|---|---|---|---|\n")
    p = f"_p{page}"

    def cell(r: dict, name: str, frac: bool = True) -> str:
        key = f"{name}{p}_{flush}_us" if name != "sdpa" else f"sdpa_{flush}_us"
        if key not in r:
            return "–"
        return f"{r[key]:.1f}" + (f" ({r[key.replace('_us', '_frac')]:.2f})" if frac else "")

    lines = []
    for r in bench:
        flash, fdpp = r[f"flash{p}_{flush}_us"], r[f"fdpp{p}_{flush}_us"]
        lines.append(
            f"| {r['B']} | {r['L'] // K}K | {r['kv_bytes'] / r['copy_bw'] * 1e6:.1f} | {cell(r, 'sdpa')} "
            f"| {cell(r, 'standard', False)} | {cell(r, 'flash')} | {cell(r, 'fdpp')} | {cell(r, 'fdpp_phi', False)} "
            f"| {flash / r[f'sdpa_{flush}_us']:.2f} | {flash / fdpp:.2f} |")
    return head + "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--bench", action="store_true")
    parser.add_argument("--sweep", action="store_true", help="also: bench with the sweep's best config")
    parser.add_argument("--seed", type=int, default=int(time.time()))
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    import triton
    result: dict[str, Any] = {
        "meta": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                 "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "triton": triton.__version__, "command": " ".join(sys.argv), "seed": args.seed}}
    timer = Timer()
    copy_bw = copy_bandwidth()
    noop = torch.zeros(1, device="cuda")
    result["meta"].update(copy_bw=copy_bw, empty_graph_clean_us=timer(lambda: noop.add_(1)),
                          empty_graph_dirty_us=timer(lambda: noop.add_(1), "dirty"))
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s (read + write); one-kernel graph: "
          f"{result['meta']['empty_graph_clean_us']:.1f} µs clean flush, "
          f"{result['meta']['empty_graph_dirty_us']:.1f} µs dirty flush", flush=True)
    path = args.out / "kernels.json"

    def save():
        path.write_text(json.dumps(result, indent=1))

    cfg = vendor_configs("nvidia").decode
    if args.sweep:
        t0 = time.time()
        result["sweep"] = run_sweep(timer, args.seed, copy_bw)
        cfg = pick_config(result["sweep"])
        save()
        print(f"sweep done in {time.time() - t0:.0f}s; best {cfg}", flush=True)
    result["meta"]["decode_config"] = repr(cfg)
    if args.check:
        t0 = time.time()
        result["check"] = run_checks(args.seed, cfg)
        save()
        print(f"checks done in {time.time() - t0:.0f}s", flush=True)
    if args.bench:
        t0 = time.time()
        result["bench"] = run_bench(timer, args.seed + 1, copy_bw, cfg)
        save()
        plot(result["bench"], args.out / "kernels_latency.png")
        from kernels.occupancy import _CACHE
        result["meta"]["resident_ctas_measured"] = sorted({
            f"{'fdpp' if 'ESTIMATE' in dict(k[4]) else 'flash'} estimate={dict(k[4]).get('ESTIMATE')} "
            f"page={dict(k[4])['PAGE']}: {v} CTAs/SM" for k, v in _CACHE.items()})
        save()
        print(f"bench done in {time.time() - t0:.0f}s", flush=True)
    if "sweep" in result:
        print_sweep(result["sweep"])
    if "check" in result:
        bad = [r for r in result["check"] if not r["ok"]]
        worst: dict[str, float] = {}
        for r in result["check"]:
            worst[r["variant"]] = max(worst.get(r["variant"], 0.0), r["rel_err"])
        print(f"checks: {len(result['check'])} run, {len(bad)} failed; worst rel err per variant: "
              + ", ".join(f"{k} {v:.2e}" for k, v in worst.items()))
        print("fallback rows:", sum(r["fallback_rows"] for r in result["check"]))
        for r in bad[:10]:
            print("  FAILED", r)
    if "bench" in result:
        worst = max(r[k] for r in result["bench"] for k in r if k.endswith("_err"))
        spread = max(abs(r["flash_p16_clean_repeat_us"] / r["flash_p16_clean_us"] - 1) for r in result["bench"])
        print(f"bench outputs after graph replays: worst rel err {worst:.2e}; config {cfg}")
        print(f"same flash kernel timed twice: largest difference {100 * spread:.1f} %")
        for page, flush in ((16, "clean"), (64, "clean"), (16, "dirty")):
            print(f"\nblock size {page}, {flush} L2 flush:\n" + table(result["bench"], page, flush))


if __name__ == "__main__":
    main()
