// Paged causal prefill attention on the CPU in float32: FMAs on GCC/Clang vectors of W floats (16 where the
// build targets AVX-512, else 8: one AVX2 register, two NEON ones).
//
// Each sequence's keys and values are first copied per KV head into contiguous rows (bf16 pages widened).
// Then work items of (sequence, KV head, up to MAX_PAIRS (row, query head) pairs) walk the keys up to their
// last row's position, SPAN keys at a time, with the pairs across the vector lanes: scores S^T[key][pair]
// and the output O^T[column][pair] grow by FMAs of a broadcast key or value element with a vector of the
// pairs' queries or probabilities, so the online softmax (exp2 of scores pre-scaled by log2 e) is vector
// arithmetic over pairs with no horizontal reductions, and every broadcast reads the packed rows, which no
// store touches while the items run. A pair's arithmetic involves only its own query and the keys in a
// fixed order, so a row's result does not depend on the chunk, the item or the lane that holds it.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "bf16.h"
#include "prefill_schedule.h"
#include "simd.h"

namespace {

#if defined(PAGED_PREFILL_W)
constexpr int W = PAGED_PREFILL_W;      // a build for another width (the tests build both)
#elif defined(__AVX512F__)
constexpr int W = 16;
#else
constexpr int W = 8;
#endif
constexpr int MAX_PAIRS = 48;           // (row, head) pairs a work item
constexpr int MAX_PV = MAX_PAIRS / W;   // their vectors
constexpr int PVT = 3;                  // pair vectors a register tile
constexpr int JT = W == 16 ? 8 : 4;     // keys a scores tile: JT x PVT accumulators + PVT queries + a broadcast
constexpr int DT = JT;                  // value columns a P·V tile, likewise
constexpr int SPAN = 64;                // keys a softmax update
constexpr int MAX_GROUP = 16;
static_assert(MAX_PV % PVT == 0 && SPAN % JT == 0, "whole register tiles");

typedef float vf __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));

inline vf splat(float x) { return simd::splat<vf>(x); }
inline vf load(const float *p) { return simd::load<vf>(p); }

inline vf select(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }

inline vf max(vf a, vf b) { return a > b ? a : b; }   // one max instruction

// 2^x for x <= 0: x = n + r, |r| <= 1/2, 2^r by the Taylor series of e^(r ln 2) to r^6 (relative error about
// 1e-7), 2^n put into the exponent bits. Lanes below -125 (masked keys' -inf included) give exactly 0.
inline vf exp2_nonpositive(vf x) {
    const vf n = (x + 12582912.0f) - 12582912.0f;   // round to nearest by 1.5 * 2^23
    const vf r = x - n;
    vf p = splat(1.5403530393381608e-04f);
    p = p * r + 1.3333558146428443e-03f;
    p = p * r + 9.6181291076284772e-03f;
    p = p * r + 5.5504108664821580e-02f;
    p = p * r + 2.4022650695910071e-01f;
    p = p * r + 6.9314718055994531e-01f;
    p = p * r + 1.0f;
    const vf y = (vf)((vi)p + (__builtin_convertvector(n, vi) << 23));
    return (vf)((vi)y & (x >= -125.0f));
}

inline int64_t spans_of(int64_t len) { return (len + SPAN - 1) / SPAN; }

inline float widen(float x) { return x; }
inline float widen(uint16_t x) { return bf16::widen(x); }

// One KV head's key and value rows of one sequence, spans [s_begin, s_end), copied contiguous; rows past the
// sequence are zeros (every row's causal limit masks them).
template <typename T>
void pack_spans(const T *k_cache, const T *v_cache, const int32_t *block_table, int64_t len, int64_t s_begin,
                int64_t s_end, int block_size, int64_t token_stride, int dim, float *kp, float *vp) {
    for (int64_t t = s_begin * SPAN; t < s_end * SPAN; ++t) {
        float *kdst = kp + t * dim;
        float *vdst = vp + t * dim;
        if (t >= len) {
            std::memset(kdst, 0, sizeof(float) * dim);
            std::memset(vdst, 0, sizeof(float) * dim);
            continue;
        }
        const int64_t slot = (int64_t)block_table[t / block_size] * block_size + t % block_size;
        const T *krow = k_cache + slot * token_stride;
        const T *vrow = v_cache + slot * token_stride;
        for (int d = 0; d < dim; ++d) kdst[d] = widen(krow[d]);
        for (int d = 0; d < dim; ++d) vdst[d] = widen(vrow[d]);
    }
}

