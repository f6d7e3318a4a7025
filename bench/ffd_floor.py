"""What moving the FFD decode's bytes costs on this GPU, with no arithmetic: how far below the FFD
kernel a decode of the same data flow could go, and at which batch sizes, lengths and sparsities
any kernel can reach 1.5× the bandwidth bound of `bench/ffd_kernels.py`.

    python bench/ffd_floor.py --out DIR        # GPU: the table, DIR/ffd_floor.json
    python bench/ffd_floor.py --smoke          # CPU (TRITON_INTERPRET=1): the skeletons read what they should

Per row (Llama-3.1-8B shapes, the synthetic keys of bench/ffd_kernels.py, the kept blocks the FFD
kernel chose), in the timing harness of bench/ffd_kernels.py (CUDA-graph replay, L2 cleaned, median
of 100), each skeleton at a few launch shapes, the fastest kept:
  stream     one launch reading exactly the bound's bytes (codes and scales of every full block,
             residual and V of the kept ones) from one contiguous buffer, no block table: the
             floor of any decode here (read-only streams beat the copy bandwidth by up to ~7 %).
  empty      the first 1, 2 and 3 launches of `three` with no work: the fixed cost of a decode in
             that many launches (attend and merge are programmatic dependents on sm_90, as ours).
  three      the decode's data flow with sums for arithmetic: a scan streaming every full block's
             codes and scales through the block table; an attend gathering the kept blocks' codes,
             residual and V in balanced ranges (kept lists made on the host: no flags, no prefix
             sum); a merge reading the splits' partials.
  fused      one pass over contiguous block ranges that loads each block's codes and scales and, for
             a kept block, its residual and V (predicated loads, no branch), then the merge: the data
             flow of a decode that selects and attends in one launch.
Each pass of `three` is also timed alone, at every launch shape tried (in the JSON).
The skeletons' checksums (wrapping int32 sums of the bytes they load) are compared with torch's in
--smoke, so a skeleton that skips bytes fails.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels.ffd.decode import ATTEND_PROGRAMS_PER_SM, choose_splits  # noqa: E402
from kernels.ffd.tiles import _release_next, _wait_previous  # noqa: E402
from kernels.vendor import num_compute_units, programmatic_launch  # noqa: E402

BS = 128


@triton.jit
def _wsum(x, axis: tl.constexpr):
    """int32 sum that wraps modulo 2**32 (int32 adds, on the GPU and in the interpreter alike)."""
    return tl.sum(x, axis)


@triton.jit
def _stream_kernel(X, OUT, n, programs, CHUNK: tl.constexpr, WORK: tl.constexpr):
    """Sum of int32 words [p * CHUNK, ...) in a grid-stride loop over X[:n] (n a multiple of CHUNK)."""
    p = tl.program_id(0)
    acc = tl.zeros([CHUNK], tl.int32)
    if WORK:
        for c in range(p, n // CHUNK, programs):
            acc += tl.load(X + c.to(tl.int64) * CHUNK + tl.arange(0, CHUNK))  # type: ignore[attr-defined]  # jit: c is a tl tensor
    tl.store(OUT + p, _wsum(acc, 0))


@triton.jit
def _scan_skeleton(CODES, SCALES, BT, OUT, stride_bt, nblk, NUM_KV_HEADS: tl.constexpr, W: tl.constexpr,
                   D: tl.constexpr, WORK: tl.constexpr, PDL: tl.constexpr):
    """Every full block of (sequence, KV head): its W int32 words of codes and D scales."""
    b = tl.program_id(0)
    hk = tl.program_id(1)
    p = tl.program_id(2)
    programs = tl.num_programs(2)
    _release_next(PDL)
    acc = tl.zeros([W], tl.int32)
    acc_s = tl.zeros([D], tl.int32)
    if WORK:
        for blk in range(p, nblk, programs):
            page = tl.load(BT + b.to(tl.int64) * stride_bt + blk).to(tl.int64)
            base = page * NUM_KV_HEADS + hk
            acc += tl.load(CODES + base * W + tl.arange(0, W))
            acc_s += tl.load(SCALES + base * D + tl.arange(0, D))
    row = b * NUM_KV_HEADS + hk
    tl.store(OUT + row * programs + p, _wsum(acc, 0) + _wsum(acc_s, 0))


@triton.jit
def _block_words(CODES, RES, V, page, hk, stride_vb, stride_vt, stride_vh, keep, NUM_KV_HEADS: tl.constexpr,
                 W: tl.constexpr, BS: tl.constexpr, D: tl.constexpr):
    """One block's bytes as int32 sums: its codes always, its residual and V where `keep` (predicated
    loads). Returns [D/2] (the codes' and residual's sums in column 0) and the V tile [BS, D/2]."""
    base = page * NUM_KV_HEADS + hk
    toks = tl.arange(0, BS)
    cols = tl.arange(0, D // 2)
    on = toks[:, None] * 0 + keep.to(tl.int32) != 0    # [BS, 1]: the scalar decision as a tile mask
    c = _wsum(tl.load(CODES + base * W + tl.arange(0, W)), 0)
    r = tl.load(RES + (base * BS + toks[:, None]) * (D // 4) + tl.arange(0, D // 4)[None, :], mask=on, other=0)
    v = tl.load(V + page * stride_vb + toks[:, None] * stride_vt + hk * stride_vh + cols[None, :], mask=on, other=0)
    return tl.where(cols == 0, c + _wsum(_wsum(r, 1), 0), 0), v


@triton.jit
def _attend_skeleton(CODES, RES, V, KEPT, KEPT_START, PART, stride_vb, stride_vt, stride_vh, per,
                     NUM_KV_HEADS: tl.constexpr, W: tl.constexpr, BS: tl.constexpr, D: tl.constexpr,
                     WORK: tl.constexpr, PDL: tl.constexpr):
    """Kept blocks [start + split * per, ...) of the row's kept list: codes, residual and V."""
    b = tl.program_id(0)
    hk = tl.program_id(1)
    split = tl.program_id(2)
    splits = tl.num_programs(2)
    _release_next(PDL)
    row = b * NUM_KV_HEADS + hk
    acc = tl.zeros([BS, D // 2], tl.int32)
    acc_cr = tl.zeros([D // 2], tl.int32)
    _wait_previous(PDL)
    if WORK:
        start = tl.load(KEPT_START + row)
        end = tl.load(KEPT_START + row + 1)
        lo = start + split * per
        for i in range(lo, tl.minimum(lo + per, end)):
            page = tl.load(KEPT + i).to(tl.int64)
            cr, v = _block_words(CODES, RES, V, page, hk, stride_vb, stride_vt, stride_vh, page >= 0, NUM_KV_HEADS, W,
                                 BS, D)
            acc += v
            acc_cr += cr
    tl.store(PART + (row * splits + split) * (D // 2) + tl.arange(0, D // 2), _wsum(acc, 0) + acc_cr)


@triton.jit
def _fused_skeleton(CODES, SCALES, RES, V, BT, KEEP, PART, stride_bt, stride_vb, stride_vt, stride_vh, nblk, per,
                    NUM_KV_HEADS: tl.constexpr, W: tl.constexpr, BS: tl.constexpr, D: tl.constexpr,
                    WORK: tl.constexpr, PDL: tl.constexpr):
    """Blocks [p * per, (p + 1) * per): codes and scales of each, residual and V of the kept ones."""
    b = tl.program_id(0)
    hk = tl.program_id(1)
    p = tl.program_id(2)
    programs = tl.num_programs(2)
    _release_next(PDL)
    row = b * NUM_KV_HEADS + hk
    acc = tl.zeros([BS, D // 2], tl.int32)
    acc_cr = tl.zeros([D // 2], tl.int32)
    acc_s = tl.zeros([D], tl.int32)
    if WORK:
        for blk in range(p * per, tl.minimum(p * per + per, nblk)):
            page = tl.load(BT + b.to(tl.int64) * stride_bt + blk).to(tl.int64)
            base = page * NUM_KV_HEADS + hk
            acc_s += tl.load(SCALES + base * D + tl.arange(0, D))
            keep = tl.load(KEEP + row.to(tl.int64) * nblk + blk) != 0
            cr, v = _block_words(CODES, RES, V, page, hk, stride_vb, stride_vt, stride_vh, keep, NUM_KV_HEADS, W,
                                 BS, D)
            acc += v
            acc_cr += cr
    cols = tl.arange(0, D // 2)
    tl.store(PART + (row * programs + p) * (D // 2) + cols,
             _wsum(acc, 0) + acc_cr + tl.where(cols == 0, _wsum(acc_s, 0), 0))


@triton.jit
def _merge_skeleton(PART, OUT, splits, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, SPLITS: tl.constexpr,
                    D: tl.constexpr, WORK: tl.constexpr, PDL: tl.constexpr):
    """One (sequence, query head): the sum of its KV head's split partials."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    row = b * NUM_KV_HEADS + h // (NUM_HEADS // NUM_KV_HEADS)
    _wait_previous(PDL)
    s = tl.arange(0, SPLITS)
    part = tl.zeros([SPLITS, D // 2], tl.int32)
    if WORK:
        part = tl.load(PART + (row * splits + s[:, None]) * (D // 2) + tl.arange(0, D // 2)[None, :],
                       mask=(s < splits)[:, None], other=0)
    tl.store(OUT + (b * NUM_HEADS + h) * (D // 2) + tl.arange(0, D // 2), _wsum(part, 0))


def int32_view(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32) if x.dtype != torch.int32 else x


class Skeletons:
    """The skeleton launches over one case's pages and the kept blocks of `keep` [B, Hkv, blocks]."""

    def __init__(self, codes, scales, residual, v, tables, lens, keep, num_heads):
        self.dev = codes.device
        self.hkv, self.dim = codes.shape[1], scales.shape[2]
        self.batch, self.num_heads = len(lens), num_heads
        self.nblk = lens[0] // BS                   # equal lengths, full blocks only (the bound's bytes)
        assert all(n == lens[0] for n in lens), "one length per case"
        self.codes, self.scales = int32_view(codes), scales.view(torch.int32)
        self.res, self.v = residual.view(torch.int32), v.view(torch.int32)   # [N, BS, Hkv, D/2] words
        self.tables = tables
        self.keep = keep[:, :, :self.nblk].contiguous().to(torch.int8)
        rows = []
        for b in range(self.batch):
            for h in range(self.hkv):
                rows.append(tables[b, :self.nblk][self.keep[b, h].bool()])
        self.kept = torch.cat(rows).to(torch.int32)
        counts = torch.tensor([0] + [len(r) for r in rows], device=self.dev).cumsum(0)
        self.kept_start = counts.to(torch.int32)
        self.row_max = max(len(r) for r in rows)
        self.out = torch.empty(self.batch, num_heads, self.dim // 2, dtype=torch.int32, device=self.dev)
        units = num_compute_units(self.dev)
        self.units = units
        self.pdl = programmatic_launch(self.dev)
        w = BS * self.dim // 16                     # int32 words of one block's codes
        self.consts = {"NUM_KV_HEADS": self.hkv, "W": w, "D": self.dim}

    def bound_words(self) -> int:
        """int32 words of the bound: codes + scales of every full block, residual + V of the kept."""
        per_block = self.consts["W"] + self.dim
        kept_words = BS * self.dim // 4 + BS * self.dim // 2
        return self.batch * self.hkv * self.nblk * per_block + int(self.kept.numel()) * kept_words

    def scan(self, programs_per_row: int, warps: int, work: bool = True, stages: int = 4) -> torch.Tensor:
        rows = self.batch * self.hkv
        out = torch.empty(rows * programs_per_row, dtype=torch.int32, device=self.dev)
        _scan_skeleton[(self.batch, self.hkv, programs_per_row)](
            self.codes, self.scales, self.tables, out, self.tables.stride(0), self.nblk, WORK=work, PDL=self.pdl,
            num_warps=warps, num_stages=stages, **self.consts)
        return out

    def _merge(self, part, splits, work, pdl):
        extra = {"launch_pdl": True} if pdl else {}
        _merge_skeleton[(self.batch, self.num_heads)](
            part, self.out, splits, NUM_HEADS=self.num_heads, NUM_KV_HEADS=self.hkv,
            SPLITS=triton.next_power_of_2(splits), D=self.dim, WORK=work, PDL=pdl, num_warps=4, **extra)
        return self.out

    def attend(self, splits: int, resident: int, warps: int, work: bool = True, pdl: bool | None = None,
               stages: int = 2):
        """Balanced ranges: per = max(ceil(row max / splits), ceil(kept / resident)) kept blocks."""
        pdl = self.pdl if pdl is None else pdl
        per = max(1, -(-self.row_max // splits), -(-int(self.kept.numel()) // max(1, resident)))
        splits = max(1, -(-self.row_max // per))
        part = torch.empty(self.batch * self.hkv * splits * (self.dim // 2), dtype=torch.int32, device=self.dev)
        extra = {"launch_pdl": True} if pdl else {}
        s = self.v.stride()
        _attend_skeleton[(self.batch, self.hkv, splits)](
            self.codes, self.res, self.v, self.kept, self.kept_start, part, s[0], s[1], s[2], per, BS=BS, WORK=work,
            PDL=pdl, num_warps=warps, num_stages=stages, **self.consts, **extra)
        return part, splits

    def three(self, scan_programs: int, scan_warps: int, splits: int, resident: int, attend_warps: int,
              work: bool = True, stages: int = 2, scan_stages: int = 4, launches: int = 3):
        """The scan, attend and merge skeletons (`launches` < 3: only the first ones)."""
        flags = self.scan(scan_programs, scan_warps, work, scan_stages)
        if launches == 1:
            return flags, None, None
        part, n = self.attend(splits, resident, attend_warps, work, stages=stages)
        return flags, part, self._merge(part, n, work, self.pdl) if launches == 3 else None

    def fused(self, programs_per_row: int, warps: int, work: bool = True, stages: int = 2):
        per = -(-self.nblk // programs_per_row)
        programs = -(-self.nblk // per)
        part = torch.empty(self.batch * self.hkv * programs * (self.dim // 2), dtype=torch.int32, device=self.dev)
        s = self.v.stride()
        _fused_skeleton[(self.batch, self.hkv, programs)](
            self.codes, self.scales, self.res, self.v, self.tables, self.keep, part, self.tables.stride(0), s[0], s[1],
            s[2], self.nblk, per, BS=BS, WORK=work, PDL=self.pdl, num_warps=warps, num_stages=stages, **self.consts)
        return part, self._merge(part, programs, work, self.pdl)


def stream(buf: torch.Tensor, programs: int, warps: int, chunk: int = 4096, work: bool = True) -> torch.Tensor:
    out = torch.empty(programs, dtype=torch.int32, device=buf.device)
    _stream_kernel[(programs,)](buf, out, buf.numel(), programs, CHUNK=chunk, WORK=work, num_warps=warps)
    return out


# ----- checksums (torch) ---------------------------------------------------------------------------

def wrap(x: torch.Tensor) -> int:
    """A wrapping int32 sum, as the kernels' int32 accumulators compute it."""
    return int(((x.to(torch.int64).sum() + 2**31) % 2**32) - 2**31)


def expected_sums(sk: Skeletons) -> dict:
    """torch's wrapping sums of what each skeleton must read."""
    full = torch.cat([sk.tables[b, :sk.nblk].long() for b in range(sk.batch)])   # page of each (b, blk)
    codes = sk.codes.view(sk.codes.shape[0], sk.hkv, -1)
    kept = sk.kept.long()
    rows = torch.repeat_interleave(torch.arange(sk.batch * sk.hkv, device=sk.dev),
                                   (sk.kept_start[1:] - sk.kept_start[:-1]).long())
    heads = rows % sk.hkv
    refine = wrap(sk.res.view(sk.res.shape[0], sk.hkv, -1)[kept, heads]) + wrap(sk.v[kept, :, heads])
    scan = wrap(codes[full]) + wrap(sk.scales[full])
    return {"scan": scan, "attend": wrap(codes[kept, heads]) + refine, "fused": scan + refine}


def check_skeletons(sk: Skeletons) -> dict:
    """Each skeleton's checksum against torch's: True where it read exactly its bytes."""
    want = expected_sums(sk)
    flags, part, merged = (t.clone() for t in sk.three(4, 1, 8, 16, 4))   # the merges share one output
    fused_part, fused_merged = sk.fused(4, 4)
    got = {"scan": wrap(flags), "attend": wrap(part), "fused": wrap(fused_part)}
    mod = lambda x: (x + 2**31) % 2**32 - 2**31   # noqa: E731
    group = sk.num_heads // sk.hkv   # every query head's merge sums its KV head's partials
    return {**{k: mod(got[k]) == mod(want[k]) for k in want},
            "merge": mod(wrap(merged)) == mod(group * got["attend"]),
            "fused_merge": mod(wrap(fused_merged)) == mod(group * got["fused"])}


# ----- the run -------------------------------------------------------------------------------------

def skeleton_for(case, p) -> Skeletons:
    from bench.ffd_kernels import ffd
    masks = torch.zeros(len(case.lens), case.hkv, max(case.lens) // BS + 1, dtype=torch.int8, device=case.q.device)
    ffd(case, p, masks=masks)
    return Skeletons(case.qp.codes, case.qp.scales, case.qp.residual, case.v, case.tables, case.lens, masks, case.hq)


def fastest(timer, variants: dict) -> tuple[float, str]:
    times = {name: timer(fn) for name, fn in variants.items()}
    best = min(times, key=times.__getitem__)
    return times[best], best


def kernel_times(fn, calls: int = 20) -> dict:
    """Mean device µs per call of each kernel `fn` launches (torch profiler, eager launches)."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return {e.key: e.device_time_total / calls for e in prof.key_averages() if e.device_time_total > 0}


def time_floor_row(timer, case, bw: float, label: str, profile: bool = False) -> dict:
    from bench.ffd_kernels import ffd, params, sparsity
    p = params()
    s = sparsity(case, p)
    sk = skeleton_for(case, p)
    units = sk.units
    rows = sk.batch * sk.hkv
    row = {"data": label, "B": sk.batch, "L": case.lens[0], "sparsity": s, "checks": check_skeletons(sk)}
    row["bound_us"] = case.ffd_bytes(s) / bw * 1e6
    row["ffd_us"] = min(timer(lambda: ffd(case, p)) for _ in range(2))
    buf = torch.empty(-(-sk.bound_words() // 4096) * 4096, dtype=torch.int32, device=case.q.device).random_()
    row["stream_bytes"] = buf.numel() * 4
    row["stream_us"], row["stream_cfg"] = fastest(timer, {
        f"{k}/SM,{w}w": (lambda k=k, w=w, buf=buf: stream(buf, k * units, w)) for k in (2, 4, 8) for w in (4, 8)})
    del buf
    # each pass alone at a few launch shapes, then the three launches at the best two of each
    splits = choose_splits(sk.batch, sk.hkv, case.q.device, ATTEND_PROGRAMS_PER_SM)   # the FFD attend's grid
    scans = {f"{k}/SM,{w}w,{st}st": (max(1, k * units // rows), w, st)
             for k, w, st in ((12, 1, 4), (16, 1, 4), (8, 1, 4), (12, 1, 6), (8, 2, 4), (4, 4, 4))}
    attends = {f"{w}w,{st}st,{r}/SM": (w, st, r * units - rows)
               for w, st, r in ((4, 2, 2), (4, 3, 2), (8, 2, 2), (8, 3, 2), (4, 2, 3), (4, 2, 4))}
    row["scan_alone_us"] = {n: timer(lambda c=c: sk.scan(c[0], c[1], stages=c[2])) for n, c in scans.items()}
    row["attend_alone_us"] = {n: timer(lambda c=c: sk.attend(splits, c[2], c[0], pdl=False, stages=c[1]))
                              for n, c in attends.items()}
    best_scans = sorted(scans, key=row["scan_alone_us"].get)[:2]
    best_attends = sorted(attends, key=row["attend_alone_us"].get)[:2]
    c, a = scans[best_scans[0]], attends[best_attends[0]]
    row["empty_us"] = {n: timer(lambda n=n: sk.three(c[0], c[1], splits, a[2], a[0], work=False, launches=n))
                       for n in (1, 2, 3)}
    row["three_us"], row["three_cfg"] = fastest(timer, {
        f"scan {sn}, attend {an}": (lambda c=scans[sn], a=attends[an]: sk.three(
            c[0], c[1], splits, a[2], a[0], stages=a[1], scan_stages=c[2]))
        for sn in best_scans for an in best_attends})
    row["fused_us"], row["fused_cfg"] = fastest(timer, {
        f"{k}/SM,{w}w {st}st": (lambda k=k, w=w, st=st: sk.fused(max(1, k * units // rows), w, stages=st))
        for k in (2, 4) for w in (4, 8) for st in (2, 3)})
    if profile:
        best = row["three_cfg"].removeprefix("scan ").split(", attend ")
        c, a = scans[best[0]], attends[best[1]]
        row["kernel_us"] = {"ffd": kernel_times(lambda: ffd(case, p)),
                            "three": kernel_times(lambda: sk.three(c[0], c[1], splits, a[2], a[0], stages=a[1],
                                                                   scan_stages=c[2]))}
    for key in ("ffd", "stream", "three", "fused"):
        row[f"{key}_over_bound"] = row[f"{key}_us"] / row["bound_us"]
    print("floor", json.dumps(row), flush=True)
    return row


PROFILED = {(1, 131072, 0.1), (1, 262144, 0.1), (8, 65536, 0.02), (8, 131072, 0.1)}   # --profile rows


def run(out_dir: Path, budget_s: float, profile: bool = False) -> dict:
    from bench.ffd_kernels import Case
    from bench.kernels import Timer, copy_bandwidth
    gen = torch.Generator(device="cuda").manual_seed(0)
    timer = Timer()
    bw = copy_bandwidth()
    report: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "triton": triton.__version__, "copy_bw": bw, "rows": []}
    deadline = time.time() + budget_s
    for length in (131072, 262144, 65536, 16384):
        for batch in (1, 8):
            for f_hot in (0.1, 0.02):
                if time.time() > deadline:
                    print("floor: budget spent, skipping the rest", flush=True)
                    break
                case = Case([length] * batch, 32, 8, 128, gen, f_hot=f_hot)
                report["rows"].append(time_floor_row(timer, case, bw, f"synthetic f={f_hot}",
                                                     profile and (batch, length, f_hot) in PROFILED))
                del case
                torch.cuda.empty_cache()
                out_dir.mkdir(parents=True, exist_ok=True)
                (out_dir / "ffd_floor.json").write_text(json.dumps(report, indent=1))   # after every row
    return report


def print_table(report: dict) -> None:
    print(f"\n{report['gpu']}, copy bandwidth {report['copy_bw'] / 1e12:.2f} TB/s; µs, CUDA-graph replay, L2 cleaned")
    print("| B | L | sparsity | bound | 1.5 x bound | stream | empty 3 launches | three | fused | FFD | "
          "stream/bound | three/bound | fused/bound | FFD/bound | checks |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in report["rows"]:
        print(f"| {r['B']} | {r['L'] // 1024}K | {r['sparsity']:.3f} | {r['bound_us']:.1f} | "
              f"{1.5 * r['bound_us']:.1f} | "
              f"{r['stream_us']:.1f} | {r['empty_us'][3]:.1f} | {r['three_us']:.1f} | {r['fused_us']:.1f} | "
              f"{r['ffd_us']:.1f} | {r['stream_over_bound']:.2f} | {r['three_over_bound']:.2f} | "
              f"{r['fused_over_bound']:.2f} | {r['ffd_over_bound']:.2f} | {all(r['checks'].values())} |")
    print("\nThe passes alone (fastest launch shape) and the empty launches, µs")
    print("| B | L | sparsity | scan alone | attend alone | empty 1 | empty 2 | empty 3 | three (config) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in report["rows"]:
        sn = min(r["scan_alone_us"], key=r["scan_alone_us"].get)
        an = min(r["attend_alone_us"], key=r["attend_alone_us"].get)
        e = r["empty_us"]
        print(f"| {r['B']} | {r['L'] // 1024}K | {r['sparsity']:.3f} | {r['scan_alone_us'][sn]:.1f} ({sn}) | "
              f"{r['attend_alone_us'][an]:.1f} ({an}) | {e[1]:.1f} | {e[2]:.1f} | {e[3]:.1f} | "
              f"{r['three_us']:.1f} ({r['three_cfg']}) |")
    profiled = [r for r in report["rows"] if "kernel_us" in r]
    if profiled:
        print("\nDevice µs per kernel and call (torch profiler, eager)")
        for r in profiled:
            print(f"B = {r['B']}, L = {r['L'] // 1024}K, s = {r['sparsity']:.3f}:")
            for who, kernels in r["kernel_us"].items():
                print(f"  {who}: " + ", ".join(f"{k} {v:.1f}" for k, v in kernels.items())
                      + f" (sum {sum(kernels.values()):.1f})")


def smoke() -> dict:
    """Interpreter: the skeletons over a small random case read exactly their bytes."""
    g = torch.Generator().manual_seed(1)
    hkv, dim, n, lens = 2, 64, 12, [128 * 5, 128 * 5]
    codes = torch.randint(0, 256, (n, hkv, BS, dim // 4), dtype=torch.uint8, generator=g)
    scales = torch.rand(n, hkv, dim, generator=g)
    residual = torch.randn(n, hkv, BS, dim, generator=g).to(torch.float8_e4m3fn)
    v = torch.randn(n, BS, hkv, dim, generator=g).bfloat16()
    tables = torch.randperm(n - 1, generator=g)[:10].reshape(2, 5).to(torch.int32) + 1
    keep = torch.rand(2, hkv, 5, generator=g) < 0.4
    keep[0, 0, 0] = True
    sk = Skeletons(codes, scales, residual, v, tables, lens, keep, 6)
    return check_skeletons(sk)


# --layers rows: (B, L, f)
LAYERED = ((1, 131072, 0.1), (1, 131072, 0.02), (1, 262144, 0.1), (1, 262144, 0.02), (1, 65536, 0.1),
           (1, 65536, 0.02), (8, 65536, 0.02), (8, 16384, 0.1), (8, 16384, 0.02), (1, 16384, 0.1))


def run_layered(out_dir: Path, layers: int) -> dict:
    """FFD and flash as a model step runs them: `layers` decodes in one graph, each over its own pages
    (as the layers of one step), L2 cleaned once before the graph; µs per layer = graph / layers. The
    fixed cost of a launch, which the one-decode graphs above pay once per row, is spread as in a step."""
    from bench.ffd_kernels import Case, ffd, flash, params, sparsity
    from bench.kernels import Timer, copy_bandwidth
    gen = torch.Generator(device="cuda").manual_seed(0)
    timer, bw = Timer(), copy_bandwidth()
    report: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "copy_bw": bw, "layers": layers, "rows": []}
    p = params()
    for batch, length, f_hot in LAYERED:
        cases = [Case([length] * batch, 32, 8, 128, gen, f_hot=f_hot) for _ in range(layers)]
        s = sum(sparsity(c, p) for c in cases) / layers
        bound = cases[0].ffd_bytes(s) / bw * 1e6
        one = min(timer(lambda cs=cases: ffd(cs[0], p)) for _ in range(2))
        ffd_us = min(timer(lambda cs=cases: [ffd(c, p) for c in cs]) for _ in range(2)) / layers
        flash_us = min(timer(lambda cs=cases: [flash(c) for c in cs]) for _ in range(2)) / layers
        # the three-launch skeleton per layer, at the launch shapes that won most rows of the one-decode table
        sks = [skeleton_for(c, p) for c in cases]
        units, rows = sks[0].units, batch * 8
        splits = choose_splits(batch, 8, cases[0].q.device, ATTEND_PROGRAMS_PER_SM)
        scan_programs = max(1, 16 * units // rows)
        # each lambda is timed at once, in this iteration
        three_us = min(timer(lambda a=a, sks=sks: [sk.three(scan_programs, 1, splits, a[2] * units - rows,  # noqa: B023
                                                            4, stages=a[1]) for sk in sks]) / layers
                       for a in ((4, 2, 2), (4, 3, 2), (4, 2, 4)))
        row = {"B": batch, "L": length, "f": f_hot, "sparsity": s, "bound_us": bound, "ffd_one_graph_us": one,
               "ffd_per_layer_us": ffd_us, "flash_per_layer_us": flash_us, "three_per_layer_us": three_us}
        del sks
        report["rows"].append(row)
        print("layered", json.dumps(row), flush=True)
        del cases
        torch.cuda.empty_cache()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "ffd_floor_layered.json").write_text(json.dumps(report, indent=1))
    print(f"\n{report['gpu']}, copy bandwidth {bw / 1e12:.2f} TB/s; µs per layer, {layers} decodes in one graph")
    print("| B | L | sparsity | bound | 1.5 x bound | FFD alone (one graph) | FFD per layer | flash per layer | "
          "three per layer | FFD/bound | three/bound | vs flash |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in report["rows"]:
        print(f"| {r['B']} | {r['L'] // 1024}K | {r['sparsity']:.3f} | {r['bound_us']:.1f} | "
              f"{1.5 * r['bound_us']:.1f} | {r['ffd_one_graph_us']:.1f} | {r['ffd_per_layer_us']:.1f} | "
              f"{r['flash_per_layer_us']:.1f} | {r['three_per_layer_us']:.1f} | "
              f"{r['ffd_per_layer_us'] / r['bound_us']:.2f} | {r['three_per_layer_us'] / r['bound_us']:.2f} | "
              f"{r['flash_per_layer_us'] / r['ffd_per_layer_us']:.2f}x |")
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    ap.add_argument("--budget-s", type=float, default=400, help="no new row after this many seconds")
    ap.add_argument("--profile", action="store_true",
                    help="also each kernel's device time (torch profiler), FFD's and the skeletons', at four rows")
    ap.add_argument("--layers", type=int, default=0,
                    help="instead: FFD and flash per layer with this many decodes in one graph, as in a model step")
    ap.add_argument("--smoke", action="store_true", help="CPU, under TRITON_INTERPRET=1: the checksums only")
    args = ap.parse_args()
    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--smoke runs under the Triton interpreter: "
                             "TRITON_INTERPRET=1 python bench/ffd_floor.py --smoke")
        checks = smoke()
        print(json.dumps(checks))
        raise SystemExit(0 if all(checks.values()) else 1)
    if not torch.cuda.is_available():
        raise SystemExit("ffd_floor needs a GPU (or --smoke under the interpreter)")
    if args.layers:
        run_layered(args.out, args.layers)
        return
    print_table(run(args.out, args.budget_s, args.profile))


if __name__ == "__main__":
    main()
