"""FFD decode kernel on the GPU: correctness at real shapes, then speed against our dense
Flash-Decoding kernel and torch SDPA, in one run.

    python bench/ffd_kernels.py --dump-real            # CPU, once: real K/V of the embedded model
    python bench/ffd_kernels.py --check --bench --crossover --out DIR      # GPU

--check      Llama-3.1-8B shapes (32 q / 8 KV heads, D 128, bf16, BS 128) plus Qwen2.5-7B (28/4) and
             SmolLM2 (9/3, D 64): quantize-on-write bit-exact vs torch; δ = ∞ vs an fp32 dense
             reference over the refined keys; δ = 5 nats: block masks and output vs the torch rule;
             odd lengths and block boundaries (127 .. 257 blocks, tails 0, 1, 127), mixed batches,
             outputs poisoned with NaN first, CUDA-graph replay with changed lengths == eager.
--bench      CUDA-graph replay, L2 cleaned before each replay (a 256 MB read), median of 100:
             FFD vs our flash kernel (same pages; each timed twice, interleaved, the faster kept and
             both recorded) vs SDPA (contiguous KV) at L in {16K, 64K, 128K,
             256K}, B in {1, 8}, on (a) a sparsity-controlled synthetic generator (sinks, local
             window, planted needles in a fraction f of the blocks, N(0,1) background; the block
             sparsity the kernel measured is printed beside each time) and (b) real K/V of the
             embedded model (8K tokens of real text, one layer's K/V tiled to L; SmolLM2 shapes).
             Bound = dense bytes * (codes + scales + (1 - s)(residual + V)) / dense bytes / copy BW.
--crossover  FFD vs flash at L in {4K .. 128K}, B in {1, 8}, synthetic f = 0.2: the shortest L from
             which FFD is faster at both batch sizes (the `kernel = "auto"` crossover).
--auto-dense `kernel = "auto"` below its crossover (the FFD kernel's dense split-KV rows) against our
             flash kernel at 4K and 16K, B in {1, 8}: output difference and time.
--prefill    the FFD prefill kernel (kernels/ffd/prefill.py) on the last 2,048-query chunk of an 8K and
             a 32K prompt (B = 1, Llama-3.1-8B shapes), synthetic f = 0.1 and unstructured N(0,1)
             keys (nothing pruned): error vs the torch rule (fp32, on the GPU) and time against our
             dense Triton prefill on the same pages. --prefill-sweep: its time at 32K per tile
             and warp count.
--sweep NAME=V1,V2  each value of a tuning constant of kernels/ffd/decode.py (SCAN_STAGES, PM_SLICE, ...;
             repeatable) timed beside the defaults in one run, same inputs, at B in {1, 8}, L in {16K ..
             256K}, f = 0.1 (and 0.02 at 128K), Llama-3.1-8B shapes plus one head_dim 64 row, and
             `auto`'s dense rows at 4K and 16K; whether each output is bit-equal to the defaults'
             (split counts change the summation order).
--profile    GPU time per FFD launch (pseudo-max, scan, attend, merge) at 128K, B in {1, 8},
             synthetic f = 0.1, from the torch profiler: which pass the time goes to.
Writes DIR/ffd_kernels.json and prints the tables last.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.kernels import Timer, copy_bandwidth, time_sdpa  # noqa: E402
from kernels.ffd.reference import FFDParams, QuantizedPages, dequantize_blocks_ref, ffd_decode_ref, quantize_blocks_ref  # noqa: E402
from kernels.vendor import programmatic_launch  # noqa: E402

BS = 128
DEV = "cuda" if torch.cuda.is_available() else "cpu"    # cpu: --smoke under the Triton interpreter
REAL = Path(__file__).resolve().parent / "results" / "ffd_realkv.pt"
DELTA5 = FFDParams.delta_to_log2(5.0, "e")
ROUNDS = 2          # --bench: timings of each kernel per row (the minimum is reported)


def params(delta_log2=DELTA5, min_len=0) -> FFDParams:
    return FFDParams(block_size=BS, delta_log2=delta_log2, sink_tokens=4, local_window=128, min_ffd_len=min_len)


# ----- data --------------------------------------------------------------------------------------

class Case:
    """Paged bf16 K/V for `lens` (pages shuffled) with its quantized keys, built on the GPU."""

    def __init__(self, lens, hq, hkv, dim, gen, f_hot=None, real=None):
        self.lens, self.hq, self.hkv, self.dim = lens, hq, hkv, dim
        dev = DEV
        pages = [-(-n // BS) for n in lens]
        num = sum(pages) + 1
        self.q = torch.randn(len(lens), hq, dim, device=dev, generator=gen)
        if real is None:
            self.k = torch.randn(num, BS, hkv, dim, device=dev, generator=gen)
        else:
            self.k = torch.empty(num, BS, hkv, dim, device=dev)
        self.v = torch.randn(num, BS, hkv, dim, device=dev, generator=gen)
        perm = torch.randperm(num - 1, device=dev, generator=gen).to(torch.int32) + 1
        self.tables = torch.zeros(len(lens), max(pages), dtype=torch.int32, device=dev)
        start = 0
        for b, n in enumerate(pages):
            self.tables[b, :n] = perm[start:start + n]
            start += n
        if real is not None:
            self._fill_real(real)
        elif f_hot is not None:
            self._plant(f_hot, gen)
        self.q, self.k, self.v = self.q.bfloat16(), self.k.bfloat16(), self.v.bfloat16()
        self.seq = torch.tensor(lens, dtype=torch.int32, device=dev)
        self.qp = QuantizedPages(torch.zeros(num, hkv, BS, dim // 4, dtype=torch.uint8, device=dev),
                                 torch.zeros(num, hkv, dim, device=dev),
                                 torch.zeros(num, hkv, BS, dim, dtype=torch.float8_e4m3fn, device=dev))
        from kernels.ffd.quantize import quantize_on_write
        full = torch.cat([self.tables[b, :n // BS].long() for b, n in enumerate(lens)])
        quantize_on_write(self.k, self.qp.codes, self.qp.scales, self.qp.residual, full * BS + BS - 1)

    def _tokens(self, b, pos):
        t = pos.long()
        return self.tables[b, t // BS].long(), t % BS

    def _plant(self, f_hot, gen):
        """Sinks (logit ~12 nats), local window (~8), one needle (~10) in a fraction f of the
        blocks, background N(0,1) logits: a block is kept iff it holds a needle (or is forced)."""
        scale = self.dim ** -0.5
        group = self.hq // self.hkv
        for b, n in enumerate(self.lens):
            u = self.q[b].reshape(self.hkv, group, -1).mean(1)
            u = u / u.norm(dim=-1, keepdim=True)                       # [Hkv, D]
            proj = (self.q[b].reshape(self.hkv, group, -1) @ u[..., None]).squeeze(-1).min(1).values.clamp_min(0.5)
            amp = lambda logit, proj=proj: (logit / (proj * scale))[:, None]   # noqa: E731  [Hkv, 1]
            page, row = self._tokens(b, torch.arange(min(4, n), device=DEV))
            self.k[page, row] = (amp(12.0) * u)[None].expand(len(page), -1, -1)
            lo = max(0, n - 128)
            page, row = self._tokens(b, torch.arange(lo, n, device=DEV))
            self.k[page, row] = (amp(8.0) * u)[None] + 0.1 * self.k[page, row]
            nblk = n // BS
            hot = torch.rand(self.hkv, nblk, device=DEV, generator=gen) < f_hot
            for h in range(self.hkv):
                blocks = hot[h].nonzero().flatten()
                if blocks.numel():
                    pos = blocks * BS + torch.randint(0, BS, (blocks.numel(),), device=DEV, generator=gen)
                    page, row = self._tokens(b, pos)
                    self.k[page, row, h] = amp(10.0)[h] * u[h]

    def _fill_real(self, real):
        """Real K/V (and the real query of the last position) of one layer, tiled to each length."""
        k, v, q = real["k"].to(DEV).float(), real["v"].to(DEV).float(), real["q"].to(DEV).float()
        for b, n in enumerate(self.lens):
            reps = -(-n // k.shape[0])
            kk, vv = k.repeat(reps, 1, 1)[:n], v.repeat(reps, 1, 1)[:n]
            page, row = self._tokens(b, torch.arange(n, device=DEV))
            self.k[page, row], self.v[page, row] = kk, vv
            self.q[b] = q[b % q.shape[0]]

    def dense_bytes(self) -> int:
        return sum(self.lens) * self.hkv * self.dim * 2 * 2

    def ffd_bytes(self, sparsity: float) -> float:
        """The bandwidth bound's bytes: codes and scales of every token, residual and V of the kept
        blocks' (36 + 384 (1 - s)) / 512 of the dense bytes at D = 128."""
        d = self.dim
        return self.dense_bytes() * ((d / 4 + 4 * d / BS) + (1 - sparsity) * 3 * d) / (4 * d)

    def contiguous(self):
        """[B, Hkv, L, D] K and V for SDPA (equal lengths)."""
        n = self.lens[0]
        idx = self.tables[:, :n // BS].long()
        k = self.k[idx].reshape(len(self.lens), n, self.hkv, self.dim).transpose(1, 2).contiguous()
        v = self.v[idx].reshape(len(self.lens), n, self.hkv, self.dim).transpose(1, 2).contiguous()
        return k, v


def ffd(case, p, **kw):
    """The FFD decode as the engine calls it: one counter buffer kept across calls (no memset per call)."""
    from kernels.ffd.decode import ffd_decode, ffd_sync_buffer
    if getattr(case, "sync", None) is None:
        case.sync = ffd_sync_buffer(len(case.lens), case.hkv, case.q.device)
    return ffd_decode(case.q, case.k, case.v, case.qp.codes, case.qp.scales, case.qp.residual, case.tables,
                      case.seq, scale=case.dim ** -0.5, params=p, sync=case.sync, **kw)


def flash(case):
    from kernels import decode_attention
    return decode_attention(case.q, case.k, case.v, case.tables, case.seq, scale=case.dim ** -0.5, variant="flash")


def dense_refined_fp32(case):
    """fp32 attention over refined keys of full blocks + exact tail keys: what δ = ∞ must give."""
    out = torch.empty(case.q.shape, dtype=torch.float32, device=DEV)
    g = case.hq // case.hkv
    for b, n in enumerate(case.lens):
        nq = n // BS
        pages = case.tables[b, :-(-n // BS)].long()
        kh = dequantize_blocks_ref(case.qp.codes[pages[:nq]], case.qp.scales[pages[:nq]], case.qp.residual[pages[:nq]])
        keys = torch.cat([kh.permute(0, 2, 1, 3).reshape(-1, case.hkv, case.dim),
                          case.k[pages].reshape(-1, case.hkv, case.dim)[nq * BS:n].float()])
        vals = case.v[pages].reshape(-1, case.hkv, case.dim)[:n].float()
        s = torch.einsum("hgd,thd->hgt", case.q[b].float().reshape(case.hkv, g, -1), keys) * case.dim ** -0.5
        out[b] = torch.einsum("hgt,thd->hgd", s.softmax(-1), vals).reshape(case.hq, case.dim)
    return out


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


# ----- checks -------------------------------------------------------------------------------------

def run_checks(gen, smoke=False) -> list[dict]:
    rows = []
    shapes = [("llama3.1-8b", 32, 8, 128), ("qwen2.5-7b", 28, 4, 128), ("smollm2", 9, 3, 64)]
    lens_sets = [[16384 + 77, 128 * 129, 128 * 257 + 1, 5000, 127], [128 * 127, 128 * 128 + 127, 1]]
    if smoke:
        shapes, lens_sets = [("llama3.1-8b", 8, 2, 64)], [[128 * 3 + 77, 128 * 2, 127]]
    for name, hq, hkv, dim in shapes:
        for lens in lens_sets:
            case = Case(lens, hq, hkv, dim, gen, f_hot=0.1)
            row: dict[str, Any] = {"shape": name, "lens": lens}
            # quantize-on-write: bit-exact against the torch quantizer
            used = torch.cat([case.tables[b, :n // BS].long() for b, n in enumerate(lens)])
            c, s, r = quantize_blocks_ref(case.k[used])
            row["quant_codes_equal"] = bool(torch.equal(c, case.qp.codes[used]))
            row["quant_scales_equal"] = bool(torch.equal(s, case.qp.scales[used]))
            residual_differs = r.view(torch.uint8) != case.qp.residual[used].view(torch.uint8)
            row["quant_residual_mismatch"] = int(residual_differs.sum())
            # δ = ∞: dense attention over the refined keys
            out = torch.full_like(case.q, float("nan"))
            ffd(case, params(math.inf), out=out)
            row["inf_all_written"] = bool(torch.isfinite(out).all())
            row["inf_rel_err"] = rel(out, dense_refined_fp32(case))
            # δ = 5 nats: masks and output against the torch rule (fp32)
            masks = torch.full((len(lens), hkv, max(lens) // BS + 1), -1, dtype=torch.int8, device=DEV)
            stats = torch.zeros(2, dtype=torch.int64, device=DEV)
            out = torch.full_like(case.q, float("nan"))
            ffd(case, params(), out=out, masks=masks, stats=stats)
            ref_masks: list[torch.Tensor] = []
            ref_stats: dict[str, float] = {}
            ref = ffd_decode_ref(case.q, case.k, case.v, case.qp, case.tables, case.seq, scale=dim ** -0.5,
                                 params=params(), stats=ref_stats, masks=ref_masks)
            diff = sum(int((masks[b, :, :n // BS].cpu().bool() != ref_masks[b]).sum()) for b, n in enumerate(lens))
            unvisited = sum(int((masks[b, :, :n // BS] < 0).sum()) for b, n in enumerate(lens))
            row.update(d5_mask_mismatch=diff, d5_unvisited=unvisited, d5_all_written=bool(torch.isfinite(out).all()),
                       d5_rel_err=rel(out, ref),
                       d5_sparsity=1 - ref_stats["ffd_blocks_kept"] / ref_stats["ffd_blocks_total"],
                       d5_stats_equal=stats.tolist() == [ref_stats["ffd_blocks_total"], ref_stats["ffd_blocks_kept"]])
            # graph replay with other lengths (device-side lengths): equal to eager
            if name == "llama3.1-8b" and DEV == "cuda":
                out_g = torch.empty_like(case.q)
                graph = torch.cuda.CUDAGraph()
                ffd(case, params(), out=out_g)
                with torch.cuda.graph(graph):
                    ffd(case, params(), out=out_g)
                case.seq.copy_(torch.tensor([max(1, n - 129) for n in lens], dtype=torch.int32))
                graph.replay()
                eager = ffd(case, params())
                row["graph_equals_eager"] = bool(torch.equal(out_g, eager))
            rows.append(row)
            print("check", json.dumps(row), flush=True)
            del case
            if DEV == "cuda":
                torch.cuda.empty_cache()
    return rows


def sparsity(case, p) -> float:
    stats = torch.zeros(2, dtype=torch.int64, device=DEV)
    ffd(case, p, stats=stats)
    total, kept = stats.tolist()
    return 1 - kept / max(1, total)


def sdpa_on_case(timer, case) -> tuple[float, str]:
    """The fastest torch SDPA backend on the case's K/V made contiguous [B, Hkv, L, D]."""
    k, v = case.contiguous()
    return time_sdpa(timer, case.q, k, v, scale=case.dim ** -0.5)


def time_row(timer, case, bw, label, with_sdpa=True) -> dict:
    p = params()
    s = sparsity(case, p)
    row = {"data": label, "B": len(case.lens), "L": case.lens[0], "sparsity": s}
    # FFD and flash twice each, interleaved, the faster of each kept and both recorded: one timing can read slow.
    rounds: dict[str, list[float]] = {"ffd": [], "flash": []}
    for _ in range(ROUNDS):
        rounds["ffd"].append(timer(lambda: ffd(case, p)))
        rounds["flash"].append(timer(lambda: flash(case)))
    row["ffd_us"], row["flash_us"] = min(rounds["ffd"]), min(rounds["flash"])
    row["ffd_us_rounds"], row["flash_us_rounds"] = rounds["ffd"], rounds["flash"]
    if programmatic_launch(case.q.device):   # side by side: the attend and merge in plain stream order
        row["ffd_plain_launch_us"] = timer(lambda: ffd(case, p, pdl=False))
    if with_sdpa:
        row["sdpa_us"], row["sdpa_backend"] = sdpa_on_case(timer, case)
    row["bound_us"] = case.ffd_bytes(s) / bw * 1e6
    row["ffd_over_bound"] = row["ffd_us"] / row["bound_us"]
    row["speedup_vs_flash"] = row["flash_us"] / row["ffd_us"]
    if with_sdpa:
        row["speedup_vs_sdpa"] = row["sdpa_us"] / row["ffd_us"]
    print("bench", json.dumps(row), flush=True)
    return row


def run_bench(timer, gen, bw, deadline) -> list[dict]:
    rows: list[dict[str, Any]] = []
    real = torch.load(REAL) if REAL.exists() else None
    if real is None:
        print(f"bench: no real K/V at {REAL} (`python bench/ffd_kernels.py --dump-real` writes it, on the CPU): "
              "synthetic rows only", flush=True)
    for length in (131072, 262144, 16384, 65536):          # the goal's lengths first
        for batch in (1, 8):
            for f_hot in (0.1, 0.02):
                if time.time() > deadline:
                    print("bench: deadline reached, skipping the rest", flush=True)
                    return rows
                case = Case([length] * batch, 32, 8, 128, gen, f_hot=f_hot)
                rows.append(time_row(timer, case, bw, f"synthetic f={f_hot}"))
                del case
                torch.cuda.empty_cache()
            if real is not None:
                for layer, data in real["layers"].items():
                    case = Case([length] * batch, data["q"].shape[1], data["k"].shape[1], data["k"].shape[2], gen,
                                real=data)
                    rows.append(time_row(timer, case, bw, f"real smollm2 layer {layer}", with_sdpa=False))
                    del case
                    torch.cuda.empty_cache()
    return rows


def run_crossover(timer, gen) -> dict:
    rows = []
    for length in (4096, 8192, 16384, 32768, 65536, 131072):
        for batch in (1, 8):
            case = Case([length] * batch, 32, 8, 128, gen, f_hot=0.2)
            s = sparsity(case, params())
            rows.append({"L": length, "B": batch, "sparsity": s,
                         "ffd_us": timer(lambda case=case: ffd(case, params())),
                         "flash_us": timer(lambda case=case: flash(case))})
            print("crossover", json.dumps(rows[-1]), flush=True)
    lengths = sorted({r["L"] for r in rows})
    wins = {n for n in lengths if all(r["ffd_us"] < r["flash_us"] for r in rows if r["L"] == n)}   # every batch size
    cross = next((n for i, n in enumerate(lengths) if all(m in wins for m in lengths[i:])), None)
    return {"rows": rows, "crossover_tokens": cross, "gpu": torch.cuda.get_device_name()}


def prefill_runner(case, q, chunk: int):
    """A call of the FFD prefill on `case`'s pages with the chunk's queries `q` (graph-safe)."""
    from kernels.ffd.prefill import ffd_prefill
    qsl = torch.tensor([0, chunk], dtype=torch.int32, device=DEV)
    return lambda: ffd_prefill(q, case.k, case.v, case.qp.codes, case.qp.scales, case.qp.residual, case.tables,
                               case.seq, qsl, scale=case.dim ** -0.5, params=params(), max_query_len=chunk)


def chunk_queries(case, gen, chunk: int) -> torch.Tensor:
    """`chunk` queries near the case's decode query (so they find its needles), bf16."""
    noise = torch.randn(chunk, case.hq, case.dim, device=DEV, generator=gen)
    return (case.q[0].float()[None] + 0.3 * noise).bfloat16()


def run_prefill_sweep(timer, gen, chunk: int = 2048) -> list[dict]:
    """FFD prefill time at 32K over the tile (`TILE_ROWS`) and warp (`PREFILL_WARPS`) choices."""
    import kernels.ffd.prefill as fp
    shipped = fp.TILE_ROWS, fp.PREFILL_WARPS
    rows = []
    for f_hot in (0.1, None):
        case = Case([32768], 32, 8, 128, gen, f_hot=f_hot)
        run = prefill_runner(case, chunk_queries(case, gen, chunk), chunk)
        for tile in (32, 64, 128):
            for warps in (4, 8):
                fp.TILE_ROWS, fp.PREFILL_WARPS = tile, warps
                rows.append({"data": f"synthetic f={f_hot}" if f_hot else "N(0,1) keys", "tile_rows": tile,
                             "warps": warps, "us": timer(run, reps=10)})
                print("prefill_sweep", json.dumps(rows[-1]), flush=True)
        del case, run
        torch.cuda.empty_cache()
    fp.TILE_ROWS, fp.PREFILL_WARPS = shipped
    return rows


def run_prefill(timer, gen, chunk: int = 2048) -> list[dict]:
    from kernels import prefill_attention
    from kernels.ffd.reference import ffd_prefill_ref
    rows = []
    for length in (8192, 32768):
        for f_hot in (0.1, None):
            case = Case([length], 32, 8, 128, gen, f_hot=f_hot)
            q = chunk_queries(case, gen, chunk)
            qsl = torch.tensor([0, chunk], dtype=torch.int32, device=DEV)
            run_ffd = prefill_runner(case, q, chunk)
            row: dict[str, Any] = {"L": length, "chunk": chunk,
                                   "data": f"synthetic f={f_hot}" if f_hot else "N(0,1) keys",
                                   "decode_sparsity": sparsity(case, params())}
            out = run_ffd()
            if length <= 8192:
                ref = ffd_prefill_ref(q.float(), case.k.float(), case.v.float(), case.qp, case.tables, case.seq, qsl,
                                      scale=case.dim ** -0.5, params=params(), max_scores=1 << 27)
                row["rel_err_vs_rule"] = rel(out, ref)
                del ref
            row["finite"] = bool(torch.isfinite(out).all())
            row["ffd_us"] = timer(run_ffd, reps=20)
            row["flash_us"] = timer(lambda case=case, q=q, qsl=qsl: prefill_attention(
                q, case.k, case.v, case.tables, case.seq, qsl, scale=case.dim ** -0.5, max_query_len=chunk), reps=20)
            row["ffd_over_flash"] = row["ffd_us"] / row["flash_us"]
            rows.append(row)
            print("prefill", json.dumps(row), flush=True)
            del case, run_ffd
            torch.cuda.empty_cache()
    return rows


def run_auto_dense(timer, gen) -> list[dict]:
    """`kernel = "auto"` below its crossover: the FFD kernel's dense split-KV path (every row under
    min_ffd_len) against our flash kernel on the same pages, L in {4K, 16K}, B in {1, 8}."""
    rows = []
    for length in (4096, 16384):
        for batch in (1, 8):
            case = Case([length] * batch, 32, 8, 128, gen)
            below = params(min_len=length + 1)
            err = rel(ffd(case, below), flash(case))
            rows.append({"L": length, "B": batch, "rel_err_vs_flash": err,
                         "auto_dense_us": timer(lambda case=case, p=below: ffd(case, p)),
                         "flash_us": timer(lambda case=case: flash(case))})
            rows[-1]["auto_over_flash"] = rows[-1]["auto_dense_us"] / rows[-1]["flash_us"]
            print("auto_dense", json.dumps(rows[-1]), flush=True)
            del case
            torch.cuda.empty_cache()
    return rows


# kernels/ffd/decode.py constants a sweep may override: launch shapes only, none changes the rule
TUNABLE = ("SCAN_PROGRAMS_PER_SM", "ATTEND_PROGRAMS_PER_SM", "MIN_PER_SPLIT", "DENSE_MIN_PER_SPLIT", "SCAN_STAGES",
           "SCAN_WARPS", "SCAN_BLOCKS_PER_STEP", "PM_SLICE", "DECIDE_CHUNK", "MERGE_TILE", "SCAN_WAVE_MIN_STEPS")
# (B, L, f, Hq, Hkv, D, "auto" below its crossover: the FFD kernel's dense rows)
SWEEP_CASES = ((1, 131072, 0.1, 32, 8, 128, False), (1, 262144, 0.1, 32, 8, 128, False),
               (1, 65536, 0.1, 32, 8, 128, False), (1, 16384, 0.1, 32, 8, 128, False),
               (1, 131072, 0.02, 32, 8, 128, False), (8, 131072, 0.1, 32, 8, 128, False),
               (8, 262144, 0.1, 32, 8, 128, False), (8, 65536, 0.1, 32, 8, 128, False),
               (8, 16384, 0.1, 32, 8, 128, False), (8, 131072, 0.1, 24, 8, 64, False),
               (1, 4096, 0.1, 32, 8, 128, True), (8, 4096, 0.1, 32, 8, 128, True),
               (1, 16384, 0.1, 32, 8, 128, True), (8, 16384, 0.1, 32, 8, 128, True))


def parse_sweep(specs: list[str]) -> list[tuple[str, int]]:
    """["SCAN_STAGES=4,8", ...] -> [("SCAN_STAGES", 4), ("SCAN_STAGES", 8), ...]; exits on a bad spec."""
    overrides = []
    for spec in specs:
        name, _, values = spec.partition("=")
        try:
            ints = [int(v) for v in values.split(",")]
        except ValueError:
            ints = []
        if name not in TUNABLE or not ints or min(ints) < 1:
            raise SystemExit(f"--sweep NAME=V1,V2,... with NAME one of {', '.join(TUNABLE)} and positive "
                             f"integer values; got {spec!r}")
        overrides += [(name, v) for v in ints]
    return overrides


def run_sweep(timer, gen, overrides: list[tuple[str, int]], deadline: float) -> list[dict]:
    """Per case: the defaults (timed first and last, the faster kept) and each override, same inputs."""
    import kernels.ffd.decode as ffd_module
    rows = []
    for batch, length, f_hot, hq, hkv, dim, dense in SWEEP_CASES:
        if time.time() > deadline:
            print("sweep: deadline reached, skipping the rest", flush=True)
            break
        case = Case([length] * batch, hq, hkv, dim, gen, f_hot=f_hot)
        p = params(min_len=length + 1 if dense else 0)
        base = ffd(case, p).clone()
        row = {"B": batch, "L": length, "f": "auto, dense" if dense else f_hot, "D": dim,
               "sparsity": None if dense else sparsity(case, p),
               "default_us": timer(lambda case=case, p=p: ffd(case, p)), "us": {}, "bit_equal": {}}
        for name, value in overrides:
            default = getattr(ffd_module, name)
            setattr(ffd_module, name, value)
            try:
                row["us"][f"{name}={value}"] = timer(lambda case=case, p=p: ffd(case, p))
                row["bit_equal"][f"{name}={value}"] = bool(torch.equal(ffd(case, p), base))
            finally:
                setattr(ffd_module, name, default)
        row["default_us"] = min(row["default_us"], timer(lambda case=case, p=p: ffd(case, p)))
        row["flash_us"] = timer(lambda case=case: flash(case))
        rows.append(row)
        print("sweep", json.dumps(row), flush=True)
        del case
        torch.cuda.empty_cache()
    return rows


def run_profile(gen) -> list[dict]:
    """Per-launch GPU µs of one FFD decode (mean over 20 calls) at 128K, B = 1 and 8, f = 0.1."""
    from torch.profiler import ProfilerActivity, profile
    rows = []
    for batch in (1, 8):
        case = Case([131072] * batch, 32, 8, 128, gen, f_hot=0.1)
        for _ in range(3):
            ffd(case, params())
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                ffd(case, params())
            torch.cuda.synchronize()
        per = {e.key: e.device_time_total / 20 for e in prof.key_averages() if e.device_time_total > 0}
        rows.append({"B": batch, "L": 131072, "sparsity": sparsity(case, params()), "us_per_launch": per})
        print("profile", json.dumps(rows[-1]), flush=True)
        del case
        torch.cuda.empty_cache()
    return rows


# ----- real K/V dump (CPU) ------------------------------------------------------------------------

def dump_real(length: int, layers: list[int]) -> None:
    """Run the embedded model densely over `length` tokens of real text; keep q (last 8 positions),
    K and V of a few layers in bf16 (about 3 MB per layer at 8K)."""
    import gzip

    from bench.ffd_quality import TEXT, Runner, Tokenizer, load_model, resolve_model_dir
    from engine.attention.torch_reference import ReferenceBackend
    model_dir = resolve_model_dir(None)
    tok = Tokenizer.from_pretrained(model_dir)
    runner = Runner(load_model(model_dir, torch.float32, torch.device("cpu")))
    ids = tok.encode(gzip.decompress(TEXT.read_bytes()).decode("utf-8", "replace"))[:length]
    probe = list(range(length - 8, length))
    _, kv = runner.run(ids, ReferenceBackend("dense"), logits_from=length - 1, probe_pos=probe)
    out: dict[str, Any] = {"text": str(TEXT), "length": length, "layers": {}}
    for i in layers:
        k = kv[0, i].reshape(-1, *kv.shape[-2:])[:length]
        v = kv[1, i].reshape(-1, *kv.shape[-2:])[:length]
        out["layers"][i] = {"q": torch.cat(runner.q_probe[i]).bfloat16(), "k": k.bfloat16(), "v": v.bfloat16()}
    REAL.parent.mkdir(parents=True, exist_ok=True)
    torch.save(out, REAL)
    print(f"wrote {REAL}")


def print_tables(report) -> None:
    if report.get("checks"):
        print("\n| shape | lens | quant exact (codes/scales/resid mism.) | δ=∞ rel err | δ=5 mask mism. | "
              "unvisited | δ=5 rel err | sparsity | graph==eager |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in report["checks"]:
            print(f"| {r['shape']} | {r['lens']} | {r['quant_codes_equal']}/{r['quant_scales_equal']}/"
                  f"{r['quant_residual_mismatch']} | {r['inf_rel_err']:.1e} | {r['d5_mask_mismatch']} | "
                  f"{r['d5_unvisited']} | {r['d5_rel_err']:.1e} | {r['d5_sparsity']:.3f} | "
                  f"{r.get('graph_equals_eager', '')} |")
    if report.get("bench"):
        print(f"\ncopy bandwidth {report['copy_bw'] / 1e12:.2f} TB/s; µs, CUDA-graph replay, L2 cleaned")
        print("| data | B | L | sparsity | FFD | flash | SDPA | bound | FFD/bound | vs flash | vs SDPA | FFD rounds |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in report["bench"]:
            sd = f"{r['sdpa_us']:.1f}" if "sdpa_us" in r else "-"
            vs = f"{r['speedup_vs_sdpa']:.2f}x" if "speedup_vs_sdpa" in r else "-"
            print(f"| {r['data']} | {r['B']} | {r['L'] // 1024}K | {r['sparsity']:.3f} | {r['ffd_us']:.1f} | "
                  f"{r['flash_us']:.1f} | {sd} | {r['bound_us']:.1f} | {r['ffd_over_bound']:.2f} | "
                  f"{r['speedup_vs_flash']:.2f}x | {vs} | {' / '.join(f'{t:.1f}' for t in r['ffd_us_rounds'])} |")
    if report.get("auto_dense"):
        print("\n| L | B | auto (dense rows) µs | flash µs | auto / flash | rel diff |")
        print("|---|---|---|---|---|---|")
        for r in report["auto_dense"]:
            print(f"| {r['L'] // 1024}K | {r['B']} | {r['auto_dense_us']:.1f} | {r['flash_us']:.1f} | "
                  f"{r['auto_over_flash']:.2f} | {r['rel_err_vs_flash']:.1e} |")
    if report.get("prefill"):
        print("\n| data | L | chunk | decode sparsity | rel err vs rule | FFD prefill µs | flash prefill µs "
              "| FFD/flash |")
        print("|---|---|---|---|---|---|---|---|")
        for r in report["prefill"]:
            err = f"{r['rel_err_vs_rule']:.1e}" if "rel_err_vs_rule" in r else "-"
            print(f"| {r['data']} | {r['L'] // 1024}K | {r['chunk']} | {r['decode_sparsity']:.3f} | {err} | "
                  f"{r['ffd_us']:.0f} | {r['flash_us']:.0f} | {r['ffd_over_flash']:.2f} |")
    if report.get("sweep"):
        keys = list(report["sweep"][0]["us"])
        print("\nµs, CUDA-graph replay, L2 cleaned; * = output not bit-equal to the defaults'")
        print("| B | L | D | f | sparsity | defaults | " + " | ".join(keys) + " | flash |")
        print("|---|---|---|---|---|---|" + "---|" * len(keys) + "---|")
        for r in report["sweep"]:
            cells = " | ".join(f"{r['us'][k]:.1f}{'' if r['bit_equal'][k] else '*'}" for k in keys)
            s = "-" if r["sparsity"] is None else f"{r['sparsity']:.3f}"
            print(f"| {r['B']} | {r['L'] // 1024}K | {r['D']} | {r['f']} | {s} | "
                  f"{r['default_us']:.1f} | {cells} | {r['flash_us']:.1f} |")
    if report.get("crossover"):
        c = report["crossover"]
        print(f"\ncrossover on {c['gpu']}: {c['crossover_tokens']} tokens")
        for r in c["rows"]:
            print(f"  L={r['L']} B={r['B']} s={r['sparsity']:.2f} ffd {r['ffd_us']:.1f} flash {r['flash_us']:.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--crossover", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--prefill", action="store_true")
    ap.add_argument("--prefill-sweep", action="store_true")
    ap.add_argument("--auto-dense", action="store_true")
    ap.add_argument("--dump-real", action="store_true")
    ap.add_argument("--sweep", action="append", default=[], metavar="NAME=V1,V2",
                    help="time kernels/ffd/decode.py with a tuning constant set to each value, beside the defaults")
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter: tiny checks, no timing")
    ap.add_argument("--budget-s", type=float, default=330, help="stop starting new bench rows after this")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args()
    overrides = parse_sweep(args.sweep)
    if args.dump_real:
        dump_real(8192, [3, 14, 25])
        return
    start = time.time()
    gen = torch.Generator(device=DEV).manual_seed(0)
    if args.smoke:
        rows = run_checks(gen, smoke=True)
        print_tables({"checks": rows})
        return
    report: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv)}
    import triton
    report["triton"] = triton.__version__
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "ffd_kernels.json"
    try:
        if args.check:
            report["checks"] = run_checks(gen)
            path.write_text(json.dumps(report, indent=1))
        if args.profile:
            report["profile"] = run_profile(gen)
            path.write_text(json.dumps(report, indent=1))
        timer = Timer()
        timed = {"auto_dense": run_auto_dense, "prefill_sweep": run_prefill_sweep, "prefill": run_prefill,
                 "crossover": run_crossover}
        for mode, run_mode in timed.items():
            if getattr(args, mode):
                report[mode] = run_mode(timer, gen)
                path.write_text(json.dumps(report, indent=1))
        if overrides:
            report["sweep"] = run_sweep(timer, gen, overrides, start + args.budget_s)
            path.write_text(json.dumps(report, indent=1))
        if args.bench:
            report["real_kv"] = str(REAL) if REAL.exists() else f"missing ({REAL}): synthetic rows only"
            report["copy_bw"] = copy_bandwidth()
            report["bench"] = run_bench(timer, gen, report["copy_bw"], start + args.budget_s)
    finally:
        report["seconds"] = time.time() - start
        path.write_text(json.dumps(report, indent=1))
        print_tables(report)


if __name__ == "__main__":
    main()
