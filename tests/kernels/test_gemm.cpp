// gemm_f32 against a naive double-precision product written here, over every transpose
// combination, odd sizes with tails, padded leading dimensions, beta 0/1/other, each backend
// and one and two threads.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <limits>
#include <random>
#include <tuple>
#include <vector>

#include "kernels/gemm.h"

namespace cputrain::kernels {
namespace {

std::vector<float> random_vector(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

struct Case {
  Transpose ta, tb;
  int64_t M, N, K;
  int64_t pad;  // extra columns in every leading dimension
  float beta;
};

// C = op(A) op(B) + beta C, with element access spelled out from the storage layout.
std::vector<double> naive(const Case& c, const std::vector<float>& A, int64_t lda,
                          const std::vector<float>& B, int64_t ldb, const std::vector<float>& C,
                          int64_t ldc) {
  std::vector<double> out(C.begin(), C.end());
  for (int64_t i = 0; i < c.M; ++i)
    for (int64_t j = 0; j < c.N; ++j) {
      double s = 0.0;
      for (int64_t k = 0; k < c.K; ++k) {
        const double a = c.ta == Transpose::No ? A[i * lda + k] : A[k * lda + i];
        const double b = c.tb == Transpose::No ? B[k * ldb + j] : B[j * ldb + k];
        s += a * b;
      }
      out[i * ldc + j] = s + (c.beta == 0.0f ? 0.0 : c.beta * static_cast<double>(C[i * ldc + j]));
    }
  return out;
}

class GemmTest : public ::testing::TestWithParam<std::tuple<GemmBackend, int>> {
 protected:
  void SetUp() override {
    saved_backend_ = gemm_backend();
    saved_threads_ = omp_get_max_threads();
    gemm_set_backend(std::get<0>(GetParam()));
    omp_set_num_threads(std::get<1>(GetParam()));
  }
  void TearDown() override {
    gemm_set_backend(saved_backend_);
    omp_set_num_threads(saved_threads_);
  }
  GemmBackend saved_backend_{};
  int saved_threads_ = 1;
};

TEST_P(GemmTest, MatchesNaiveProduct) {
  std::vector<Case> cases;
  const int64_t sizes[][3] = {{1, 1, 1}, {3, 5, 7}, {17, 33, 65}, {64, 48, 32}, {129, 31, 257},
                              {2, 300, 1}, {31, 1, 100}};
  uint32_t seed = 1;
  for (const auto& s : sizes)
    for (Transpose ta : {Transpose::No, Transpose::Yes})
      for (Transpose tb : {Transpose::No, Transpose::Yes})
        for (float beta : {0.0f, 1.0f, 0.5f})
          cases.push_back({ta, tb, s[0], s[1], s[2], (seed++ % 3) * 3, beta});
  for (const Case& c : cases) {
    const int64_t a_rows = c.ta == Transpose::No ? c.M : c.K;
    const int64_t a_cols = c.ta == Transpose::No ? c.K : c.M;
    const int64_t b_rows = c.tb == Transpose::No ? c.K : c.N;
    const int64_t b_cols = c.tb == Transpose::No ? c.N : c.K;
    const int64_t lda = a_cols + c.pad, ldb = b_cols + c.pad, ldc = c.N + c.pad;
    const std::vector<float> A = random_vector(a_rows * lda, seed++);
    const std::vector<float> B = random_vector(b_rows * ldb, seed++);
    std::vector<float> C = random_vector(c.M * ldc, seed++);
    if (c.beta == 0.0f)  // beta 0 must overwrite whatever C holds, NaN included
      for (int64_t i = 0; i < c.M; ++i) C[i * ldc] = std::numeric_limits<float>::quiet_NaN();
    const std::vector<double> want = naive(c, A, lda, B, ldb, C, ldc);
    std::vector<float> got = C;
    gemm_f32(c.ta, c.tb, c.M, c.N, c.K, A.data(), lda, B.data(), ldb, c.beta, got.data(), ldc);
    const double tol = 1e-5 * std::sqrt(static_cast<double>(c.K)) + 1e-6;
    for (int64_t i = 0; i < c.M; ++i) {
      for (int64_t j = 0; j < ldc; ++j) {
        const size_t at = i * ldc + j;
        if (j >= c.N) {  // padding is never written
          ASSERT_EQ(got[at], C[at]);
          continue;
        }
        ASSERT_NEAR(got[at], want[at], tol)
            << "M=" << c.M << " N=" << c.N << " K=" << c.K << " ta=" << (c.ta == Transpose::Yes)
            << " tb=" << (c.tb == Transpose::Yes) << " beta=" << c.beta << " at " << i << ","
            << j;
      }
    }
  }
}

TEST_P(GemmTest, EmptyInnerDimensionScalesC) {
  std::vector<float> C = {1.0f, std::numeric_limits<float>::quiet_NaN(), 3.0f, 4.0f};
  const float unused = 0.0f;
  gemm_f32(Transpose::No, Transpose::No, 2, 2, 0, &unused, 1, &unused, 2, 0.0f, C.data(), 2);
  for (float c : C) EXPECT_EQ(c, 0.0f);
  std::vector<float> D = {1.0f, 2.0f, 3.0f, 4.0f};
  gemm_f32(Transpose::No, Transpose::No, 2, 2, 0, &unused, 1, &unused, 2, 1.0f, D.data(), 2);
  EXPECT_EQ(D, (std::vector<float>{1.0f, 2.0f, 3.0f, 4.0f}));
}

INSTANTIATE_TEST_SUITE_P(Backends, GemmTest,
                         ::testing::Combine(::testing::Values(GemmBackend::Reference,
                                                              GemmBackend::Eigen),
                                            ::testing::Values(1, 2)),
                         [](const auto& info) {
                           return std::string(gemm_backend_name(std::get<0>(info.param))) + "_" +
                                  std::to_string(std::get<1>(info.param)) + "threads";
                         });

TEST(GemmBackendNames, RoundTrip) {
  for (GemmBackend b : {GemmBackend::Reference, GemmBackend::Eigen}) {
    GemmBackend parsed{};
    ASSERT_TRUE(gemm_backend_from_name(gemm_backend_name(b), &parsed));
    EXPECT_EQ(parsed, b);
  }
  GemmBackend parsed{};
  EXPECT_FALSE(gemm_backend_from_name("avx9000", &parsed));
  EXPECT_FALSE(gemm_backend_from_name("", &parsed));
}

}  // namespace
}  // namespace cputrain::kernels
