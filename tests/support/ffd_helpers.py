"""Shared builders for the FFD tests: paged caches with shuffled pages and structured attention."""
from __future__ import annotations

import torch

from kernels.ffd.reference import FFDParams, QuantizedPages, quantize_on_write_ref


def paged_case(lens, *, bs, kv_heads, group, dim, seed=0, structured=True, dtype=torch.float32):
    """Random paged K/V (pages shuffled, page 0 unused) holding `lens`, quantized on write.

    structured: keys get a few outlier channels and q is aligned with a handful of "needle"
    tokens plus the sinks, so top-δ selection prunes a real fraction of the blocks.
    Returns q[B, Hq, D], k_cache, v_cache, QuantizedPages, block_tables, seq_lens.
    """
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-n // bs) for n in lens]
    num = sum(pages) + 1
    k = torch.randn(num, bs, kv_heads, dim, generator=gen)
    v = torch.randn(num, bs, kv_heads, dim, generator=gen)
    q = torch.randn(len(lens), kv_heads * group, dim, generator=gen)
    if structured:
        k[..., :4] *= 4.0                               # outlier channels, as real keys have
        q = q * 0.5
    perm = torch.randperm(num - 1, generator=gen) + 1
    tables = torch.zeros(len(lens), max(pages + [1]), dtype=torch.int32)
    start = 0
    for b, n in enumerate(pages):
        tables[b, :n] = perm[start:start + n].to(torch.int32)
        start += n
        if structured and lens[b]:
            flat_k = k[tables[b, :n].long()].reshape(-1, kv_heads, dim)
            hot = torch.randint(0, lens[b], (3,), generator=gen).tolist() + [0, 1]
            mean_q = q[b].reshape(kv_heads, group, dim).mean(1)
            needle = mean_q * (8.0 * dim ** 0.5 / mean_q.square().sum(-1, keepdim=True))
            for t in hot:                                # needles and sinks: logits near 8
                flat_k[t] = needle
            k[tables[b, :n].long()] = flat_k.reshape(n, bs, kv_heads, dim)
    k, v = k.to(dtype), v.to(dtype)
    qp = empty_pages(num, bs, kv_heads, dim)
    slots = torch.cat([tables[b, :-(-n // bs)].long().repeat_interleave(bs) * bs
                       + torch.arange(pages[b] * bs) % bs for b, n in enumerate(lens) if n])
    written = torch.cat([torch.arange(pages[b] * bs) < n for b, n in enumerate(lens) if n])
    quantize_on_write_ref(k, qp.codes, qp.scales, qp.residual, torch.where(written, slots, -1))
    return q.to(dtype), k, v, qp, tables, torch.tensor(lens, dtype=torch.int32)


def empty_pages(num, bs, kv_heads, dim, device="cpu") -> QuantizedPages:
    return QuantizedPages(
        codes=torch.zeros(num, kv_heads, bs, dim // 4, dtype=torch.uint8, device=device),
        scales=torch.zeros(num, kv_heads, dim, dtype=torch.float32, device=device),
        residual=torch.zeros(num, kv_heads, bs, dim, dtype=torch.float8_e4m3fn, device=device))


def params(bs=16, delta_log2=5.0, sink=4, window=16, min_ffd_len=0) -> FFDParams:
    return FFDParams(block_size=bs, delta_log2=delta_log2, sink_tokens=sink, local_window=window,
                     min_ffd_len=min_ffd_len)
