// RoPE on q and k (GPT-NeoX halves) and the K/V store into pages of the same type, bf16 or float32, in one
// call: what torch runs on the CPU as a dozen small ops a layer. Same roundings as the torch form: float32
// products and sum, one rounding to the rows' type.
#include <cstdint>
#include <cstring>

#include "bf16.h"

namespace {

using elem::from_float;
using elem::to_float;

// One head of one token: the first `rotary_dim` features rotated (x1 c - x2 s, x2 c + x1 s), the rest copied.
template <typename Elem>
inline void rotate_head(const Elem *x, Elem *out, const float *cos, const float *sin, int head_dim, int rotary_dim) {
    const int half = rotary_dim / 2;
    for (int i = 0; i < half; ++i) {
        const float x1 = to_float(x[i]), x2 = to_float(x[i + half]);
        const volatile float a = x1 * cos[i], b = x2 * -sin[i];   // no fused multiply-add: torch rounds each product
        const volatile float c = x2 * cos[i], d = x1 * sin[i];
        out[i] = from_float<Elem>(a + b);
        out[i + half] = from_float<Elem>(c + d);
    }
    for (int i = rotary_dim; i < head_dim; ++i) out[i] = x[i];
}

template <typename Elem>
void rope_store(const Elem *q, const Elem *k, const Elem *v, int64_t row_stride, const float *cos_cache,
                const float *sin_cache, const int64_t *positions, const int64_t *slots, Elem *k_cache, Elem *v_cache,
                Elem *q_out, int64_t tokens, int num_heads, int num_kv_heads, int head_dim, int rotary_dim,
                int num_threads) {
    const int half = rotary_dim / 2;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (tokens >= 64)
    for (int64_t t = 0; t < tokens; ++t) {
        const float *cos = cos_cache + positions[t] * half;
        const float *sin = sin_cache + positions[t] * half;
        for (int h = 0; h < num_heads; ++h)
            rotate_head(q + t * row_stride + h * head_dim, q_out + (t * num_heads + h) * head_dim, cos, sin, head_dim,
                        rotary_dim);
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        const int64_t row = slot * num_kv_heads * head_dim;
        for (int h = 0; h < num_kv_heads; ++h)
            rotate_head(k + t * row_stride + h * head_dim, k_cache + row + h * head_dim, cos, sin, head_dim,
                        rotary_dim);
        std::memcpy(v_cache + row, v + t * row_stride, sizeof(Elem) * num_kv_heads * head_dim);
    }
}

}  // namespace

extern "C" {

// q [T, Hq*D], k and v [T, Hkv*D] rows of `row_stride` elements (views into one projection); cos/sin float32
// [max_position, rotary_dim / 2]; positions, slots int64 [T] (slot -1: not stored); caches [blocks *
// block_size, Hkv, D]; q_out [T, Hq*D] contiguous; rows, caches and q_out all bf16, or all float32.
void rope_store_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, int64_t row_stride,
                     const float *cos_cache, const float *sin_cache, const int64_t *positions, const int64_t *slots,
                     uint16_t *k_cache, uint16_t *v_cache, uint16_t *q_out, int64_t tokens, int num_heads,
                     int num_kv_heads, int head_dim, int rotary_dim, int num_threads) {
    rope_store(q, k, v, row_stride, cos_cache, sin_cache, positions, slots, k_cache, v_cache, q_out, tokens, num_heads,
               num_kv_heads, head_dim, rotary_dim, num_threads);
}

void rope_store_f32(const float *q, const float *k, const float *v, int64_t row_stride, const float *cos_cache,
                    const float *sin_cache, const int64_t *positions, const int64_t *slots, float *k_cache,
                    float *v_cache, float *q_out, int64_t tokens, int num_heads, int num_kv_heads, int head_dim,
                    int rotary_dim, int num_threads) {
    rope_store(q, k, v, row_stride, cos_cache, sin_cache, positions, slots, k_cache, v_cache, q_out, tokens, num_heads,
               num_kv_heads, head_dim, rotary_dim, num_threads);
}

}  // extern "C"
