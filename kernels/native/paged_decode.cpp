// The C entry points of paged_decode.h (the kernel is described there).
#include "paged_decode.h"


extern "C" {

// The vector instructions the build targets.
const char *paged_decode_isa() { return simd::isa_name(); }

// Limits the caller checks before a call.
int paged_decode_max_group() { return paged::MAX_GROUP; }
int paged_decode_max_dim() { return paged::MAX_DIM; }
int paged_decode_dim_multiple() { return paged::W; }
int paged_decode_max_kv_heads() { return paged::MAX_KV_HEADS; }

// Token splits per sequence for a call, and the floats of `work` it needs (the scaled queries included).
int paged_decode_num_splits(int batch, int64_t max_len, int num_threads) {
    return paged::num_splits(batch, max_len, num_threads);
}
int64_t paged_decode_work_floats(int batch, int num_heads, int num_kv_heads, int dim, int splits) {
    return paged::work_floats(batch, num_heads, num_kv_heads, dim, splits) + (int64_t)batch * num_heads * dim;
}

// q and out [batch, num_heads, dim] contiguous, float32 (q_bf16 = 0) or bfloat16 (1); caches [blocks,
// block_size, num_kv_heads, dim] (dtype_code 0 = float32, 1 = bfloat16); block_tables int32 rows of
// block_table_stride; seq_lens int32 [batch]; work float32 [paged_decode_work_floats(...)].
void paged_decode_attention(const void *q, int q_bf16, const void *k_cache, const void *v_cache, int dtype_code,
                            const int32_t *block_tables, int64_t block_table_stride, const int32_t *seq_lens,
                            int batch, int num_heads, int num_kv_heads, int dim, int block_size, float scale,
                            int splits, int num_threads, float *work, void *out) {
    // The scale is folded into a float32 copy of q (at the end of work): scores come out scaled.
    float *q_scaled = work + paged::work_floats(batch, num_heads, num_kv_heads, dim, splits);
    const int64_t q_size = (int64_t)batch * num_heads * dim;
    if (q_bf16)
        for (int64_t i = 0; i < q_size; ++i) q_scaled[i] = bf16::widen(((const uint16_t *)q)[i]) * scale;
    else
        for (int64_t i = 0; i < q_size; ++i) q_scaled[i] = ((const float *)q)[i] * scale;
    if (dtype_code == 1)
        paged::paged_decode(q_scaled, (const uint16_t *)k_cache, (const uint16_t *)v_cache, block_tables,
                     block_table_stride, seq_lens, batch, num_heads, num_kv_heads, dim, block_size, splits,
                     num_threads, work, out, q_bf16 != 0);
    else
        paged::paged_decode(q_scaled, (const float *)k_cache, (const float *)v_cache, block_tables, block_table_stride,
                     seq_lens, batch, num_heads, num_kv_heads, dim, block_size, splits, num_threads, work, out,
                     q_bf16 != 0);
}

}  // extern "C"
