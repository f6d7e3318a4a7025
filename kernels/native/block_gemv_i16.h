// block_gemv.h's product with each input row rounded to 16-bit integers per group (one float32 scale a
// group, the group's largest |x| mapped to 32767), so that the products with the codes run as integer
// multiply-adds: vpmaddwd multiplies 16 pairs of 16-bit numbers and sums each pair into 32 bits, twice the
// multiplies of an 8-float FMA, with no code converted to float. A group's integer sums meet d and the input
// scale once; c meets the float32 input sum as in block_gemv.h. The input's rounding is at most half a step
// of 1/32767 of its group's largest |x|, the only difference from the float32 product.
//
// Same weight layout as block_gemv.h (codes [N / W, K / P, W] words, scale_bias [N / W, K / G, 2, W]), read
// 8 output rows at a time: a 256-bit load holds 8 rows x 4 bytes, each row's word P codes of consecutive
// inputs. Bytes widened to 16 bits within each 128-bit half (unpack with zero) pair up as (row 0, 1 | row 4,
// 5) and (row 2, 3 | row 6, 7), two 32-bit sums a row; a horizontal add of the two puts the rows in order.
// 8-bit codes: the word's bytes are inputs k..k+3, met by those 4 inputs broadcast. 4-bit codes: the low
// nibbles of a word's bytes are inputs k, k+2, k+4, k+6, the high ones k+1, k+3, k+5, k+7, so the rounded
// inputs are stored in that order. A group's sums fit 32 bits for groups up to 256 inputs (8-bit codes).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#include "block_gemv.h"

