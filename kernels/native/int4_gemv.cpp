// Weight-only int4 products for a few rows (decode): y[m, n] = sum_k x[m, k] w[n, k] with bf16 x and
// w = (q - 8) * scale + zero, q a 4-bit code, scale and zero bf16 per (row, group of k).
//
// A code q becomes the bf16 number 128 + q by setting its bits under the exponent of 128 (0x4300 | q),
// so one AVX512-BF16 vdpbf16ps multiplies 16 rows by a pair of inputs with no conversion beyond bit
// operations; products are exact in float32 and sums are float32. Per group the 128 offset comes back
// out with the group's input sum: sum x (q - 8) scale + zero sum x = scale D + (zero - 136 scale) X, with
// D = sum x (128 + q) and X = sum x.
//
// Layout (made by int4_gemv.py): tiles of 16 rows; per tile and block of 32 inputs, four 64-byte loads
// of 32 words, word 2r + e of load j holding in its nibble i the code of row r at input 2 (j + 4 i) + e.
// Scales and zeros per tile and group as 16 bf16 each.
// Built only where the compiler targets AVX512-BF16; elsewhere `int4_gemv_available` says 0.
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

namespace {

constexpr int ROWS = 16;          // rows a tile (float32 lanes)
constexpr int KB = 32;            // inputs a block
constexpr int BLOCK_BYTES = 256;  // a tile's codes for one block
constexpr int MAX_M = 8;

inline __m512 widen16(const uint16_t *p) {   // 16 bf16 -> float32
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

inline __m512bh as_bh(__m512i v) { return (__m512bh)v; }

// T tiles of 16 rows against M input rows: out rows [tile0 * 16, (tile0 + T) * 16).
template <int M, int T>
void tiles(const uint16_t *x, int64_t x_stride, const float *xsum, int K, int group_size, const uint8_t *codes,
           const uint16_t *scale_zero, int64_t tile0, int N, void *out, bool out_bf16) {
    const int groups = K / group_size;
    const int blocks_per_group = group_size / KB;
    const int64_t tile_bytes = (int64_t)(K / KB) * BLOCK_BYTES;
    const __m512i mask = _mm512_set1_epi16(0x000F);
    const __m512i expo = _mm512_set1_epi16(0x4300);
    __m512 y[T][M];
    for (int t = 0; t < T; ++t)
        for (int m = 0; m < M; ++m) y[t][m] = _mm512_setzero_ps();
    for (int g = 0; g < groups; ++g) {
        __m512 d0[T][M], d1[T][M];
        for (int t = 0; t < T; ++t)
            for (int m = 0; m < M; ++m) d0[t][m] = d1[t][m] = _mm512_setzero_ps();
        for (int b = g * blocks_per_group; b < (g + 1) * blocks_per_group; ++b) {
            for (int j = 0; j < 4; ++j) {
                __m512i w[T][4];
                for (int t = 0; t < T; ++t) {
                    const uint8_t *at = codes + (tile0 + t) * tile_bytes + (int64_t)b * BLOCK_BYTES + j * 64;
                    const __m512i raw = _mm512_loadu_si512(at);
                    w[t][0] = _mm512_ternarylogic_epi32(raw, mask, expo, 0xEA);                        // (a & b) | c
                    w[t][1] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(raw, 4), mask, expo, 0xEA);
                    w[t][2] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(raw, 8), mask, expo, 0xEA);
                    w[t][3] = _mm512_or_si512(_mm512_srli_epi16(raw, 12), expo);
                }
                for (int m = 0; m < M; ++m) {
                    const uint16_t *xb = x + m * x_stride + b * KB + 2 * j;
                    __m512bh xp[4];
                    for (int i = 0; i < 4; ++i) {
                        int32_t pair;
                        std::memcpy(&pair, xb + 8 * i, sizeof pair);
                        xp[i] = as_bh(_mm512_set1_epi32(pair));
                    }
                    for (int t = 0; t < T; ++t) {
                        d0[t][m] = _mm512_dpbf16_ps(d0[t][m], xp[0], as_bh(w[t][0]));
                        d1[t][m] = _mm512_dpbf16_ps(d1[t][m], xp[1], as_bh(w[t][1]));
                        d0[t][m] = _mm512_dpbf16_ps(d0[t][m], xp[2], as_bh(w[t][2]));
                        d1[t][m] = _mm512_dpbf16_ps(d1[t][m], xp[3], as_bh(w[t][3]));
                    }
                }
            }
        }
        for (int t = 0; t < T; ++t) {
            const uint16_t *sz = scale_zero + ((tile0 + t) * groups + g) * 2 * ROWS;
            const __m512 scale = widen16(sz), zero = widen16(sz + ROWS);
            const __m512 bias = _mm512_fnmadd_ps(_mm512_set1_ps(136.0f), scale, zero);
            for (int m = 0; m < M; ++m) {
                y[t][m] = _mm512_fmadd_ps(scale, _mm512_add_ps(d0[t][m], d1[t][m]), y[t][m]);
                y[t][m] = _mm512_fmadd_ps(bias, _mm512_set1_ps(xsum[m * groups + g]), y[t][m]);
            }
        }
    }
    for (int t = 0; t < T; ++t)
        for (int m = 0; m < M; ++m) {
            const int64_t at = (int64_t)m * N + (tile0 + t) * ROWS;
            if (out_bf16)
                _mm256_storeu_si256((__m256i *)((uint16_t *)out + at), (__m256i)_mm512_cvtneps_pbh(y[t][m]));
            else
                _mm512_storeu_ps((float *)out + at, y[t][m]);
        }
}

