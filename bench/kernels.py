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


VARIANTS = {   # name -> decode_attention options
    "standard": {"variant": "standard"},
    "flash": {"variant": "flash"},
    "fdpp": {"variant": "fdpp"},                  # φ estimated per step (fixed_max_value = false)
    "fdpp_phi": {"variant": "fdpp", "phi": 0.0},  # φ forced (random data: scores ~ N(0, 1))
}


def run_checks(seed: int) -> list[dict]:
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
                    extra = {"stats": stats} if stats is not None else {}
                    decode_attention(q, k, v, tables, seq_lens, scale=SCALE, out=out, **opts, **extra)
                    ref = reference_fp32(q, k, v, tables, seq_lens)
                    err = rel_err(out, ref)
                    rows.append({"variant": name, "page": page, "B": batch, "L": length,
                                 "rel_err": err, "max_abs": float((out.float() - ref).abs().max()),
                                 "fallback_rows": int(stats[0]) if stats is not None else 0,
                                 "ok": bool(torch.isfinite(out).all()) and err < 1e-2})
                del k, v
        torch.cuda.empty_cache()
    return rows


def graph_time_us(fn, rep: int = 150) -> float:
    """Median µs of one CUDA-graph replay of `fn`, L2 flushed before each (triton do_bench)."""
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
    return 1000 * triton.testing.do_bench(graph.replay, warmup=25, rep=rep, return_mode="median")


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


def time_sdpa(q, k, v) -> tuple[float, str]:
    """Fastest torch SDPA backend that runs GQA decode on contiguous [B, Hkv, L, D] KV."""
    from torch.nn.attention import sdpa_kernel
    best = (float("inf"), "none")
    q4 = q[:, :, None, :]
    for name, backend in sdpa_backends().items():
        if name == "math":
            continue
        def fn(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q4, k, v, scale=SCALE, enable_gqa=True)
        try:
            best = min(best, (graph_time_us(fn), name))
        except RuntimeError:
            continue
    return best


def kv_bytes(batch: int, length: int) -> int:
    return batch * length * HKV * D * 2 * 2


def run_bench(seed: int, copy_bw: float, pages=(16, 64)) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rows = []
    for batch in (1, 8, 32):
        for length in (4 * K, 16 * K, 64 * K, 128 * K):
            q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16, generator=gen)
            kc = torch.randn(batch, HKV, length, D, device="cuda", dtype=torch.bfloat16, generator=gen)
            vc = torch.randn_like(kc)
            sdpa_us, sdpa_name = time_sdpa(q, kc, vc)
            del kc, vc
            row = {"B": batch, "L": length, "kv_bytes": kv_bytes(batch, length),
                   "sdpa_us": sdpa_us, "sdpa_backend": sdpa_name}
            for page in pages:
                k, v, tables, seq_lens = paged_kv([length] * batch, page, gen)
                ref = reference_fp32(q, k, v, tables, seq_lens)
                for name, opts in VARIANTS.items():
                    out = torch.empty_like(q)
                    us = graph_time_us(lambda: decode_attention(q, k, v, tables, seq_lens, scale=SCALE,
                                                                out=out, **opts))
                    row[f"{name}_p{page}_us"] = us
                    row[f"{name}_p{page}_err"] = rel_err(out, ref)   # after hundreds of replays
                del k, v
                torch.cuda.empty_cache()
            row["frac_sdpa"] = row["kv_bytes"] / (sdpa_us * 1e-6) / copy_bw
            for page in pages:
                for name in VARIANTS:
                    row[f"{name}_p{page}_frac"] = row["kv_bytes"] / (row[f"{name}_p{page}_us"] * 1e-6) / copy_bw
            rows.append(row)
            print(f"  B={batch} L={length // K}K sdpa {sdpa_us:.1f} ({sdpa_name}) "
                  + " ".join(f"{n}={row[f'{n}_p16_us']:.1f}" for n in VARIANTS), flush=True)
    return rows


def sweep_configs() -> list[DecodeConfig]:
    """Prefetch on/off, KV tile, warps and occupancy target: what the defaults were chosen from."""
    configs = [DecodeConfig(prefetch=False, block_n=128, num_stages=3)]   # Triton's own pipeliner
    configs += [DecodeConfig(prefetch=True, block_n=bn, num_warps=w, num_stages=1)
                for bn, w in ((32, 4), (64, 4), (64, 8), (128, 8))]
    configs += [DecodeConfig(prefetch=True, block_n=64, num_stages=1, ctas_per_sm=c) for c in (3, 4)]
    configs += [DecodeConfig(prefetch=True, block_n=128, num_warps=8, num_stages=1, ctas_per_sm=c) for c in (1, 3)]
    return configs


def run_sweep(seed: int, copy_bw: float) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shapes = [(1, 4 * K), (1, 16 * K), (1, 128 * K), (8, 16 * K), (32, 16 * K), (32, 128 * K)]
    rows = []
    for page in (16,):
        for batch, length in shapes:
            q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16, generator=gen)
            k, v, tables, seq_lens = paged_kv([length] * batch, page, gen)
            ref = reference_fp32(q, k, v, tables, seq_lens)
            for cfg in sweep_configs():
                for variant in ("flash", "fdpp"):
                    out = torch.empty_like(q)
                    row = {"page": page, "B": batch, "L": length, "variant": variant, "config": repr(cfg)}
                    try:
                        us = graph_time_us(lambda: decode_attention(q, k, v, tables, seq_lens, scale=SCALE,
                                                                    variant=variant, out=out, config=cfg), rep=60)
                    except Exception as exc:   # a config that does not compile is data too
                        rows.append({**row, "error": str(exc)[:300]})
                        continue
                    rows.append({**row, "us": us, "err": rel_err(out, ref),
                                 "frac": kv_bytes(batch, length) / (us * 1e-6) / copy_bw})
            del k, v
            torch.cuda.empty_cache()
    return rows


