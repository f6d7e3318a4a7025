"""A prefill chunk's attention over its sequence's cached prefix, ahead of the paged prefill kernel.

Every row of a chunk sees all keys before the chunk's first token: a dense rectangle of rows x
prefix keys, with no mask. On Hopper cuDNN's fused attention runs that rectangle faster than a
Triton kernel reaches (about 610-640 TFLOP/s against 450, bench/RESULTS.md), so for long prefixes
the rectangle is read as one contiguous K/V per sequence (its pages in place when they are
consecutive blocks, else gathered), attended by cuDNN with its log-sum-exp, and handed to
`prefill_attention` as a `PrefixSeed`: each row's softmax state over keys [0, key_start), from which
the kernel folds in the rest (the chunk's own causal part). The two parts merge exactly: a state
(max = lse, denominator = 1, accumulator = normalised out) is what the online softmax would hold
after those keys. Over FP8 pages cuDNN reads K dequantized to the queries' dtype and V's codes as they are
(exact in that dtype), so the seed's output is in units of V's codes, as the kernel's own accumulator is:
the kernel multiplies both by V's per-head scale at the end.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from kernels.attention.kv_quant import dequantize_kv, is_fp8
from kernels.attention.page_runs import PageRun, page_runs, run_view
from kernels.attention.reference import gather_kv_ref
from kernels.host_copy import to_device

# (q [C, Hq, D], k [P, Hkv, D], v [P, Hkv, D], scale) -> (out [C, Hq, D] in q's dtype, lse [Hq, C] float32)
PrefixAttend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class PrefixSpan:
    """Rows [q_start, q_end) of sequence `seq` attend keys [0, key_start) outside the prefill kernel.
    `run`: the prefix's pages as one run of consecutive blocks, read where they lie instead of gathered
    (`plan_prefix` finds it)."""

    seq: int
    q_start: int
    q_end: int
    key_start: int
    run: PageRun | None = None


def prefix_spans(seq_lens: list[int], query_start_loc: list[int], *, min_keys: int, min_rows: int,
                 align: int) -> list[PrefixSpan]:
    """The sequences whose cached prefix is worth attending outside the kernel: at least `min_rows` new
    tokens over at least `min_keys` keys before them, cut to a multiple of `align` (the kernel's KV tile,
    so it resumes on a tile boundary)."""
    spans = []
    for b, length in enumerate(seq_lens):
        q_start, q_end = query_start_loc[b], query_start_loc[b + 1]
        keys = (length - (q_end - q_start)) // align * align
        if q_end - q_start >= min_rows and keys >= min_keys:
            spans.append(PrefixSpan(b, q_start, q_end, keys))
    return spans


# torch builds (tens of ms) and keeps one cuDNN graph per shape, so rows are padded to a multiple of this and
# spans end on multiples of `PrefillConfig.prefix_key_bucket`: a bounded set of shapes, each built once.
CUDNN_ROW_BUCKET = 512


def prefix_attention_cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cuDNN's fused attention of q [C, Hq, D] over k, v [P, Hkv, D] (no mask; grouped heads as they are)
    -> (out [C, Hq, D], lse [Hq, C] float32)."""
    rows = q.shape[0]
    padded = -(-rows // CUDNN_ROW_BUCKET) * CUDNN_ROW_BUCKET
    if padded != rows:
        q = torch.cat((q, q.new_zeros(padded - rows, *q.shape[1:])))
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], None, True, 0.0, False, False,
        scale=scale)[:2]
    return out[0].transpose(0, 1)[:rows], lse.view(q.shape[1], padded)[:, :rows]


