// The reference GEMM: a triple loop in double, the ground truth the tests hold every other
// implementation to.
#include <cstdint>

#include "kernels/cpu/bf16.h"
#include "kernels/gemm/gemm.h"

namespace cputrain::kernels {
namespace {

// Double-precision triple loop over elements read through `load`.
template <typename T, typename Load>
void reference_product(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K, const T* A,
                       int64_t lda, const T* B, int64_t ldb, float beta, float* C, int64_t ldc,
                       Load load) {
  const bool at = ta == Transpose::Yes, bt = tb == Transpose::Yes;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t j = 0; j < N; ++j) {
      double sum = 0.0;
      for (int64_t k = 0; k < K; ++k) {
        const double a = load(at ? A[k * lda + i] : A[i * lda + k]);
        const double b = load(bt ? B[j * ldb + k] : B[k * ldb + j]);
        sum += a * b;
      }
      float& c = C[i * ldc + j];
      c = beta == 0.0f ? static_cast<float>(sum)
                       : static_cast<float>(sum + static_cast<double>(beta) * c);
    }
  }
}

}  // namespace

void gemm_f32_reference(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K, const float* A,
                        int64_t lda, const float* B, int64_t ldb, float beta, float* C,
                        int64_t ldc) {
  reference_product(ta, tb, M, N, K, A, lda, B, ldb, beta, C, ldc,
                    [](float x) { return static_cast<double>(x); });
}

void gemm_bf16_reference(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K,
                         const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb, float beta,
                         float* C, int64_t ldc) {
  reference_product(ta, tb, M, N, K, A, lda, B, ldb, beta, C, ldc,
                    [](uint16_t x) { return static_cast<double>(bf16_to_fp32(x)); });
}

}  // namespace cputrain::kernels
