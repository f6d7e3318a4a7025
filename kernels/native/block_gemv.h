// Float32 products of a few rows (decode) with block-quantized weights: y[m, n] = sum_k x[m, k] w[n, k],
// w = d * u + c per (row, group of k), u an unsigned 4-bit or 8-bit code, d and c half-precision numbers
// (what a GGUF block stores) widened to float32. A GGUF Q4_1
// block is this form as it stands (d, min); a Q8_0 block is d * (u - 128), so c = -128 d. Products and sums
// are float32, so the result is the float32 product with the dequantized weight up to summation order.
//
// Written with GCC/Clang vector extensions of W floats (16 where the build targets AVX-512, else 8),
// so AVX-512, AVX2 and NEON builds come from one source. Tiles of W rows; the codes of one row for
// P = 32 / BITS consecutive inputs share a 32-bit word, code i in bits [BITS i, BITS (i + 1)). Code i
// is taken out in place by a mask (worth u * 2^(BITS i)) and converted to float, and the input it
// multiplies was scaled by 2^-(BITS i) beforehand (exact: a power of two), so no shift is spent on it;
// the top code is shifted down instead. Per group the sum over its inputs of x * u meets d, and
// c meets the group's input sum.
//
// Layout (made by block_gemv.py): codes [N / W, K / P, W] words; scale_bias [N / W, K / G, 2, W]
// half precision (d then c).
#pragma once
#include <cstdint>
#include <cstring>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "simd.h"

namespace blocks {

#if defined(BLOCKS_W)   // a test build: another instruction set's tile width (16: AVX-512's) on this CPU
constexpr int W = BLOCKS_W;
#elif defined(__AVX512F__)
constexpr int W = 16;
#else
constexpr int W = 8;
#endif
constexpr int PREFETCH_WORDS = 1024;   // codes read ahead of the tile stream (4 KB): the weights come from DRAM
constexpr int MAX_M = 8;
constexpr int TILES_AT_ONE_ROW = 2;   // tiles a work item takes for one input row: codes in flight beside the FMAs

typedef float vf __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));
typedef uint32_t vu __attribute__((vector_size(W * 4)));

inline vf splat(float x) { return simd::splat<vf>(x); }

inline void store(float *p, vf v) { simd::store(p, v); }

// W half-precision numbers (a scale or bias row of a tile) as floats.
inline vf widen_half(const uint16_t *p) {
#if defined(__AVX512F__) && !defined(BLOCKS_W)
    return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif defined(__F16C__) && !defined(BLOCKS_W)
    return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    vf v;
    for (int i = 0; i < W; ++i) {
        _Float16 h;
        std::memcpy(&h, p + i, sizeof h);
        v[i] = (float)h;
    }
    return v;
#endif
}

// Code i of each lane's word, as a float worth u * 2^(BITS i) (the top code: u).
template <int BITS, int I>
inline vf code(vu raw) {
    constexpr int P = 32 / BITS;
    if constexpr (I == P - 1) {
        return __builtin_convertvector((vi)(raw >> (32 - BITS)), vf);
    } else {
        constexpr uint32_t mask = ((1u << BITS) - 1u) << (BITS * I);
        return __builtin_convertvector((vi)(raw & mask), vf);
    }
}

// Independent FMA chains per (tile, input row): the FMA's latency times its issue rate, shared out.
template <int ROWS>
constexpr int chains() { return 8 / ROWS > 1 ? 8 / ROWS : 1; }

// acc[t][m][(BASE + i) % A] += x[m, code i's input] * code i of tile t, for the P codes of one word a tile.
template <int BITS, int T, int M, int A, int BASE, int I = 0>
inline void codes_times_inputs(const vu (&raw)[T], const float *xs, int64_t xs_stride, vf (&acc)[T][M][A]) {
    constexpr int P = 32 / BITS;
    if constexpr (I < P) {
        vf v[T];
        for (int t = 0; t < T; ++t) v[t] = code<BITS, I>(raw[t]);
        for (int m = 0; m < M; ++m) {
            const vf x = splat(xs[m * xs_stride + I]);
            for (int t = 0; t < T; ++t) acc[t][m][(BASE + I) % A] += x * v[t];
        }
        codes_times_inputs<BITS, T, M, A, BASE, I + 1>(raw, xs, xs_stride, acc);
    }
}

