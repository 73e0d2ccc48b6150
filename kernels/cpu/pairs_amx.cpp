// The AMX products of pairs_amx.h.
#include "kernels/cpu/pairs_amx.h"

#include <immintrin.h>

#include "kernels/cpu/amx_tiles.h"

namespace cputrain::kernels {

void pairs_amx_configure() {
  load_full_tile_config();
}

void pairs_product_amx(float* C, int64_t ldc, const uint32_t* A, int64_t lda, const uint32_t* B,
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

}  // namespace cputrain::kernels