namespace blocks_i16 {

#if defined(__AVX2__) && defined(__F16C__)
constexpr bool AVAILABLE = true;
#else
constexpr bool AVAILABLE = false;
#endif
constexpr int ROWS = 8;          // output rows of one accumulator pair
constexpr int MAX_PASS = 4;      // input rows a pass over a group's codes (two accumulators each)
constexpr int MAX_GROUP = 256;
constexpr float LEVELS = 32767.0f;

// x [M, K] -> q [M, K] int16 (4-bit codes: each run of 8 stored as k, k+2, k+4, k+6, k+1, k+3, k+5, k+7),
// scale [M, K / G] (a NaN where the group holds a NaN or infinity, so the product is NaN as float32's would be)
// and sum [M, K / G] of the float32 inputs.
inline void round_inputs(const float *x, int64_t x_stride, int M, int K, int bits, int group_size, int16_t *q,
                         float *scale, float *sum) {
    const int groups = K / group_size;
    for (int m = 0; m < M; ++m) {
        const float *row = x + m * x_stride;
        for (int g = 0; g < groups; ++g) {
            const float *in = row + g * group_size;
            float largest = 0.0f, s = 0.0f;
            for (int i = 0; i < group_size; ++i) {
                largest = std::fmax(largest, std::fabs(in[i]));
                s += in[i];
            }
            const bool finite = std::isfinite(largest) && std::isfinite(s);
            const float inv = largest > 0.0f && finite ? LEVELS / largest : 0.0f;
            scale[m * groups + g] = finite ? largest / LEVELS : NAN;
            sum[m * groups + g] = s;
            int16_t *out = q + (int64_t)m * K + g * group_size;
            for (int i = 0; i < group_size; ++i) {
                const int at = bits == 4 ? (i & ~7) + ((i & 1) ? 4 + (i & 7) / 2 : (i & 7) / 2) : i;
                out[at] = (int16_t)std::nearbyint(in[i] * inv);
            }
        }
    }
}

#if defined(__AVX2__) && defined(__F16C__)

inline __m256i broadcast4(const int16_t *p) {
    int64_t v;
    std::memcpy(&v, p, sizeof v);
    return _mm256_set1_epi64x(v);
}

// S runs of 8 output rows (sub-tiles s0 .. s0 + S - 1) against M <= MAX_PASS rounded input rows: out[m, rows] =.
template <int BITS, int M, int S>
void sub_tiles(const int16_t *q, int K, const float *scale, const float *sum, int group_size, const uint32_t *codes,
               const uint16_t *scale_bias, int64_t s0, int N, float *out, int64_t out_stride) {
    constexpr int P = 32 / BITS;
    constexpr int SUBS = blocks::W / ROWS;        // runs of 8 rows in a tile of W
    const int groups = K / group_size;
    const int words_per_group = group_size / P;
    const int64_t tile_words = (int64_t)(K / P) * blocks::W;
    const uint32_t *base[S];
    const uint16_t *sb_base[S];
    for (int s = 0; s < S; ++s) {
        const int64_t tile = (s0 + s) / SUBS, sub = (s0 + s) % SUBS;
        base[s] = codes + tile * tile_words + sub * ROWS;
        sb_base[s] = scale_bias + tile * groups * 2 * blocks::W + sub * ROWS;
    }
    const __m256i zero = _mm256_setzero_si256(), low = _mm256_set1_epi8(0x0F);
    __m256 y[S][M];
    for (int s = 0; s < S; ++s)
        for (int m = 0; m < M; ++m) y[s][m] = _mm256_setzero_ps();
    for (int g = 0; g < groups; ++g) {
        __m256i a[S][M], b[S][M];
        for (int s = 0; s < S; ++s)
            for (int m = 0; m < M; ++m) a[s][m] = b[s][m] = zero;
        for (int w = g * words_per_group; w < (g + 1) * words_per_group; ++w) {
            for (int s = 0; s < S; ++s) {
                const uint32_t *at = base[s] + (int64_t)w * blocks::W;
                if ((w * blocks::W) % 16 == 0) __builtin_prefetch(at + blocks::PREFETCH_WORDS, 0, 0);
                const __m256i raw = _mm256_loadu_si256((const __m256i *)at);
                if constexpr (BITS == 8) {
                    const __m256i lo = _mm256_unpacklo_epi8(raw, zero), hi = _mm256_unpackhi_epi8(raw, zero);
                    for (int m = 0; m < M; ++m) {
                        const __m256i x = broadcast4(q + (int64_t)m * K + w * 4);
                        a[s][m] = _mm256_add_epi32(a[s][m], _mm256_madd_epi16(lo, x));
                        b[s][m] = _mm256_add_epi32(b[s][m], _mm256_madd_epi16(hi, x));
                    }
                } else {
                    const __m256i even = _mm256_and_si256(raw, low);
                    const __m256i odd = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
                    const __m256i el = _mm256_unpacklo_epi8(even, zero), eh = _mm256_unpackhi_epi8(even, zero);
                    const __m256i ol = _mm256_unpacklo_epi8(odd, zero), oh = _mm256_unpackhi_epi8(odd, zero);
                    for (int m = 0; m < M; ++m) {
                        const int16_t *xm = q + (int64_t)m * K + w * 8;
                        const __m256i xe = broadcast4(xm), xo = broadcast4(xm + 4);
                        a[s][m] = _mm256_add_epi32(a[s][m],
                                                   _mm256_add_epi32(_mm256_madd_epi16(el, xe), _mm256_madd_epi16(ol, xo)));
                        b[s][m] = _mm256_add_epi32(b[s][m],
                                                   _mm256_add_epi32(_mm256_madd_epi16(eh, xe), _mm256_madd_epi16(oh, xo)));
                    }
                }
            }
        }
        for (int s = 0; s < S; ++s) {
            const uint16_t *sb = sb_base[s] + (int64_t)g * 2 * blocks::W;
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)sb));
            const __m256 c = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sb + blocks::W)));
            for (int m = 0; m < M; ++m) {
                const __m256 total = _mm256_cvtepi32_ps(_mm256_hadd_epi32(a[s][m], b[s][m]));
                const __m256 scaled = _mm256_mul_ps(total, _mm256_set1_ps(scale[m * groups + g]));
                y[s][m] = _mm256_fmadd_ps(d, scaled, _mm256_fmadd_ps(c, _mm256_set1_ps(sum[m * groups + g]), y[s][m]));
            }
        }
    }
    for (int s = 0; s < S; ++s)
        for (int m = 0; m < M; ++m) _mm256_storeu_ps(out + m * out_stride + (s0 + s) * ROWS, y[s][m]);
}