def print_sweep(rows: list[dict]) -> None:
    """One line per config: µs at each sweep shape, flash / fdpp."""
    shapes = sorted({(r["B"], r["L"]) for r in rows})
    print("sweep (P=16), µs flash/fdpp at " + ", ".join(f"B{b} L{l // K}K" for b, l in shapes))
    for cfg in dict.fromkeys(r["config"] for r in rows):
        cells = []
        for shape in shapes:
            got = {r["variant"]: r for r in rows if r["config"] == cfg and (r["B"], r["L"]) == shape}
            cells.append("/".join(f"{got[v]['us']:.1f}" if "us" in got.get(v, {}) else "ERR" for v in ("flash", "fdpp")))
        short = cfg.replace("DecodeConfig", "").replace(", merge_warps=4, extra={}", "").replace("max_splits=64, ", "")
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
    for ax, batch in zip(axes, (1, 8, 32)):
        rows = [r for r in bench if r["B"] == batch]
        xs = [r["L"] // K for r in rows]
        ax.plot(xs, [r["sdpa_us"] for r in rows], "k--o", label="torch SDPA (contiguous)")
        for name, style in (("standard", "s-"), ("flash", "o-"), ("fdpp", "^-"), ("fdpp_phi", "v:")):
            ax.plot(xs, [r[f"{name}_p16_us"] for r in rows], style, label=f"{name} (block 16)")
        ax.plot(xs, [r["kv_bytes"] / 4.27e12 * 1e6 for r in rows], "g:", label="copy-bandwidth floor")
        ax.set(xscale="log", yscale="log", xlabel="context L (K tokens)", ylabel="µs per layer",
               title=f"decode attention, B={batch}, Llama-3.1-8B heads, bf16")
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def table(bench: list[dict], page: int = 16) -> str:
    head = (f"| B | L | floor µs | SDPA µs (frac) | standard µs | flash µs (frac) | fdpp µs (frac) "
            f"| fdpp φ fixed µs | flash/SDPA | flash/fdpp |\n|---|---|---|---|---|---|---|---|---|---|\n")
    lines = []
    for r in bench:
        p = f"_p{page}"
        lines.append(
            f"| {r['B']} | {r['L'] // K}K | {r['kv_bytes'] / r['copy_bw'] * 1e6:.1f} | {r['sdpa_us']:.1f} ({r['frac_sdpa']:.2f}) "
            f"| {r['standard' + p + '_us']:.1f} | {r['flash' + p + '_us']:.1f} ({r['flash' + p + '_frac']:.2f}) "
            f"| {r['fdpp' + p + '_us']:.1f} ({r['fdpp' + p + '_frac']:.2f}) | {r['fdpp_phi' + p + '_us']:.1f} "
            f"| {r['flash' + p + '_us'] / r['sdpa_us']:.2f} | {r['flash' + p + '_us'] / r['fdpp' + p + '_us']:.2f} |")
    return head + "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--bench", action="store_true")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--seed", type=int, default=int(time.time()))
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    import triton
    result = {"meta": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "command": " ".join(sys.argv), "seed": args.seed,
                       "decode_config": repr(vendor_configs("nvidia").decode)}}
    copy_bw = copy_bandwidth()
    result["meta"]["copy_bw"] = copy_bw
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s (read + write)", flush=True)
    path = args.out / "kernels.json"

    def save():
        path.write_text(json.dumps(result, indent=1))

    if args.sweep:
        t0 = time.time()
        result["sweep"] = run_sweep(args.seed, copy_bw)
        save()
        print(f"sweep done in {time.time() - t0:.0f}s", flush=True)
    if args.check:
        t0 = time.time()
        result["check"] = run_checks(args.seed)
        save()
        print(f"checks done in {time.time() - t0:.0f}s", flush=True)
    if args.bench:
        t0 = time.time()
        result["bench"] = run_bench(args.seed + 1, copy_bw)
        for row in result["bench"]:
            row["copy_bw"] = copy_bw
        save()
        plot(result["bench"], args.out / "kernels_latency.png")
        print(f"bench done in {time.time() - t0:.0f}s", flush=True)
    if "sweep" in result:
        print_sweep(result["sweep"])
    if "check" in result:
        bad = [r for r in result["check"] if not r["ok"]]
        worst = {}
        for r in result["check"]:
            worst[r["variant"]] = max(worst.get(r["variant"], 0.0), r["rel_err"])
        print(f"checks: {len(result['check'])} run, {len(bad)} failed; worst rel err per variant: "
              + ", ".join(f"{k} {v:.2e}" for k, v in worst.items()))
        print("fallback rows:", sum(r["fallback_rows"] for r in result["check"]))
        for r in bad[:10]:
            print("  FAILED", r)
    if "bench" in result:
        worst = max(r[k] for r in result["bench"] for k in r if k.endswith("_err"))
        print(f"bench outputs after graph replays: worst rel err {worst:.2e}")
        for page in (16, 64):
            print(f"\nblock size {page}:\n" + table(result["bench"], page))


if __name__ == "__main__":
    main()
