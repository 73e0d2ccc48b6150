// The product of one row with a bf16 matrix's rows, y[n] = x . W[n, :], as decoding computes each
// linear layer for one token: memory-bound, so the matrix is streamed once, row after row, by
// vdpbf16ps on 32 bf16 pairs at a time, four rows sharing each load of x; each thread takes a
// contiguous run of rows, so the result does not depend on the thread count.
#include <immintrin.h>

#include "kernels/gemm_isa.h"

namespace cputrain::kernels {
namespace {

inline __m512bh load_bf16(const uint16_t* p) {
  return (__m512bh)_mm512_loadu_si512(p);
}

inline __m512bh load_bf16_tail(const uint16_t* p, __mmask32 mask) {
  return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
}

inline void store(float* y, float sum, float beta) {
  *y = beta == 0.0f ? sum : sum + beta * *y;
}

}  // namespace

void gemv_bf16_avx512(int64_t N, int64_t K, const uint16_t* x, const uint16_t* W, int64_t ldw,
                      float beta, float* y) {
  const int64_t full = K / 32 * 32;
  const auto tail = static_cast<__mmask32>(K == full ? 0 : (uint32_t{1} << (K - full)) - 1);
  const int64_t groups = (N + 3) / 4;
#pragma omp parallel for schedule(static) if (N * K > 32768)
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t n0 = 4 * g, rows = std::min<int64_t>(4, N - n0);
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                     _mm512_setzero_ps()};
    const uint16_t* w[4];
    for (int64_t r = 0; r < 4; ++r) w[r] = W + (n0 + std::min<int64_t>(r, rows - 1)) * ldw;
    for (int64_t k = 0; k < full; k += 32) {
      const __m512bh xv = load_bf16(x + k);
      for (int r = 0; r < 4; ++r) acc[r] = _mm512_dpbf16_ps(acc[r], xv, load_bf16(w[r] + k));
    }
    if (tail != 0) {
      const __m512bh xv = load_bf16_tail(x + full, tail);
      for (int r = 0; r < 4; ++r)
        acc[r] = _mm512_dpbf16_ps(acc[r], xv, load_bf16_tail(w[r] + full, tail));
    }
    for (int64_t r = 0; r < rows; ++r) store(y + n0 + r, _mm512_reduce_add_ps(acc[r]), beta);
  }
}

}  // namespace cputrain::kernels
