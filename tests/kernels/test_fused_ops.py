"""Fused RMSNorm / SiLU-and-mul / RoPE (and RoPE + KV store) kernels against their torch references and the modules.

float32 tests run under Triton's interpreter without a GPU (on a GPU, compiled). The bf16/fp16
tests need a GPU and compare with the same torch code on it: both round at the same points, so
they differ only by float32 effects (rsqrt/exp approximations, reduction order, FMA). After
rounding such an effect moves a value by one ulp, or by two where that value was a rounded factor
of a product (silu(gate) * up, normed * weight); under cancellation in RoPE's x1*cos - x2*sin it
stays at float32 size in absolute terms. Measured on an H200: bf16 norm and SiLU bit-exact, RoPE
0.002 % of elements off; fp16 up to 0.2 % of elements off, at most 2 ulps.
"""
from __future__ import annotations

import pytest
import torch

from engine.model.layers import RMSNorm, RotaryEmbedding, SiluAndMul
from kernels import fused

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm device")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# float32, relative: the interpreter differs from torch only by reduction order (~8 ulp); on a GPU
# also by rsqrt/exp approximations, which grow with |gate| in exp(-gate).
TOL32 = 1e-6 if DEVICE == "cpu" else 1e-5
LOW_DTYPES = [torch.bfloat16, torch.float16]


def randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32, device: str = DEVICE) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)