def prefix_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`prefix_attention_cudnn` in float32 torch (the oracle, and the path the interpreter tests take)."""
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), vf)
    return out.to(q.dtype), lse


@dataclass(frozen=True)
class PrefixPlan:
    """A step's spans and the per-sequence key starts the kernel reads, on the device (made once per step,
    so no layer copies host data to the GPU)."""

    spans: tuple[PrefixSpan, ...]
    key_start: torch.Tensor
    key_start_host: tuple[int, ...]


@dataclass(frozen=True)
class PrefixSeed:
    """Each row's softmax over its sequence's keys [0, plan.key_start[b]): `out` [T, Hq, D] normalised,
    `lse` [Hq, T] float32 natural log (-inf for rows of sequences with no span)."""

    out: torch.Tensor
    lse: torch.Tensor
    plan: PrefixPlan


def plan_prefix(spans: list[PrefixSpan], num_seqs: int, device: torch.device,
                block_tables_host: torch.Tensor | None = None, block_size: int = 0) -> PrefixPlan:
    """The step's plan. With the host copy of the block tables, spans whose prefix pages form one run of
    consecutive blocks (what a fresh cache hands a lone long prompt) read them in place."""
    key_start = [0] * num_seqs
    for span in spans:
        key_start[span.seq] = span.key_start
    if block_tables_host is not None:
        spans = [replace(span, run=_single_run(block_tables_host[span.seq], span.key_start, block_size))
                 for span in spans]
    return PrefixPlan(tuple(spans), to_device(key_start, torch.int32, device), tuple(key_start))


def _single_run(block_table: torch.Tensor, num_tokens: int, block_size: int) -> PageRun | None:
    runs = page_runs(block_table[None], torch.tensor([num_tokens]), block_size)[0]
    return runs[0] if len(runs) == 1 else None


def prefix_pages(cache: torch.Tensor, block_table: torch.Tensor, span: PrefixSpan,
                 kv_scale: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The span's keys [0, key_start) of `cache` as [key_start, Hkv, D]: a view of its pages when they are
    one run of blocks, else a gathered copy; cast to `dtype` when given (FP8 codes times their per-head
    `kv_scale` when given, else the codes' own values)."""
    tokens = (gather_kv_ref(cache, block_table, span.key_start) if span.run is None
              else run_view(cache, span.run))
    if dtype is None and kv_scale is None:
        return tokens
    return dequantize_kv(tokens, kv_scale, dtype or torch.float32)


def prefix_seed(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                plan: PrefixPlan, scale: float, attend: PrefixAttend = prefix_attention_cudnn, *,
                k_scale: torch.Tensor | None = None) -> PrefixSeed:
    """Attend each span's rows over its prefix (`prefix_pages`) with `attend`; the seed for `prefill_attention`.
    Rows outside every span keep lse = -inf (the kernel reads no `out` for them). FP8 pages come with K's
    per-head scale; V is read as its codes, so the seed's `out` is in units of V's codes."""
    if is_fp8(k_cache.dtype) and k_scale is None:
        raise ValueError("prefix seed: FP8 pages need K's per-head k_scale")
    num_tokens, num_heads, _ = q.shape
    out = torch.empty_like(q)
    lse = torch.full((num_heads, num_tokens), float("-inf"), dtype=torch.float32, device=q.device)
    for span in plan.spans:
        k = prefix_pages(k_cache, block_tables[span.seq], span, k_scale, q.dtype)
        v = prefix_pages(v_cache, block_tables[span.seq], span, None, q.dtype)
        rows_out, rows_lse = attend(q[span.q_start:span.q_end], k, v, scale)
        out[span.q_start:span.q_end] = rows_out
        lse[:, span.q_start:span.q_end] = rows_lse
    return PrefixSeed(out, lse, plan)


# Head sizes the GPU tests run cuDNN's attention at (tests/kernels/test_prefill_prefix.py).
CUDNN_HEAD_DIMS = (64, 128)


def cudnn_prefix_available(dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int, device: torch.device) -> bool:
    """Whether `prefix_attention_cudnn` runs here: an NVIDIA GPU of compute capability 9.0+ with cuDNN's
    attention enabled in torch, a half-precision model over pages of its dtype or FP8 (dequantized for cuDNN),
    a tested head size."""
    if device.type != "cuda" or torch.version.hip or not torch.backends.cudnn.is_available():
        return False
    return (torch.backends.cuda.cudnn_sdp_enabled() and torch.cuda.get_device_capability(device)[0] >= 9
            and dtype in (torch.bfloat16, torch.float16) and (kv_dtype == dtype or is_fp8(kv_dtype))
            and head_dim in CUDNN_HEAD_DIMS)


def warm_up_cudnn(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
    """One small call at startup, so that loading cuDNN's attention engines (the first call of a process took
    about 1.6 s more than the next on the H200) is not paid by the first long prompt."""
    q = torch.zeros(CUDNN_ROW_BUCKET, num_heads, head_dim, dtype=dtype, device=device)
    kv = torch.zeros(CUDNN_ROW_BUCKET, num_kv_heads, head_dim, dtype=dtype, device=device)
    prefix_attention_cudnn(q, kv, kv, 1.0)
