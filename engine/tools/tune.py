"""`fdserve tune`: measure GEMV / flat GEMM / cuBLAS at the model's decode shapes on this GPU and
write the crossover table that `[flashdecoding] adaptive_matmul` reads (kernels.gemm.dispatch).

For each linear-layer shape (K, N) and each M in DEFAULT_MS: time cuBLAS (`F.linear`), the GEMV
(M ≤ GEMV_MAX_M) and the flat GEMM over a small config grid, every candidate checked against an
fp32 product first. A kernel wins an M only when it beats cuBLAS by MARGIN, so timing noise cannot
make the adaptive path slower than cuBLAS. Timing: many calls captured in one CUDA graph, cycling
through copies of the weight that together exceed 3× the L2, so each call reads W from HBM as a
decode step does; the median over graph replays. Needs a GPU; on CPU it says so and fails.
torch, Triton and the kernels are imported inside the functions: `fdserve --help` imports this module.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from itertools import product
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from engine.config import FdserveConfig
    from kernels.gemm.dispatch import Choice, MatmulTable
    from kernels.gemm.matmul import MatmulConfig

DEFAULT_MS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MARGIN = 0.03                 # a kernel must beat cuBLAS by 3 % to be chosen
MAX_REL_ERR = 2e-2            # vs the fp32 product; bf16 output rounding alone is ~3e-3
SMEM_BYTES = 227 * 1024       # per-CTA shared-memory limit on Hopper; larger pipelines cannot launch
GEMV_MAX_M = 8                # = kernels.gemm.matmul.GEMV_MAX_M (not imported here: see above)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output", metavar="FILE", help="where to write the table (default: the file the "
                        "server reads, $FDSERVE_CACHE_DIR/matmul_table-<gpu>.json)")
    parser.add_argument("--m", default=",".join(map(str, DEFAULT_MS)), help="batch sizes M to measure")
    parser.add_argument("--shapes", metavar="NAME=KxN,...", help="measure these shapes instead of the "
                        "model's, e.g. qkv_proj=4096x6144,o_proj=4096x4096")
    parser.add_argument("--reps", type=int, default=10, help="graph replays per timing (median)")
    parser.add_argument("--quick", action="store_true", help="a smaller config grid (about 4x faster)")
    parser.add_argument("--moe", action="store_true", help="tune the fused mixture-of-experts kernels at the "
                        "model's expert shape instead (writes $FDSERVE_CACHE_DIR/moe_table-<gpu>.json; "
                        "--m defaults to 1..4096)")


# ----- shapes ----------------------------------------------------------------------------------

def parse_shapes(text: str) -> dict[str, tuple[int, int]]:
    shapes = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, dims = item.rpartition("=")
        k, sep, n = dims.lower().partition("x")
        if not sep or not k.isdigit() or not n.isdigit():
            raise ValueError(f"--shapes {item!r}: expected NAME=KxN, e.g. o_proj=4096x4096")
        shapes[name or dims] = (int(k), int(n))
    return shapes


def model_shapes(model_name: str | None) -> tuple[dict[str, tuple[int, int]], Any]:
    """This rank's (K, N) per linear layer of the configured model, built on the meta device
    (config.json only; no weights are read), and its HF config."""
    import torch
    from transformers import AutoConfig

    from engine.model.layers import linear_shapes
    from engine.model.loader import resolve_model_dir
    from engine.model.registry import get_model_class

    hf_config = AutoConfig.from_pretrained(str(resolve_model_dir(model_name)))
    with torch.device("meta"):
        model = get_model_class(hf_config)(hf_config, torch.bfloat16)
    return linear_shapes(model), hf_config


# ----- timing ----------------------------------------------------------------------------------

class GraphTimer:
    """Median µs per call of `fn(i)`, i cycling over weight copies, replayed as one CUDA graph."""

    def __init__(self, reps: int = 10, min_calls: int = 24) -> None:
        import torch

        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        self.l2_bytes = int(getattr(props, "L2_cache_size", 0) or 64 << 20)
        self.reps = reps
        self.min_calls = min_calls

    def copies_for(self, weight_bytes: int) -> int:
        return max(1, min(64, math.ceil(3 * self.l2_bytes / weight_bytes)))

    def __call__(self, fn: Callable[[int], Any], copies: int) -> float:
        import torch

        calls = copies * math.ceil(self.min_calls / copies)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):   # compile and warm up outside the capture
            for i in range(copies):
                fn(i)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for c in range(calls):
                fn(c % copies)
        times = []
        for _ in range(self.reps + 1):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(1_000_000)   # keeps the GPU busy while the host launches the graph
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1000 / calls)
        return statistics.median(times[1:])


# ----- search ----------------------------------------------------------------------------------

def candidate_configs(impl: str, m: int, n: int, k: int, num_sms: int, vendor: str, double_buffer: bool,
                      quick: bool = False) -> list[MatmulConfig]:
    """The default config plus a grid around it: N and K tiles, split-K off / filling the SMs, depths.

    GEMV tiles hold 4K-16K weight elements per CTA and step, from a few rows streamed whole (K up
    to 4096 in one load, so every CTA has all its bytes in flight at once) to the 16 x 512 default;
    4 or 8 warps. Its loop carries no dot, so it gets one pipeline depth.
    """
    import triton

    from kernels.gemm.matmul import auto_split_k, default_config

    base = default_config(impl, m, n, k, num_sms, vendor)
    if impl == "gemv":
        tiles = ((base.block_n, base.block_k),) if quick else tuple(
            (bn, bk) for bn in (1, 2, 4, 8, 16, 32) for bk in (256, 512, 1024, 2048, 4096)
            if 4096 <= bn * bk <= 16384 and bk <= max(256, triton.next_power_of_2(k)))
        warps = (base.num_warps,) if quick else (4, 8)
        depths: tuple[int, ...] = (base.num_stages,)
    else:
        tiles = tuple(product((32, 64, 128), (base.block_k,) if quick else (128, 256)))
        warps = (base.num_warps,)
        # With double_buffer off every config runs one stage, so depths would only repeat timings.
        depths = (base.num_stages,) if quick or not double_buffer else ((2, 3) if vendor == "amd" else (3, 4, 6))
    m_tiles = -(-m // base.block_m) if impl == "flat" else 1
    found = {base}
    for (bn, bk), nw, stages in product(tiles, warps, depths):
        auto = auto_split_k(-(-n // bn) * m_tiles, k, bk, num_sms)
        for split in ({auto} if quick else {1, auto}):
            found.add(replace(base, block_n=bn, block_k=bk, split_k=split, num_stages=stages, num_warps=nw))
    return [c for c in sorted(found, key=str) if _fits(impl, c, m, double_buffer)]


def _fits(impl: str, cfg: MatmulConfig, m: int, double_buffer: bool) -> bool:
    from kernels.gemm.matmul import gemv_fits

    if impl == "gemv":
        return gemv_fits(cfg, m)
    stages = cfg.num_stages if double_buffer else 1
    return (cfg.block_m + cfg.block_n) * cfg.block_k * 2 * stages <= SMEM_BYTES


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).norm() / ref.norm().clamp_min(1e-30))


def tune_shapes(shapes: dict[str, tuple[int, int]], ms: list[int], dtype: torch.dtype, double_buffer: bool, *,
                reps: int = 10, quick: bool = False, log: Callable[[str], None] = print
                ) -> tuple[MatmulTable, list[str]]:
    """Measure every (shape, M); returns the table and the correctness failures (kernel bugs)."""
    import torch

    from kernels.gemm.dispatch import MatmulTable

    device = torch.device("cuda")
    timer = GraphTimer(reps)
    table = MatmulTable(torch.cuda.get_device_name(device), str(dtype).removeprefix("torch."), double_buffer)
    failures: list[str] = []
    gen = torch.Generator(device=device).manual_seed(0)
    for name, (k, n) in shapes.items():
        w0 = (torch.randn(n, k, device=device, generator=gen) * k ** -0.5).to(dtype)
        copies = timer.copies_for(w0.numel() * w0.element_size())
        weights = [w0] + [w0.clone() for _ in range(copies - 1)]
        table.names[(k, n)] = name
        for m in ms:
            x = torch.randn(m, k, device=device, generator=gen).to(dtype)
            times, chosen = _tune_one(timer, x, weights, double_buffer, quick, failures, log, name)
            table.choices.setdefault((k, n), {})[m] = chosen
            table.timings.setdefault((k, n), {})[m] = {i: round(t, 3) for i, t in times.items()}
            log(_row(name, k, n, m, times, chosen, double_buffer))
        weights.clear()
        torch.cuda.empty_cache()
    return table, failures


def _tune_one(timer: GraphTimer, x: torch.Tensor, weights: list[torch.Tensor], double_buffer: bool, quick: bool,
              failures: list[str], log: Callable[[str], None], name: str) -> tuple[dict[str, float], Choice]:
    """Best time per implementation at one (shape, M), and the choice (cuBLAS unless beaten by MARGIN)."""
    import torch
    import torch.nn.functional as F
    from triton.errors import TritonError

    from kernels.gemm.dispatch import CUBLAS, Choice
    from kernels.gemm.matmul import flat_gemm, gemv
    from kernels.vendor import detect_vendor

    (n, k), m = weights[0].shape, x.shape[0]
    props = torch.cuda.get_device_properties(x.device)
    ref = F.linear(x.float(), weights[0].float())
    times = {"cublas": timer(lambda i: F.linear(x, weights[i]), len(weights))}
    best: tuple[float, Choice] = (math.inf, CUBLAS)
    for impl in ("gemv", "flat") if m <= GEMV_MAX_M else ("flat",):
        kernel = gemv if impl == "gemv" else flat_gemm
        for cfg in candidate_configs(impl, m, n, k, props.multi_processor_count, detect_vendor(), double_buffer,
                                     quick):
            try:
                err = _rel_err(kernel(x, weights[0], config=cfg, double_buffer=double_buffer), ref)
            except (TritonError, RuntimeError, ValueError) as exc:   # e.g. OutOfResources at this tile/depth
                log(f"  skip {name} M={m} {impl} {cfg}: {type(exc).__name__}: {str(exc)[:120]}")
                continue
            if not err <= MAX_REL_ERR:
                failures.append(f"{name} {k}x{n} M={m} {impl} {cfg}: rel err {err:.2e}")
                continue

            def run(i: int, c: MatmulConfig = cfg, f: Callable[..., torch.Tensor] = kernel) -> torch.Tensor:
                return f(x, weights[i], config=c, double_buffer=double_buffer)

            t = timer(run, len(weights))
            times[impl] = min(times.get(impl, math.inf), t)
            if t < best[0]:
                best = (t, Choice(impl, cfg))
    return times, best[1] if best[0] <= times["cublas"] * (1 - MARGIN) else CUBLAS


def _row(name: str, k: int, n: int, m: int, times: dict[str, float], chosen: Choice, double_buffer: bool) -> str:
    from kernels.gemm.matmul import plan

    cells = "  ".join(f"{i} {times[i]:7.2f}" if i in times else f"{i}     -  " for i in ("cublas", "gemv", "flat"))
    detail = ""
    if chosen.config is not None:
        p = plan(chosen.impl, m, n, k, chosen.config, double_buffer)
        c = chosen.config
        detail = f" (BN {c.block_n} BK {c.block_k} split {p.num_splits} stages {p.num_stages})"
    speedup = times["cublas"] / min(times.values())
    return f"{name:>14} {k:>6}x{n:<6} M={m:<4} {cells} µs  -> {chosen.impl}{detail}  x{speedup:.2f}"


# ----- the subcommand ----------------------------------------------------------------------------

def run(config: FdserveConfig, args: argparse.Namespace) -> int:
    """`fdserve tune` with the parsed config (`[model]`, `[flashdecoding] double_buffer`)."""
    import torch

    if not torch.cuda.is_available():
        print(f"fdserve tune: tuning times the GEMV / flat-GEMM kernels against cuBLAS on a GPU, and this "
              f"machine has none (torch {torch.__version__} sees no CUDA/ROCm device). Run it on the GPU "
              f"that will serve; without a table the server uses cuBLAS for every linear layer.", file=sys.stderr)
        return 1
    if args.moe:
        return _run_moe(config, args)
    from engine.worker.device import select_dtype
    from kernels.gemm.dispatch import default_table_path

    ms = sorted({int(v) for v in str(args.m).split(",") if v.strip()})
    if args.shapes:
        shapes, model_dtype = parse_shapes(args.shapes), None
    else:
        shapes, hf_config = model_shapes(config.model.name)
        model_dtype = getattr(hf_config, "torch_dtype", None)
    dtype = select_dtype(config.model.dtype, torch.device("cuda"), model_dtype)
    double_buffer = bool(config.flashdecoding.double_buffer)
    print(f"fdserve tune: {torch.cuda.get_device_name()} {dtype}, double_buffer {double_buffer}, M {ms}, "
          f"shapes {shapes}", file=sys.stderr)
    start = time.perf_counter()
    table, failures = tune_shapes(shapes, ms, dtype, double_buffer, reps=args.reps, quick=args.quick)
    table.meta = {**_created(), "margin": MARGIN}
    out = Path(args.output) if args.output else default_table_path(table.gpu)
    return _write_table(table.to_json(), out, start, failures, "fdserve tune: kernel results differ from the "
                        "fp32 product (these configs were left out)")


def _created() -> dict[str, str]:
    import torch

    return {"created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(sys.argv), "torch": torch.__version__}


def _write_table(data: dict[str, Any], out: Path, start: float, failures: list[str], failure_title: str) -> int:
    """Write a tuned table; 1 (after listing them) when some configs failed their correctness check."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1), encoding="utf-8")
    print(f"wrote {out} in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    if failures:
        print(f"{failure_title}:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    return 0


def _run_moe(config: FdserveConfig, args: argparse.Namespace) -> int:
    import torch

    from engine.tools.tune_moe import DEFAULT_MOE_MS, model_moe_shape, tune_moe
    from engine.worker.device import select_dtype
    from kernels.moe.config import default_table_path

    _, hf_config = model_shapes(config.model.name)
    shape = model_moe_shape(hf_config)
    if shape is None:
        print(f"fdserve tune --moe: {config.model.name or 'the embedded default'} has no mixture-of-experts "
              f"layers; run it with a MoE model (e.g. --set model.name=synthetic:qwen3-30b-a3b)", file=sys.stderr)
        return 1
    explicit_m = args.m != ",".join(map(str, DEFAULT_MS))
    ms = sorted({int(v) for v in str(args.m).split(",") if v.strip()}) if explicit_m else list(DEFAULT_MOE_MS)
    dtype = select_dtype(config.model.dtype, torch.device("cuda"), getattr(hf_config, "torch_dtype", None))
    print(f"fdserve tune --moe: {torch.cuda.get_device_name()} {dtype}, (experts, top-k, hidden, "
          f"intermediate) {shape}, M {ms}", file=sys.stderr)
    start = time.perf_counter()
    table, failures = tune_moe(shape, ms, dtype, reps=args.reps, quick=args.quick,
                               log=lambda line: print(line, file=sys.stderr))
    table.meta = _created()
    out = Path(args.output) if args.output else default_table_path(table.gpu)
    return _write_table(table.to_json(), out, start, failures, "fdserve tune --moe: kernel results differ from "
                        "the float32 reference (these configs were left out)")