def assert_close(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    """|got - want| <= tol * (1 + |want|) everywhere: tol absolute near 0, relative elsewhere."""
    assert got.shape == want.shape and got.dtype == want.dtype, \
        f"{what}: {got.shape} {got.dtype} vs {want.shape} {want.dtype}"
    diff = (got.double() - want.double()).abs()
    worst = (diff / (1 + want.double().abs())).max().item()
    assert worst <= tol, f"{what}: max abs error {diff.max().item():.3g}, scaled {worst:.3g} > {tol:.3g}"


def assert_within_ulps(got: torch.Tensor, want: torch.Tensor, ulps: int, what: str, atol: float = 0.0) -> None:
    """|got - want| <= ulps ulps of want's dtype at |want|, plus atol."""
    assert got.shape == want.shape and got.dtype == want.dtype
    ulp = torch.finfo(want.dtype).eps * want.double().abs().clamp_min(torch.finfo(want.dtype).tiny)
    diff = (got.double() - want.double()).abs()
    worst = ((diff - atol).clamp_min(0) / ulp).max().item()
    differ = (diff > 0).double().mean().item()
    assert worst <= ulps, (f"{what}: {worst:.2f} ulps off beyond atol {atol:g} (max abs error "
                           f"{diff.max().item():.3g}, {differ:.3%} of elements differ)")


def make_norm(hidden: int, dtype: torch.dtype = torch.float32, device: str = DEVICE) -> RMSNorm:
    norm = RMSNorm(hidden, eps=1e-5, dtype=dtype).to(device)
    norm.weight.data.copy_(randn(hidden, seed=7) * 0.5 + 1.0)
    return norm


# ----- float32 (the interpreter on CPU) ----------------------------------------------------------------

@pytest.mark.parametrize("tokens", [1, 3, 17])
@pytest.mark.parametrize("hidden", [96, 576])
def test_rms_norm(tokens: int, hidden: int) -> None:
    norm = make_norm(hidden)
    x = randn(tokens, hidden, seed=tokens + hidden) * 3.0
    res = randn(tokens, hidden, seed=tokens + hidden + 1)
    x_before, res_before = x.clone(), res.clone()

    got = fused.rms_norm(x, norm.weight, norm.eps)
    assert_close(got, fused.rms_norm_ref(x, norm.weight, norm.eps), TOL32, "rms_norm vs reference")
    assert_close(got, norm(x), TOL32, "rms_norm vs RMSNorm")

    got, got_res = fused.fused_add_rms_norm(x, res, norm.weight, norm.eps)
    want, want_res = norm(x, res)
    assert torch.equal(got_res, want_res), "new residual must be exactly x + residual"
    want_ref = fused.fused_add_rms_norm_ref(x, res, norm.weight, norm.eps)[0]
    assert_close(got, want_ref, TOL32, "fused_add_rms_norm vs reference")
    assert_close(got, want, TOL32, "fused_add_rms_norm vs RMSNorm")
    assert torch.equal(x, x_before) and torch.equal(res, res_before), "inputs must be left untouched"


def test_rms_norm_strided_rows_and_heads() -> None:
    """Qwen3's q_norm: per-head norm over a [T, H, D] view of the fused qkv output."""
    tokens, heads, head_dim = 5, 3, 64
    qkv = randn(tokens, heads * head_dim + 40, seed=3)
    q = qkv[:, :heads * head_dim].reshape(tokens, heads, head_dim)
    norm = make_norm(head_dim)
    assert_close(fused.rms_norm(q, norm.weight, norm.eps), norm(q), TOL32, "per-head rms_norm")
    x, res = qkv[:, 40:], randn(tokens, heads * head_dim, seed=4)
    got, got_res = fused.fused_add_rms_norm(x, res, make_norm(heads * head_dim).weight, 1e-5)
    want, want_res = make_norm(heads * head_dim)(x, res)
    assert_close(got, want, TOL32, "fused_add_rms_norm on a strided x")
    assert torch.equal(got_res, want_res)


def qk_norm_oracle(x: torch.Tensor, weight: torch.Tensor, eps: float, head_dim: int) -> torch.Tensor:
    """The per-head RMSNorm written out in float64."""
    heads = x.double().reshape(x.shape[0], -1, head_dim)
    normed = heads / (heads.pow(2).mean(-1, keepdim=True) + eps).sqrt()
    return (normed * weight.double()).reshape(x.shape[0], -1)


@pytest.mark.parametrize("tokens", [1, 3, 17])
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 4, 2), (48, 5, 3), (128, 32, 4), (32, 7, 1)])
def test_qk_rms_norm(tokens: int, head_dim: int, heads: int, kv_heads: int) -> None:
    """Qwen3's q and k norms in one launch, read straight from views of the fused qkv output."""
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, seed=tokens * head_dim + heads) * 3.0
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q_norm, k_norm = make_norm(head_dim), RMSNorm(head_dim, eps=1e-6).to(DEVICE)
    k_norm.weight.data.copy_(randn(head_dim, seed=8) * 0.3 + 1.0)
    qkv_before = qkv.clone()
    got_q, got_k = fused.qk_rms_norm(q, k, q_norm.weight, k_norm.weight, q_norm.eps, k_norm.eps)
    assert got_q.is_contiguous() and got_k.is_contiguous()
    ref_q, ref_k = fused.qk_rms_norm_ref(q, k, q_norm.weight, k_norm.weight, q_norm.eps, k_norm.eps)
    for got, ref, x, norm, name in ((got_q, ref_q, q, q_norm, "q"), (got_k, ref_k, k, k_norm, "k")):
        assert_close(got, ref, TOL32, f"qk_rms_norm {name} vs reference")
        want = norm(x.reshape(tokens, -1, head_dim)).reshape(tokens, -1)
        assert_close(got, want, TOL32, f"qk_rms_norm {name} vs RMSNorm")
        oracle = qk_norm_oracle(x, norm.weight, norm.eps, head_dim)
        err = float((got.double() - oracle).norm() / oracle.norm())
        assert err < 1e-6, f"qk_rms_norm {name}: relative error {err:.2e} against float64"
    assert torch.equal(qkv, qkv_before), "the qkv output must be left untouched"


def test_qk_rms_norm_rejects_bad_shapes() -> None:
    w = torch.ones(64)
    with pytest.raises(ValueError, match="q must be"):
        fused.qk_rms_norm(torch.randn(3, 100), torch.randn(3, 64), w, w, 1e-6, 1e-6)
    with pytest.raises(ValueError, match="k must be"):
        fused.qk_rms_norm(torch.randn(3, 128), torch.randn(2, 64), w, w, 1e-6, 1e-6)
    with pytest.raises(ValueError, match="k_weight"):
        fused.qk_rms_norm(torch.randn(3, 128), torch.randn(3, 64), w, torch.ones(32), 1e-6, 1e-6)


@pytest.mark.parametrize("tokens", [1, 3, 17])
@pytest.mark.parametrize("inter", [96, 1100])   # 1100: two column blocks, the second partial
def test_silu_and_mul(tokens: int, inter: int) -> None:
    wide = randn(tokens, 2 * inter + 8, seed=tokens * inter) * 4.0
    x = wide[:, 8:]   # rows with a stride other than 2I
    got = fused.silu_and_mul(x)
    assert_close(got, fused.silu_and_mul_ref(x), TOL32, "silu_and_mul vs reference")
    assert_close(got, SiluAndMul()(x), TOL32, "silu_and_mul vs SiluAndMul")