template <int M>
void run(const uint16_t *x, int64_t x_stride, const float *xsum, int K, int group_size, const uint8_t *codes,
         const uint16_t *scale_zero, int N, void *out, bool out_bf16, int num_threads) {
    constexpr int T = M == 1 ? 4 : M == 2 ? 2 : 1;
    const int64_t num_tiles = N / ROWS;
    const int64_t full = num_tiles / T;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1)
    for (int64_t i = 0; i <= full; ++i) {
        if (i < full)
            tiles<M, T>(x, x_stride, xsum, K, group_size, codes, scale_zero, i * T, N, out, out_bf16);
        else
            for (int64_t t = full * T; t < num_tiles; ++t)
                tiles<M, 1>(x, x_stride, xsum, K, group_size, codes, scale_zero, t, N, out, out_bf16);
    }
}

}  // namespace

extern "C" {

int int4_gemv_available() { return 1; }
int int4_gemv_max_rows() { return MAX_M; }

// x [M, K] bf16 (rows x_stride apart); codes and scale_zero in the layout above; out [M, N] float32, or
// bf16 with out_bf16. Returns 0, or -1 for shapes it does not take (N % 16, K % group_size,
// group_size % 32, M outside 1..8).
int int4_gemv(const uint16_t *x, int64_t x_stride, int M, int K, const uint8_t *codes, const uint16_t *scale_zero,
              int N, int group_size, void *out, int out_bf16, int num_threads) {
    if (M < 1 || M > MAX_M || N % ROWS || group_size % KB || group_size <= 0 || K % group_size) return -1;
    const int groups = K / group_size;
    float xsum[MAX_M * groups];
    for (int m = 0; m < M; ++m)
        for (int g = 0; g < groups; ++g) {
            float s = 0.0f;
            for (int k = g * group_size; k < (g + 1) * group_size; ++k) {
                const uint32_t bits = (uint32_t)x[m * x_stride + k] << 16;
                float f;
                std::memcpy(&f, &bits, sizeof f);
                s += f;
            }
            xsum[m * groups + g] = s;
        }
    switch (M) {
#define CASE(MM) \
    case MM: run<MM>(x, x_stride, xsum, K, group_size, codes, scale_zero, N, out, out_bf16 != 0, num_threads); break;
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
    }
    return 0;
}

}  // extern "C"

#else

extern "C" {
int int4_gemv_available() { return 0; }
int int4_gemv_max_rows() { return 0; }
int int4_gemv(const uint16_t *, int64_t, int, int, const uint8_t *, const uint16_t *, int, int, void *, int, int) {
    return -1;
}
}  // extern "C"

#endif
