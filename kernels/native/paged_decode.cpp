// Paged decode attention on the CPU: one query token per sequence against its KV pages, exact softmax.
//
// Written with GCC/Clang vector extensions (16 floats a vector), so the compiler maps it onto the
// machine it is built on (-march=native): AVX-512 as one register, AVX2 as two, NEON as four.
// Work items are (sequence, KV head, token split); each keeps its group's query heads in registers,
// reads its keys and values once, and leaves (max, sum, accumulator) that the merge combines by
// log-sum-exp. Scores are float32 dot products of float32 queries with keys widened to float32 (no
// rounding of products or scores); P·V accumulates in float32.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "bf16.h"

namespace {

constexpr int W = 16;                    // floats a vector
constexpr int CHUNK = 64;                // tokens scored before their softmax update (4 vectors)
constexpr int MAX_GROUP = 16;            // query heads per KV head
constexpr int MAX_DIM = 256;             // head_dim

typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));
typedef uint16_t vh __attribute__((vector_size(32)));

inline vf splat(float x) { return vf{} + x; }


inline vf load_row(const float *p) {
    vf v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

inline vf load_row(const uint16_t *p) {  // bfloat16: the top half of a float32
    vh h;
    std::memcpy(&h, p, sizeof h);
    return (vf)(__builtin_convertvector(h, vu) << 16);
}

inline void store(float *p, vf v) { std::memcpy(p, &v, sizeof v); }

// Lane i of the result: a[2i] + a[2i+1] for i < 8, b[2(i-8)] + b[2(i-8)+1] after.
inline vf pair_sums(vf a, vf b) {
    vf even = __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    vf odd = __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    return even + odd;
}

// Lane i of the result: the sum of v[i]'s 16 lanes.
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

// exp(x) for x <= 0 (softmax arguments), relative error ~2e-7: x = n ln2 + r, |r| <= ln2 / 2,
// exp(r) by its Taylor series to r^7, 2^n put into the exponent bits. Below -86 it
// returns exp(-86) (2^n stays a normal number); the caller zeroes lanes that must be zero.
inline vf exp_nonpositive(vf x) {
    const vf lo = splat(-86.0f);
    x = x < lo ? lo : x;
    vf t = x * 1.44269504088896341f - 0.5f;
    vi n = __builtin_convertvector(t, vi);             // truncates toward zero: round(x log2 e) for x <= 0
    vf nf = __builtin_convertvector(n, vf);
    vf r = x - nf * 0.693145751953125f - nf * 1.428606765330187e-06f;   // ln 2 in two parts
    vf p = splat(1.0f / 5040.0f);
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    return (vf)((vi)p + (n << 23));
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
    FIXED(1, 4) FIXED(2, 4) FIXED(3, 4) FIXED(4, 4) FIXED(5, 4) FIXED(6, 4) FIXED(7, 4) FIXED(8, 4)
    FIXED(1, 8) FIXED(2, 8) FIXED(3, 8) FIXED(4, 8) FIXED(5, 8) FIXED(6, 8) FIXED(7, 8) FIXED(8, 8)
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

}  // namespace

extern "C" {

// The vector instructions the build targets.
const char *paged_decode_isa() {
#if defined(__AVX512F__)
    return "AVX-512";
#elif defined(__AVX2__)
    return "AVX2";
#elif defined(__ARM_NEON)
    return "NEON";
#else
    return "no wide vectors";
#endif
}

// Limits the caller checks before a call.
int paged_decode_max_group() { return MAX_GROUP; }
int paged_decode_max_dim() { return MAX_DIM; }
int paged_decode_dim_multiple() { return W; }

// q and out [batch, num_heads, dim] contiguous, float32 (q_bf16 = 0) or bfloat16 (1); caches [blocks,
// block_size, num_kv_heads, dim] (dtype_code 0 = float32, 1 = bfloat16); block_tables int32 rows of
// block_table_stride; seq_lens int32 [batch]; work float32 [batch * splits * num_kv_heads * group *
// (dim + 2) + batch * num_heads * dim].
void paged_decode_attention(const void *q, int q_bf16, const void *k_cache, const void *v_cache, int dtype_code,
                            const int32_t *block_tables, int64_t block_table_stride, const int32_t *seq_lens,
                            int batch, int num_heads, int num_kv_heads, int dim, int block_size, float scale,
                            int splits, int num_threads, float *work, void *out) {
    // The scale is folded into a float32 copy of q (at the end of work): scores come out scaled.
    const int64_t group = num_heads / num_kv_heads;
    float *q_scaled = work + (int64_t)batch * splits * num_kv_heads * group * (dim + 2);
    const int64_t q_size = (int64_t)batch * num_heads * dim;
    if (q_bf16)
        for (int64_t i = 0; i < q_size; ++i) q_scaled[i] = bf16::widen(((const uint16_t *)q)[i]) * scale;
    else
        for (int64_t i = 0; i < q_size; ++i) q_scaled[i] = ((const float *)q)[i] * scale;
    if (dtype_code == 1)
        paged_decode(q_scaled, (const uint16_t *)k_cache, (const uint16_t *)v_cache, block_tables,
                     block_table_stride, seq_lens, batch, num_heads, num_kv_heads, dim, block_size, splits,
                     num_threads, work, out, q_bf16 != 0);
    else
        paged_decode(q_scaled, (const float *)k_cache, (const float *)v_cache, block_tables, block_table_stride,
                     seq_lens, batch, num_heads, num_kv_heads, dim, block_size, splits, num_threads, work, out,
                     q_bf16 != 0);
}

}  // extern "C"