ROPE_CASES = [  # head_dim, rotary_dim, q heads, kv heads
    (64, 64, 4, 2),
    (128, 128, 6, 2),
    (64, 32, 3, 3),     # partial rotary, non-power-of-two head counts
    (128, 96, 4, 1),    # partial rotary with a non-power-of-two half (48)
]


@pytest.mark.parametrize("tokens", [1, 3, 17])
@pytest.mark.parametrize("head_dim,rotary_dim,heads,kv_heads", ROPE_CASES)
def test_rotary_embedding(tokens: int, head_dim: int, rotary_dim: int, heads: int, kv_heads: int) -> None:
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    rope = RotaryEmbedding(head_dim, rotary_dim, max_position=512, base=10000.0, scaling=scaling).to(DEVICE)
    positions = (torch.randperm(400, generator=torch.Generator().manual_seed(tokens))[:tokens] + 37).to(DEVICE)
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, seed=tokens + head_dim)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q_before, k_before = q.clone(), k.clone()

    got_q, got_k = fused.rotary_embedding(positions, q, k, rope.cos_cache, rope.sin_cache, head_dim, rotary_dim)
    ref_q, ref_k = fused.rotary_embedding_ref(positions, q, k, rope.cos_cache, rope.sin_cache, head_dim, rotary_dim)
    mod_q, mod_k = rope(positions, q, k)
    for got, ref, mod, name in ((got_q, ref_q, mod_q, "q"), (got_k, ref_k, mod_k, "k")):
        assert_close(got, ref, TOL32, f"rope {name} vs reference")
        assert_close(got, mod, TOL32, f"rope {name} vs RotaryEmbedding")
    assert not torch.equal(got_q, q), "rotation must change q"
    # Pass-through features are copied bit for bit.
    tail = slice(rotary_dim, head_dim)
    assert torch.equal(got_q.view(tokens, heads, head_dim)[..., tail], q.reshape(tokens, heads, head_dim)[..., tail])
    assert torch.equal(q, q_before) and torch.equal(k, k_before)


@pytest.mark.parametrize("tokens", [1, 2, 5])
@pytest.mark.parametrize("head_dim,rotary_dim,heads,kv_heads", ROPE_CASES)
def test_rotary_embedding_and_store(tokens: int, head_dim: int, rotary_dim: int, heads: int, kv_heads: int) -> None:
    """One launch = RoPE then the KV store: the same q, the same cache bytes (rotated k, v), padding
    slots (-1) and untouched cache rows left alone; q/k/v are strided slices of one qkv row."""
    rope = RotaryEmbedding(head_dim, rotary_dim, max_position=512, base=10000.0).to(DEVICE)
    positions = (torch.randperm(400, generator=torch.Generator().manual_seed(tokens))[:tokens] + 3).to(DEVICE)
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, seed=tokens + 7 * head_dim)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    page = 4
    slots = torch.randperm(6 * page, generator=torch.Generator().manual_seed(tokens))[:tokens].to(DEVICE)
    slots[0] = -1   # a padding row of a CUDA-graph batch
    caches = [randn(6, page, kv_heads, head_dim, seed=s) for s in (1, 2)]
    want_caches = [c.clone() for c in caches]

    got_q = fused.rotary_embedding_and_store(positions, q, k, v, rope.cos_cache, rope.sin_cache, head_dim,
                                             rotary_dim, caches[0], caches[1], slots)
    want_q = fused.rotary_embedding_and_store_ref(positions, q, k, v, rope.cos_cache, rope.sin_cache, head_dim,
                                                  rotary_dim, want_caches[0], want_caches[1], slots)
    assert_close(got_q, want_q, TOL32, "rope+store q vs reference")
    assert_close(caches[0], want_caches[0], TOL32, "rope+store k cache vs reference")
    assert torch.equal(caches[1], want_caches[1]), "v is copied bit for bit"
    unfused_q, unfused_k = rope(positions, q, k)
    written = slots[slots >= 0]
    flat_k = caches[0].view(-1, kv_heads * head_dim)
    if written.numel():
        assert_close(flat_k[written], unfused_k[slots >= 0], TOL32, "cached k vs RotaryEmbedding")
    assert_close(got_q, unfused_q, TOL32, "q vs RotaryEmbedding")
    untouched = torch.ones(6 * page, dtype=torch.bool, device=DEVICE)
    untouched[written] = False
    fresh = randn(6, page, kv_heads, head_dim, seed=1).view(-1, kv_heads * head_dim)
    assert torch.equal(flat_k[untouched], fresh[untouched]), "rows of other slots are never written"


