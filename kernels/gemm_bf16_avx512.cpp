// BF16 GEMM on AVX-512 BF16: 14 x 32 micro-kernel of vdpbf16ps (each FP32 lane accumulates
// a[2p] b[2p] + a[2p+1] b[2p+1]), over panels packed as K pairs: one 32-bit element holds the
// bf16 values of k = 2p (low half) and 2p + 1 (high half).
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "kernels/bf16_pairs_avx512.h"
#include "kernels/gemm_avx512_tile.h"
#include "kernels/gemm_bf16_packing.h"
#include "kernels/gemm_driver.h"
#include "kernels/gemm_isa.h"

namespace cputrain::kernels {
namespace {

using detail::bf16_pair;
using detail::interleave_pairs;
using detail::kTileCols;
using detail::kTileRows;

struct Bf16Avx512 {
  using In = uint16_t;
  using Packed = uint32_t;
  static constexpr int64_t KU = 2, MR = kTileRows, NR = kTileCols;
  static constexpr int64_t KC = 512, MC = MR * 8, NC = 2048;

  // dst[p][r] = (op(A)[i0 + r][k0 + 2p], op(A)[i0 + r][k0 + 2p + 1])
  static void pack_a(uint32_t* dst, const uint16_t* A, int64_t lda, bool trans, int64_t i0,
                     int64_t m, int64_t k0, int64_t kc) {
    const int64_t kp = (kc + 1) / 2;
    if (trans) {  // A stored (K, M): interleave rows k and k + 1
      for (int64_t p = 0; p < kp; ++p) {
        const uint16_t* row = A + (k0 + 2 * p) * lda + i0;
        detail::prefetch_rows_ahead(row, lda);
        interleave_pairs(dst + p * MR, row, 2 * p + 1 < kc ? row + lda : nullptr, m, MR);
      }
      return;
    }
    // A stored (M, K): a pair is one 32-bit element of a row; transpose 16 x 16 blocks.
    const int64_t full = kc / 2;
    detail::pack_transposed(dst, MR, MR, A + i0 * lda + k0, lda * 2,
                            static_cast<int>(std::min<int64_t>(m, MR)), full);
    if (full < kp) {  // odd K: the last pair's second half is zero
      for (int64_t r = 0; r < MR; ++r)
        dst[full * MR + r] = r < m ? bf16_pair(A[(i0 + r) * lda + k0 + kc - 1], 0) : 0;
    }
  }

  static void pack_b(uint32_t* dst, const uint16_t* B, int64_t ldb, bool trans, int64_t j0,
                     int64_t n, int64_t k0, int64_t kc) {
    detail::pack_b_pairs32(dst, B, ldb, trans, j0, n, k0, kc);
  }

  // C FP32 (+ beta C) or, for the rounded product, bf16.
  template <class CT>
  static void micro(int64_t kp, const uint32_t* a, const uint32_t* b, CT* C, int64_t ldc,
                    float beta, int m, int n) {
    const auto steps = [a, b](detail::Tile& t, int64_t p0, int64_t p1)
                           __attribute__((always_inline)) {
      for (int64_t p = p0; p < p1; ++p) {
        const __m512bh b0 = (__m512bh)_mm512_load_si512(b + p * NR);
        const __m512bh b1 = (__m512bh)_mm512_load_si512(b + p * NR + 16);
#pragma GCC unroll 14
        for (int r = 0; r < MR; ++r) {
          const __m512bh av = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[p * MR + r]));
          t.lo[r] = _mm512_dpbf16_ps(t.lo[r], av, b0);
          t.hi[r] = _mm512_dpbf16_ps(t.hi[r], av, b1);
        }
      }
    };
    detail::micro_tile(kp, steps, C, ldc, beta, m, n);
  }
};

}  // namespace

void gemm_bf16_avx512(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K,
                      const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb, float beta,
                      float* C, int64_t ldc) {
  detail::gemm_blocked<Bf16Avx512>(ta, tb, M, N, K, A, lda, B, ldb, beta, C, ldc);
}

void gemm_bf16_rounded_avx512(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K,
                              const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb,
                              uint16_t* C, int64_t ldc) {
  detail::gemm_blocked<Bf16Avx512>(ta, tb, M, N, K, A, lda, B, ldb, 0.0f, C, ldc);
}

int64_t gemm_bf16_avx512_block_k() {
  return Bf16Avx512::KC;
}

std::array<int64_t, 2> gemm_bf16_avx512_pack_floats(Transpose ta, Transpose tb,
                                                    int64_t M, int64_t N, int64_t K) {
  return detail::blocked_pack_floats<Bf16Avx512>(ta, tb, M, N, K);
}

}  // namespace cputrain::kernels