// An item's state, pairs across the lanes: queries, accumulators and the span's scores transposed.
template <int DIM>
struct ItemState {
    alignas(64) float qt[DIM][MAX_PAIRS];      // queries
    alignas(64) float acc[DIM][MAX_PAIRS];     // O^T, unnormalized
    alignas(64) float st[SPAN][MAX_PAIRS];     // the span's scaled scores, then their exp2
    vf m[MAX_PV], lsum[MAX_PV], alpha[MAX_PV];
    vi limit[MAX_PV];                          // each pair's last key
};

// S^T for keys [k0, k0 + keys) and pair vectors [0, npv): JT keys x PVT pair vectors a register tile.
template <int DIM>
inline void span_scores(ItemState<DIM> &st, const float *kp, int64_t k0, int keys, int npv, bool masked,
                        float scale_log2) {
    const vf neg_inf = splat(-std::numeric_limits<float>::infinity());
    for (int pv0 = 0; pv0 < npv; pv0 += PVT)
        for (int j0 = 0; j0 < keys; j0 += JT) {
            const float *krow = kp + (k0 + j0) * DIM;
            vf s[JT][PVT];
            for (int j = 0; j < JT; ++j)
                for (int i = 0; i < PVT; ++i) s[j][i] = splat(0.0f);
#pragma GCC unroll 4   // unrolled: 1.3x the rolled loop's rate on Zen 3
            for (int d = 0; d < DIM; ++d) {
                vf q[PVT];
                for (int i = 0; i < PVT; ++i) q[i] = load(&st.qt[d][(pv0 + i) * W]);
                for (int j = 0; j < JT; ++j) {
                    const float k = krow[j * DIM + d];   // a scalar operand: the compiler broadcasts it from memory
                    for (int i = 0; i < PVT; ++i) s[j][i] += k * q[i];
                }
            }
            for (int j = 0; j < JT; ++j)
                for (int i = 0; i < PVT; ++i) {
                    vf sv = s[j][i] * scale_log2;   // after the sum: a scaled query would add its rounding
                    if (masked) sv = select((int32_t)(k0 + j0 + j) <= st.limit[pv0 + i], sv, neg_inf);
                    simd::store(&st.st[j0 + j][(pv0 + i) * W], sv);
                }
        }
}

// The online softmax over the span, per pair vector: new maxima, the accumulators' factor, probabilities. Two
// chains each for the maxima and the sums (keys come in whole JT tiles, an even count).
template <int DIM>
inline void span_softmax(ItemState<DIM> &st, int keys, int npv) {
    const vf neg_inf = splat(-std::numeric_limits<float>::infinity());
    for (int pv = 0; pv < npv; ++pv) {
        vf mx0 = neg_inf, mx1 = neg_inf;
        for (int j = 0; j < keys; j += 2) {
            mx0 = max(mx0, load(&st.st[j][pv * W]));
            mx1 = max(mx1, load(&st.st[j + 1][pv * W]));
        }
        const vf m_new = max(st.m[pv], max(mx0, mx1));   // finite: key 0 is in every row's first span
        st.alpha[pv] = exp2_nonpositive(st.m[pv] - m_new);   // 0 at the first span (m = -inf)
        vf sum0 = splat(0.0f), sum1 = splat(0.0f);
        for (int j = 0; j < keys; j += 2) {
            const vf e0 = exp2_nonpositive(load(&st.st[j][pv * W]) - m_new);
            const vf e1 = exp2_nonpositive(load(&st.st[j + 1][pv * W]) - m_new);
            sum0 += e0;
            sum1 += e1;
            simd::store(&st.st[j][pv * W], e0);
            simd::store(&st.st[j + 1][pv * W], e1);
        }
        st.lsum[pv] = st.lsum[pv] * st.alpha[pv] + (sum0 + sum1);
        st.m[pv] = m_new;
    }
}