@gpu
@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_rotary_embedding_and_store_low_precision_equals_the_two_launches(dtype: torch.dtype) -> None:
    """Llama-3.1-8B heads: the fused launch writes the bytes RoPE + store_kv write (same rounding)."""
    from kernels import store_kv
    rope = RotaryEmbedding(128, 128, max_position=4096, base=500000.0).to(DEVICE)
    tokens, heads, kv_heads = 7, 32, 8
    positions = torch.tensor([0, 1, 17, 1000, 2047, 3000, 4095], device=DEVICE)
    qkv = randn(tokens, (heads + 2 * kv_heads) * 128, seed=3, dtype=dtype)
    q, k, v = qkv.split([heads * 128, kv_heads * 128, kv_heads * 128], dim=-1)
    slots = torch.tensor([5, -1, 16, 17, 40, 2, 63], device=DEVICE)
    fused_caches = [torch.zeros(4, 16, kv_heads, 128, dtype=dtype, device=DEVICE) for _ in range(2)]
    split_caches = [c.clone() for c in fused_caches]
    got_q = rope.rotate_and_store(positions, q, k, v, *fused_caches, slots)
    want_q, want_k = fused.rotary_embedding(positions, q, k, rope.cos_cache, rope.sin_cache, 128, 128)
    store_kv(want_k.view(tokens, kv_heads, 128), v.reshape(tokens, kv_heads, 128), *split_caches, slots)
    assert torch.equal(got_q, want_q)
    assert torch.equal(fused_caches[0], split_caches[0]) and torch.equal(fused_caches[1], split_caches[1])


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("head_dim,rotary_dim", [(64, 64), (64, 32)])
def test_rotary_embedding_and_store_writes_fp8_codes(kv_dtype: torch.dtype, head_dim: int, rotary_dim: int) -> None:
    """FP8 caches: the fused launch stores the codes that RoPE, then the KV store, store (the rotated k
    rounded to k's dtype, then quantized with its head's scale; v quantized), partial rotary included."""
    from kernels.attention.kv_quant import fp8_max
    rope = RotaryEmbedding(head_dim, rotary_dim, max_position=512, base=10000.0).to(DEVICE)
    tokens, heads, kv_heads, page = 6, 6, 3, 4
    positions = torch.tensor([0, 3, 17, 100, 255, 511], device=DEVICE)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32    # the interpreter mis-computes bf16
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, seed=11, dtype=dtype) * 30   # some values saturate
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    k_scale = torch.tensor([0.02, 0.05, 0.1], device=DEVICE) * 448 / fp8_max(kv_dtype)
    v_scale = torch.tensor([0.03, 0.01, 0.2], device=DEVICE) * 448 / fp8_max(kv_dtype)
    slots = torch.tensor([5, -1, 16, 17, 2, 23], device=DEVICE)
    caches = [torch.zeros(6, page, kv_heads, head_dim, device=DEVICE).to(kv_dtype) for _ in range(2)]
    want = [c.clone() for c in caches]
    got_q = fused.rotary_embedding_and_store(positions, q, k, v, rope.cos_cache, rope.sin_cache, head_dim, rotary_dim,
                                             caches[0], caches[1], slots, k_scale, v_scale)
    want_q = fused.rotary_embedding_and_store_ref(positions, q, k, v, rope.cos_cache, rope.sin_cache, head_dim,
                                                  rotary_dim, want[0], want[1], slots, k_scale, v_scale)
    assert_close(got_q, want_q, TOL32 if dtype == torch.float32 else 1e-2, "rope+store q vs reference")
    step = 2.0 ** -(3 if kv_dtype == torch.float8_e4m3fn else 2)
    for got, ref in zip(caches, want, strict=True):
        got, ref = got.float(), ref.float()
        # the same codes but where the two rotations' last bit puts a value on the other side of a
        # rounding edge: then one step apart (and a tiny negative may be +0 where torch has -0)
        assert (got == ref).float().mean() >= 0.99 and ref.abs().sum() > 0
        assert ((got - ref).abs() <= step * ref.abs() + 1e-6).all()
    with pytest.raises(ValueError, match="scale per KV head"):
        fused.rotary_embedding_and_store(positions, q, k, v, rope.cos_cache, rope.sin_cache, head_dim, rotary_dim,
                                         caches[0], caches[1], slots)


