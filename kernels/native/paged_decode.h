// Paged decode attention on the CPU: one query token per sequence against its KV pages, exact softmax.
//
// Written with GCC/Clang vector extensions of W floats (16 where the build targets AVX-512, else 8), so
// the compiler maps it onto the machine it is built on (-march=native): one AVX-512 or AVX2 register, two
// NEON ones.
// Work items are (sequence, token split) over every KV head; each streams its pages once and leaves, per KV
// head, (max, sum, accumulator) that the merge combines by log-sum-exp. Scores are float32 dot products of
// float32 queries with keys widened to float32 (no rounding of products or scores); P·V accumulates in float32.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

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
#if PAGED_W == 8
    // Pair sums within 128-bit halves first (in-lane shuffles, cheap on AVX2), then one exchange of halves.
    auto inlane = [](vf a, vf b) {
        return __builtin_shufflevector(a, b, 0, 2, 8, 10, 4, 6, 12, 14) +
               __builtin_shufflevector(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
    };
    const vf lo = inlane(inlane(v[0], v[1]), inlane(v[2], v[3]));   // [v0..v3 low-half sums | high-half sums]
    const vf hi = inlane(inlane(v[4], v[5]), inlane(v[6], v[7]));
    return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(lo, hi, 4, 5, 6, 7, 12, 13, 14, 15);
#else
    for (int n = W; n > 1; n /= 2)
        for (int i = 0; i < n / 2; ++i) v[i] = pair_sums(v[2 * i], v[2 * i + 1]);
    return v[0];
#endif
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

constexpr int REGISTERS = W == 16 ? 32 : 16;   // vector registers: AVX-512, else AVX2 (NEON has 32 of half width)

// The widest column block (in vectors) that divides nvec and keeps P·V's live set in registers: group x block
// accumulators, the group's broadcast weights and one value vector.
constexpr int column_block(int group, int nvec) {
    for (int cb = nvec; cb > 1; --cb)
        if (nvec % cb == 0 && group * cb + group + 1 <= REGISTERS) return cb;
    return 1;
}

// Scores of W tokens against one query head: W partial-sum vectors (one a token) over the head dimension, then
// folded into one vector of W scores. The query is read from memory a vector at a time, so W + 1 registers.
template <typename T, int NVEC>
inline vf head_scores(const float *q, const T *const *krow, int64_t offset, int nvec_arg) {
    const int nvec = NVEC ? NVEC : nvec_arg;
    vf dots[W];
    {
        const vf qc = load_row(q);
        for (int i = 0; i < W; ++i) dots[i] = qc * load_row(krow[i] + offset);
    }
    for (int c = 1; c < nvec; ++c) {
        const vf qc = load_row(q + c * W);
        for (int i = 0; i < W; ++i) dots[i] += qc * load_row(krow[i] + offset + c * W);
    }
    return totals(dots);
}

// The next chunk's cache lines, prefetched a few at a time between the current chunk's vector work: a burst of
// a whole chunk's lines would fill the core's miss buffers and stall it, so fetching and arithmetic would
// take turns instead of overlapping.
template <typename T>
struct Prefetcher {
    const T *const *rows = nullptr;   // the next chunk's row pointers: K at [0, CHUNK), V at [CHUNK, 2 CHUNK)
    int n = 0;                        // its tokens
    int row_bytes = 0;
    int quantum = 0;                  // lines a vector step
    int row = 0, offset = 0;          // row in [0, 2n): K rows, then V rows

    inline void issue() {
        for (int k = 0; k < quantum && row < 2 * n; ++k) {
            __builtin_prefetch((const char *)rows[row < n ? row : CHUNK + row - n] + offset);
            offset += 64;
            if (offset >= row_bytes) {
                offset = 0;
                ++row;
            }
        }
    }
    inline void finish() {
        while (row < 2 * n) issue();
    }
};

// One KV head over one chunk of n <= CHUNK tokens (rows: where each token's vector for the head starts,
// plus `offset`). GROUP / NVEC are fixed at compile time for the common shapes (loops unrolled); 0 = taken
// from the arguments. Each phase keeps only what fits the register file live: scores a query head at a
// time, P·V a column block of every query head at a time (keys and values are re-read from L1 instead).
template <typename T, int GROUP, int NVEC>
void attend_chunk(HeadState st, const T *const *krow, const T *const *vrow, int64_t offset, int n, int group_arg,
                  int dim, Prefetcher<T> &prefetch) {
    const int group = GROUP ? GROUP : group_arg;
    const int nvec = NVEC ? NVEC : dim / W;
    alignas(64) float scores[MAX_GROUP][CHUNK];
    for (int base = 0; base < CHUNK; base += W) {
        prefetch.issue();
        if constexpr (std::is_same_v<T, float>) {
            for (int g = 0; g < group; ++g) {
                store(&scores[g][base], head_scores<float, NVEC>(st.q + g * dim, krow + base, offset, nvec));
                asm volatile("" ::: "memory");   // keeps the compiler from holding keys across heads (they would spill)
            }
        } else {   // widened once into L1 for all the group's heads
            alignas(64) float keys[W * MAX_DIM];
            const float *kf[W];
            for (int i = 0; i < W; ++i) {
                kf[i] = keys + i * dim;
                for (int c = 0; c < nvec; ++c) store(keys + i * dim + c * W, load_row(krow[base + i] + offset + c * W));
            }
            for (int g = 0; g < group; ++g) {
                store(&scores[g][base], head_scores<float, NVEC>(st.q + g * dim, kf, 0, nvec));
                asm volatile("" ::: "memory");
            }
        }
    }
    float alpha[MAX_GROUP];
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
        alpha[g] = std::exp(m_old - m_new);   // 0 at the first chunk (m = -inf)
        vf total = vf{};
        for (int j = 0; j < CHUNK / W; ++j) {
            vf p = exp_nonpositive(s[j] - m_new);
            if (n < CHUNK)
                for (int i = 0; i < W; ++i)
                    if (j * W + i >= n) p[i] = 0.0f;
            total += p;
            store(&scores[g][j * W], p);
        }
        st.sum[g] = st.sum[g] * alpha[g] + hsum(total);
        st.max[g] = m_new;
    }
    constexpr int CB = GROUP && NVEC ? column_block(GROUP, NVEC) : 1;
    for (int c0 = 0; c0 < nvec; c0 += CB) {
        vf acc[GROUP ? GROUP : 1][CB];
        if (GROUP && NVEC) {
            for (int g = 0; g < group; ++g)
                for (int c = 0; c < CB; ++c) acc[g][c] = load_row(st.acc + g * dim + (c0 + c) * W) * alpha[g];
            for (int i = 0; i < n; ++i) {
                prefetch.issue();
                for (int c = 0; c < CB; ++c) {
                    const vf v = load_row(vrow[i] + offset + (c0 + c) * W);
                    for (int g = 0; g < group; ++g) acc[g][c] += scores[g][i] * v;   // a scalar: one broadcast
                }
            }
            for (int g = 0; g < group; ++g)
                for (int c = 0; c < CB; ++c) store(st.acc + g * dim + (c0 + c) * W, acc[g][c]);
        } else {   // any shape: one vector of one head at a time
            for (int g = 0; g < group; ++g) {
                vf a = load_row(st.acc + g * dim + c0 * W) * alpha[g];
                for (int i = 0; i < n; ++i) {
                    prefetch.issue();
                    a += scores[g][i] * load_row(vrow[i] + offset + c0 * W);
                }
                store(st.acc + g * dim + c0 * W, a);
            }
        }
    }
}

