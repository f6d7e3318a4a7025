// Paged decode attention on the CPU: one query token per sequence against its KV pages, exact softmax.
//
// Written with GCC/Clang vector extensions of W floats (16 where the build targets AVX-512, else 8), so
// the compiler maps it onto the machine it is built on (-march=native): one AVX-512 or AVX2 register, two
// NEON ones.
// Work items are (sequence, KV head, token split); each keeps its group's query heads in registers,
// reads its keys and values once, and leaves (max, sum, accumulator) that the merge combines by
// log-sum-exp. Scores are float32 dot products of float32 queries with keys widened to float32 (no
// rounding of products or scores); P·V accumulates in float32.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "bf16.h"
#include "simd.h"

namespace paged {

#if defined(PAGED_DECODE_W)
#define PAGED_W PAGED_DECODE_W           // a build for another width (the tests build both)
#elif defined(__AVX512F__)
#define PAGED_W 16                       // one AVX-512 register
#else
#define PAGED_W 8                        // one AVX2 register, two NEON ones: 16 would spill
#endif
constexpr int W = PAGED_W;               // floats a vector
constexpr int CHUNK = 64;                // tokens scored before their softmax update
constexpr int MAX_GROUP = 16;            // query heads per KV head
constexpr int MAX_DIM = 256;             // head_dim

typedef float vf __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));
typedef uint32_t vu __attribute__((vector_size(W * 4)));
typedef uint16_t vh __attribute__((vector_size(W * 2)));

inline vf splat(float x) { return simd::splat<vf>(x); }

inline vf load_row(const float *p) { return simd::load<vf>(p); }

inline vf load_row(const uint16_t *p) {  // bfloat16: the top half of a float32
    vh h;
    std::memcpy(&h, p, sizeof h);
    return (vf)(__builtin_convertvector(h, vu) << 16);
}

inline void store(float *p, vf v) { simd::store(p, v); }

// Lane i of the result: a[2i] + a[2i+1] for i < W / 2, b[2(i-W/2)] + b[2(i-W/2)+1] after.
inline vf pair_sums(vf a, vf b) {
#if PAGED_W == 16
    vf even = __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    vf odd = __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#else
    vf even = __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14);
    vf odd = __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15);
#endif
    return even + odd;
}

// Lane i of the result: the sum of v[i]'s W lanes.
inline vf totals(vf *v) {
    for (int n = W; n > 1; n /= 2)
        for (int i = 0; i < n / 2; ++i) v[i] = pair_sums(v[2 * i], v[2 * i + 1]);
    return v[0];
}

inline float hmax(vf v) {
    float m = v[0];
    for (int i = 1; i < W; ++i) m = v[i] > m ? v[i] : m;
    return m;
}

inline float hsum(vf v) {
    float s = 0.0f;
    for (int i = 0; i < W; ++i) s += v[i];
    return s;
}

// exp(x) for x <= 0 (softmax arguments), relative error ~2e-7. Below -86 it returns exp(-86) (2^n stays a
// normal number); the caller zeroes lanes that must be zero.
inline vf exp_nonpositive(vf x) {
    const vf lo = splat(-86.0f);
    x = x < lo ? lo : x;
    const vf t = x * 1.44269504088896341f - 0.5f;
    // truncating toward zero rounds x log2 e to nearest for x <= 0
    return simd::exp_reduced<vf, vi>(x, __builtin_convertvector(__builtin_convertvector(t, vi), vf));
}

struct HeadState {      // one KV head's softmax state over a work item's tokens, for its group's query heads
    const float *q;     // [G, D], scaled
    float *max;         // [G]
    float *sum;         // [G]
    float *acc;         // [G, D]
};

