// The C entry points of block_gemv.h and block_gemv_i16.h (the kernels and their layout are described there).
#include "block_gemv.h"
#include "block_gemv_i16.h"

extern "C" {

int block_gemv_rows() { return blocks::W; }
int block_gemv_max_m() { return blocks::MAX_M; }

const char *block_gemv_isa() { return simd::isa_name(); }

int block_gemv(const float *x, int64_t x_stride, int M, int K, int bits, const uint32_t *codes,
               const uint16_t *scale_bias, int N, int group_size, float *out, int num_threads) {
    return blocks::gemv(x, x_stride, M, K, bits, codes, scale_bias, N, group_size, out, num_threads);
}

int block_gemv_int16_inputs_available() { return blocks_i16::AVAILABLE ? 1 : 0; }

int block_gemv_int16_inputs(const float *x, int64_t x_stride, int M, int K, int bits, const uint32_t *codes,
                            const uint16_t *scale_bias, int N, int group_size, float *out, int num_threads) {
    return blocks_i16::gemv(x, x_stride, M, K, bits, codes, scale_bias, N, group_size, out, num_threads);
}

}  // extern "C"
