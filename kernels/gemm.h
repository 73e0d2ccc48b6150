// General matrix multiply on row-major FP32 matrices, behind a runtime dispatch table.
#pragma once

#include <cstdint>
#include <string_view>

namespace cputrain::kernels {

enum class Transpose : bool { No = false, Yes = true };

// C[M,N] = op(A)[M,K] * op(B)[K,N] + beta * C, all row-major.
//   op(A) = A   : A stored (M, K), lda >= K      op(A) = A^T : A stored (K, M), lda >= M
//   op(B) = B   : B stored (K, N), ldb >= N      op(B) = B^T : B stored (N, K), ldb >= K
//   C stored (M, N), ldc >= N. beta 0 overwrites C (C may hold garbage, even NaN); beta 1
//   accumulates.
// The three products of training a linear layer Y = X W^T, with X (M, K) and W (N, K):
//   forward   Y  = X W^T      gemm_f32(No,  Yes, M, N, K, X, K, W, K, 0, Y, N)
//   input     dX = dY W       gemm_f32(No,  No,  M, K, N, dY, N, W, K, 0 or 1, dX, K)
//   weight    dW += dY^T X    gemm_f32(Yes, No,  N, K, M, dY, N, X, K, 1, dW, K)
void gemm_f32(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K, const float* A,
              int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc);

// The implementations behind gemm_f32. Each has the exact contract above.
enum class GemmBackend { Reference, Eigen };

// Straightforward triple loop with double accumulation: the ground truth for tests.
void gemm_f32_reference(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K,
                        const float* A, int64_t lda, const float* B, int64_t ldb, float beta,
                        float* C, int64_t ldc);
void gemm_f32_eigen(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K, const float* A,
                    int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc);

// Selects the implementation gemm_f32 calls (default: the fastest this CPU runs).
void gemm_set_backend(GemmBackend backend);
GemmBackend gemm_backend();
std::string_view gemm_backend_name(GemmBackend backend);
// Parses "reference" or "eigen"; returns false for anything else.
bool gemm_backend_from_name(std::string_view name, GemmBackend* backend);

}  // namespace cputrain::kernels