// One KV head over one chunk of n <= CHUNK tokens (rows: where each token's vector for the head starts,
// plus `offset`). GROUP / NVEC are fixed at compile time for the common shapes (loops
// unrolled, vectors in registers); 0 = taken from the arguments.
template <typename T, int GROUP, int NVEC>
void attend_chunk(HeadState st, const T *const *krow, const T *const *vrow, int64_t offset, int n, int group_arg,
                  int dim) {
    const int group = GROUP ? GROUP : group_arg;
    const int nvec = NVEC ? NVEC : dim / W;
    vf qv[MAX_GROUP][MAX_DIM / W];
    vf acc[MAX_GROUP][MAX_DIM / W];
    for (int g = 0; g < group; ++g)
        for (int c = 0; c < nvec; ++c) {
            qv[g][c] = load_row(st.q + g * dim + c * W);
            acc[g][c] = load_row(st.acc + g * dim + c * W);
        }
    alignas(64) float scores[MAX_GROUP][CHUNK];
    for (int base = 0; base < CHUNK; base += W) {
        vf dots[MAX_GROUP][W];
        for (int i = 0; i < W; ++i) {
            vf kv[MAX_DIM / W];
            for (int c = 0; c < nvec; ++c) kv[c] = load_row(krow[base + i] + offset + c * W);
            for (int g = 0; g < group; ++g) {
                vf d = qv[g][0] * kv[0];
                for (int c = 1; c < nvec; ++c) d += qv[g][c] * kv[c];
                dots[g][i] = d;
            }
        }
        for (int g = 0; g < group; ++g) store(&scores[g][base], totals(dots[g]));
    }
    for (int g = 0; g < group; ++g) {
        vf s[CHUNK / W];
        vf mx = splat(-std::numeric_limits<float>::infinity());
        for (int j = 0; j < CHUNK / W; ++j) {
            s[j] = load_row(&scores[g][j * W]);
            if (n < CHUNK)
                for (int i = 0; i < W; ++i)
                    if (j * W + i >= n) s[j][i] = -std::numeric_limits<float>::infinity();
            mx = s[j] > mx ? s[j] : mx;
        }
        const float m_old = st.max[g];
        const float m_new = std::fmax(m_old, hmax(mx));
        const float alpha = std::exp(m_old - m_new);   // 0 at the first chunk (m = -inf)
        vf total = vf{};
        for (int j = 0; j < CHUNK / W; ++j) {
            vf p = exp_nonpositive(s[j] - m_new);
            if (n < CHUNK)
                for (int i = 0; i < W; ++i)
                    if (j * W + i >= n) p[i] = 0.0f;
            total += p;
            store(&scores[g][j * W], p);
        }
        st.sum[g] = st.sum[g] * alpha + hsum(total);
        st.max[g] = m_new;
        for (int c = 0; c < nvec; ++c) acc[g][c] *= alpha;
    }
    for (int i = 0; i < n; ++i) {
        vf vv[MAX_DIM / W];
        for (int c = 0; c < nvec; ++c) vv[c] = load_row(vrow[i] + offset + c * W);
        for (int g = 0; g < group; ++g) {
            const vf p = splat(scores[g][i]);
            for (int c = 0; c < nvec; ++c) acc[g][c] += p * vv[c];
        }
    }
    for (int g = 0; g < group; ++g)
        for (int c = 0; c < nvec; ++c) store(st.acc + g * dim + c * W, acc[g][c]);
}

template <typename T, int GROUP, int NVEC>
void attend_range_fixed(HeadState st, const T *k_cache, const T *v_cache, const int32_t *block_table,
                        int64_t begin, int64_t end, int block_size, int64_t token_stride, int group, int dim) {
    const T *krow[2][CHUNK];
    const T *vrow[2][CHUNK];
    const int64_t row_bytes = (int64_t)dim * sizeof(T);
    // A chunk's row pointers, its rows prefetched: they are scattered over pages, so a decode step that
    // follows the weights' stream through the caches would otherwise wait on each page in turn.
    auto rows_of = [&](int64_t start, int which) {
        const int n = (int)(end - start < CHUNK ? end - start : CHUNK);
        for (int i = 0; i < CHUNK; ++i) {   // rows past the end repeat the last one; their scores are masked
            const int64_t t = start + (i < n ? i : n - 1);
            const int64_t slot = (int64_t)block_table[t / block_size] * block_size + t % block_size;
            krow[which][i] = k_cache + slot * token_stride;
            vrow[which][i] = v_cache + slot * token_stride;
            if (i < n)
                for (int64_t b = 0; b < row_bytes; b += 64) {
                    __builtin_prefetch((const char *)krow[which][i] + b);
                    __builtin_prefetch((const char *)vrow[which][i] + b);
                }
        }
        return n;
    };
    int which = 0;
    int n = begin < end ? rows_of(begin, 0) : 0;
    for (int64_t start = begin; start < end; start += CHUNK) {
        const int next_n = start + CHUNK < end ? rows_of(start + CHUNK, which ^ 1) : 0;
        attend_chunk<T, GROUP, NVEC>(st, krow[which], vrow[which], 0, n, group, dim);
        which ^= 1;
        n = next_n;
    }
}

