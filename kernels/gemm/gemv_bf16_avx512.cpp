// The product of one row with a bf16 matrix's rows, y[n] = x . W[n, :], as decoding computes each
// linear layer for one token: memory-bound, so the matrix is streamed once
// (kernels/gemm/gemv_rows.h), by vdpbf16ps on 32 bf16 pairs at a time. (The FP32 one,
// gemv_f32_avx512, is beside the FP32 GEMM.)
#include <immintrin.h>

#include "kernels/gemm/gemm_isa.h"
#include "kernels/gemm/gemv_rows.h"

namespace cputrain::kernels {
namespace {

struct Bf16Ops {
  using T = uint16_t;
  static constexpr int64_t kStep = 32;
  static __m512 step(__m512 acc, const T* x, const T* w) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(x), (__m512bh)_mm512_loadu_si512(w));
  }
  static __m512 tail(__m512 acc, const T* x, const T* w, int64_t n) {
    const auto mask = static_cast<__mmask32>((uint32_t{1} << n) - 1);
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_maskz_loadu_epi16(mask, x),
                            (__m512bh)_mm512_maskz_loadu_epi16(mask, w));
  }
};

}  // namespace

void gemv_bf16_avx512(int64_t N, int64_t K, const uint16_t* x, const uint16_t* W, int64_t ldw,
                      float beta, float* y) {
  detail::gemv_rows<Bf16Ops>(N, K, x, W, ldw, beta, y);
}

}  // namespace cputrain::kernels
