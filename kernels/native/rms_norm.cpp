// RMSNorm over bf16 or float32 rows on the CPU, optionally adding a residual first, in one call: what torch
// runs as six to nine small ops (each a dispatch), bit for bit. The residual sum is rounded to the rows' type,
// the norm is float32, x / rms is rounded to the rows' type before the weight, the product too. The sum of squares
// is added in the order torch's CPU sum adds a contiguous float row: `lanes`-wide partial sums over four
// interleaved streams of vectors, each stream summed in a cascade of up to four levels, the streams then
// folded into the first, leftover scalars first and then the lanes in order. The Python side checks the
// result against torch at first use and picks `lanes` (8 or 16) from that check.
// Built with -ffp-contract=off: a fused multiply-add would round differently.
#include <cmath>
#include <cstdint>
#include <cstring>

#include <omp.h>

#include "bf16.h"

namespace {

using elem::from_float;
using elem::rounded;
using elem::to_float;

constexpr int MAX_HIDDEN = 16384;
constexpr int STREAMS = 4;
constexpr int LEVELS = 4;

int ceil_log2(int64_t n) {
    int bits = 0;
    while (((int64_t)1 << bits) < n) ++bits;
    return bits;
}

// The sum of v[0, n) in torch's order for `lanes`-wide vectors (a template argument: the lane loops vectorize).
template <int lanes>
float torch_order_sum(const float *v, int64_t n) {
    const int64_t vectors = n / lanes;
    const int64_t per_stream = vectors / STREAMS;
    const int level_power = ceil_log2(per_stream) / LEVELS > 4 ? ceil_log2(per_stream) / LEVELS : 4;
    const int64_t level_step = (int64_t)1 << level_power;
    const int64_t level_mask = level_step - 1;
    float acc[LEVELS][STREAMS][lanes] = {};
    auto add_vector = [&](float *into, int64_t vector) {
        for (int l = 0; l < lanes; ++l) into[l] += v[vector * lanes + l];
    };
    int64_t i = 0;
    while (i + level_step <= per_stream) {
        for (int64_t j = 0; j < level_step; ++j, ++i)
            for (int s = 0; s < STREAMS; ++s) add_vector(acc[0][s], i * STREAMS + s);
        for (int level = 1; level < LEVELS; ++level) {
            for (int s = 0; s < STREAMS; ++s)
                for (int l = 0; l < lanes; ++l) {
                    acc[level][s][l] += acc[level - 1][s][l];
                    acc[level - 1][s][l] = 0.0f;
                }
            if (i & (level_mask << (level * level_power))) break;
        }
    }
    for (; i < per_stream; ++i)
        for (int s = 0; s < STREAMS; ++s) add_vector(acc[0][s], i * STREAMS + s);
    for (int level = 1; level < LEVELS; ++level)
        for (int s = 0; s < STREAMS; ++s)
            for (int l = 0; l < lanes; ++l) acc[0][s][l] += acc[level][s][l];
    for (int64_t vector = per_stream * STREAMS; vector < vectors; ++vector) add_vector(acc[0][0], vector);
    for (int s = 1; s < STREAMS; ++s)
        for (int l = 0; l < lanes; ++l) acc[0][0][l] += acc[0][s][l];
    float total = 0.0f;
    for (int64_t k = vectors * lanes; k < n; ++k) total += v[k];
    for (int l = 0; l < lanes; ++l) total += acc[0][0][l];
    return total;
}

template <typename Elem>
void norm_row(const Elem *__restrict x, const Elem *__restrict residual, Elem *__restrict out,
              Elem *__restrict sum_out, const Elem *__restrict weight, int hidden, float eps, int lanes,
              float *__restrict squares) {
    if (residual) {
        for (int i = 0; i < hidden; ++i) {
            const float v = rounded<Elem>(to_float(x[i]) + to_float(residual[i]));
            sum_out[i] = from_float<Elem>(v);
            squares[i] = v * v;
        }
    } else {
        for (int i = 0; i < hidden; ++i) squares[i] = to_float(x[i]) * to_float(x[i]);
    }
    const float sum = lanes == 8 ? torch_order_sum<8>(squares, hidden) : torch_order_sum<16>(squares, hidden);
    const float inv = 1.0f / std::sqrt(sum / (float)hidden + eps);
    const Elem *src = residual ? sum_out : x;
    for (int i = 0; i < hidden; ++i)
        out[i] = from_float<Elem>(to_float(weight[i]) * rounded<Elem>(to_float(src[i]) * inv));
}

template <typename Elem>
int norm_rows(const Elem *x, int64_t x_stride, const Elem *residual, Elem *out, Elem *sum_out, const Elem *weight,
              int64_t rows, int hidden, float eps, int lanes, int num_threads) {
    if ((lanes != 8 && lanes != 16) || hidden <= 0 || hidden > MAX_HIDDEN) return -1;
    auto rows_from = [&](int64_t begin, int64_t end, int64_t step) {
        float squares[MAX_HIDDEN];
        for (int64_t r = begin; r < end; r += step)
            norm_row(x + r * x_stride, residual ? residual + r * hidden : nullptr, out + r * hidden,
                     residual ? sum_out + r * hidden : nullptr, weight, hidden, eps, lanes, squares);
    };
    if (rows < 64 || num_threads <= 1) {   // a decode step's few rows: no thread team
        rows_from(0, rows, 1);
        return 0;
    }
#pragma omp parallel num_threads(num_threads)
    rows_from(omp_get_thread_num(), rows, omp_get_num_threads());
    return 0;
}

}  // namespace

extern "C" {

// x, out [rows, hidden] (x's rows x_stride elements apart); residual and sum_out (x + residual) null or
// [rows, hidden] contiguous; weight [hidden]; all bf16, or all float32; lanes 8 or 16. Returns 0, or -1 for
// lanes or hidden it does not take (hidden at most 16384).
int rms_norm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *residual, uint16_t *out, uint16_t *sum_out,
                  const uint16_t *weight, int64_t rows, int hidden, float eps, int lanes, int num_threads) {
    return norm_rows(x, x_stride, residual, out, sum_out, weight, rows, hidden, eps, lanes, num_threads);
}

int rms_norm_f32(const float *x, int64_t x_stride, const float *residual, float *out, float *sum_out,
                 const float *weight, int64_t rows, int hidden, float eps, int lanes, int num_threads) {
    return norm_rows(x, x_stride, residual, out, sum_out, weight, rows, hidden, eps, lanes, num_threads);
}

// The float32 mean of each row's squares [rows], as the norm computes it (for the check against torch).
int rms_mean_of_squares(const uint16_t *x, int64_t x_stride, int64_t rows, int hidden, int lanes, float *out) {
    if ((lanes != 8 && lanes != 16) || hidden <= 0 || hidden > MAX_HIDDEN) return -1;
    float squares[MAX_HIDDEN];
    for (int64_t r = 0; r < rows; ++r) {
        for (int i = 0; i < hidden; ++i) {
            const float v = bf16::widen(x[r * x_stride + i]);
            squares[i] = v * v;
        }
        const float sum = lanes == 8 ? torch_order_sum<8>(squares, hidden) : torch_order_sum<16>(squares, hidden);
        out[r] = sum / (float)hidden;
    }
    return 0;
}

}  // extern "C"