def test_rotary_embedding_and_store_refuses_a_cache_of_another_dtype() -> None:
    rope = RotaryEmbedding(64, 64, 16, 10000.0)
    pos = torch.arange(2)
    cache = torch.zeros(2, 4, 1, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="caches"):
        fused.rotary_embedding_and_store(pos, torch.randn(2, 64), torch.randn(2, 64), torch.randn(2, 64),
                                         rope.cos_cache, rope.sin_cache, 64, 64, cache, cache.clone(),
                                         torch.arange(2))


def test_empty_batch() -> None:
    weight = torch.ones(96)
    x = torch.empty(0, 96)
    assert fused.rms_norm(x, weight, 1e-6).shape == (0, 96)
    out, res = fused.fused_add_rms_norm(x, x, weight, 1e-6)
    assert out.shape == res.shape == (0, 96)
    assert fused.silu_and_mul(torch.empty(0, 192)).shape == (0, 96)
    rope = RotaryEmbedding(64, 64, 16, 10000.0)
    q, k = fused.rotary_embedding(torch.empty(0, dtype=torch.long), torch.empty(0, 128), torch.empty(0, 64),
                            rope.cos_cache, rope.sin_cache, 64, 64)
    assert q.shape == (0, 128) and k.shape == (0, 64)


def test_bad_shapes_raise() -> None:
    x = torch.randn(3, 96)
    with pytest.raises(ValueError, match="weight shape"):
        fused.rms_norm(x, torch.ones(95), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        fused.fused_add_rms_norm(x, torch.randn(3, 95), torch.ones(96), 1e-6)
    with pytest.raises(ValueError, match="contiguous last dimension"):
        fused.rms_norm(torch.randn(96, 3).t(), torch.ones(96), 1e-6)
    with pytest.raises(ValueError, match="2 \\* intermediate"):
        fused.silu_and_mul(torch.randn(3, 97))
    rope = RotaryEmbedding(64, 64, 16, 10000.0)
    pos = torch.arange(3)
    with pytest.raises(ValueError, match="q must be"):
        fused.rotary_embedding(pos, torch.randn(3, 100), torch.randn(3, 64), rope.cos_cache, rope.sin_cache, 64, 64)
    with pytest.raises(ValueError, match="k must be"):
        fused.rotary_embedding(pos, torch.randn(3, 128), torch.randn(2, 64), rope.cos_cache, rope.sin_cache, 64, 64)
    with pytest.raises(ValueError, match="rotary_dim"):
        fused.rotary_embedding(pos, torch.randn(3, 128), torch.randn(3, 64), rope.cos_cache, rope.sin_cache, 64, 63)
    with pytest.raises(ValueError, match="cos_cache"):
        fused.rotary_embedding(pos, torch.randn(3, 128), torch.randn(3, 64), rope.cos_cache[:, :16], rope.sin_cache,
                               64, 64)


# ----- GPU (bf16 / fp16, real shapes) ------------------------------------------------------------

@gpu
@pytest.mark.parametrize("dtype", LOW_DTYPES)
@pytest.mark.parametrize("tokens", [1, 17, 300])
@pytest.mark.parametrize("hidden", [576, 4096, 8192])
def test_rms_norm_gpu(dtype: torch.dtype, tokens: int, hidden: int) -> None:
    norm = make_norm(hidden, dtype, "cuda")
    x = randn(tokens, hidden, seed=1, dtype=dtype, device="cuda") * 3.0
    res = randn(tokens, hidden, seed=2, dtype=dtype, device="cuda")
    out, new_res = norm(x, res)   # the module takes the fused path on CUDA
    want, want_res = fused.fused_add_rms_norm_ref(x, res, norm.weight, norm.eps)
    assert torch.equal(new_res, want_res), "new residual must be exactly x + residual"
    assert_within_ulps(out, want, 2, f"fused_add_rms_norm {dtype} T={tokens} H={hidden}")
    assert_within_ulps(norm(x), fused.rms_norm_ref(x, norm.weight, norm.eps), 2, f"rms_norm {dtype}")


@gpu
@pytest.mark.parametrize("dtype", LOW_DTYPES)
@pytest.mark.parametrize("tokens", [1, 17, 300])
@pytest.mark.parametrize("inter", [1536, 14336])
def test_silu_and_mul_gpu(dtype: torch.dtype, tokens: int, inter: int) -> None:
    x = randn(tokens, 2 * inter, seed=5, dtype=dtype, device="cuda") * 4.0
    assert_within_ulps(SiluAndMul()(x), fused.silu_and_mul_ref(x), 2, f"silu_and_mul {dtype} T={tokens} I={inter}")


@gpu
@pytest.mark.parametrize("dtype", LOW_DTYPES)
@pytest.mark.parametrize("tokens", [1, 17, 300])
@pytest.mark.parametrize("head_dim,rotary_dim,heads,kv_heads", [(128, 128, 32, 8), (64, 64, 9, 3), (128, 64, 16, 2)])
def test_rotary_embedding_gpu(dtype: torch.dtype, tokens: int, head_dim: int, rotary_dim: int, heads: int,
                              kv_heads: int) -> None:
    rope = RotaryEmbedding(head_dim, rotary_dim, 131072, 500000.0).cuda()
    positions = torch.randint(0, 131072, (tokens,), generator=torch.Generator().manual_seed(tokens)).cuda()
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, seed=6, dtype=dtype, device="cuda")
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    got_q, got_k = rope(positions, q, k)
    ref_q, ref_k = fused.rotary_embedding_ref(positions, q, k, rope.cos_cache, rope.sin_cache, head_dim, rotary_dim)
    # |x| < 6, so FMA-level float32 differences stay below 1e-5 in absolute terms.
    assert_within_ulps(got_q, ref_q, 1, f"rope q {dtype}", atol=1e-5)
    assert_within_ulps(got_k, ref_k, 1, f"rope k {dtype}", atol=1e-5)


