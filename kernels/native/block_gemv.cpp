// The C entry points of block_gemv.h (the kernel and its layout are described there).
#include "block_gemv.h"

extern "C" {

int block_gemv_rows() { return blocks::W; }
int block_gemv_max_m() { return blocks::MAX_M; }

const char *block_gemv_isa() { return simd::isa_name(); }

int block_gemv(const float *x, int64_t x_stride, int M, int K, int bits, const uint32_t *codes,
               const uint16_t *scale_bias, int N, int group_size, float *out, int num_threads) {
    return blocks::gemv(x, x_stride, M, K, bits, codes, scale_bias, N, group_size, out, num_threads);
}

}  // extern "C"
