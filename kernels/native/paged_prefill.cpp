// Paged causal prefill attention on the CPU with bf16 dot products (AVX512-BF16's vdpbf16ps).
//
// Each sequence's keys and values are first packed, per KV head, into blocks of 32 keys laid out for
// vdpbf16ps (keys: [head_dim / 2][32] pairs of dims; values: [16][head_dim] pairs of keys). Then work
// items of (sequence, KV head, a few query rows) walk the key blocks up to their last row's position
// with an online softmax in float32 (exp2 of scores pre-scaled by log2 e), the probabilities rounded
// to bf16 for P·V, the accumulators float32. Every (row, head) is computed the same way whatever
// chunk or item it falls in, so a row's output does not depend on how the prompt was chunked.
// Built only where the compiler targets AVX512-BF16; elsewhere `paged_prefill_available` says 0.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

#include "prefill_schedule.h"

namespace {

constexpr int KB = 32;          // keys a block
constexpr int MAX_PAIRS = 48;   // (row, head) pairs a work item
constexpr int MAX_GROUP = 16;

// 2^x for x <= 0: x = n + r, |r| <= 1/2, 2^r by the Taylor series of e^(r ln 2) to r^6, then
// scaled by 2^n (vscalefps: underflows to 0 cleanly). Relative error about 1e-7.
inline __m512 exp2_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-160.0f));   // also maps -inf (masked keys) to 2^-160 = 0
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.5403530393381608e-04f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3333558146428443e-03f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.6181291076284772e-03f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.5504108664821580e-02f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(2.4022650695910071e-01f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(6.9314718055994531e-01f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

inline int64_t blocks_of(int64_t len) { return (len + KB - 1) / KB; }

// A KV head's packed K elements of a sequence of `len` tokens (its V elements, as many, follow them).
inline int64_t head_elements(int64_t len, int dim) { return blocks_of(len) * KB * dim; }

// One KV head's keys and values of one sequence, key blocks [kb_begin, kb_end), into their packed
// layouts; rows past the sequence are zeros.
void pack_blocks(const uint16_t *k_cache, const uint16_t *v_cache, const int32_t *block_table, int64_t len,
                 int64_t kb_begin, int64_t kb_end, int block_size, int64_t token_stride, int dim, uint32_t *kp,
                 uint16_t *vp) {
    const int pairs = dim / 2;
    for (int64_t kb = kb_begin; kb < kb_end; ++kb) {
        uint32_t *kblock = kp + kb * pairs * KB;
        uint16_t *vblock = vp + kb * KB * dim;
        for (int j = 0; j < KB; ++j) {
            const int64_t t = kb * KB + j;
            uint16_t *vdst = vblock + (j / 2) * dim * 2 + (j & 1);
            if (t >= len) {
                for (int d2 = 0; d2 < pairs; ++d2) kblock[d2 * KB + j] = 0;
                for (int d = 0; d < dim; ++d) vdst[d * 2] = 0;
                continue;
            }
            const int64_t slot = (int64_t)block_table[t / block_size] * block_size + t % block_size;
            const uint16_t *krow = k_cache + slot * token_stride;
            const uint16_t *vrow = v_cache + slot * token_stride;
            for (int d2 = 0; d2 < pairs; ++d2) {
                uint32_t pair;
                std::memcpy(&pair, krow + 2 * d2, sizeof pair);
                kblock[d2 * KB + j] = pair;
            }
            for (int d = 0; d < dim; ++d) vdst[d * 2] = vrow[d];
        }
    }
}

// PG (row, head) pairs at a time: their scores (2 vectors each) and accumulators (DIM / 16 each) stay
// in registers through a key block.
template <int DIM>
void attend_item(const uint16_t *q, int64_t q_row_stride, int group, int rows, int64_t first_pos,
                 const uint32_t *kp, const uint16_t *vp, float scale_log2, float *out, int64_t out_row_stride) {
    constexpr int PG = DIM == 64 ? 4 : 2;
    constexpr int NV = DIM / 16;
    constexpr int PAIRS = DIM / 2;
    const int npairs = rows * group;
    alignas(64) float acc[MAX_PAIRS + PG][DIM];
    float m[MAX_PAIRS + PG];
    __m512 lsum[MAX_PAIRS + PG];   // the softmax denominators, lane-wise: summed once at the end
    const uint32_t *qp[MAX_PAIRS + PG];
    int64_t limit[MAX_PAIRS + PG];
    for (int p = 0; p < npairs + PG; ++p) {
        const int pp = p < npairs ? p : npairs - 1;   // the last group's spare slots repeat a pair
        qp[p] = (const uint32_t *)(q + (pp / group) * q_row_stride + (pp % group) * DIM);
        limit[p] = first_pos + pp / group;
        m[p] = -std::numeric_limits<float>::infinity();
        lsum[p] = _mm512_setzero_ps();
        std::memset(acc[p], 0, sizeof acc[p]);
    }
    const int64_t num_blocks = blocks_of(first_pos + rows);
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t kb = 0; kb < num_blocks; ++kb) {
        const uint32_t *kblock = kp + kb * PAIRS * KB;
        const uint16_t *vblock = vp + kb * KB * DIM;
        const bool masked = (kb + 1) * KB - 1 > first_pos;   // some key is past the first row's position
        for (int p0 = 0; p0 < npairs; p0 += PG) {
            __m512 s[PG][2];
            for (int p = 0; p < PG; ++p) s[p][0] = s[p][1] = _mm512_setzero_ps();
            for (int d2 = 0; d2 < PAIRS; ++d2) {
                const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kblock + d2 * KB);
                const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kblock + d2 * KB + 16);
                for (int p = 0; p < PG; ++p) {
                    const __m512bh qb = (__m512bh)_mm512_set1_epi32((int)qp[p0 + p][d2]);
                    s[p][0] = _mm512_dpbf16_ps(s[p][0], qb, k0);
                    s[p][1] = _mm512_dpbf16_ps(s[p][1], qb, k1);
                }
            }
            alignas(64) uint32_t probs[PG][KB / 2];
            __m512 o[PG][NV];
            for (int p = 0; p < PG; ++p) {
                __m512 s0 = _mm512_mul_ps(s[p][0], _mm512_set1_ps(scale_log2));
                __m512 s1 = _mm512_mul_ps(s[p][1], _mm512_set1_ps(scale_log2));
                if (masked) {
                    const __m512i key0 = _mm512_add_epi32(lane, _mm512_set1_epi32((int)(kb * KB)));
                    const __m512i key1 = _mm512_add_epi32(key0, _mm512_set1_epi32(16));
                    const __m512i lim = _mm512_set1_epi32((int)limit[p0 + p]);
                    s0 = _mm512_mask_mov_ps(neg_inf, _mm512_cmple_epi32_mask(key0, lim), s0);
                    s1 = _mm512_mask_mov_ps(neg_inf, _mm512_cmple_epi32_mask(key1, lim), s1);
                }
                const float m_old = m[p0 + p];
                const float m_new = std::fmax(m_old, _mm512_reduce_max_ps(_mm512_max_ps(s0, s1)));
                const float alpha = std::exp2(m_old - m_new);   // 0 at the first block (m = -inf)
                const __m512 mv = _mm512_set1_ps(m_new);
                const __m512 e0 = exp2_nonpositive(_mm512_sub_ps(s0, mv));
                const __m512 e1 = exp2_nonpositive(_mm512_sub_ps(s1, mv));
                lsum[p0 + p] = _mm512_fmadd_ps(lsum[p0 + p], _mm512_set1_ps(alpha), _mm512_add_ps(e0, e1));
                m[p0 + p] = m_new;
                _mm512_store_si512(probs[p], (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
                const __m512 av = _mm512_set1_ps(alpha);
                for (int c = 0; c < NV; ++c) o[p][c] = _mm512_mul_ps(_mm512_load_ps(acc[p0 + p] + c * 16), av);
            }
            for (int jj = 0; jj < KB / 2; ++jj) {
                __m512bh v[NV];
                for (int c = 0; c < NV; ++c) v[c] = (__m512bh)_mm512_loadu_si512(vblock + (jj * DIM + c * 16) * 2);
                for (int p = 0; p < PG; ++p) {
                    const __m512bh pb = (__m512bh)_mm512_set1_epi32((int)probs[p][jj]);
                    for (int c = 0; c < NV; ++c) o[p][c] = _mm512_dpbf16_ps(o[p][c], pb, v[c]);
                }
            }
            for (int p = 0; p < PG; ++p)
                for (int c = 0; c < NV; ++c) _mm512_store_ps(acc[p0 + p] + c * 16, o[p][c]);
        }
    }
    for (int p = 0; p < npairs; ++p) {
        float *o = out + (p / group) * out_row_stride + (p % group) * DIM;
        const float inv = 1.0f / _mm512_reduce_add_ps(lsum[p]);
        for (int d = 0; d < DIM; ++d) o[d] = acc[p][d] * inv;
    }
}

}  // namespace