// A work item: every KV head of one sequence over its tokens [begin, end), each head's state starting empty
// (states[h]). A chunk's rows are whole page rows (all heads' keys and values of a token, contiguous), so an
// item streams its pages once, front to back, while each head's pass over the chunk reads it from cache.
template <typename T, int GROUP, int NVEC>
void attend_range_fixed(const HeadState *states, int num_kv_heads, const T *k_cache, const T *v_cache,
                        const int32_t *block_table, int64_t begin, int64_t end, int block_size, int group, int dim) {
    const T *rows[2][2 * CHUNK];   // a chunk's K row pointers, then its V row pointers
    const int64_t token_stride = (int64_t)num_kv_heads * dim;
    const int64_t row_bytes = token_stride * (int64_t)sizeof(T);
    auto rows_of = [&](int64_t start, int which) {
        const int n = (int)(end - start < CHUNK ? end - start : CHUNK);
        for (int i = 0; i < CHUNK; ++i) {   // rows past the end repeat the last one; their scores are masked
            const int64_t t = start + (i < n ? i : n - 1);
            const int64_t slot = (int64_t)block_table[t / block_size] * block_size + t % block_size;
            rows[which][i] = k_cache + slot * token_stride;
            rows[which][CHUNK + i] = v_cache + slot * token_stride;
        }
        return n;
    };
    // Issues a chunk's lines over about the vector steps of a chunk (score blocks and P·V rows of every head).
    const int steps = num_kv_heads * (CHUNK / W + CHUNK * (GROUP && NVEC ? NVEC / column_block(GROUP, NVEC) : dim / W));
    int which = 0;
    int n = begin < end ? rows_of(begin, 0) : 0;
    for (int i = 0; i < n; ++i)
        for (int64_t b = 0; b < row_bytes; b += 64) {
            __builtin_prefetch((const char *)rows[0][i] + b);
            __builtin_prefetch((const char *)rows[0][CHUNK + i] + b);
        }
    for (int64_t start = begin; start < end; start += CHUNK) {
        const int next_n = start + CHUNK < end ? rows_of(start + CHUNK, which ^ 1) : 0;
        const int lines = 2 * next_n * (int)((row_bytes + 63) / 64);
        Prefetcher<T> prefetch{rows[which ^ 1], next_n, (int)row_bytes, std::max(1, (lines + steps - 1) / steps)};
        for (int h = 0; h < num_kv_heads; ++h)
            attend_chunk<T, GROUP, NVEC>(states[h], rows[which], rows[which] + CHUNK, (int64_t)h * dim, n, group, dim,
                                         prefetch);
        prefetch.finish();
        which ^= 1;
        n = next_n;
    }
}