// One work item: S sub-tiles from s0 against all M rows, MAX_PASS rows a pass.
template <int BITS, int S>
void item(const int16_t *q, int M, int K, const float *scale, const float *sum, int group_size, const uint32_t *codes,
          const uint16_t *scale_bias, int64_t s0, int N, float *out) {
    const int groups = K / group_size;
    for (int m0 = 0; m0 < M; m0 += MAX_PASS) {
        const int16_t *qm = q + (int64_t)m0 * K;
        const float *sc = scale + m0 * groups, *su = sum + m0 * groups;
        float *o = out + (int64_t)m0 * N;
        switch (M - m0 < MAX_PASS ? M - m0 : MAX_PASS) {
            case 1: sub_tiles<BITS, 1, S>(qm, K, sc, su, group_size, codes, scale_bias, s0, N, o, N); break;
            case 2: sub_tiles<BITS, 2, S>(qm, K, sc, su, group_size, codes, scale_bias, s0, N, o, N); break;
            case 3: sub_tiles<BITS, 3, 1>(qm, K, sc, su, group_size, codes, scale_bias, s0, N, o, N);
                    if constexpr (S == 2) sub_tiles<BITS, 3, 1>(qm, K, sc, su, group_size, codes, scale_bias, s0 + 1, N, o, N);
                    break;
            default: sub_tiles<BITS, 4, 1>(qm, K, sc, su, group_size, codes, scale_bias, s0, N, o, N);
                     if constexpr (S == 2) sub_tiles<BITS, 4, 1>(qm, K, sc, su, group_size, codes, scale_bias, s0 + 1, N, o, N);
                     break;
        }
    }
}

template <int BITS>
void run(const int16_t *q, int M, int K, const float *scale, const float *sum, int group_size, const uint32_t *codes,
         const uint16_t *scale_bias, int N, float *out, int num_threads) {
    constexpr int S = 2;   // two runs of 8 rows an item: codes of both in flight beside the multiply-adds
    const int64_t subs = N / ROWS, full = subs / S;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1)
    for (int64_t i = 0; i <= full; ++i) {
        if (i < full)
            item<BITS, S>(q, M, K, scale, sum, group_size, codes, scale_bias, i * S, N, out);
        else
            for (int64_t s = full * S; s < subs; ++s)
                item<BITS, 1>(q, M, K, scale, sum, group_size, codes, scale_bias, s, N, out);
    }
}

#endif

// block_gemv.h's gemv with 16-bit inputs; the same arguments and refusals, and -1 where the build has no
// AVX2 (AVAILABLE) or a group is longer than MAX_GROUP.
inline int gemv(const float *x, int64_t x_stride, int M, int K, int bits, const uint32_t *codes,
                const uint16_t *scale_bias, int N, int group_size, float *out, int num_threads) {
    if (!AVAILABLE || (bits != 4 && bits != 8)) return -1;
    const int P = 32 / bits;
    if (M < 1 || M > blocks::MAX_M || N % blocks::W || group_size <= 0 || group_size > MAX_GROUP ||
        group_size % (2 * P) || K % group_size)
        return -1;
#if defined(__AVX2__) && defined(__F16C__)
    const int groups = K / group_size;
    alignas(32) int16_t q[blocks::MAX_M * K];
    float scale[blocks::MAX_M * groups], sum[blocks::MAX_M * groups];
    round_inputs(x, x_stride, M, K, bits, group_size, q, scale, sum);
    if (bits == 4)
        run<4>(q, M, K, scale, sum, group_size, codes, scale_bias, N, out, num_threads);
    else
        run<8>(q, M, K, scale, sum, group_size, codes, scale_bias, N, out, num_threads);
    return 0;
#else
    (void)x; (void)x_stride; (void)codes; (void)scale_bias; (void)out; (void)num_threads;
    return -1;
#endif
}

}  // namespace blocks_i16