// A work item: one KV head of one sequence over its tokens [begin, end), the state starting empty.
template <typename T>
void attend_range(HeadState st, const T *k_cache, const T *v_cache, const int32_t *block_table, int64_t begin,
                  int64_t end, int block_size, int64_t token_stride, int group, int dim) {
    for (int g = 0; g < group; ++g) {
        st.max[g] = -std::numeric_limits<float>::infinity();
        st.sum[g] = 0.0f;
    }
    std::memset(st.acc, 0, sizeof(float) * group * dim);
    if (begin >= end) return;
#define FIXED(G, NV) \
    if (group == G && dim == NV * W) \
        return attend_range_fixed<T, G, NV>(st, k_cache, v_cache, block_table, begin, end, block_size, token_stride, \
                                            group, dim);
    constexpr int D64 = 64 / W, D128 = 128 / W;   // head_dim 64 and 128, the common ones
    FIXED(1, D64) FIXED(2, D64) FIXED(3, D64) FIXED(4, D64) FIXED(5, D64) FIXED(6, D64) FIXED(7, D64) FIXED(8, D64)
    FIXED(1, D128) FIXED(2, D128) FIXED(3, D128) FIXED(4, D128) FIXED(5, D128) FIXED(6, D128) FIXED(7, D128)
    FIXED(8, D128)
#undef FIXED
    attend_range_fixed<T, 0, 0>(st, k_cache, v_cache, block_table, begin, end, block_size, token_stride, group, dim);
}

template <typename T>
void paged_decode(const float *q, const T *k_cache, const T *v_cache, const int32_t *block_tables,
                  int64_t block_table_stride, const int32_t *seq_lens, int batch, int num_heads,
                  int num_kv_heads, int dim, int block_size, int splits, int num_threads, float *work,
                  void *out, bool out_bf16) {
    const int group = num_heads / num_kv_heads;
    const int64_t token_stride = (int64_t)num_kv_heads * dim;
    const int64_t head_floats = (int64_t)group * (dim + 2);   // a work item's max[G], sum[G], acc[G, D]
    const int64_t items = (int64_t)batch * num_kv_heads * splits;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (num_threads > 1)
    for (int64_t item = 0; item < items; ++item) {
        const int split = (int)(item % splits);
        const int h = (int)(item / splits % num_kv_heads);
        const int b = (int)(item / splits / num_kv_heads);
        const int64_t len = seq_lens[b];
        float *w = work + item * head_floats;
        HeadState st{q + ((int64_t)b * num_heads + (int64_t)h * group) * dim, w, w + group, w + 2 * group};
        attend_range(st, k_cache + (int64_t)h * dim, v_cache + (int64_t)h * dim, block_tables + b * block_table_stride,
                     len * split / splits, len * (split + 1) / splits, block_size, token_stride, group, dim);
    }
    // Merge each query head's splits by their log-sum-exps; a sequence with no tokens gets zeros.
    for (int b = 0; b < batch; ++b)
        for (int h = 0; h < num_kv_heads; ++h)
            for (int g = 0; g < group; ++g) {
                float o[MAX_DIM];
                const float *first = work + ((int64_t)b * num_kv_heads + h) * splits * head_floats;
                float m = -std::numeric_limits<float>::infinity();
                for (int s = 0; s < splits; ++s) m = std::fmax(m, first[s * head_floats + g]);
                for (int d = 0; d < dim; ++d) o[d] = 0.0f;
                float total = 0.0f;
                for (int s = 0; s < splits; ++s) {
                    const float *w = first + s * head_floats;
                    if (w[g] == -std::numeric_limits<float>::infinity()) continue;   // a split with no tokens
                    const float weight = std::exp(w[g] - m);
                    total += weight * w[group + g];
                    const float *acc = w + 2 * group + g * dim;
                    for (int d = 0; d < dim; ++d) o[d] += weight * acc[d];
                }
                const float inv = total > 0.0f ? 1.0f / total : 0.0f;   // no tokens at all: zeros
                const int64_t row = ((int64_t)b * num_heads + (int64_t)h * group + g) * dim;
                if (out_bf16)
                    for (int d = 0; d < dim; ++d) ((uint16_t *)out)[row + d] = bf16::round(o[d] * inv);
                else
                    for (int d = 0; d < dim; ++d) ((float *)out)[row + d] = o[d] * inv;
            }
}

}  // namespace paged
