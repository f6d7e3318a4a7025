"""Faster Flash Decoding (FFD) in torch: the key quantizer, the per-query attention rule and the
paged decode/prefill wrappers. The CPU path of `kernel = "ffd"` and the oracle of `kernels/ffd/decode.py`.

Quantized key format, one quantization block = one KV page of BS tokens, head-major per page:
  codes    [N, Hkv, BS, D/4] uint8    2-bit codes; byte i holds channels i, i+D/4, i+D/2, i+3D/4 in
                                      bits 0-1, 2-3, 4-5, 6-7, so each 2-bit plane is one contiguous
                                      channel range (the kernel dots a plane at a time, no shuffles)
  scales   [N, Hkv, D]       float32  per-channel symmetric scale s = max_t |k_t| * 2/3
  residual [N, Hkv, BS, D]   fp8 e4m3 (x - (code - 1.5)) * R with x = k / s and R = 256, i.e. the
                                      quantization error in units of s/R, rounded to nearest even
code = clamp(floor(x) + 2, 0, 3): the nearest of the levels (-1.5, -0.5, 0.5, 1.5) * s, so
|x - (code - 1.5)| <= 1/2 and the stored residual is within about +-128 (e4m3 saturates at 448).
k̂ = (code - 1.5) * s + residual * s / R is the "refined" key; (code - 1.5) * s alone the "2-bit" key.
The residual is stored relative to its channel's scale, which costs no bytes (s is stored anyway)
and makes the refined key's error independent of the key's magnitude: every residual above
s * 2^-14 is an e4m3 normal (3 mantissa bits, relative error <= 2^-4), and with R a power of two
the largest residuals, |x - (code - 1.5)| in [1/4, 1/2], fill one binade, where e4m3's step is
s/32. Stored unscaled, residuals below 2^-6 are e4m3 subnormals (absolute step 2^-9, coarse for
channels with s below ~0.1), and the largest residuals get a step between s/32 and s/16,
depending on where s/2 falls in its binade.

The attention rule for one query at position p (its context is tokens 0..p), natural-log units:
  nq = (p + 1) // BS blocks are full and quantized; tokens nq*BS..p are the exact tail.
  score(t) = scale * q.k̂_t for quantized t, scale * q.k_t in the tail (exact keys).
  m = max score over the sink tokens t < sink and the local window t > p - W (tail included).
  A full block is kept when, for any query head of its KV group, its max 2-bit score
  scale * q.(code - 1.5) s >= m - δ; blocks overlapping the sinks or the window are always kept.
  Softmax over the kept blocks and the tail. m = -inf (no sinks, no window) keeps everything.
  "auto": a query with p + 1 < min_ffd_len attends densely over the exact keys instead.
Decode, prefill, chunked prefill, prefix hits and recompute all apply this rule per query, so the
model computes one function of the tokens whatever the scheduling (what makes multi-turn and
prefix-cache hits equal to a cold run).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kernels.attention.reference import key_pages_ref

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
LN2 = math.log(2.0)
LOG2E = 1.0 / LN2
SCALE_OF_ABSMAX = 2.0 / 3.0    # s = absmax / 1.5, as a product so kernel and reference round alike
MIN_SCALE = 1e-8               # an all-zero channel still divides safely
RESIDUAL_SCALE = 256.0         # R: the residual is stored as fp8((k/s - (code - 1.5)) * R), a power of two


@dataclass(frozen=True)
class FFDParams:
    block_size: int            # BS: quantization block = KV page
    delta_log2: float          # threshold offset in log2 units (inf: keep every block)
    sink_tokens: int
    local_window: int
    min_ffd_len: int = 0       # queries with fewer context tokens attend densely ("auto")

    @property
    def delta_nat(self) -> float:
        return self.delta_log2 * LN2

    @staticmethod
    def delta_to_log2(delta: float, units: str) -> float:
        """`[flashdecoding] delta` in `delta_units` ("e": natural log, "2": base 2) -> log2 units."""
        if units == "e":
            return delta * LOG2E
        if units == "2":
            return float(delta)
        raise ValueError(f"delta_units must be 'e' or '2', got {units!r}")


# ----- quantizer -----------------------------------------------------------------------------

def quantize_blocks_ref(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k[N, BS, Hkv, D] (any float dtype, the page layout) -> (codes, scales, residual) above."""
    num, bs, heads, dim = k.shape
    if dim % 4:
        raise ValueError(f"head_dim must be a multiple of 4 for 2-bit packing, got {dim}")
    kf = k.float().permute(0, 2, 1, 3)                                 # [N, H, BS, D]
    scales = (kf.abs().amax(2) * SCALE_OF_ABSMAX).clamp_min(MIN_SCALE)  # [N, H, D]
    x = kf / scales[:, :, None, :]
    codes = (torch.floor(x) + 2).clamp(0, 3)
    residual = ((x - (codes - 1.5)) * RESIDUAL_SCALE).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    c = codes.to(torch.uint8).reshape(num, heads, bs, 4, dim // 4)
    packed = c[..., 0, :] | (c[..., 1, :] << 2) | (c[..., 2, :] << 4) | (c[..., 3, :] << 6)
    return packed.contiguous(), scales.contiguous(), residual.contiguous()


def unpack_codes_ref(codes: torch.Tensor) -> torch.Tensor:
    """codes[..., D/4] uint8 -> [..., D] float32 in 0..3 (plane j = channels j*D/4 .. (j+1)*D/4)."""
    planes = [((codes >> (2 * j)) & 3) for j in range(4)]
    return torch.cat(planes, dim=-1).float()


def dequantize_blocks_ref(codes: torch.Tensor, scales: torch.Tensor,
                          residual: torch.Tensor | None = None) -> torch.Tensor:
    """-> keys [N, Hkv, BS, D] float32: 2-bit keys, or refined keys when `residual` is given."""
    k = (unpack_codes_ref(codes) - 1.5) * scales[:, :, None, :]
    return k if residual is None else k + residual_ref(residual, scales)


def residual_ref(residual: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Stored residual [N, Hkv, BS, D] fp8 -> k - 2-bit key, float32 (`* s / R`; R a power of two)."""
    return residual.float() * (scales[:, :, None, :] * (1.0 / RESIDUAL_SCALE))


def quantize_on_write_ref(k_cache: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                          residual: torch.Tensor, slot_mapping: torch.Tensor,
                          key_page_map: torch.Tensor | None = None) -> None:
    """Quantize every page whose last row this step wrote (a page fills in token order).

    k_cache[N, BS, Hkv, D] (or the K pool of `key_page_map`); the quantized tensors are indexed by
    the KV page ids, so prefix hits (shared pages) and recomputed pages are right by construction.
    """
    bs = k_cache.shape[1]
    slots = slot_mapping[slot_mapping >= 0].long()
    pages = torch.unique(slots[slots % bs == bs - 1] // bs)
    if pages.numel() == 0:
        return
    c, s, r = quantize_blocks_ref(k_cache[key_pages_ref(pages, key_page_map)])
    codes[pages], scales[pages], residual[pages] = c, s, r


# ----- the attention rule ----------------------------------------------------------------------

def attend_seq_ref(q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   k2: torch.Tensor, khat: torch.Tensor, scale: float, params: FFDParams,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rule above for the queries of one sequence, in float32.

    q[Tq, Hq, D] at positions q_pos[Tq]; k, v[L, Hkv, D] exact (L > max q_pos); k2, khat
    [Lq, Hkv, D] the 2-bit and refined keys of the first Lq = nblk*BS tokens (nblk >= the
    quantized blocks of the last query). Returns (out[Tq, Hq, D], keep[Tq, Hkv, nblk] bool
    (False past a query's nq), nq[Tq]).
    """
    num_q, num_heads, dim = q.shape
    kv_heads = k.shape[1]
    group = num_heads // kv_heads
    bs = params.block_size
    ctx = int(q_pos.max()) + 1
    pos = q_pos.long()
    nq = (pos + 1) // bs                                               # [Tq]
    nblk = min(k2.shape[0], ctx) // bs                                  # blocks any of these queries can see
    qf = (q.float() * scale).reshape(num_q, kv_heads, group, dim).permute(1, 2, 0, 3)  # [Hkv, G, Tq, D]
    t = torch.arange(ctx, device=q.device)
    lq = min(nblk * bs, ctx)
    dense = (pos + 1) < params.min_ffd_len                             # "auto": short contexts
    # exact scores only where some query of this group reads exact keys: its tail (or all, dense)
    any_dense = bool(dense.any())
    t_lo = 0 if any_dense else min(int(nq.min()) * bs, lq)
    keys_t = lambda x: x.float().permute(1, 2, 0)[:, None]              # noqa: E731  [Hkv, 1, D, T]
    exact = torch.matmul(qf, keys_t(k[t_lo:ctx]))                      # [Hkv, G, Tq, ctx - t_lo]
    refined = torch.matmul(qf, keys_t(khat[:lq]))                      # [Hkv, G, Tq, lq]
    quantized = t[None, t_lo:lq] < (nq * bs)[:, None]                  # [Tq, lq - t_lo] per query
    score = torch.cat([refined[..., :t_lo], exact], dim=-1) if t_lo else exact.clone()
    if lq > t_lo:
        score[..., t_lo:lq] = torch.where(quantized, refined[..., t_lo:], exact[..., :lq - t_lo])
    del refined
    if any_dense:                                                      # t_lo == 0: exact everywhere
        score[:, :, dense] = exact[:, :, dense]
    # pseudo-max over the sinks and the local window: a narrow band of columns
    w_lo = max(0, int(pos.min()) + 1 - params.local_window)
    cols = torch.cat([t[:min(params.sink_tokens, w_lo)], t[w_lo:]])
    in_s = (cols[None, :] <= pos[:, None]) & ((cols[None, :] < params.sink_tokens)
                                              | (cols[None, :] > pos[:, None] - params.local_window))
    m = score[..., cols].masked_fill_(~in_s, float("-inf")).amax(-1)   # [Hkv, G, Tq]

    blk = torch.arange(nblk, device=q.device)
    keep = torch.zeros(num_q, kv_heads, nblk, dtype=torch.bool, device=q.device)
    if nblk:
        s2 = torch.matmul(qf, keys_t(k2[:nblk * bs]))
        bmax = s2.reshape(kv_heads, group, num_q, nblk, bs).amax(-1)    # [Hkv, G, Tq, nblk]
        del s2
        passed = (bmax >= (m - params.delta_nat)[..., None]).any(1)     # OR over the group
        lo = pos + 1 - params.local_window
        forced = (blk[None, :] < -(-params.sink_tokens // bs)) | ((blk[None, :] + 1) * bs > lo[:, None])
        quantized_blk = (blk[None, :] < nq[:, None]) & ~dense[:, None]  # [Tq, nblk]
        keep = (passed.permute(1, 0, 2) | forced[:, None, :]) & quantized_blk[:, None, :]
        drop = ~keep & quantized_blk[:, None, :]                       # [Tq, Hkv, nblk]
        blocks = score[..., :nblk * bs].view(kv_heads, group, num_q, nblk, bs)
        blocks.masked_fill_(drop.permute(1, 0, 2)[:, None, :, :, None], float("-inf"))
    first = int(pos.min()) + 1                                         # causal: only the chunk's band
    score[..., first:].masked_fill_(t[None, first:] > pos[:, None], float("-inf"))
    probs = torch.softmax(score, dim=-1)
    out = torch.matmul(probs, v[:ctx].float().permute(1, 0, 2)[:, None])   # [Hkv, G, Tq, D]
    out = out.permute(2, 0, 1, 3).reshape(num_q, num_heads, dim)
    nq_eff = torch.where(dense, torch.zeros_like(nq), nq)
    return out, keep, nq_eff


# ----- paged wrappers ------------------------------------------------------------------------

@dataclass
class QuantizedPages:
    """One layer's quantized keys, indexed by KV page id (see the module docstring)."""

    codes: torch.Tensor
    scales: torch.Tensor
    residual: torch.Tensor


def _seq_keys(k_cache, v_cache, qpages: QuantizedPages, table, length: int, nblk: int,
              key_page_map: torch.Tensor | None = None):
    """Exact K (NaN on pages without exact keys: any read of them shows), V, 2-bit and refined K."""
    bs = k_cache.shape[1]
    pages = table[:-(-length // bs)].long()
    kp = key_pages_ref(pages, key_page_map)
    k = k_cache[kp.clamp_min(0)].masked_fill((kp < 0)[:, None, None, None], float("nan"))
    k = k.reshape(-1, *k_cache.shape[2:])[:length]
    v = v_cache[pages].reshape(-1, *v_cache.shape[2:])[:length]
    qp = pages[:nblk]
    k2 = dequantize_blocks_ref(qpages.codes[qp], qpages.scales[qp])
    khat = k2 + residual_ref(qpages.residual[qp], qpages.scales[qp])
    flat = lambda x: x.permute(0, 2, 1, 3).reshape(nblk * bs, *x.shape[1:2], x.shape[3])  # noqa: E731
    return k, v, flat(k2), flat(khat)


def _count(stats: dict[str, float] | None, keep: torch.Tensor, nq: torch.Tensor, kv_heads: int) -> None:
    if stats is not None:
        stats["ffd_blocks_total"] = stats.get("ffd_blocks_total", 0.0) + float(nq.sum()) * kv_heads
        stats["ffd_blocks_kept"] = stats.get("ffd_blocks_kept", 0.0) + float(keep.sum())


def ffd_decode_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, qpages: QuantizedPages,
                   block_tables: torch.Tensor, seq_lens: torch.Tensor, *, scale: float, params: FFDParams,
                   stats: dict[str, float] | None = None, masks: list | None = None,
                   key_page_map: torch.Tensor | None = None) -> torch.Tensor:
    """q[B, Hq, D], one query per sequence at position seq_lens[b] - 1 -> out[B, Hq, D] (q's dtype).

    `stats` gets ffd_blocks_total / ffd_blocks_kept ((KV head, full block) pairs); `masks`, if a
    list, gets each sequence's keep mask [Hkv, nq].
    """
    if k_cache.shape[1] != params.block_size:
        raise ValueError(f"KV page size {k_cache.shape[1]} != ffd block size {params.block_size}")
    out = torch.zeros_like(q)
    for b, length in enumerate(seq_lens.tolist()):
        if length == 0:
            if masks is not None:
                masks.append(torch.zeros(k_cache.shape[2], 0, dtype=torch.bool))
            continue
        nblk = length // params.block_size
        k, v, k2, khat = _seq_keys(k_cache, v_cache, qpages, block_tables[b], length, nblk, key_page_map)
        pos = torch.tensor([length - 1], device=q.device)
        o, keep, nq = attend_seq_ref(q[b:b + 1], pos, k, v, k2, khat, scale, params)
        out[b] = o[0].to(q.dtype)
        _count(stats, keep, nq, k.shape[1])
        if masks is not None:
            masks.append(keep[0, :, :int(nq[0])].cpu())
    return out


def ffd_prefill_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, qpages: QuantizedPages,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, *,
                    scale: float, params: FFDParams, max_scores: int = 1 << 24,
                    key_page_map: torch.Tensor | None = None) -> torch.Tensor:
    """Prefill chunks (the last q_len of seq_lens[b] tokens, K/V already stored and quantized)
    under the same per-query rule; queries go in groups so a group's scores stay <= max_scores."""
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    heads = q.shape[1]
    for b, length in enumerate(seq_lens.tolist()):
        q0, q1 = starts[b], starts[b + 1]
        if q1 == q0:
            continue
        nblk = length // params.block_size
        k, v, k2, khat = _seq_keys(k_cache, v_cache, qpages, block_tables[b], length, nblk, key_page_map)
        first = length - (q1 - q0)
        step = max(1, max_scores // (heads * length))
        for i in range(q0, q1, step):
            j = min(i + step, q1)
            pos = torch.arange(first + i - q0, first + j - q0, device=q.device)
            o, _, _ = attend_seq_ref(q[i:j], pos, k, v, k2, khat, scale, params)
            out[i:j] = o.to(q.dtype)
    return out


def dense_over_refined_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           qpages: QuantizedPages, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           *, scale: float, block_size: int, key_page_map: torch.Tensor | None = None
                           ) -> torch.Tensor:
    """Decode over refined keys of full blocks + the exact tail, nothing pruned (the δ = ∞ oracle),
    written independently of `attend_seq_ref` (float64)."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b, length in enumerate(seq_lens.tolist()):
        if length == 0:
            continue
        nblk = length // block_size
        k, v, _, khat = _seq_keys(k_cache, v_cache, qpages, block_tables[b], length, nblk, key_page_map)
        keys = torch.cat([khat.double(), k[nblk * block_size:].double()])
        g = q.shape[1] // k.shape[1]
        keys = keys.repeat_interleave(g, dim=1)
        vals = v.double().repeat_interleave(g, dim=1)
        p = torch.softmax(torch.einsum("hd,thd->ht", q[b].double(), keys) * scale, dim=-1)
        out[b] = torch.einsum("ht,thd->hd", p, vals)
    return out
