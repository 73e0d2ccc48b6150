// The loop of a one-row product y[n] = x . W[n, :] (+ beta y[n]), shared by the FP32 and bf16
// kernels: four rows share each load of x, each thread takes a contiguous run of rows (so the
// result does not depend on the thread count), the matrix is streamed once. `Ops` gives the
// element type T, the values per step kStep, and step(acc, x, w) and tail(acc, x, w, n) that
// accumulate kStep, or the last n < kStep, products into 16 FP32 lanes. Included by each kernel's
// own file, compiled for its ISA.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace cputrain::kernels::detail {

template <typename Ops>
void gemv_rows(int64_t N, int64_t K, const typename Ops::T* x, const typename Ops::T* W,
               int64_t ldw, float beta, float* y) {
  const int64_t full = K / Ops::kStep * Ops::kStep;
  const int64_t groups = (N + 3) / 4;
#pragma omp parallel for schedule(static) if (N * K > 32768)
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t n0 = 4 * g, rows = std::min<int64_t>(4, N - n0);
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                     _mm512_setzero_ps()};
    const typename Ops::T* w[4];
    for (int64_t r = 0; r < 4; ++r) w[r] = W + (n0 + std::min<int64_t>(r, rows - 1)) * ldw;
    for (int64_t k = 0; k < full; k += Ops::kStep)
      for (int r = 0; r < 4; ++r) acc[r] = Ops::step(acc[r], x + k, w[r] + k);
    if (K > full)
      for (int r = 0; r < 4; ++r) acc[r] = Ops::tail(acc[r], x + full, w[r] + full, K - full);
    for (int64_t r = 0; r < rows; ++r) {
      const float sum = _mm512_reduce_add_ps(acc[r]);
      y[n0 + r] = beta == 0.0f ? sum : sum + beta * y[n0 + r];
    }
  }
}

}  // namespace cputrain::kernels::detail