@gpu
@pytest.mark.parametrize("dtype", LOW_DTYPES)
@pytest.mark.parametrize("tokens", [1, 17, 300])
def test_qk_rms_norm_gpu(dtype: torch.dtype, tokens: int) -> None:
    """Qwen3-30B-A3B's heads (32 q, 4 kv, 128): within 2 ulps of the two RMSNorm modules' torch path."""
    qkv = randn(tokens, 40 * 128, seed=9, dtype=dtype, device="cuda") * 3.0
    q, k, _ = qkv.split([32 * 128, 4 * 128, 4 * 128], dim=-1)
    q_norm, k_norm = make_norm(128, dtype, "cuda"), make_norm(128, dtype, "cuda")
    k_norm.weight.data.mul_(0.5)
    got_q, got_k = fused.qk_rms_norm(q, k, q_norm.weight, k_norm.weight, q_norm.eps, k_norm.eps)
    ref_q, ref_k = fused.qk_rms_norm_ref(q, k, q_norm.weight, k_norm.weight, q_norm.eps, k_norm.eps)
    assert_within_ulps(got_q, ref_q, 2, f"qk_rms_norm q {dtype} T={tokens}")
    assert_within_ulps(got_k, ref_k, 2, f"qk_rms_norm k {dtype} T={tokens}")


@gpu
def test_fused_ops_capture_in_cuda_graph() -> None:
    """Graph-safe: captured once, replayed on new data in the same buffers."""
    dtype, hidden, tokens = torch.bfloat16, 4096, 4
    norm, act = make_norm(hidden, dtype, "cuda"), SiluAndMul()
    rope = RotaryEmbedding(128, 128, 4096, 500000.0).cuda()
    x = randn(tokens, hidden, seed=1, dtype=dtype, device="cuda")
    res = randn(tokens, hidden, seed=2, dtype=dtype, device="cuda")
    gate_up = randn(tokens, 2 * hidden, seed=3, dtype=dtype, device="cuda")
    q = randn(tokens, 32 * 128, seed=4, dtype=dtype, device="cuda")
    k = randn(tokens, 8 * 128, seed=5, dtype=dtype, device="cuda")
    pos = torch.arange(tokens, device="cuda") + 100

    def step() -> tuple[torch.Tensor, ...]:
        return (*norm(x, res), act(gate_up), *rope(pos, q, k))

    step()   # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for buf, seed in ((x, 11), (res, 12), (gate_up, 13), (q, 14), (k, 15)):
        buf.copy_(randn(*buf.shape, seed=seed, dtype=dtype, device="cuda"))
    pos.copy_(torch.randint(0, 4096, (tokens,), generator=torch.Generator().manual_seed(0)))
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(outs, step(), strict=False):
        assert torch.equal(got, want), "replay must compute on the new inputs"
