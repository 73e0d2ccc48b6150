#include "kernels/gemm.h"

#include <Eigen/Core>
#include <atomic>
#include <cstdlib>
#include <stdexcept>
#include <string>

namespace cputrain::kernels {
namespace {

using RowMajor = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using ConstMap = Eigen::Map<const RowMajor, Eigen::Unaligned, Eigen::OuterStride<>>;
using MutMap = Eigen::Map<RowMajor, Eigen::Unaligned, Eigen::OuterStride<>>;

GemmBackend initial_backend() {
  const char* env = std::getenv("CPUTRAIN_GEMM");
  GemmBackend backend = GemmBackend::Eigen;
  if (env != nullptr && *env != '\0' && !gemm_backend_from_name(env, &backend))
    throw std::invalid_argument(std::string("CPUTRAIN_GEMM: unknown GEMM backend '") + env +
                                "' (expected reference or eigen)");
  return backend;
}

std::atomic<GemmBackend>& backend_slot() {
  static std::atomic<GemmBackend> slot{initial_backend()};
  return slot;
}

}  // namespace

void gemm_f32_reference(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K,
                        const float* A, int64_t lda, const float* B, int64_t ldb, float beta,
                        float* C, int64_t ldc) {
  const bool at = ta == Transpose::Yes, bt = tb == Transpose::Yes;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t j = 0; j < N; ++j) {
      double sum = 0.0;
      for (int64_t k = 0; k < K; ++k) {
        const double a = at ? A[k * lda + i] : A[i * lda + k];
        const double b = bt ? B[j * ldb + k] : B[k * ldb + j];
        sum += a * b;
      }
      float& c = C[i * ldc + j];
      c = beta == 0.0f ? static_cast<float>(sum)
                       : static_cast<float>(sum + static_cast<double>(beta) * c);
    }
  }
}

void gemm_f32_eigen(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K, const float* A,
                    int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  MutMap c(C, M, N, Eigen::OuterStride<>(ldc));
  if (K == 0) {
    if (beta == 0.0f)
      c.setZero();
    else
      c *= beta;
    return;
  }
  const bool at = ta == Transpose::Yes, bt = tb == Transpose::Yes;
  // op(A) and op(B) as expressions over row-major maps of the stored matrices.
  const ConstMap a(A, at ? K : M, at ? M : K, Eigen::OuterStride<>(lda));
  const ConstMap b(B, bt ? N : K, bt ? K : N, Eigen::OuterStride<>(ldb));
  auto run = [&](const auto& opa, const auto& opb) {
    if (beta == 0.0f) {
      c.noalias() = opa * opb;
    } else {
      if (beta != 1.0f) c *= beta;
      c.noalias() += opa * opb;
    }
  };
  if (!at && !bt) run(a, b);
  if (!at && bt) run(a, b.transpose());
  if (at && !bt) run(a.transpose(), b);
  if (at && bt) run(a.transpose(), b.transpose());
}

void gemm_f32(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K, const float* A,
              int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  switch (gemm_backend()) {
    case GemmBackend::Reference:
      gemm_f32_reference(ta, tb, M, N, K, A, lda, B, ldb, beta, C, ldc);
      return;
    case GemmBackend::Eigen:
      gemm_f32_eigen(ta, tb, M, N, K, A, lda, B, ldb, beta, C, ldc);
      return;
  }
}

void gemm_set_backend(GemmBackend backend) { backend_slot().store(backend); }

GemmBackend gemm_backend() { return backend_slot().load(std::memory_order_relaxed); }

std::string_view gemm_backend_name(GemmBackend backend) {
  switch (backend) {
    case GemmBackend::Reference:
      return "reference";
    case GemmBackend::Eigen:
      return "eigen";
  }
  return "unknown";
}

bool gemm_backend_from_name(std::string_view name, GemmBackend* backend) {
  for (GemmBackend b : {GemmBackend::Reference, GemmBackend::Eigen}) {
    if (name == gemm_backend_name(b)) {
      *backend = b;
      return true;
    }
  }
  return false;
}

}  // namespace cputrain::kernels
