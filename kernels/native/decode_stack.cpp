// A decode step through the decoder layers of a Llama-family model on the CPU, in one call: for each layer,
// RMSNorm (adding the residual), the q/k/v product, RoPE (GPT-NeoX halves) and the K/V store into the
// layer's pages, paged attention, the output product, RMSNorm, the gate/up product, SiLU(gate) * up and the
// down product; then the final RMSNorm. What the torch form runs as a few hundred small ops a layer, each
// a dispatch from Python, here is one call a step.
//
// Activations are float32 throughout; the four products a layer are block_gemv.h's (weights as the
// checkpoint's own 4-bit or 8-bit blocks; or block_gemv_i16.h's, inputs rounded to 16 bits per group), attention is paged_decode.h's over float32 or bfloat16 pages
// (stored rows rounded to nearest). The same operations as the torch form, so a row differs from it only by
// float32 rounding (the order of sums, where a multiply and an add fuse).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "block_gemv.h"
#include "block_gemv_i16.h"
#include "paged_decode.h"

namespace {

struct BlockMatrix {             // one weight in block_gemv.h's layout
    const uint32_t *codes;
    const uint16_t *scale_bias;
    int32_t bits, out_features, in_features, group_size;
};

struct StackLayer {
    const float *input_norm;      // [hidden]
    const float *post_norm;       // [hidden]
    BlockMatrix qkv, o, gate_up, down;
    void *k_cache, *v_cache;      // [blocks, block_size, num_kv_heads, head_dim], float32 or bfloat16
};

struct StackModel {
    int32_t num_layers, hidden, num_heads, num_kv_heads, head_dim, rotary_dim, intermediate, block_size;
    int32_t bf16_pages;           // 0: float32 pages, 1: bfloat16
    int32_t int16_inputs;         // 1: the products round their inputs to 16 bits per group (block_gemv_i16.h)
    float eps, attn_scale;
    const float *cos_cache, *sin_cache;   // [max_position, rotary_dim / 2]
    int64_t max_position, num_slots;      // num_slots: blocks * block_size
    const float *final_norm;
    const StackLayer *layers;
};

// Below this many (sequence, KV head, token) rows attention runs on one thread. Lower than the Python
// path's 2048: here the other threads are already awake from the layer's products.
constexpr int64_t MIN_PARALLEL_ROWS = 256;

// rows [M, H]: out = norm(x) * weight, the norm in float32 as torch's x * rsqrt(mean(x^2) + eps).
void rms_norm(const float *x, const float *weight, float eps, int M, int H, float *out) {
    for (int m = 0; m < M; ++m) {
        const float *row = x + (int64_t)m * H;
        double squares = 0.0;
        for (int i = 0; i < H; ++i) squares += (double)row[i] * row[i];
        const float inv = 1.0f / std::sqrt((float)(squares / H) + eps);
        for (int i = 0; i < H; ++i) out[(int64_t)m * H + i] = weight[i] * (row[i] * inv);
    }
}

void add_into(float *residual, const float *x, int64_t n) {
    for (int64_t i = 0; i < n; ++i) residual[i] += x[i];
}

// exp(x) to float32 precision for any x (clamped to +-87).
inline blocks::vf exp_any(blocks::vf x) {
    using blocks::vf;
    const vf hi = blocks::splat(87.0f), lo = blocks::splat(-87.0f);
    x = x > hi ? hi : x;
    x = x < lo ? lo : x;
    const vf magic = blocks::splat(12582912.0f);              // 1.5 * 2^23: adding it rounds to a whole number
    return simd::exp_reduced<vf, blocks::vi>(x, (x * 1.44269504088896341f + magic) - magic);
}

// gate_up [M, 2I] (gate then up) -> out [M, I] = silu(gate) * up = gate / (1 + exp(-gate)) * up.
void silu_and_mul(const float *gate_up, int M, int I, float *out) {
    using blocks::vf;
    constexpr int W = blocks::W;
    for (int m = 0; m < M; ++m) {
        const float *gate = gate_up + (int64_t)m * 2 * I, *up = gate + I;
        float *row = out + (int64_t)m * I;
        int i = 0;
        for (; i + W <= I; i += W) {
            const vf g = simd::load<vf>(gate + i), u = simd::load<vf>(up + i);
            blocks::store(row + i, g / (1.0f + exp_any(-g)) * u);
        }
        for (; i < I; ++i) row[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
    }
}

// One head's first rotary_dim features rotated (x1 c - x2 s, x2 c + x1 s), times `scale`; the rest copied.
inline void rotate_head(const float *x, float *out, const float *cos, const float *sin, int head_dim, int rotary_dim,
                        float scale) {
    const int half = rotary_dim / 2;
    for (int i = 0; i < half; ++i) {
        const float x1 = x[i], x2 = x[i + half];
        out[i] = (x1 * cos[i] + x2 * -sin[i]) * scale;
        out[i + half] = (x2 * cos[i] + x1 * sin[i]) * scale;
    }
    for (int i = rotary_dim; i < head_dim; ++i) out[i] = x[i] * scale;
}

inline void store_row(const float *x, float *out, int n) { std::memcpy(out, x, sizeof(float) * n); }

inline void store_row(const float *x, uint16_t *out, int n) {
    for (int i = 0; i < n; ++i) out[i] = bf16::round(x[i]);
}

// q [M, Hq * D] rotated and scaled into q_out; k rotated and v copied into the pages at slots (-1: none).
template <typename T>
void rope_and_store(const StackModel &model, const float *qkv, const int64_t *positions, const int64_t *slots, int M,
                    T *k_cache, T *v_cache, float *q_out) {
    const int D = model.head_dim, Hq = model.num_heads, Hkv = model.num_kv_heads;
    const int half = model.rotary_dim / 2;
    const int64_t row = (int64_t)(Hq + 2 * Hkv) * D;
    for (int m = 0; m < M; ++m) {
        const float *cos = model.cos_cache + positions[m] * half, *sin = model.sin_cache + positions[m] * half;
        const float *q = qkv + m * row, *k = q + Hq * D, *v = k + Hkv * D;
        for (int h = 0; h < Hq; ++h)
            rotate_head(q + h * D, q_out + ((int64_t)m * Hq + h) * D, cos, sin, D, model.rotary_dim, model.attn_scale);
        if (slots[m] < 0) continue;
        float k_rot[paged::MAX_DIM];
        for (int h = 0; h < Hkv; ++h) {
            rotate_head(k + h * D, k_rot, cos, sin, D, model.rotary_dim, 1.0f);
            store_row(k_rot, k_cache + (slots[m] * Hkv + h) * D, D);
        }
        store_row(v, v_cache + slots[m] * Hkv * D, Hkv * D);
    }
}

bool product(const StackModel &model, const BlockMatrix &w, const float *x, int M, float *out, int num_threads) {
    const auto gemv = model.int16_inputs ? blocks_i16::gemv : blocks::gemv;
    return gemv(x, w.in_features, M, w.in_features, w.bits, w.codes, w.scale_bias, w.out_features, w.group_size,
                out, num_threads) == 0;
}

template <typename T>
int run(const StackModel &model, float *hidden, int M, const int64_t *positions, const int64_t *slots,
        const int32_t *block_tables, int64_t block_table_stride, const int32_t *seq_lens, int num_threads) {
    const int H = model.hidden, D = model.head_dim, Hq = model.num_heads, Hkv = model.num_kv_heads;
    const int I = model.intermediate;
    int max_len = 0;
    for (int m = 0; m < M; ++m) max_len = seq_lens[m] > max_len ? seq_lens[m] : max_len;
    const int attn_threads = (int64_t)M * Hkv * max_len < MIN_PARALLEL_ROWS ? 1 : num_threads;
    const int splits = paged::num_splits(M, max_len, attn_threads);
    std::vector<float> residual(hidden, hidden + (int64_t)M * H), x((int64_t)M * H), h((int64_t)M * H);
    std::vector<float> qkv((int64_t)M * (Hq + 2 * Hkv) * D), q((int64_t)M * Hq * D), attn((int64_t)M * Hq * D);
    std::vector<float> gate_up((int64_t)M * 2 * I), act((int64_t)M * I);
    std::vector<float> work(paged::work_floats(M, Hq, Hkv, D, splits));
    for (int l = 0; l < model.num_layers; ++l) {
        const StackLayer &layer = model.layers[l];
        if (l > 0) add_into(residual.data(), h.data(), (int64_t)M * H);
        rms_norm(residual.data(), layer.input_norm, model.eps, M, H, x.data());
        if (!product(model, layer.qkv, x.data(), M, qkv.data(), num_threads)) return -2;
        T *k_cache = (T *)layer.k_cache, *v_cache = (T *)layer.v_cache;
        rope_and_store(model, qkv.data(), positions, slots, M, k_cache, v_cache, q.data());
        paged::paged_decode(q.data(), (const T *)k_cache, (const T *)v_cache, block_tables, block_table_stride,
                            seq_lens, M, Hq, Hkv, D, model.block_size, splits, attn_threads, work.data(), attn.data(),
                            false);
        if (!product(model, layer.o, attn.data(), M, h.data(), num_threads)) return -2;
        add_into(residual.data(), h.data(), (int64_t)M * H);
        rms_norm(residual.data(), layer.post_norm, model.eps, M, H, x.data());
        if (!product(model, layer.gate_up, x.data(), M, gate_up.data(), num_threads)) return -2;
        silu_and_mul(gate_up.data(), M, I, act.data());
        if (!product(model, layer.down, act.data(), M, h.data(), num_threads)) return -2;
    }
    add_into(residual.data(), h.data(), (int64_t)M * H);
    rms_norm(residual.data(), model.final_norm, model.eps, M, H, hidden);
    return 0;
}

}  // namespace

extern "C" {

int decode_stack_max_rows() { return blocks::MAX_M; }

int decode_stack_int16_inputs_available() { return blocks_i16::AVAILABLE ? 1 : 0; }

// hidden [M, H] float32: the rows' embeddings in, the final norm's output out. positions and slots int64 [M]
// (a slot of -1 stores nothing); block_tables int32 rows of block_table_stride and seq_lens int32 [M]: every
// block a length reaches lies in the caches (the caller checks). Returns 0, or before touching anything:
// -1 rows outside 1..MAX_M, -3 a position outside the RoPE tables, -4 a slot outside the pages, -5 a length
// other than position + 1; -2 a weight the product kernel does not take (the layers before have stored
// this step's K and V).
int decode_stack(const StackModel *model, float *hidden, int M, const int64_t *positions, const int64_t *slots,
                 const int32_t *block_tables, int64_t block_table_stride, const int32_t *seq_lens, int num_threads) {
    if (M < 1 || M > blocks::MAX_M) return -1;
    for (int m = 0; m < M; ++m) {
        if (positions[m] < 0 || positions[m] >= model->max_position) return -3;
        if (slots[m] >= model->num_slots || slots[m] < -1) return -4;
        if (seq_lens[m] != positions[m] + 1) return -5;
    }
    if (model->bf16_pages)
        return run<uint16_t>(*model, hidden, M, positions, slots, block_tables, block_table_stride, seq_lens,
                             num_threads);
    return run<float>(*model, hidden, M, positions, slots, block_tables, block_table_stride, seq_lens, num_threads);
}

}  // extern "C"
