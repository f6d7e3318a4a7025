// RMSNorm over bf16 rows on the CPU, optionally adding a residual first, in one call: what torch runs
// as eight or nine small ops (each a dispatch), with the same roundings: the residual sum rounded to
// bf16, the norm in float32, x / rms rounded to bf16 before the weight, the product rounded to bf16.
// Only the order of the sum of squares differs from torch's.
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

inline float widen(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

inline uint16_t round_bf16(float f) {   // to nearest, ties to even (inputs are finite)
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof bits);
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

void norm_row(const uint16_t *x, const uint16_t *residual, uint16_t *out, uint16_t *sum_out, const uint16_t *weight,
              int hidden, float eps) {
    float sq = 0.0f;
    for (int i = 0; i < hidden; ++i) {
        float v = widen(x[i]);
        if (residual) {
            const uint16_t s = round_bf16(v + widen(residual[i]));
            sum_out[i] = s;
            v = widen(s);
        }
        sq += v * v;
    }
    const float inv = 1.0f / std::sqrt(sq / (float)hidden + eps);
    const uint16_t *src = residual ? sum_out : x;
    for (int i = 0; i < hidden; ++i) out[i] = round_bf16(widen(weight[i]) * widen(round_bf16(widen(src[i]) * inv)));
}

}  // namespace

extern "C" {

// x, out [rows, hidden] bf16 (row strides in elements); residual and sum_out (x + residual) null or
// [rows, hidden] contiguous; weight [hidden] bf16.
void rms_norm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *residual, uint16_t *out, uint16_t *sum_out,
                   const uint16_t *weight, int64_t rows, int hidden, float eps, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows >= 64)
    for (int64_t r = 0; r < rows; ++r)
        norm_row(x + r * x_stride, residual ? residual + r * hidden : nullptr, out + r * hidden,
                 residual ? sum_out + r * hidden : nullptr, weight, hidden, eps);
}

}  // extern "C"