template <typename T>
void attend_range(const HeadState *states, int num_kv_heads, const T *k_cache, const T *v_cache,
                  const int32_t *block_table, int64_t begin, int64_t end, int block_size, int group, int dim) {
    for (int h = 0; h < num_kv_heads; ++h) {
        const HeadState &st = states[h];
        for (int g = 0; g < group; ++g) {
            st.max[g] = -std::numeric_limits<float>::infinity();
            st.sum[g] = 0.0f;
        }
        std::memset(st.acc, 0, sizeof(float) * group * dim);
    }
    if (begin >= end) return;
#define FIXED(G, NV) \
    if (group == G && dim == NV * W) \
        return attend_range_fixed<T, G, NV>(states, num_kv_heads, k_cache, v_cache, block_table, begin, end, \
                                            block_size, group, dim);
    constexpr int D64 = 64 / W, D128 = 128 / W;   // head_dim 64 and 128, the common ones
    FIXED(1, D64) FIXED(2, D64) FIXED(3, D64) FIXED(4, D64) FIXED(5, D64) FIXED(6, D64) FIXED(7, D64) FIXED(8, D64)
    FIXED(1, D128) FIXED(2, D128) FIXED(3, D128) FIXED(4, D128) FIXED(5, D128) FIXED(6, D128) FIXED(7, D128)
    FIXED(8, D128)
#undef FIXED
    attend_range_fixed<T, 0, 0>(states, num_kv_heads, k_cache, v_cache, block_table, begin, end, block_size, group,
                                dim);
}

constexpr int MIN_SPLIT_TOKENS = 256;   // tokens a split covers at least
constexpr int ITEMS_PER_THREAD = 4;     // items per thread aimed at (dynamic scheduling evens them out)
constexpr int MAX_KV_HEADS = 64;

// Token splits per sequence: enough (sequence, split) items for every thread, none under MIN_SPLIT_TOKENS.
inline int num_splits(int batch, int64_t max_len, int num_threads) {
    const int64_t wanted = ((int64_t)num_threads * ITEMS_PER_THREAD + batch - 1) / (batch > 0 ? batch : 1);
    const int64_t most = max_len / MIN_SPLIT_TOKENS;
    return (int)(wanted < most ? (wanted > 1 ? wanted : 1) : (most > 1 ? most : 1));
}

// Floats of `work` a call needs: every (sequence, KV head, split)'s max[G], sum[G] and acc[G, D].
inline int64_t work_floats(int batch, int num_heads, int num_kv_heads, int dim, int splits) {
    return (int64_t)batch * num_kv_heads * splits * (num_heads / num_kv_heads) * (dim + 2);
}

template <typename T>
void paged_decode(const float *q, const T *k_cache, const T *v_cache, const int32_t *block_tables,
                  int64_t block_table_stride, const int32_t *seq_lens, int batch, int num_heads,
                  int num_kv_heads, int dim, int block_size, int splits, int num_threads, float *work,
                  void *out, bool out_bf16) {
    const int group = num_heads / num_kv_heads;
    const int64_t head_floats = (int64_t)group * (dim + 2);   // one (sequence, KV head, split)'s state
    const int64_t items = (int64_t)batch * splits;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (num_threads > 1)
    for (int64_t item = 0; item < items; ++item) {
        const int split = (int)(item % splits);
        const int b = (int)(item / splits);
        const int64_t len = seq_lens[b];
        HeadState states[MAX_KV_HEADS];
        for (int h = 0; h < num_kv_heads; ++h) {
            float *w = work + (((int64_t)b * num_kv_heads + h) * splits + split) * head_floats;
            states[h] = HeadState{q + ((int64_t)b * num_heads + (int64_t)h * group) * dim, w, w + group, w + 2 * group};
        }
        attend_range(states, num_kv_heads, k_cache, v_cache, block_tables + b * block_table_stride,
                     len * split / splits, len * (split + 1) / splits, block_size, group, dim);
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