extern "C" {

int paged_prefill_available() { return 1; }

// The packed keys and values of every sequence: uint16 elements the caller allocates for `work`.
int64_t paged_prefill_work_elements(const int32_t *seq_lens, int batch, int num_kv_heads, int dim) {
    return prefill_schedule::packed_size(seq_lens, batch, num_kv_heads,
                                         [dim](int64_t len) { return head_elements(len, dim); });
}

// Rows of a work item for groups of `group` query heads.
int paged_prefill_rows_per_item(int group) { return group >= MAX_PAIRS ? 1 : MAX_PAIRS / group; }

// q [T, num_heads, dim] bf16; caches [blocks, block_size, num_kv_heads, dim] bf16; block_tables int32
// rows of block_table_stride; seq_lens int32 [batch] (cached + new tokens); query_start_loc int32
// [batch + 1] (each sequence's new tokens, the last of its seq_lens); out [T, num_heads, dim] float32.
// Returns 0, or -1 for shapes it does not take (dim 64 or 128, groups of at most 16).
int paged_prefill_attention(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                            const int32_t *block_tables, int64_t block_table_stride, const int32_t *seq_lens,
                            const int32_t *query_start_loc, int batch, int num_heads, int num_kv_heads, int dim,
                            int block_size, float scale, int num_threads, uint16_t *work, float *out) {
    const int group = num_heads / num_kv_heads;
    if ((dim != 64 && dim != 128) || group > MAX_GROUP || group * num_kv_heads != num_heads) return -1;
    const int64_t token_stride = (int64_t)num_kv_heads * dim;
    const prefill_schedule::PackedHeads<uint16_t> heads(work, seq_lens, batch, num_kv_heads,
                                                        [dim](int64_t len) { return head_elements(len, dim); });
    const float scale_log2 = scale * 1.4426950408889634f;
    const int64_t stride = (int64_t)num_heads * dim;
    prefill_schedule::run(
        seq_lens, query_start_loc, batch, num_kv_heads, paged_prefill_rows_per_item(group), KB, 8, num_threads,
        [&](int b, int h, int64_t kb0, int64_t kb1) {
            pack_blocks(k_cache + (int64_t)h * dim, v_cache + (int64_t)h * dim, block_tables + b * block_table_stride,
                        seq_lens[b], kb0, kb1, block_size, token_stride, dim, (uint32_t *)heads.keys(b, h),
                        heads.values(b, h));
        },
        [&](int b, int h, int64_t r0, int rows) {
            const uint32_t *keys = (const uint32_t *)heads.keys(b, h);
            const uint16_t *values = heads.values(b, h);
            const int64_t row = query_start_loc[b] + r0;
            const uint16_t *qh = q + row * stride + (int64_t)h * group * dim;
            float *oh = out + row * stride + (int64_t)h * group * dim;
            const int64_t first_pos = seq_lens[b] - (query_start_loc[b + 1] - query_start_loc[b]) + r0;
            if (dim == 64)
                attend_item<64>(qh, stride, group, rows, first_pos, keys, values, scale_log2, oh, stride);
            else
                attend_item<128>(qh, stride, group, rows, first_pos, keys, values, scale_log2, oh, stride);
        });
    return 0;
}

}  // extern "C"

#else

extern "C" {
int paged_prefill_available() { return 0; }
int64_t paged_prefill_work_elements(const int32_t *, int, int, int) { return 0; }
int paged_prefill_rows_per_item(int) { return 1; }
int paged_prefill_attention(const uint16_t *, const uint16_t *, const uint16_t *, const int32_t *, int64_t,
                            const int32_t *, const int32_t *, int, int, int, int, int, float, int, uint16_t *,
                            float *) {
    return -1;
}
}  // extern "C"

#endif
