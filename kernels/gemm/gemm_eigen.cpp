// The GEMM on Eigen's FP32 product, through row-major maps of the stored matrices.
#include <Eigen/Core>

#include "kernels/gemm/gemm_isa.h"

namespace cputrain::kernels {
namespace {

using RowMajor = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using ConstMap = Eigen::Map<const RowMajor, Eigen::Unaligned, Eigen::OuterStride<>>;
using MutMap = Eigen::Map<RowMajor, Eigen::Unaligned, Eigen::OuterStride<>>;

}  // namespace

void gemm_f32_eigen(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K, const float* A,
                    int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  if (K == 0) return detail::scale_c(C, M, N, ldc, beta);
  MutMap c(C, M, N, Eigen::OuterStride<>(ldc));
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

}  // namespace cputrain::kernels
