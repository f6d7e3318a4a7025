"""Fused element-wise kernels of a decoder layer: residual add + RMSNorm, the per-head q and k
RMSNorm (Qwen3) in one launch, SiLU-and-mul, RoPE, and RoPE + KV-cache store.

Each replaces several small torch launches by one, and matches the torch modules of
`engine/model/layers.py` numerically: low-precision values are rounded where torch rounds them (the
residual sum, the normalised activations before the weight, silu(gate) before the product), all
arithmetic in between runs in float32. The remaining differences are float32 ones (reduction order,
rsqrt/exp approximations, fused multiply-adds) that flip at most one last bit after rounding.
Low-precision values are only loaded, cast and stored, never computed on, so the kernels need no
interpreter upcast; the interpreter's float32 -> bf16 cast truncates, so CPU tests use float32.

Wrappers are graph-safe (grids depend only on shapes, no host sync), return new tensors and
accept rows with any stride as long as the last dimension is contiguous. `*_ref` are the torch
references, written like the modules they mirror.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.attention.kv_quant import check_scales, fp8_grid, is_fp8
from kernels.attention.kv_store import quantize_rows
from kernels.attention.reference import store_kv_ref

MAX_NORM_HIDDEN = 16384   # one row lives in registers; beyond this it would spill
SILU_BLOCK = 1024         # columns of the intermediate size per program


# ----- torch references -----------------------------------------------------------------------

def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def fused_add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    new_residual = x + residual
    return rms_norm_ref(new_residual, weight, eps), new_residual


def qk_rms_norm_ref(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                    q_eps: float, k_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    head_dim = q_weight.shape[0]
    return (rms_norm_ref(q.reshape(q.shape[0], -1, head_dim), q_weight, q_eps).reshape(q.shape[0], -1),
            rms_norm_ref(k.reshape(k.shape[0], -1, head_dim), k_weight, k_eps).reshape(k.shape[0], -1))


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary_embedding_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_cache: torch.Tensor,
                         sin_cache: torch.Tensor, head_dim: int, rotary_dim: int
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    cos = cos_cache[positions][:, None, :]
    sin = sin_cache[positions][:, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        heads = x.reshape(x.shape[0], -1, head_dim)
        x1, x2 = heads[..., :rotary_dim].float().chunk(2, dim=-1)
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
        return torch.cat((rotated, heads[..., rotary_dim:]), dim=-1).reshape(x.shape[0], -1)

    return rotate(q), rotate(k)


def rotary_embedding_and_store_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                   cos_cache: torch.Tensor, sin_cache: torch.Tensor, head_dim: int, rotary_dim: int,
                                   k_cache: torch.Tensor, v_cache: torch.Tensor,
                                   slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                                   v_scale: torch.Tensor | None = None) -> torch.Tensor:
    q, k = rotary_embedding_ref(positions, q, k, cos_cache, sin_cache, head_dim, rotary_dim)
    num_tokens, num_kv_heads = k.shape[0], k.shape[1] // head_dim
    store_kv_ref(k.view(num_tokens, num_kv_heads, head_dim), v.reshape(num_tokens, num_kv_heads, head_dim),
                 k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)
    return q


# ----- RMSNorm ---------------------------------------------------------------------------------

@triton.jit
def _rms_norm_kernel(X, RES, W, OUT, RES_OUT, stride_x, stride_r, stride_o, stride_ro, hidden, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(RES + row * stride_r + cols, mask=mask, other=0.0)
        # Rounded to the input dtype, as torch's `x + residual`, before the norm reads it.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(RES_OUT.dtype.element_ty)
        tl.store(RES_OUT + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, 0) / hidden + eps)
    # Rounded to the input dtype before the weight multiplies, as transformers does.
    normed = (xf * rstd).to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + row * stride_o + cols, (w * normed).to(OUT.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor, what: str) -> torch.Tensor:
    """x[..., N] as rows [R, N] without a copy when the layout allows; last dim contiguous."""
    if x.dim() == 0 or x.stride(-1) != 1:
        raise ValueError(f"{what} needs a contiguous last dimension; got shape {tuple(x.shape)}, "
                         f"strides {x.stride()}")
    return x.reshape(-1, x.shape[-1])


def _norm_warps(block: int) -> int:
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


def _launch_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    hidden = x.shape[-1] if x.dim() else 0
    if weight.shape != (hidden,) or weight.stride(0) != 1:
        raise ValueError(f"rms_norm: weight shape {tuple(weight.shape)} (strides {weight.stride()}) is not a "
                         f"contiguous (hidden,) = ({hidden},)")
    if not 0 < hidden <= MAX_NORM_HIDDEN:
        raise ValueError(f"rms_norm: hidden size {hidden} outside (0, {MAX_NORM_HIDDEN}]")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"fused_add_rms_norm: residual {tuple(residual.shape)} {residual.dtype} does not "
                         f"match x {tuple(x.shape)} {x.dtype}")
    x2 = _rows(x, "rms_norm x")
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    res_out = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else None
    rows = x2.shape[0]
    if rows:
        r2 = _rows(residual, "fused_add_rms_norm residual") if residual is not None else x2
        ro2 = res_out.view(-1, hidden) if res_out is not None else x2
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(rows,)](
            x2, r2, weight, out, ro2, x2.stride(0), r2.stride(0), hidden, ro2.stride(0), hidden, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=_norm_warps(block))
    return out, res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x[..., H] -> weight * (x / rms(x)).to(x.dtype), one program per row."""
    return _launch_rms_norm(x, None, weight, eps)[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one pass; the inputs are left untouched."""
    out, res_out = _launch_rms_norm(x, residual, weight, eps)
    assert res_out is not None
    return out, res_out


# ----- per-head q and k RMSNorm ------------------------------------------------------------------

@triton.jit
def _norm_heads(X_ROW, OUT_ROW, W, h0, num_heads, eps, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                BLOCK_D: tl.constexpr):
    """Heads [h0, h0 + BLOCK_H) of one token row, each normalised over its HEAD_DIM features as
    `_rms_norm_kernel` normalises a row."""
    heads = h0 + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (heads < num_heads)[:, None] & (d < HEAD_DIM)[None, :]
    offs = heads[:, None] * HEAD_DIM + d[None, :]
    x = tl.load(X_ROW + offs, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, 1) / HEAD_DIM + eps)
    normed = (xf * rstd[:, None]).to(X_ROW.dtype.element_ty).to(tl.float32)
    w = tl.load(W + d, mask=d < HEAD_DIM, other=0.0).to(tl.float32)
    tl.store(OUT_ROW + offs, (w[None, :] * normed).to(OUT_ROW.dtype.element_ty), mask=mask)


@triton.jit
def _qk_norm_kernel(Q, K, QW, KW, Q_OUT, K_OUT, stride_q, stride_k, num_q_heads, num_k_heads, q_blocks,
                    q_eps, k_eps, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    # Program blocks [0, q_blocks) cover the query heads, the rest the key heads: one launch.
    if hb < q_blocks:
        _norm_heads(Q + t * stride_q, Q_OUT + t * num_q_heads * HEAD_DIM, QW, hb * BLOCK_H, num_q_heads, q_eps,
                    HEAD_DIM, BLOCK_H, BLOCK_D)
    else:
        _norm_heads(K + t * stride_k, K_OUT + t * num_k_heads * HEAD_DIM, KW, (hb - q_blocks) * BLOCK_H,
                    num_k_heads, k_eps, HEAD_DIM, BLOCK_H, BLOCK_D)


def qk_rms_norm(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                q_eps: float, k_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq*D], k [T, Hkv*D] (rows of any stride, e.g. views into the qkv output) -> new
    contiguous (q, k), each head RMS-normalised with the (D,) weight of its kind; grid (token,
    head block) over the q heads then the k heads."""
    head_dim = q_weight.shape[0] if q_weight.dim() == 1 else 0
    for name, x in (("q", q), ("k", k)):
        if x.dim() != 2 or x.shape[0] != q.shape[0] or not head_dim or x.shape[1] % head_dim or x.stride(1) != 1:
            raise ValueError(f"qk_rms_norm: {name} must be [T, heads*{head_dim}] with a contiguous last dimension; "
                             f"got shape {tuple(x.shape)}, strides {x.stride()}")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w.shape != (head_dim,) or w.stride(0) != 1:
            raise ValueError(f"qk_rms_norm: {name} must be a contiguous ({head_dim},); got {tuple(w.shape)}")
    q_out = torch.empty(q.shape, dtype=torch.promote_types(q_weight.dtype, q.dtype), device=q.device)
    k_out = torch.empty(k.shape, dtype=torch.promote_types(k_weight.dtype, k.dtype), device=k.device)
    num_tokens = q.shape[0]
    num_q_heads, num_k_heads = q.shape[1] // head_dim, k.shape[1] // head_dim
    if num_tokens == 0 or num_q_heads + num_k_heads == 0:
        return q_out, k_out
    block_d = triton.next_power_of_2(head_dim)
    block_h = _head_block(num_k_heads, block_d // 2)
    q_blocks = triton.cdiv(num_q_heads, block_h)
    _qk_norm_kernel[(num_tokens, q_blocks + triton.cdiv(num_k_heads, block_h))](
        q, k, q_weight, k_weight, q_out, k_out, q.stride(0), k.stride(0), num_q_heads, num_k_heads, q_blocks,
        q_eps, k_eps, HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4)
    return q_out, k_out


# ----- SiLU and mul ----------------------------------------------------------------------------

@triton.jit
def _silu_and_mul_kernel(X, OUT, stride_x, stride_o, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    # Rounded to the input dtype before the product, as torch's F.silu(gate) * up.
    act = (gate / (1.0 + tl.exp(-gate))).to(OUT.dtype.element_ty).to(tl.float32)
    tl.store(OUT + row * stride_o + cols, (act * up).to(OUT.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x[..., 2I] (gate then up) -> silu(gate) * up, [..., I]; grid (row, column block)."""
    x2 = _rows(x, "silu_and_mul x")
    if x2.shape[-1] % 2:
        raise ValueError(f"silu_and_mul: last dimension {x2.shape[-1]} is not 2 * intermediate size")
    inter = x2.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    if x2.shape[0] and inter:
        block = min(SILU_BLOCK, triton.next_power_of_2(inter))
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](
            x2, out, x2.stride(0), inter, inter, BLOCK=block, num_warps=4)
    return out


# ----- rotary embedding ------------------------------------------------------------------------

@triton.jit
def _row_values(x, X_ROW, OUT_ROW, SCALE, heads, h_ok, QUANT: tl.constexpr, LIMIT: tl.constexpr,
                EMIN: tl.constexpr, MBITS: tl.constexpr):
    """x in OUT_ROW's dtype; FP8 codes (`quantize_rows`) of x rounded to X_ROW's dtype first, the
    values the unfused RoPE would hand the KV store."""
    if QUANT:
        return quantize_rows(x.to(X_ROW.dtype.element_ty), SCALE, heads, h_ok, LIMIT, EMIN, MBITS,
                             OUT_ROW.dtype.element_ty)
    return x.to(OUT_ROW.dtype.element_ty)


@triton.jit
def _rotate_heads(X_ROW, OUT_ROW, h0, num_heads, stride_xh, stride_oh, cos, sin,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
                  PASS: tl.constexpr, BLOCK_PASS: tl.constexpr, SCALE=None, QUANT: tl.constexpr = False,
                  LIMIT: tl.constexpr = 0.0, EMIN: tl.constexpr = 0, MBITS: tl.constexpr = 0):
    """Heads [h0, h0 + BLOCK_H) of one token row: GPT-NeoX rotation of the first 2*HALF features
    in float32, the other PASS features copied bit for bit (QUANT: written as FP8 codes of the
    heads' SCALE instead)."""
    heads = h0 + tl.arange(0, BLOCK_H)
    h_ok = heads < num_heads
    d = tl.arange(0, BLOCK_HALF)
    mask = h_ok[:, None] & (d < HALF)[None, :]
    src = X_ROW + heads[:, None] * stride_xh + d[None, :]
    dst = OUT_ROW + heads[:, None] * stride_oh + d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst, _row_values(x1 * cos - x2 * sin, X_ROW, OUT_ROW, SCALE, heads, h_ok, QUANT, LIMIT, EMIN, MBITS),
             mask=mask)
    tl.store(dst + HALF, _row_values(x2 * cos + x1 * sin, X_ROW, OUT_ROW, SCALE, heads, h_ok, QUANT, LIMIT, EMIN,
                                     MBITS), mask=mask)
    if PASS > 0:
        p = tl.arange(0, BLOCK_PASS)
        pmask = h_ok[:, None] & (p < PASS)[None, :]
        rest = 2 * HALF + p[None, :]
        kept = tl.load(X_ROW + heads[:, None] * stride_xh + rest, mask=pmask)
        if QUANT:
            kept = quantize_rows(kept, SCALE, heads, h_ok, LIMIT, EMIN, MBITS, OUT_ROW.dtype.element_ty)
        tl.store(OUT_ROW + heads[:, None] * stride_oh + rest, kept, mask=pmask)


@triton.jit
def _cos_sin(POS, COS, SIN, t, stride_c, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    pos = tl.load(POS + t).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    cos = tl.load(COS + pos * stride_c + d, mask=d < HALF, other=0.0)[None, :]
    sin = tl.load(SIN + pos * stride_c + d, mask=d < HALF, other=0.0)[None, :]
    return cos, sin


@triton.jit
def _rotary_kernel(POS, Q, K, Q_OUT, K_OUT, COS, SIN, stride_q, stride_k, stride_qo, stride_ko, stride_c,
                   num_q_heads, num_k_heads, q_blocks,
                   HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                   BLOCK_HALF: tl.constexpr, PASS: tl.constexpr, BLOCK_PASS: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    cos, sin = _cos_sin(POS, COS, SIN, t, stride_c, HALF, BLOCK_HALF)
    # Program blocks [0, q_blocks) cover the query heads, the rest the key heads: one launch.
    if hb < q_blocks:
        _rotate_heads(Q + t * stride_q, Q_OUT + t * stride_qo, hb * BLOCK_H, num_q_heads, HEAD_DIM, HEAD_DIM,
                      cos, sin, HALF, BLOCK_H, BLOCK_HALF, PASS, BLOCK_PASS)
    else:
        _rotate_heads(K + t * stride_k, K_OUT + t * stride_ko, (hb - q_blocks) * BLOCK_H, num_k_heads, HEAD_DIM,
                      HEAD_DIM, cos, sin, HALF, BLOCK_H, BLOCK_HALF, PASS, BLOCK_PASS)


@triton.jit
def _rotary_store_kernel(POS, Q, K, V, Q_OUT, K_CACHE, V_CACHE, SLOTS, COS, SIN, K_SCALE, V_SCALE,
                         stride_q, stride_k, stride_v, stride_qo, stride_c, stride_cb, stride_ct, stride_ch,
                         num_q_heads, num_kv_heads, q_blocks, kv_blocks,
                         PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                         BLOCK_HALF: tl.constexpr, PASS: tl.constexpr, BLOCK_PASS: tl.constexpr,
                         BLOCK_D: tl.constexpr, QUANT: tl.constexpr, LIMIT: tl.constexpr, EMIN: tl.constexpr,
                         MBITS: tl.constexpr):
    """Blocks [0, q_blocks): rotate q heads; then k heads, rotated straight into the cache row of
    the token's slot; then v heads, copied there (slot -1: padding, nothing stored). QUANT: the
    caches are FP8 and k / v are stored as codes of their heads' K_SCALE / V_SCALE."""
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    if hb < q_blocks:
        cos, sin = _cos_sin(POS, COS, SIN, t, stride_c, HALF, BLOCK_HALF)
        _rotate_heads(Q + t * stride_q, Q_OUT + t * stride_qo, hb * BLOCK_H, num_q_heads, HEAD_DIM, HEAD_DIM,
                      cos, sin, HALF, BLOCK_H, BLOCK_HALF, PASS, BLOCK_PASS)
    else:
        slot = tl.load(SLOTS + t).to(tl.int64)
        if slot >= 0:
            row = (slot // PAGE) * stride_cb + (slot % PAGE) * stride_ct
            if hb < q_blocks + kv_blocks:
                cos, sin = _cos_sin(POS, COS, SIN, t, stride_c, HALF, BLOCK_HALF)
                _rotate_heads(K + t * stride_k, K_CACHE + row, (hb - q_blocks) * BLOCK_H, num_kv_heads, HEAD_DIM,
                              stride_ch, cos, sin, HALF, BLOCK_H, BLOCK_HALF, PASS, BLOCK_PASS, K_SCALE, QUANT,
                              LIMIT, EMIN, MBITS)
            else:
                heads = (hb - q_blocks - kv_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
                d = tl.arange(0, BLOCK_D)
                mask = (heads < num_kv_heads)[:, None] & (d < HEAD_DIM)[None, :]
                val = tl.load(V + t * stride_v + heads[:, None] * HEAD_DIM + d[None, :], mask=mask)
                if QUANT:
                    val = quantize_rows(val, V_SCALE, heads, heads < num_kv_heads, LIMIT, EMIN, MBITS,
                                        V_CACHE.dtype.element_ty)
                tl.store(V_CACHE + row + heads[:, None] * stride_ch + d[None, :],
                         val.to(V_CACHE.dtype.element_ty), mask=mask)


def _check_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_cache: torch.Tensor,
                  sin_cache: torch.Tensor, head_dim: int, rotary_dim: int) -> None:
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"rotary_embedding: rotary_dim {rotary_dim} must be even and in (0, head_dim={head_dim}]")
    for name, x in (("q", q), ("k", k)):
        if x.dim() != 2 or x.shape[0] != positions.shape[0] or x.shape[1] % head_dim or x.stride(1) != 1:
            raise ValueError(f"rotary_embedding: {name} must be [T, heads*{head_dim}] with a contiguous last "
                             f"dimension and T = {positions.shape[0]} (positions); got shape {tuple(x.shape)}, "
                             f"strides {x.stride()}")
    if positions.dim() != 1:
        raise ValueError(f"rotary_embedding: positions must be [T]; got shape {tuple(positions.shape)}")
    for name, c in (("cos_cache", cos_cache), ("sin_cache", sin_cache)):
        if c.dim() != 2 or c.shape[1] != rotary_dim // 2 or c.stride(1) != 1 or c.dtype != torch.float32:
            raise ValueError(f"rotary_embedding: {name} must be float32 [max_position, {rotary_dim // 2}] "
                             f"with a contiguous last dimension; got {c.dtype} {tuple(c.shape)}")
    if cos_cache.stride() != sin_cache.stride():
        raise ValueError("rotary_embedding: cos_cache and sin_cache must share strides")


def _head_block(num_kv_heads: int, half: int) -> int:
    """Heads per program: sized to the KV heads (capped at ~1K rotated pairs), so k is one program
    and q a few: a decode token spreads over several SMs with no idle rows."""
    return min(triton.next_power_of_2(max(num_kv_heads, 1)), max(1, 1024 // triton.next_power_of_2(half)))


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_cache: torch.Tensor,
                     sin_cache: torch.Tensor, head_dim: int, rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """positions[T]; q[T, Hq*D], k[T, Hkv*D] -> new contiguous (q, k), GPT-NeoX RoPE of the first
    rotary_dim features of each head with cos/sin[max_position, rotary_dim/2] float32.

    Grid (token, head block): one launch covers the q and the k heads.
    """
    _check_rotary(positions, q, k, cos_cache, sin_cache, head_dim, rotary_dim)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    num_tokens = positions.shape[0]
    num_q_heads, num_k_heads = q.shape[1] // head_dim, k.shape[1] // head_dim
    if num_tokens == 0 or num_q_heads + num_k_heads == 0:
        return q_out, k_out
    half, rest = rotary_dim // 2, head_dim - rotary_dim
    block_h = _head_block(num_k_heads, half)
    q_blocks = triton.cdiv(num_q_heads, block_h)
    _rotary_kernel[(num_tokens, q_blocks + triton.cdiv(num_k_heads, block_h))](
        positions, q, k, q_out, k_out, cos_cache, sin_cache,
        q.stride(0), k.stride(0), q_out.stride(0), k_out.stride(0), cos_cache.stride(0),
        num_q_heads, num_k_heads, q_blocks,
        HEAD_DIM=head_dim, HALF=half, BLOCK_H=block_h, BLOCK_HALF=triton.next_power_of_2(half),
        PASS=rest, BLOCK_PASS=triton.next_power_of_2(max(rest, 1)), num_warps=4)
    return q_out, k_out


def rotary_embedding_and_store(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               cos_cache: torch.Tensor, sin_cache: torch.Tensor, head_dim: int, rotary_dim: int,
                               k_cache: torch.Tensor, v_cache: torch.Tensor,
                               slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                               v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """`rotary_embedding` and `kernels.store_kv` in one launch: returns the rotated q; the rotated
    k and v[T, Hkv*D] go straight into caches[num_blocks, block_size, Hkv, D] at slot_mapping[T]
    (-1 skips). k never exists rotated outside the cache. The caches must have k's dtype (the
    unfused path rounds the rotated k to k's dtype before the store casts it), or be FP8 with
    their per-head `k_scale` / `v_scale` (the rotated k is rounded to k's dtype, then quantized)."""
    _check_rotary(positions, q, k, cos_cache, sin_cache, head_dim, rotary_dim)
    check_scales(k_cache, k_scale, "rotary_embedding_and_store")
    check_scales(v_cache, v_scale, "rotary_embedding_and_store")
    quant = is_fp8(k_cache.dtype)
    cache_dtype = k_cache.dtype if quant else k.dtype
    num_tokens = positions.shape[0]
    num_q_heads, num_kv_heads = q.shape[1] // head_dim, k.shape[1] // head_dim
    if (v.shape != k.shape or v.stride(1) != 1 or k_cache.stride() != v_cache.stride()
            or k_cache.shape[2:] != (num_kv_heads, head_dim) or k_cache.stride(3) != 1
            or k_cache.dtype != cache_dtype or v_cache.dtype != cache_dtype or slot_mapping.shape != (num_tokens,)):
        raise ValueError(f"rotary_embedding_and_store: v must be shaped like k {tuple(k.shape)}, the caches "
                         f"[blocks, page, {num_kv_heads}, {head_dim}] of k's dtype {k.dtype} (or both of one FP8 "
                         f"dtype) with shared strides, "
                         f"slot_mapping [{num_tokens}]; got v {tuple(v.shape)}, caches {tuple(k_cache.shape)} "
                         f"{k_cache.dtype}/{v_cache.dtype}, slot_mapping {tuple(slot_mapping.shape)}")
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_out
    half, rest = rotary_dim // 2, head_dim - rotary_dim
    block_h = _head_block(num_kv_heads, half)
    q_blocks, kv_blocks = triton.cdiv(num_q_heads, block_h), triton.cdiv(num_kv_heads, block_h)
    _rotary_store_kernel[(num_tokens, q_blocks + 2 * kv_blocks)](
        positions, q, k, v, q_out, k_cache, v_cache, slot_mapping, cos_cache, sin_cache,
        slot_mapping if k_scale is None else k_scale, slot_mapping if v_scale is None else v_scale,
        q.stride(0), k.stride(0), v.stride(0), q_out.stride(0), cos_cache.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        num_q_heads, num_kv_heads, q_blocks, kv_blocks,
        PAGE=k_cache.shape[1], HEAD_DIM=head_dim, HALF=half, BLOCK_H=block_h,
        BLOCK_HALF=triton.next_power_of_2(half), PASS=rest, BLOCK_PASS=triton.next_power_of_2(max(rest, 1)),
        BLOCK_D=triton.next_power_of_2(head_dim), QUANT=quant, **fp8_grid(k_cache.dtype), num_warps=4)
    return q_out