// O^T = O^T x alpha + V^T P^T over the span: DT columns x PVT pair vectors a register tile.
template <int DIM>
inline void span_pv(ItemState<DIM> &st, const float *vp, int64_t k0, int keys, int npv) {
    for (int pv0 = 0; pv0 < npv; pv0 += PVT)
        for (int d0 = 0; d0 < DIM; d0 += DT) {
            vf o[DT][PVT];   // the span's own sums, added to the scaled accumulators after: shorter FMA chains
            for (int d = 0; d < DT; ++d)
                for (int i = 0; i < PVT; ++i) o[d][i] = splat(0.0f);
            const float *vrow = vp + k0 * DIM + d0;
#pragma GCC unroll 4
            for (int j = 0; j < keys; ++j) {
                vf p[PVT];
                for (int i = 0; i < PVT; ++i) p[i] = load(&st.st[j][(pv0 + i) * W]);
                for (int d = 0; d < DT; ++d) {
                    const float v = vrow[j * DIM + d];
                    for (int i = 0; i < PVT; ++i) o[d][i] += v * p[i];
                }
            }
            for (int d = 0; d < DT; ++d)
                for (int i = 0; i < PVT; ++i) {
                    float *a = &st.acc[d0 + d][(pv0 + i) * W];
                    simd::store(a, load(a) * st.alpha[pv0 + i] + o[d][i]);
                }
        }
}

// One work item: `rows` query rows from position first_pos on, each with its `group` heads.
template <int DIM>
void attend_item(const float *q, int64_t q_row_stride, int group, int rows, int64_t first_pos, const float *kp,
                 const float *vp, float scale_log2, float *out, int64_t out_row_stride) {
    thread_local ItemState<DIM> st;
    const int npairs = rows * group;
    const int npv = ((npairs + W - 1) / W + PVT - 1) / PVT * PVT;
    for (int p = 0; p < npv * W; ++p) {
        const int pp = p < npairs ? p : npairs - 1;   // spare lanes repeat a pair
        const float *qrow = q + (pp / group) * q_row_stride + (pp % group) * DIM;
        for (int d = 0; d < DIM; ++d) st.qt[d][p] = qrow[d];
        for (int d = 0; d < DIM; ++d) st.acc[d][p] = 0.0f;
        st.limit[p / W][p % W] = (int32_t)(first_pos + pp / group);
    }
    for (int pv = 0; pv < npv; ++pv) {
        st.m[pv] = splat(-std::numeric_limits<float>::infinity());
        st.lsum[pv] = splat(0.0f);
    }
    const int64_t num_keys = first_pos + rows;   // the keys the last row sees
    for (int64_t k0 = 0; k0 < num_keys; k0 += SPAN) {
        const int keys = (int)((num_keys - k0 < SPAN ? num_keys - k0 : SPAN) + JT - 1) / JT * JT;
        const bool masked = k0 + keys - 1 > first_pos;   // some key is past the first row's position
        span_scores<DIM>(st, kp, k0, keys, npv, masked, scale_log2);
        span_softmax<DIM>(st, keys, npv);
        span_pv<DIM>(st, vp, k0, keys, npv);
    }
    for (int p = 0; p < npairs; ++p) {
        const float inv = 1.0f / st.lsum[p / W][p % W];
        float *o = out + (p / group) * out_row_stride + (p % group) * DIM;
        for (int d = 0; d < DIM; ++d) o[d] = st.acc[d][p] * inv;
    }
}

// A KV head's packed K floats of a sequence of `len` tokens (its V floats, as many, follow them).
inline int64_t head_floats(int64_t len, int dim) { return spans_of(len) * SPAN * dim; }

// Rows of a work item for groups of `group` query heads.
inline int rows_per_item(int group) { return group >= MAX_PAIRS ? 1 : MAX_PAIRS / group; }

