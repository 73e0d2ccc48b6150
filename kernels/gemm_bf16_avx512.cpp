// BF16 GEMM on AVX-512 BF16: 14 x 32 micro-kernel of vdpbf16ps (each FP32 lane accumulates
// a[2p] b[2p] + a[2p+1] b[2p+1]), over panels packed as K pairs: one 32-bit element holds the
// bf16 values of k = 2p (low half) and 2p + 1 (high half).
#include <immintrin.h>

#include <cstring>

#include "kernels/gemm_avx512_tile.h"
#include "kernels/gemm_driver.h"
#include "kernels/gemm_isa.h"

namespace cputrain::kernels {
namespace {

using detail::kTileCols;
using detail::kTileRows;

inline uint32_t pair(uint16_t lo, uint16_t hi) {
  return static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
}

struct Bf16Avx512 {
  using In = uint16_t;
  using Packed = uint32_t;
  static constexpr int64_t KU = 2, MR = kTileRows, NR = kTileCols;
  static constexpr int64_t KC = 512, MC = MR * 8, NC = 2048, MB = MR * 144;

  // dst[p][r] = (op(A)[i0 + r][k0 + 2p], op(A)[i0 + r][k0 + 2p + 1])
  static void pack_a(uint32_t* dst, const uint16_t* A, int64_t lda, bool trans, int64_t i0,
                     int64_t m, int64_t k0, int64_t kc) {
    const int64_t kp = (kc + 1) / 2;
    for (int64_t r = 0; r < MR; ++r) {
      if (r >= m) {
        for (int64_t p = 0; p < kp; ++p) dst[p * MR + r] = 0;
        continue;
      }
      for (int64_t p = 0; p < kp; ++p) {
        const int64_t k = k0 + 2 * p;
        const bool second = 2 * p + 1 < kc;
        const uint16_t lo = trans ? A[k * lda + i0 + r] : A[(i0 + r) * lda + k];
        const uint16_t hi = !second ? 0 : trans ? A[(k + 1) * lda + i0 + r] : A[(i0 + r) * lda + k + 1];
        dst[p * MR + r] = pair(lo, hi);
      }
    }
  }

  // dst[p][c] = (op(B)[k0 + 2p][j0 + c], op(B)[k0 + 2p + 1][j0 + c])
  static void pack_b(uint32_t* dst, const uint16_t* B, int64_t ldb, bool trans, int64_t j0,
                     int64_t n, int64_t k0, int64_t kc) {
    const int64_t kp = (kc + 1) / 2;
    if (!trans && n == NR) {  // B stored (K, N): interleave two rows of 32 values
      for (int64_t p = 0; p < kp; ++p) {
        const uint16_t* r0 = B + (k0 + 2 * p) * ldb + j0;
        const __m512i x0 = _mm512_loadu_si512(r0);
        const __m512i x1 = 2 * p + 1 < kc ? _mm512_loadu_si512(r0 + ldb) : _mm512_setzero_si512();
        // unpacklo/hi work within 128-bit lanes; the permutes put columns back in order.
        const __m512i lo = _mm512_unpacklo_epi16(x0, x1), hi = _mm512_unpackhi_epi16(x0, x1);
        const __m512i first = _mm512_permutex2var_epi64(
            lo, _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0), hi);
        const __m512i second = _mm512_permutex2var_epi64(
            lo, _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4), hi);
        _mm512_store_si512(dst + p * NR, first);
        _mm512_store_si512(dst + p * NR + 16, second);
      }
      return;
    }
    for (int64_t c = 0; c < NR; ++c) {
      for (int64_t p = 0; p < kp; ++p) {
        if (c >= n) {
          dst[p * NR + c] = 0;
          continue;
        }
        const int64_t k = k0 + 2 * p, j = j0 + c;
        const bool second = 2 * p + 1 < kc;
        const uint16_t lo = trans ? B[j * ldb + k] : B[k * ldb + j];
        const uint16_t hi = !second ? 0 : trans ? B[j * ldb + k + 1] : B[(k + 1) * ldb + j];
        dst[p * NR + c] = pair(lo, hi);
      }
    }
  }

  static void micro(int64_t kp, const uint32_t* a, const uint32_t* b, float* C, int64_t ldc,
                    float beta, int m, int n) {
    detail::Tile t;
#pragma GCC unroll 14
    for (int r = 0; r < MR; ++r) t.lo[r] = t.hi[r] = _mm512_setzero_ps();
    for (int64_t p = 0; p < kp; ++p) {
      const __m512bh b0 = (__m512bh)_mm512_load_si512(b + p * NR);
      const __m512bh b1 = (__m512bh)_mm512_load_si512(b + p * NR + 16);
#pragma GCC unroll 14
      for (int r = 0; r < MR; ++r) {
        const __m512bh av = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[p * MR + r]));
        t.lo[r] = _mm512_dpbf16_ps(t.lo[r], av, b0);
        t.hi[r] = _mm512_dpbf16_ps(t.hi[r], av, b1);
      }
    }
    detail::store_tile(t, C, ldc, beta, m, n);
  }
};

}  // namespace

void gemm_bf16_avx512(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K,
                      const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb, float beta,
                      float* C, int64_t ldc) {
  detail::gemm_blocked<Bf16Avx512>(ta, tb, M, N, K, A, lda, B, ldb, beta, C, ldc);
}

}  // namespace cputrain::kernels
