// The products of the bf16 attention (attention_bf16_avx512.cpp) on AMX tiles: C (+)= A B with
// A rows of bf16 pairs (a tile is 16 rows x 16 pairs) and B pairs x columns (a tile is 16 pairs
// x 16 columns), exactly the operand layouts the vdpbf16ps products use, so the attention's
// packing is the same on both paths. Reached only where cpu_features().amx_bf16 is set.
#include <immintrin.h>

#include <cstdint>

#include "kernels/attention/attention_isa.h"
#include "kernels/cpu/amx_tiles.h"

namespace cputrain::kernels {

void attention_amx_configure() {
  load_full_tile_config();
}

void attention_product_amx(float* C, int64_t ldc, const uint32_t* A, int64_t lda, const uint32_t* B,
                           int64_t ldb, int64_t M, int64_t N, int64_t pairs, bool accumulate) {
  for (int64_t m0 = 0; m0 < M; m0 += 32) {
    const bool two_rows = M - m0 >= 32;
    for (int64_t n0 = 0; n0 < N; n0 += 32) {
      const bool two_cols = N - n0 >= 32;
      float* c = C + m0 * ldc + n0;
      const uint32_t *a = A + m0 * lda, *b = B + n0;
      if (two_rows && two_cols)
        tile_product<2, 2, false>(c, ldc, a, lda, b, ldb, pairs, accumulate);
      else if (two_rows)
        tile_product<2, 1, false>(c, ldc, a, lda, b, ldb, pairs, accumulate);
      else if (two_cols)
        tile_product<1, 2, false>(c, ldc, a, lda, b, ldb, pairs, accumulate);
      else
        tile_product<1, 1, false>(c, ldc, a, lda, b, ldb, pairs, accumulate);
    }
  }
}

// The bf16 attention with its products on AMX tiles; FP32 attention as on AVX-512.
const AttentionKernels& attention_kernels_amx() {
  static const AttentionKernels k{attention_forward_avx512, attention_backward_avx512,
                                  attention_forward_bf16_on<true>,
                                  attention_backward_bf16_on<true>};
  return k;
}

}  // namespace cputrain::kernels