template <typename T>
int attention(const float *q, const T *k_cache, const T *v_cache, const int32_t *block_tables,
              int64_t block_table_stride, const int32_t *seq_lens, const int32_t *query_start_loc, int batch,
              int num_heads, int num_kv_heads, int dim, int block_size, float scale, int num_threads, float *work,
              float *out) {
    const int group = num_heads / num_kv_heads;
    if ((dim != 64 && dim != 128) || group > MAX_GROUP || group * num_kv_heads != num_heads) return -1;
    const int64_t token_stride = (int64_t)num_kv_heads * dim;
    const prefill_schedule::PackedHeads<float> heads(work, seq_lens, batch, num_kv_heads,
                                                     [dim](int64_t len) { return head_floats(len, dim); });
    const float scale_log2 = scale * 1.4426950408889634f;
    const int64_t q_stride = (int64_t)num_heads * dim;
    prefill_schedule::run(
        seq_lens, query_start_loc, batch, num_kv_heads, rows_per_item(group), SPAN, 4, num_threads,
        [&](int b, int h, int64_t s0, int64_t s1) {
            pack_spans(k_cache + (int64_t)h * dim, v_cache + (int64_t)h * dim, block_tables + b * block_table_stride,
                       seq_lens[b], s0, s1, block_size, token_stride, dim, heads.keys(b, h), heads.values(b, h));
        },
        [&](int b, int h, int64_t r0, int rows) {
            const float *keys = heads.keys(b, h), *values = heads.values(b, h);
            const int64_t row = query_start_loc[b] + r0;
            const float *qh = q + row * q_stride + (int64_t)h * group * dim;
            float *oh = out + row * q_stride + (int64_t)h * group * dim;
            const int64_t first_pos = seq_lens[b] - (query_start_loc[b + 1] - query_start_loc[b]) + r0;
            if (dim == 64)
                attend_item<64>(qh, q_stride, group, rows, first_pos, keys, values, scale_log2, oh, q_stride);
            else
                attend_item<128>(qh, q_stride, group, rows, first_pos, keys, values, scale_log2, oh, q_stride);
        });
    return 0;
}

}  // namespace

extern "C" {

int paged_prefill_f32_vector_width() { return W; }

// Whether this build's vectors are the FMA registers the kernel was written for (AVX2 or AVX-512).
int paged_prefill_f32_available() {
#if defined(__AVX2__) && defined(__FMA__)
    return 1;
#else
    return 0;
#endif
}

const char *paged_prefill_f32_isa() { return simd::isa_name(); }

// The packed keys and values of every sequence: floats the caller allocates for `work`.
int64_t paged_prefill_f32_work_floats(const int32_t *seq_lens, int batch, int num_kv_heads, int dim) {
    return prefill_schedule::packed_size(seq_lens, batch, num_kv_heads,
                                         [dim](int64_t len) { return head_floats(len, dim); });
}

// q [T, num_heads, dim] float32; caches [blocks, block_size, num_kv_heads, dim] float32 (kv_bf16 = 0) or bf16
// (kv_bf16 = 1); block_tables int32 rows of block_table_stride; seq_lens int32 [batch] (cached + new tokens);
// query_start_loc int32 [batch + 1] (each sequence's new tokens, the last of its seq_lens); out [T, num_heads,
// dim] float32. Returns 0, or -1 for shapes it does not take (dim 64 or 128, groups of at most 16).
int paged_prefill_f32_attention(const float *q, const void *k_cache, const void *v_cache, int kv_bf16,
                                const int32_t *block_tables, int64_t block_table_stride, const int32_t *seq_lens,
                                const int32_t *query_start_loc, int batch, int num_heads, int num_kv_heads,
                                int dim, int block_size, float scale, int num_threads, float *work, float *out) {
    if (kv_bf16)
        return attention(q, (const uint16_t *)k_cache, (const uint16_t *)v_cache, block_tables, block_table_stride,
                         seq_lens, query_start_loc, batch, num_heads, num_kv_heads, dim, block_size, scale,
                         num_threads, work, out);
    return attention(q, (const float *)k_cache, (const float *)v_cache, block_tables, block_table_stride, seq_lens,
                     query_start_loc, batch, num_heads, num_kv_heads, dim, block_size, scale, num_threads, work,
                     out);
}

}  // extern "C"