// T tiles of W rows from tile t0 against M input rows. xs: the inputs scaled per code position; xsum: [M, groups].
template <int BITS, int M, int T>
void tiles(const float *xs, int K, const float *xsum, int group_size, const uint32_t *codes,
           const uint16_t *scale_bias, int64_t t0, int N, float *out) {
    constexpr int P = 32 / BITS;
    constexpr int A = chains<M * T>();
    constexpr int STEP = A > P ? A / P : 1;   // words a step, so that every chain gets a code
    const int groups = K / group_size;
    const int words_per_group = group_size / P;
    const int64_t tile_words = (int64_t)(K / P) * W;
    vf y[T][M];
    for (int t = 0; t < T; ++t)
        for (int m = 0; m < M; ++m) y[t][m] = vf{};
    for (int g = 0; g < groups; ++g) {
        vf acc[T][M][A];
        for (int t = 0; t < T; ++t)
            for (int m = 0; m < M; ++m)
                for (int a = 0; a < A; ++a) acc[t][m][a] = vf{};
        for (int w = g * words_per_group; w < (g + 1) * words_per_group; w += STEP) {
            vu raw[T];
            for (int t = 0; t < T; ++t) {
                const uint32_t *at = codes + (t0 + t) * tile_words + (int64_t)w * W;
                if ((w * W) % 16 == 0) __builtin_prefetch(at + PREFETCH_WORDS, 0, 0);   // a cache line a prefetch
                raw[t] = simd::load<vu>(at);
            }
            codes_times_inputs<BITS, T, M, A, 0>(raw, xs + (int64_t)w * P, K, acc);
            if constexpr (STEP == 2) {
                for (int t = 0; t < T; ++t)
                    raw[t] = simd::load<vu>(codes + (t0 + t) * tile_words + (int64_t)(w + 1) * W);
                codes_times_inputs<BITS, T, M, A, P>(raw, xs + (int64_t)(w + 1) * P, K, acc);
            }
        }
        for (int t = 0; t < T; ++t) {
            const uint16_t *sb = scale_bias + (((t0 + t) * groups + g) * 2) * W;
            const vf d = widen_half(sb), c = widen_half(sb + W);
            for (int m = 0; m < M; ++m) {
                vf sum = acc[t][m][0];
                for (int a = 1; a < A; ++a) sum += acc[t][m][a];
                y[t][m] += d * sum + c * splat(xsum[m * groups + g]);
            }
        }
    }
    for (int t = 0; t < T; ++t)
        for (int m = 0; m < M; ++m) store(out + (int64_t)m * N + (t0 + t) * W, y[t][m]);
}

template <int BITS, int M>
void run(const float *xs, int K, const float *xsum, int group_size, const uint32_t *codes, const uint16_t *scale_bias,
         int N, float *out, int num_threads) {
    constexpr int T = M == 1 ? TILES_AT_ONE_ROW : 1;
    const int64_t num_tiles = N / W;
    const int64_t full = num_tiles / T;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1)
    for (int64_t i = 0; i <= full; ++i) {
        if (i < full)
            tiles<BITS, M, T>(xs, K, xsum, group_size, codes, scale_bias, i * T, N, out);
        else
            for (int64_t t = full * T; t < num_tiles; ++t)
                tiles<BITS, M, 1>(xs, K, xsum, group_size, codes, scale_bias, t, N, out);
    }
}

template <int BITS>
void dispatch(int M, const float *xs, int K, const float *xsum, int group_size, const uint32_t *codes,
              const uint16_t *scale_bias, int N, float *out, int num_threads) {
    switch (M) {
#define CASE(MM) \
    case MM: run<BITS, MM>(xs, K, xsum, group_size, codes, scale_bias, N, out, num_threads); break;
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
    }
}

// x [M, K] float32 (rows x_stride apart); codes and scale_bias in the layout above; out [M, N] float32.
// Returns 0, or -1 for what it does not take (bits other than 4 or 8, N % W, K % group_size, group_size
// not a multiple of 2 * 32 / bits, M outside 1..8).
inline int gemv(const float *x, int64_t x_stride, int M, int K, int bits, const uint32_t *codes,
               const uint16_t *scale_bias, int N, int group_size, float *out, int num_threads) {
    if (bits != 4 && bits != 8) return -1;
    const int P = 32 / bits;
    if (M < 1 || M > MAX_M || N % W || group_size <= 0 || group_size % (2 * P) || K % group_size) return -1;
    const int groups = K / group_size;
    float xs[MAX_M * K];
    float xsum[MAX_M * groups];
    for (int m = 0; m < M; ++m) {
        for (int k = 0; k < K; ++k) {
            const int i = k % P;   // code i is worth u * 2^(bits i), but the top code was shifted down
            const float unit = i == P - 1 ? 1.0f : 1.0f / (float)(1u << (bits * i));
            xs[m * K + k] = x[m * x_stride + k] * unit;
        }
        for (int g = 0; g < groups; ++g) {
            float s = 0.0f;
            for (int k = g * group_size; k < (g + 1) * group_size; ++k) s += x[m * x_stride + k];
            xsum[m * groups + g] = s;
        }
    }
    if (bits == 4)
        dispatch<4>(M, xs, K, xsum, group_size, codes, scale_bias, N, out, num_threads);
    else
        dispatch<8>(M, xs, K, xsum, group_size, codes, scale_bias, N, out, num_threads);
    return 0;
}

}  // namespace blocks
