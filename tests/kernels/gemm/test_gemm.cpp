// gemm_f32 and gemm_bf16 on every backend this CPU runs, against a naive double-precision
// product written here: every transpose combination, sizes 1 to 257 with tails in every
// dimension, padded leading dimensions, beta 0 (over NaN), 1 and 0.5, one and two threads.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/cpu/bf16.h"
#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/dispatch.h"
#include "kernels/gemm/gemm.h"
#include "kernels/gemm/gemm_isa.h"
#include "kernels/gemm/gemm_test_hooks.h"
#include "kernels/gemm/gemm_tuning.h"

namespace cputrain::kernels {
namespace {

constexpr int64_t kSizes[] = {1, 2, 3, 7, 15, 16, 17, 31, 33, 63, 65, 127, 257};
constexpr size_t kSizeCount = sizeof(kSizes) / sizeof(kSizes[0]);

template <class Vector = std::vector<float>>
Vector random_vector(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  Vector v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// random_vector's values rounded to bf16.
std::vector<uint16_t> random_bf16(size_t n, uint32_t seed) {
  const std::vector<float> f = random_vector(n, seed);
  std::vector<uint16_t> out(n);
  fp32_to_bf16_array(out.data(), f.data(), static_cast<int64_t>(n));
  return out;
}

// Storage that starts a 64-byte cache line, as the engine's tensors do (the direct path takes
// only operands whose rows start lines).
template <class T>
struct LineAllocator {
  using value_type = T;
  LineAllocator() = default;
  template <class U>
  LineAllocator(const LineAllocator<U>&) {}
  T* allocate(size_t n) {
    void* p = std::aligned_alloc(64, (n * sizeof(T) + 63) / 64 * 64);
    if (p == nullptr) throw std::bad_alloc();
    return static_cast<T*>(p);
  }
  void deallocate(T* p, size_t) { std::free(p); }
  template <class U>
  bool operator==(const LineAllocator<U>&) const {
    return true;
  }
};
using LineFloats = std::vector<float, LineAllocator<float>>;

struct Case {
  Transpose ta, tb;
  int64_t M, N, K;
  int64_t pad;  // extra columns in every leading dimension
  float beta;
  bool lines = false;  // leading dimensions (with pad) rounded up to whole 64-byte lines of floats
  int64_t lda() const { return stride((ta == Transpose::No ? K : M) + pad); }
  int64_t ldb() const { return stride((tb == Transpose::No ? N : K) + pad); }
  int64_t ldc() const { return stride(N + pad); }
  int64_t stride(int64_t columns) const { return lines ? (columns + 15) / 16 * 16 : columns; }
  int64_t a_rows() const { return ta == Transpose::No ? M : K; }
  int64_t b_rows() const { return tb == Transpose::No ? K : N; }
};

// Every size appears as M, N and K, each with every transpose combination and beta.
std::vector<Case> cases() {
  std::vector<Case> out;
  for (size_t i = 0; i < kSizeCount; ++i)
    for (size_t shift : {4u, 7u}) {
      const int64_t M = kSizes[i], N = kSizes[(i + shift) % kSizeCount],
                    K = kSizes[(i + 2 * shift) % kSizeCount];
      for (Transpose ta : {Transpose::No, Transpose::Yes})
        for (Transpose tb : {Transpose::No, Transpose::Yes})
          for (float beta : {0.0f, 1.0f, 0.5f})
            out.push_back({ta, tb, M, N, K, static_cast<int64_t>(out.size() % 3) * 5, beta});
    }
  // Whole 32 x 32 blocks with K a multiple of 32 (the AMX kernel's C through the tiles), and
  // with K = 33 (one step of tiles, then a pair on vdpbf16ps).
  for (Transpose ta : {Transpose::No, Transpose::Yes})
    for (Transpose tb : {Transpose::No, Transpose::Yes})
      for (float beta : {0.0f, 1.0f, 0.5f}) {
        out.push_back({ta, tb, 64, 96, 64, 3, beta});
        out.push_back({ta, tb, 64, 96, 33, 0, beta});
      }
  // A K longer than one cache block, and M and N beyond one packed block.
  out.push_back({Transpose::No, Transpose::Yes, 40, 70, 1100, 0, 0.0f});
  out.push_back({Transpose::Yes, Transpose::No, 2100, 33, 20, 1, 1.0f});
  out.push_back({Transpose::No, Transpose::No, 17, 2200, 9, 0, 0.5f});
  // Enough rows for the blocked path's last work items to be smaller than the others.
  out.push_back({Transpose::No, Transpose::No, 1000, 40, 30, 2, 1.0f});
  // Over 1024 columns, so B's K blocks are grouped into super-blocks (several K blocks an item
  // runs through) with a short last one, for an A stored (M, K), and one K block at a time for
  // a transposed A.
  out.push_back({Transpose::No, Transpose::No, 9, 1100, 2100, 2, 1.0f});
  out.push_back({Transpose::No, Transpose::Yes, 15, 1060, 2100, 0, 0.0f});
  out.push_back({Transpose::Yes, Transpose::No, 9, 1100, 2100, 1, 0.5f});
  // A transposed A whose rows are 2048 values apart (8 KiB in FP32, 4 KiB in bf16), which the
  // blocked path packs a few K rows at a time (rows that alias in L1): odd K, and K over one
  // block.
  out.push_back({Transpose::Yes, Transpose::No, 60, 33, 37, 2048 - 60, 1.0f});
  out.push_back({Transpose::Yes, Transpose::No, 40, 45, 1100, 2048 - 40, 0.5f});
  // Every count of rows a tile can end with (1 to 14, alone and after a whole tile): the
  // micro-kernels compute a tile's last rows in a tile of their own size. A weight gradient
  // wide enough for the fused path, and a forward product on the blocked one.
  for (int64_t M = 1; M <= 28; ++M) {
    out.push_back({Transpose::Yes, Transpose::No, M, 260, 40, M % 2, 1.0f});
    out.push_back({Transpose::No, Transpose::Yes, M, 33, 20, 0, 0.0f});
  }
  return out;
}

std::string describe(const Case& c) {
  std::ostringstream s;
  s << "M=" << c.M << " N=" << c.N << " K=" << c.K << " ta=" << (c.ta == Transpose::Yes)
    << " tb=" << (c.tb == Transpose::Yes) << " beta=" << c.beta << " pad=" << c.pad
    << (c.lines ? " (whole lines)" : "");
  return s.str();
}

// want = op(A) op(B) + beta C and scale = sum |a||b|, element by element from the storage layout.
void naive(const Case& c, const std::vector<float>& A, const std::vector<float>& B,
           const std::vector<float>& C, std::vector<double>* want, std::vector<double>* scale) {
  want->assign(C.size(), 0.0);
  scale->assign(C.size(), 0.0);
  for (int64_t i = 0; i < c.M; ++i)
    for (int64_t j = 0; j < c.N; ++j) {
      double s = 0.0, abs = 0.0;
      for (int64_t k = 0; k < c.K; ++k) {
        const double a = c.ta == Transpose::No ? A[i * c.lda() + k] : A[k * c.lda() + i];
        const double b = c.tb == Transpose::No ? B[k * c.ldb() + j] : B[j * c.ldb() + k];
        s += a * b;
        abs += std::abs(a * b);
      }
      const size_t at = i * c.ldc() + j;
      const double old = c.beta == 0.0f ? 0.0 : c.beta * static_cast<double>(C[at]);
      (*want)[at] = s + old;
      (*scale)[at] = abs + std::abs(old);
    }
}

class GemmTest : public ::testing::TestWithParam<std::tuple<GemmBackend, int>> {
 protected:
  void SetUp() override {
    saved_backend_ = gemm_backend();
    saved_threads_ = omp_get_max_threads();
    const GemmBackend backend = std::get<0>(GetParam());
    if (backend == GemmBackend::Amx && !isa_usable(Isa::Amx))
      GTEST_SKIP() << "AMX is absent on this CPU (" << cpu_features_string()
                   << ") or above CPUTRAIN_ISA: the AMX path is not tested here";
    if (backend == GemmBackend::Amx && !gemm_backend_available(backend))
      GTEST_FAIL() << "this CPU has AMX but the AMX GEMM failed its self-test against AVX-512";
    if (!gemm_backend_available(backend))
      GTEST_SKIP() << gemm_backend_name(backend) << " does not run on this CPU ("
                   << cpu_features_string() << ")";
    gemm_set_backend(std::get<0>(GetParam()));
    omp_set_num_threads(std::get<1>(GetParam()));
  }
  void TearDown() override {
    gemm_set_backend(saved_backend_);
    omp_set_num_threads(saved_threads_);
  }

  // Runs every case through `run` (which converts inputs as its data type needs) and checks
  // |got - want| <= tolerance * scale + 1e-6, and that padding columns are untouched.
  template <typename Run>
  void check_all(bool bf16_inputs, double tolerance, Run run) {
    uint32_t seed = 1;
    for (const Case& c : cases()) {
      std::vector<float> A = random_vector(c.a_rows() * c.lda(), seed++);
      std::vector<float> B = random_vector(c.b_rows() * c.ldb(), seed++);
      if (bf16_inputs) {  // the reference sees exactly the bf16 values the kernel sees
        for (float& x : A) x = bf16_to_fp32(fp32_to_bf16(x));
        for (float& x : B) x = bf16_to_fp32(fp32_to_bf16(x));
      }
      std::vector<float> C = random_vector(c.M * c.ldc(), seed++);
      if (c.beta == 0.0f)  // beta 0 must overwrite whatever C holds, NaN included
        for (int64_t i = 0; i < c.M; ++i) C[i * c.ldc()] = std::numeric_limits<float>::quiet_NaN();
      std::vector<double> want, scale;
      naive(c, A, B, C, &want, &scale);
      std::vector<float> got = C;
      run(c, A, B, got);
      for (int64_t i = 0; i < c.M; ++i)
        for (int64_t j = 0; j < c.ldc(); ++j) {
          const size_t at = i * c.ldc() + j;
          if (j >= c.N) {
            ASSERT_EQ(got[at], C[at]) << "padding written: " << describe(c);
            continue;
          }
          ASSERT_NEAR(got[at], want[at], tolerance * scale[at] + 1e-6)
              << describe(c) << " at " << i << "," << j;
        }
    }
  }

  GemmBackend saved_backend_{};
  int saved_threads_ = 1;
};

// FP32: within 2e-6 of sum |a||b| (float rounding of a K-term sum in blocks).
TEST_P(GemmTest, Fp32MatchesNaiveProduct) {
  check_all(false, 2e-6,
            [](const Case& c, const std::vector<float>& A, const std::vector<float>& B,
               std::vector<float>& C) {
              gemm_f32(c.ta, c.tb, c.M, c.N, c.K, A.data(), c.lda(), B.data(), c.ldb(), c.beta,
                       C.data(), c.ldc());
            });
}

// BF16 inputs, FP32 sums: within 1e-5 of sum |a||b| of an FP64 product of the same bf16 values.
TEST_P(GemmTest, Bf16MatchesNaiveProductOfRoundedInputs) {
  check_all(true, 1e-5,
            [](const Case& c, const std::vector<float>& A, const std::vector<float>& B,
               std::vector<float>& C) {
              std::vector<uint16_t> a(A.size()), b(B.size());
              fp32_to_bf16_array(a.data(), A.data(), static_cast<int64_t>(A.size()));
              fp32_to_bf16_array(b.data(), B.data(), static_cast<int64_t>(B.size()));
              gemm_bf16(c.ta, c.tb, c.M, c.N, c.K, a.data(), c.lda(), b.data(), c.ldb(), c.beta,
                        C.data(), c.ldc());
            });
}

TEST_P(GemmTest, EmptyInnerDimensionScalesC) {
  std::vector<float> C = {1.0f, std::numeric_limits<float>::quiet_NaN(), 3.0f, 4.0f};
  const float unused = 0.0f;
  gemm_f32(Transpose::No, Transpose::No, 2, 2, 0, &unused, 1, &unused, 2, 0.0f, C.data(), 2);
  for (float c : C) EXPECT_EQ(c, 0.0f);
  std::vector<float> D = {1.0f, 2.0f, 3.0f, 4.0f};
  gemm_f32(Transpose::No, Transpose::No, 2, 2, 0, &unused, 1, &unused, 2, 1.0f, D.data(), 2);
  EXPECT_EQ(D, (std::vector<float>{1.0f, 2.0f, 3.0f, 4.0f}));
  const uint16_t unused16 = 0;
  gemm_bf16(Transpose::No, Transpose::No, 2, 2, 0, &unused16, 1, &unused16, 2, 0.5f, D.data(), 2);
  EXPECT_EQ(D, (std::vector<float>{0.5f, 1.0f, 1.5f, 2.0f}));
}

// The rounded product is bitwise the rounding of gemm_bf16's FP32 one (beta 0), over every case
// and both sides of the kernel's one K block (512), with a NaN and an infinity among the
// inputs; padding columns are untouched. Where it is direct (the AVX-512 BF16 kernel, K within
// its block) the rounding happens in the kernel; elsewhere through an FP32 scratch.
TEST_P(GemmTest, Bf16RoundedIsTheRoundingOfTheFp32Product) {
  std::vector<Case> all = cases();
  all.push_back({Transpose::No, Transpose::Yes, 130, 97, 512, 3, 0.0f});
  all.push_back({Transpose::No, Transpose::Yes, 130, 97, 513, 0, 0.0f});
  all.push_back({Transpose::Yes, Transpose::No, 29, 70, 511, 2, 0.0f});
  uint32_t seed = 1000;
  for (const Case& c : all) {
    std::vector<uint16_t> a(c.a_rows() * c.lda()), b(c.b_rows() * c.ldb());
    const std::vector<float> A = random_vector(a.size(), seed++),
                             B = random_vector(b.size(), seed++);
    fp32_to_bf16_array(a.data(), A.data(), static_cast<int64_t>(a.size()));
    fp32_to_bf16_array(b.data(), B.data(), static_cast<int64_t>(b.size()));
    a[0] = fp32_to_bf16(std::numeric_limits<float>::quiet_NaN());
    b[b.size() - 1] = fp32_to_bf16(std::numeric_limits<float>::infinity());
    std::vector<float> f(c.M * c.ldc());
    gemm_bf16(c.ta, c.tb, c.M, c.N, c.K, a.data(), c.lda(), b.data(), c.ldb(), 0.0f, f.data(),
              c.ldc());
    std::vector<uint16_t> got(c.M * c.ldc(), 0xBEEF);
    gemm_bf16_rounded(c.ta, c.tb, c.M, c.N, c.K, a.data(), c.lda(), b.data(), c.ldb(), got.data(),
                      c.ldc());
    for (int64_t i = 0; i < c.M; ++i)
      for (int64_t j = 0; j < c.ldc(); ++j) {
        const size_t at = i * c.ldc() + j;
        ASSERT_EQ(got[at], j < c.N ? fp32_to_bf16(f[at]) : uint16_t{0xBEEF})
            << describe(c) << " at " << i << "," << j;
      }
  }
  const GemmBackend backend = std::get<0>(GetParam());
  const bool direct = backend == GemmBackend::Amx ||
                      (backend == GemmBackend::Avx512 && gemm_bf16_native(GemmBackend::Avx512));
  EXPECT_EQ(gemm_bf16_rounded_direct(512), direct);
  EXPECT_FALSE(gemm_bf16_rounded_direct(513));
}

// Each output element is computed by one thread in a fixed order, so results are bit-identical
// for any thread count.
TEST_P(GemmTest, ResultsDoNotDependOnThreadCount) {
  if (std::get<0>(GetParam()) == GemmBackend::Eigen ||
      std::get<0>(GetParam()) == GemmBackend::Onednn)
    GTEST_SKIP() << "library backends choose their own blocking per thread count";
  // A forward product, and weight gradients (A transposed, B not) accumulated into C: one of
  // fewer rows than a thread's row block (the fused path, each thread taking its own columns),
  // one of more (the direct path, each thread taking its own rows).
  for (const Case& c : {Case{Transpose::No, Transpose::Yes, 300, 200, 600, 0, 0.0f},
                        Case{Transpose::Yes, Transpose::No, 40, 520, 700, 3, 1.0f},
                        Case{Transpose::Yes, Transpose::No, 301, 333, 1100, 2, 1.0f, true}}) {
    const LineFloats A = random_vector<LineFloats>(c.a_rows() * c.lda(), 7);
    const LineFloats B = random_vector<LineFloats>(c.b_rows() * c.ldb(), 8);
    // The paths named above.
    if (std::get<0>(GetParam()) == GemmBackend::Avx512 && c.ta == Transpose::Yes) {
      const bool direct = c.M >= 2 * 64;  // a row block of 64 rows for each of two threads
      for (int threads : {1, 2}) {
        omp_set_num_threads(threads);
        EXPECT_EQ(gemm_f32_avx512_takes_direct(c.ta, c.tb, c.M, c.N, c.K, A.data(), c.lda(),
                                               B.data(), c.ldb()),
                  direct)
            << describe(c);
        EXPECT_EQ(gemm_f32_avx512_takes_fused(c.ta, c.tb, c.M, c.N, c.K), !direct) << describe(c);
      }
    }
    const std::vector<float> C = random_vector(c.M * c.ldc(), 9);
    std::vector<float> one = C, two = C;
    omp_set_num_threads(1);
    gemm_f32(c.ta, c.tb, c.M, c.N, c.K, A.data(), c.lda(), B.data(), c.ldb(), c.beta, one.data(),
             c.ldc());
    omp_set_num_threads(2);
    gemm_f32(c.ta, c.tb, c.M, c.N, c.K, A.data(), c.lda(), B.data(), c.ldb(), c.beta, two.data(),
             c.ldc());
    EXPECT_EQ(one, two) << describe(c);
  }
  // BF16, a down projection's weight gradient: the fused path there too.
  const Case c{Transpose::Yes, Transpose::No, 150, 520, 700, 2, 1.0f};
  std::vector<uint16_t> A(c.a_rows() * c.lda()), B(c.b_rows() * c.ldb());
  const std::vector<float> a = random_vector(A.size(), 10), b = random_vector(B.size(), 11);
  for (size_t i = 0; i < A.size(); ++i) A[i] = fp32_to_bf16(a[i]);
  for (size_t i = 0; i < B.size(); ++i) B[i] = fp32_to_bf16(b[i]);
  std::vector<float> one = random_vector(c.M * c.ldc(), 12), two = one;
  omp_set_num_threads(1);
  gemm_bf16(c.ta, c.tb, c.M, c.N, c.K, A.data(), c.lda(), B.data(), c.ldb(), c.beta, one.data(),
            c.ldc());
  omp_set_num_threads(2);
  gemm_bf16(c.ta, c.tb, c.M, c.N, c.K, A.data(), c.lda(), B.data(), c.ldb(), c.beta, two.data(),
            c.ldc());
  EXPECT_EQ(one, two) << "bf16 " << describe(c);
}

// A weight-gradient case's operands in FP32 and as bf16, and C; run() computes the case into
// `out` (a copy of C) in either data type on the current backend.
struct WeightGradientOperands {
  WeightGradientOperands(const Case& c_, uint32_t seed)
      : c(c_),
        a(random_vector<LineFloats>(c.a_rows() * c.lda(), seed)),
        b(random_vector<LineFloats>(c.b_rows() * c.ldb(), seed + 1)),
        C(random_vector(c.M * c.ldc(), seed + 2)),
        a16(a.size()),
        b16(b.size()) {
    for (size_t i = 0; i < a.size(); ++i) a16[i] = fp32_to_bf16(a[i]);
    for (size_t i = 0; i < b.size(); ++i) b16[i] = fp32_to_bf16(b[i]);
  }
  void run(bool bf16, std::vector<float>& out) const {
    if (bf16)
      gemm_bf16(c.ta, c.tb, c.M, c.N, c.K, a16.data(), c.lda(), b16.data(), c.ldb(), c.beta,
                out.data(), c.ldc());
    else
      gemm_f32(c.ta, c.tb, c.M, c.N, c.K, a.data(), c.lda(), b.data(), c.ldb(), c.beta, out.data(),
               c.ldc());
  }
  // The case computed with the fused and direct paths on, then off (gemm_set_fused; left off).
  std::array<std::vector<float>, 2> on_and_off(bool bf16) const {
    std::array<std::vector<float>, 2> out{C, C};
    for (int i = 0; i < 2; ++i) {
      gemm_set_fused(i == 0);
      run(bf16, out[i]);
    }
    return out;
  }
  bool takes_fused(bool bf16) const {
    return bf16 ? gemm_bf16_avx512_takes_fused(c.ta, c.tb, c.M, c.N, c.K)
                : gemm_f32_avx512_takes_fused(c.ta, c.tb, c.M, c.N, c.K);
  }
  bool takes_direct() const {
    return gemm_f32_avx512_takes_direct(c.ta, c.tb, c.M, c.N, c.K, a.data(), c.lda(), b.data(),
                                        c.ldb());
  }
  Case c;
  LineFloats a, b;
  std::vector<float> C;
  std::vector<uint16_t> a16, b16;
};

// The fused path computes each tile over the same K blocks in the same order as the blocked
// path, so the two give the same bits: weight-gradient shapes that take it in FP32 and BF16
// (tails in every dimension; K 700, 1031 and 1100, within and over the fused path's K blocks of
// 1, 2 and 3 blocks of 512, whose products store the tile after each 512; beta 1 and 0.5; more
// columns than rows and, as an FFN's up projection, more rows than columns), fused against
// blocked.
TEST_P(GemmTest, FusedPathGivesTheBlockedPathsBits) {
  if (std::get<0>(GetParam()) != GemmBackend::Avx512)
    GTEST_SKIP() << "the fused path is the avx512 kernels'";
  struct Restore {
    int k_blocks = gemm_fused_k_blocks();
    ~Restore() {
      gemm_set_fused(true);
      gemm_set_direct(true);
      gemm_set_fused_k_blocks(k_blocks);
    }
  } restore;
  gemm_set_direct(false);  // FP32 shapes like these take the direct path by default
  for (const Case& c : {Case{Transpose::Yes, Transpose::No, 300, 520, 1100, 3, 1.0f},
                        Case{Transpose::Yes, Transpose::No, 33, 1100, 700, 0, 0.5f},
                        Case{Transpose::Yes, Transpose::No, 150, 545, 1031, 1, 1.0f},
                        Case{Transpose::Yes, Transpose::No, 1003, 300, 1031, 2, 1.0f}}) {
    const WeightGradientOperands ops(c, 20);
    for (int k_blocks : {1, 2, 3}) {
      gemm_set_fused_k_blocks(k_blocks);
      for (bool bf16 : {false, true}) {
        const std::string what = std::string(bf16 ? "bf16 " : "f32 ") + describe(c) +
                                 ", fused K blocks of " + std::to_string(k_blocks) + " x 512";
        // Each shape takes the fused path, so that the comparison is not of the blocked path
        // with itself.
        gemm_set_fused(true);
        ASSERT_TRUE(ops.takes_fused(bf16)) << what;
        gemm_set_fused(false);
        ASSERT_FALSE(ops.takes_fused(bf16)) << what;
        const auto [fused, blocked] = ops.on_and_off(bf16);
        EXPECT_EQ(fused, blocked) << what;
      }
    }
  }
}

// Restores OpenMP's thread count at the end of a test.
struct RestoreThreads {
  int threads = omp_get_max_threads();
  ~RestoreThreads() { omp_set_num_threads(threads); }
};

// The direct path reads A and B where they are stored and sums each tile over the blocked path's
// K blocks, so it gives that path's bits too: shapes that take it (every row count a micro-panel
// can end with, among the threads' shares; columns short of a micro-panel; K within one block
// of 512 and over three; beta 1, 0.5 and 0), on one thread and two, against the blocked path.
TEST_P(GemmTest, DirectPathGivesTheBlockedPathsBits) {
  if (std::get<0>(GetParam()) != GemmBackend::Avx512)
    GTEST_SKIP() << "the direct path is the avx512 kernels'";
  const RestoreThreads restore_threads;
  struct Restore {
    ~Restore() { gemm_set_fused(true); }
  } restore;
  std::vector<Case> shapes = {Case{Transpose::Yes, Transpose::No, 301, 333, 1100, 2, 1.0f, true},
                              Case{Transpose::Yes, Transpose::No, 129, 512, 700, 0, 0.5f, true},
                              Case{Transpose::Yes, Transpose::No, 200, 250, 1537, 5, 0.0f, true},
                              Case{Transpose::Yes, Transpose::No, 131, 113, 300, 1, 1.0f, true}};
  for (int64_t M = 128; M < 136; ++M)  // the last micro-panel of 8 - 1 rows .. 8 rows
    shapes.push_back(Case{Transpose::Yes, Transpose::No, M, 100, 530, 1, 1.0f, true});
  for (const Case& c : shapes) {
    const WeightGradientOperands ops(c, 40);
    for (int threads : {1, 2}) {
      omp_set_num_threads(threads);
      const std::string what = describe(c) + ", " + std::to_string(threads) + " threads";
      gemm_set_fused(true);
      ASSERT_TRUE(ops.takes_direct()) << what;
      ASSERT_FALSE(ops.takes_fused(false)) << what;
      gemm_set_fused(false);
      ASSERT_FALSE(ops.takes_direct()) << what;
      const auto [direct, blocked] = ops.on_and_off(false);
      EXPECT_EQ(direct, blocked) << what;
    }
  }
}

// Which FP32 weight gradients take the direct path, on one thread and two: mega's, with up to 4x
// as many rows as columns, and not with gemm_set_direct(false) (the fused path then).
TEST(GemmPaths, DirectPathTakesTheFp32WeightGradientsOfMega) {
  if (!isa_usable(Isa::Avx512Bf16)) GTEST_SKIP() << "the direct path is the avx512 kernels'";
  ASSERT_TRUE(gemm_fused());
  const RestoreThreads restore;
  constexpr Transpose T = Transpose::Yes, N = Transpose::No;
  for (int threads : {1, 2}) {
    omp_set_num_threads(threads);
    for (const auto& [M, Ncols] :
         {std::pair{512, 512}, std::pair{1536, 512}, std::pair{512, 1536}}) {
      EXPECT_TRUE(gemm_f32_avx512_takes_direct(T, N, M, Ncols, 4096)) << M << " x " << Ncols;
      EXPECT_FALSE(gemm_f32_avx512_takes_fused(T, N, M, Ncols, 4096)) << M << " x " << Ncols;
      gemm_set_direct(false);
      EXPECT_FALSE(gemm_f32_avx512_takes_direct(T, N, M, Ncols, 4096)) << M << " x " << Ncols;
      EXPECT_TRUE(gemm_f32_avx512_takes_fused(T, N, M, Ncols, 4096)) << M << " x " << Ncols;
      gemm_set_direct(true);
    }
    // Not where rows are a multiple of 4 KiB apart (behemoth's: the fused path), nor the LM
    // head's (32x as many rows as columns: the blocked path), nor the forward product's layout.
    for (const auto& [M, Ncols] :
         {std::pair{1024, 1024}, std::pair{2816, 1024}, std::pair{1024, 2816}}) {
      EXPECT_FALSE(gemm_f32_avx512_takes_direct(T, N, M, Ncols, 2048)) << M << " x " << Ncols;
      EXPECT_TRUE(gemm_f32_avx512_takes_fused(T, N, M, Ncols, 2048)) << M << " x " << Ncols;
    }
    EXPECT_FALSE(gemm_f32_avx512_takes_direct(T, N, 16384, 512, 4096)) << threads;
    EXPECT_FALSE(gemm_f32_avx512_takes_direct(N, T, 512, 512, 4096)) << threads;
  }
}

// Operands whose rows do not start cache lines (an odd pointer or stride) take the fused path
// instead of the direct one, and give the same bits as the same values stored on lines.
TEST(GemmPaths, Fp32WeightGradientsOffCacheLinesTakeTheFusedPath) {
  if (!isa_usable(Isa::Avx512Bf16)) GTEST_SKIP() << "the direct path is the avx512 kernels'";
  ASSERT_TRUE(gemm_fused());
  const RestoreThreads restore;
  const Case c{Transpose::Yes, Transpose::No, 301, 333, 1100, 2, 1.0f, true};
  const WeightGradientOperands ops(c, 50);
  // The same values one float further on, and with strides one float longer.
  LineFloats a(ops.a.size() + 1), b(ops.b.size() + 1);
  std::copy(ops.a.begin(), ops.a.end(), a.begin() + 1);
  std::copy(ops.b.begin(), ops.b.end(), b.begin() + 1);
  const auto widen = [](const LineFloats& v, int64_t rows, int64_t ld) {
    LineFloats w(rows * (ld + 1));
    for (int64_t r = 0; r < rows; ++r)
      std::copy(v.begin() + r * ld, v.begin() + (r + 1) * ld, w.begin() + r * (ld + 1));
    return w;
  };
  const LineFloats a_wide = widen(ops.a, c.a_rows(), c.lda());
  const LineFloats b_wide = widen(ops.b, c.b_rows(), c.ldb());
  for (int threads : {1, 2}) {
    omp_set_num_threads(threads);
    const std::string what = describe(c) + ", " + std::to_string(threads) + " threads";
    ASSERT_TRUE(ops.takes_direct()) << what;
    std::vector<float> want = ops.C;
    gemm_f32_avx512(c.ta, c.tb, c.M, c.N, c.K, ops.a.data(), c.lda(), ops.b.data(), c.ldb(), c.beta,
                    want.data(), c.ldc());
    struct Off {
      const char* name;
      const float *A, *B;
      int64_t lda, ldb;
    };
    for (const Off& o : {Off{"A a float past a line", a.data() + 1, ops.b.data(), c.lda(), c.ldb()},
                         Off{"B a float past a line", ops.a.data(), b.data() + 1, c.lda(), c.ldb()},
                         Off{"A's stride", a_wide.data(), ops.b.data(), c.lda() + 1, c.ldb()},
                         Off{"B's stride", ops.a.data(), b_wide.data(), c.lda(), c.ldb() + 1}}) {
      EXPECT_FALSE(gemm_f32_avx512_takes_direct(c.ta, c.tb, c.M, c.N, c.K, o.A, o.lda, o.B, o.ldb))
          << o.name << ", " << what;
      std::vector<float> got = ops.C;
      gemm_f32_avx512(c.ta, c.tb, c.M, c.N, c.K, o.A, o.lda, o.B, o.ldb, c.beta, got.data(),
                      c.ldc());
      EXPECT_EQ(got, want) << o.name << ", " << what;
    }
  }
}

// The cases of every row count a tile can end with (cases()) reach the paths they are there for:
// the weight gradient the fused path, the forward product the blocked one.
TEST(GemmPaths, RowTailCasesReachTheFusedAndTheBlockedPath) {
  if (!isa_usable(Isa::Avx512Bf16)) GTEST_SKIP() << "the fused path is the avx512 kernels'";
  ASSERT_TRUE(gemm_fused());
  const RestoreThreads restore;
  for (int threads : {1, 2}) {
    omp_set_num_threads(threads);
    for (int64_t M = 1; M <= 28; ++M) {
      EXPECT_TRUE(gemm_f32_avx512_takes_fused(Transpose::Yes, Transpose::No, M, 260, 40)) << M;
      EXPECT_TRUE(gemm_bf16_avx512_takes_fused(Transpose::Yes, Transpose::No, M, 260, 40)) << M;
      EXPECT_FALSE(gemm_f32_avx512_takes_fused(Transpose::No, Transpose::Yes, M, 33, 20)) << M;
    }
  }
}

// The AVX-512 backend for the lifetime of the object; then the backend and OpenMP's thread count
// as they were, and the fused and direct paths on.
struct OnAvx512Kernels {
  GemmBackend backend = gemm_backend();
  int threads = omp_get_max_threads();
  OnAvx512Kernels() { gemm_set_backend(GemmBackend::Avx512); }
  ~OnAvx512Kernels() {
    gemm_set_backend(backend);
    gemm_set_fused(true);
    gemm_set_direct(true);
    omp_set_num_threads(threads);
  }
};

// On the fused path a thread that has finished its columns computes rows the others have left
// of their last K block (here the second of two). Two threads with 4 and 5 micro-panels of
// columns: the first finishes early and takes rows of the second's; the results have the bits
// of one thread's, and rows are taken (within some calls: it depends on timing, and on a loaded
// machine the two threads may not overlap in a given call).
TEST(GemmPaths, FusedRowsTakenByAnotherThreadGiveTheSameBits) {
  if (!isa_usable(Isa::Avx512Bf16)) GTEST_SKIP() << "the fused path is the avx512 kernels'";
  const OnAvx512Kernels on_avx512;
  gemm_set_direct(false);  // FP32 would take the direct path
  const WeightGradientOperands ops({Transpose::Yes, Transpose::No, 280, 9 * 32, 2048, 0, 1.0f}, 30);
  for (bool bf16 : {false, true}) {
    omp_set_num_threads(1);
    std::vector<float> one = ops.C;
    ops.run(bf16, one);
    omp_set_num_threads(2);
    ASSERT_TRUE(ops.takes_fused(bf16));
    const int64_t shared_before = gemm_fused_rows_shared();
    constexpr int kCalls = 2000;
    for (int call = 0; call < kCalls && gemm_fused_rows_shared() == shared_before; ++call) {
      std::vector<float> two = ops.C;
      ops.run(bf16, two);
      ASSERT_EQ(two, one) << (bf16 ? "bf16" : "f32") << ", call " << call;
    }
    EXPECT_GT(gemm_fused_rows_shared(), shared_before)
        << (bf16 ? "bf16" : "f32") << ": no row was taken by the other thread in " << kCalls
        << " calls";
  }
}

// Products of at most 32 columns with A not transposed (a LoRA adapter's u = X A' and g = dY B)
// take the bf16 kernel's own path, which sums as the blocked path does: the same bits, on rows
// by 8 and their tails, columns 1 to 32 (one vector and two, masked), K within a block, at a
// block's end, over several and odd (the last pair's zero), both layouts of B, strides past the
// widths (odd ones too), beta 0 over NaN, 1 and 0.5, on 1 and 2 threads; C's padding untouched.
TEST(GemmPaths, Bf16SkinnyPathGivesTheBlockedPathsBits) {
  if (!isa_usable(Isa::Avx512Bf16)) GTEST_SKIP() << "the skinny path is the avx512 kernels'";
  const OnAvx512Kernels on_avx512;
  struct Restore {
    ~Restore() { gemm_set_skinny(true); }
  } restore;
  uint32_t seed = 50;
  for (const int threads : {1, 2}) {
    omp_set_num_threads(threads);
    for (const int64_t M : {2, 9, 37, 300})
      for (const int64_t N : {1, 7, 16, 17, 32})
        for (const int64_t K : {1, 3, 64, 512, 1025})
          for (const Transpose tb : {Transpose::No, Transpose::Yes})
            for (const float beta : {0.0f, 1.0f, 0.5f}) {
              const Case c{Transpose::No, tb, M, N, K, 3, beta};
              const std::string what = describe(c) + ", " + std::to_string(threads) + " threads";
              const std::vector<uint16_t> a = random_bf16(c.a_rows() * c.lda(), seed++);
              const std::vector<uint16_t> b = random_bf16(c.b_rows() * c.ldb(), seed++);
              std::vector<float> C = random_vector(c.M * c.ldc(), seed++);
              if (beta == 0.0f)
                for (int64_t i = 0; i < M; ++i) C[i * c.ldc()] = std::nan("");
              std::vector<float> got[2] = {C, C};
              for (const bool skinny : {false, true}) {
                gemm_set_skinny(skinny);
                ASSERT_EQ(gemm_bf16_avx512_takes_skinny(c.ta, c.tb, M, N, K), skinny) << what;
                gemm_bf16(c.ta, c.tb, M, N, K, a.data(), c.lda(), b.data(), c.ldb(), beta,
                          got[skinny].data(), c.ldc());
              }
              ASSERT_EQ(0, std::memcmp(got[0].data(), got[1].data(), sizeof(float) * C.size()))
                  << what;
            }
  }
}

// The bf16 product of a CPU without bf16 instructions widens its operands as it packs them and
// runs the FP32 kernel's blocked path: the FP32 kernel's bits on the same values widened (every
// path of it gives the blocked path's bits; one row against a transposed B, which the FP32 kernel
// streams instead, within rounding), over every case of the suite on 1 and 2 threads, and
// within the naive product's tolerance; C's padding untouched.
TEST(GemmPaths, Bf16WidenedInPackingGivesTheFp32KernelsBits) {
  if (!isa_usable(Isa::Avx512)) GTEST_SKIP() << "the widened path is the avx512 kernel's";
  const OnAvx512Kernels on_avx512;
  uint32_t seed = 70;
  for (const int threads : {1, 2}) {
    omp_set_num_threads(threads);
    for (const Case& c : cases()) {
      const std::string what = describe(c) + ", " + std::to_string(threads) + " threads";
      const std::vector<uint16_t> a = random_bf16(c.a_rows() * c.lda(), seed++);
      const std::vector<uint16_t> b = random_bf16(c.b_rows() * c.ldb(), seed++);
      std::vector<float> af(a.size()), bf(b.size());
      bf16_to_fp32_array(af.data(), a.data(), static_cast<int64_t>(a.size()));
      bf16_to_fp32_array(bf.data(), b.data(), static_cast<int64_t>(b.size()));
      std::vector<float> C = random_vector(c.M * c.ldc(), seed++);
      if (c.beta == 0.0f)
        for (int64_t i = 0; i < c.M; ++i) C[i * c.ldc()] = std::nan("");
      std::vector<float> want = C, got = C;
      gemm_f32_avx512(c.ta, c.tb, c.M, c.N, c.K, af.data(), c.lda(), bf.data(), c.ldb(), c.beta,
                      want.data(), c.ldc());
      gemm_bf16_widened_avx512(c.ta, c.tb, c.M, c.N, c.K, a.data(), c.lda(), b.data(), c.ldb(),
                               c.beta, got.data(), c.ldc());
      std::vector<double> exact, scale;
      naive(c, af, bf, C, &exact, &scale);
      const bool streamed = c.M == 1 && c.ta == Transpose::No && c.tb == Transpose::Yes;
      for (int64_t i = 0; i < c.M; ++i)
        for (int64_t j = 0; j < c.ldc(); ++j) {
          const size_t at = i * c.ldc() + j;
          if (j >= c.N) {
            ASSERT_EQ(got[at], C[at]) << "padding written: " << what;
            continue;
          }
          ASSERT_NEAR(got[at], exact[at], 2e-6 * scale[at] + 1e-6) << what;
          if (!streamed) {
            ASSERT_EQ(got[at], want[at]) << what << " at " << i << "," << j;
          }
        }
    }
  }
  // gemm_bf16 takes it where the backend has no bf16 instructions (below AVX512_BF16).
  EXPECT_EQ(gemm_bf16_widens_in_packing(), !gemm_bf16_native(GemmBackend::Avx512));
}

// A weight gradient's product and its transpose, dY' U (N x r) and U' dY (r x N) with dY (T x
// N) and U (T x r) both stored along T, give the same bits on the bf16 kernel: the same pair sums
// (a times b is b times a) in the same K blocks, whichever path each takes (a LoRA adapter's dB
// is computed as its transpose, which runs faster). N within a tile and over several, r 1, 16 and
// 32, T within a block and over several, beta 0 and 1, on 1 and 2 threads.
TEST(GemmPaths, Bf16WeightGradientAndItsTransposeGiveTheSameBits) {
  if (!isa_usable(Isa::Avx512Bf16)) GTEST_SKIP() << "a property of the avx512 bf16 kernel";
  const OnAvx512Kernels on_avx512;
  uint32_t seed = 90;
  for (const int threads : {1, 2}) {
    omp_set_num_threads(threads);
    for (const int64_t N : {20, 128, 900})
      for (const int64_t r : {1, 16, 32})
        for (const int64_t T : {37, 512, 2100})
          for (const float beta : {0.0f, 1.0f}) {
            const std::vector<uint16_t> dy = random_bf16(T * N, seed++);
            const std::vector<uint16_t> u = random_bf16(T * r, seed++);
            const std::vector<float> c0 = random_vector(N * r, seed++);
            std::vector<float> direct = c0, transposed(r * N);
            for (int64_t n = 0; n < N; ++n)
              for (int64_t j = 0; j < r; ++j) transposed[j * N + n] = c0[n * r + j];
            gemm_bf16(Transpose::Yes, Transpose::No, N, r, T, dy.data(), N, u.data(), r, beta,
                      direct.data(), r);
            gemm_bf16(Transpose::Yes, Transpose::No, r, N, T, u.data(), r, dy.data(), N, beta,
                      transposed.data(), N);
            for (int64_t n = 0; n < N; ++n)
              for (int64_t j = 0; j < r; ++j)
                ASSERT_EQ(direct[n * r + j], transposed[j * N + n])
                    << "N=" << N << " r=" << r << " T=" << T << " beta=" << beta << ", " << threads
                    << " threads, at " << n << ", " << j;
          }
  }
}

// Clears the GEMM tunings at the end of a test.
struct ClearTunings {
  ~ClearTunings() { gemm_clear_tunings(); }
};

// gemm_bf16_low_rank adds its rank-r update C += U op(V) inside the blocked product, each tile
// right after its last K block: the same bits as the two products one after the other (the
// switch off). Rows short of a micro-panel and of 8, columns past one B block (with the
// tuning's NC at 128, several) and short of a micro-panel, K within a block, at its end and over
// several, both layouts of B and of V, ranks 1 (odd: the pair's zero), 16 and 33, strides past
// the widths, beta 0 over NaN, 1 and 0.5, on 1 and 2 threads; and the update's product on its
// own against the reference.
TEST(GemmPaths, Bf16LowRankUpdateGivesTheTwoProductsBits) {
  if (!isa_usable(Isa::Avx512Bf16)) GTEST_SKIP() << "the update is added by the avx512 kernel";
  const OnAvx512Kernels on_avx512;
  const ClearTunings clear;
  struct Restore {
    ~Restore() { gemm_set_low_rank(true); }
  } restore;
  uint32_t seed = 70;
  for (const int threads : {1, 2})
    for (const int64_t nc : {int64_t{0}, int64_t{128}}) {
      omp_set_num_threads(threads);
      gemm_clear_tunings();
      if (nc > 0) gemm_set_tuning(TunedGemm::Bf16Avx512, threads, {.nc = nc});
      for (const int64_t M : {2, 37, 300})
        for (const int64_t N : {33, 130, 600})
          for (const int64_t K : {3, 512, 1100})
            for (const Transpose tb : {Transpose::No, Transpose::Yes})
              for (const Transpose tv : {Transpose::No, Transpose::Yes})
                for (const int64_t r : {1, 16, 33})
                  for (const float beta : {0.0f, 1.0f, 0.5f}) {
                    const Case c{Transpose::No, tb, M, N, K, (M + N + r) % 3, beta};
                    std::ostringstream what;
                    what << describe(c) << " r=" << r << " tv=" << (tv == Transpose::Yes) << ", "
                         << threads << " threads, nc " << nc;
                    const std::vector<uint16_t> a = random_bf16(c.a_rows() * c.lda(), seed++);
                    const std::vector<uint16_t> b = random_bf16(c.b_rows() * c.ldb(), seed++);
                    const int64_t ldu = r + c.pad, ldv = (tv == Transpose::Yes ? r : N) + c.pad;
                    const std::vector<uint16_t> u = random_bf16(M * ldu, seed++);
                    const std::vector<uint16_t> v =
                        random_bf16((tv == Transpose::Yes ? N : r) * ldv, seed++);
                    const LowRankUpdate update{u.data(), ldu, v.data(), ldv, tv, r};
                    std::vector<float> C = random_vector(c.M * c.ldc(), seed++);
                    if (beta == 0.0f)
                      for (int64_t i = 0; i < M; ++i) C[i * c.ldc()] = std::nan("");
                    std::vector<float> got[2] = {C, C};
                    for (const bool fused : {false, true}) {
                      gemm_set_low_rank(fused);
                      ASSERT_EQ(gemm_bf16_low_rank_fused(c.ta, c.tb, M, N, K, r), fused)
                          << what.str();
                      gemm_bf16_low_rank(c.ta, c.tb, M, N, K, a.data(), c.lda(), b.data(), c.ldb(),
                                         beta, got[fused].data(), c.ldc(), update);
                    }
                    ASSERT_EQ(0,
                              std::memcmp(got[0].data(), got[1].data(), sizeof(float) * C.size()))
                        << what.str();
                    // The update alone (K 0 rows of the product are not a case: a zero A
                    // instead) against the reference, so that both sides cannot be wrong alike.
                    if (K != 3 || beta != 1.0f) continue;
                    const std::vector<uint16_t> zero_a(a.size(), 0);
                    std::vector<float> alone = C, want = C;
                    gemm_bf16_low_rank(c.ta, c.tb, M, N, K, zero_a.data(), c.lda(), b.data(),
                                       c.ldb(), 1.0f, alone.data(), c.ldc(), update);
                    gemm_bf16_reference(Transpose::No, tv, M, N, r, u.data(), ldu, v.data(), ldv,
                                        1.0f, want.data(), c.ldc());
                    for (int64_t i = 0; i < M; ++i)
                      for (int64_t j = 0; j < N; ++j)
                        ASSERT_NEAR(alone[i * c.ldc() + j], want[i * c.ldc() + j],
                                    1e-5f * (1.0f + std::fabs(want[i * c.ldc() + j])) * r)
                            << what.str() << " at " << i << ", " << j;
                  }
    }
}

// An LM head's products over chunks of rows that share one kept op(B): each chunk's bits are
// gemm_bf16's, whether the chunk packs B into the KeptB (the first) or reads it there (B is
// zeroed after the first chunk, so a chunk that packed it again would differ); rows short of a
// micro-panel, one row, N short of a micro-panel and over several NC blocks, K within / at /
// over a block, both layouts of B, padded strides, beta 0 over NaN and 1; 1 and 2 threads, K
// blocks one super-block at a time (super_block_kib 64), and a change of thread count between
// chunks whose tunings differ in NC (packed again, the same bits).
TEST(GemmPaths, Bf16KeptBGivesEachProductsBits) {
  if (!isa_usable(Isa::Avx512Bf16)) GTEST_SKIP() << "B is kept by the avx512 kernel";
  const OnAvx512Kernels on_avx512;
  const ClearTunings clear;
  struct Restore {
    ~Restore() { gemm_set_kept_b(true); }
  } restore;
  uint32_t seed = 90;
  const std::vector<int64_t> chunks = {37, 64, 1, 2, 29};
  const int64_t M = 37 + 64 + 1 + 2 + 29;
  for (const int threads : {1, 2})
    for (const int64_t nc : {int64_t{0}, int64_t{128}})
      for (const int64_t N : {33, 130, 600})
        for (const int64_t K : {3, 512, 1100})
          for (const Transpose tb : {Transpose::No, Transpose::Yes})
            for (const float beta : {0.0f, 1.0f})
              for (const bool switch_threads : {false, true}) {
                if (switch_threads && (threads != 2 || nc == 0)) continue;
                omp_set_num_threads(threads);
                gemm_clear_tunings();
                // (Products too small for two threads run on one: the same NC on both, but
                // where the thread count switches.)
                if (nc > 0)
                  for (const int t : {1, 2})
                    if (t == threads || !switch_threads)
                      gemm_set_tuning(TunedGemm::Bf16Avx512, t, {.nc = nc, .super_block_kib = 64});
                const Case c{Transpose::No, tb, M, N, K, (N + K) % 3, beta};
                std::ostringstream what;
                what << describe(c) << ", " << threads << " threads, nc " << nc
                     << (switch_threads ? ", one thread from the second chunk on" : "");
                const std::vector<uint16_t> a = random_bf16(c.a_rows() * c.lda(), seed++);
                std::vector<uint16_t> b = random_bf16(c.b_rows() * c.ldb(), seed++);
                const std::vector<uint16_t> b0 = b;
                std::vector<float> C = random_vector(c.M * c.ldc(), seed++);
                if (beta == 0.0f)
                  for (int64_t i = 0; i < M; ++i) C[i * c.ldc()] = std::nan("");
                std::vector<float> got = C, want = C;
                gemm_set_kept_b(true);
                const size_t bytes = gemm_bf16_kept_b_bytes(N, K);
                ASSERT_GE(bytes, static_cast<size_t>(N * K) * 2) << what.str();
                LineFloats kept_data(bytes / sizeof(float));
                KeptB kept{kept_data.data()};
                int64_t r0 = 0;
                for (const int64_t m : chunks) {
                  const bool keeps = gemm_bf16_keeps_b(tb, m, N, K);
                  ASSERT_EQ(keeps, !(m == 1 && tb == Transpose::Yes)) << what.str() << " m " << m;
                  // (One row of a transposed B is gemm_bf16's own product, which reads B.)
                  gemm_bf16_kept(tb, m, N, K, a.data() + r0 * c.lda(), c.lda(),
                                 keeps ? b.data() : b0.data(), c.ldb(), beta,
                                 got.data() + r0 * c.ldc(), c.ldc(), kept);
                  gemm_bf16(Transpose::No, tb, m, N, K, a.data() + r0 * c.lda(), c.lda(), b0.data(),
                            c.ldb(), beta, want.data() + r0 * c.ldc(), c.ldc());
                  ASSERT_EQ(0, std::memcmp(got.data() + r0 * c.ldc(), want.data() + r0 * c.ldc(),
                                           sizeof(float) * m * c.ldc()))
                      << what.str() << ", rows " << r0 << " + " << m;
                  if (r0 == 0) {
                    ASSERT_GT(kept.packed_nc, 0) << what.str();
                    if (switch_threads)
                      omp_set_num_threads(1);
                    else
                      std::fill(b.begin(), b.end(), uint16_t{0});
                  }
                  r0 += m;
                }
              }
}

// Where a thread's B block on the fused path is larger than L2, bf16 packs A once for all
// threads: a row's packed A is taken from a shared slot another thread has filled, or packed
// where it is not ready. The bits are the blocked path's: 2 threads with 18 micro-panels of
// columns each and 3 threads with 18, K over three blocks of 1024 (the third refills the first
// block's slots), rows ending short of a micro-panel, beta 1 and 0; and rows are read from the
// shared slots. The threshold is the tuning's L2 of 1 MiB, whatever this CPU's L2.
TEST(GemmPaths, Bf16FusedSharedPackingOfAGivesTheBlockedPathsBits) {
  if (!isa_usable(Isa::Avx512Bf16)) GTEST_SKIP() << "the fused path is the avx512 kernels'";
  const OnAvx512Kernels on_avx512;
  const ClearTunings clear;
  for (const int threads : {2, 3})
    gemm_set_tuning(TunedGemm::Bf16Avx512, threads, {.shared_a_kib = 1024});
  struct Setting {
    int threads;
    Case c;
  };
  for (const Setting& s : {Setting{2, {Transpose::Yes, Transpose::No, 100, 1100, 2600, 0, 1.0f}},
                           Setting{3, {Transpose::Yes, Transpose::No, 61, 1700, 2100, 0, 0.0f}}}) {
    omp_set_num_threads(s.threads);
    const WeightGradientOperands ops(s.c, 40);
    const std::string what = describe(s.c) + ", " + std::to_string(s.threads) + " threads";
    gemm_set_fused(true);
    ASSERT_TRUE(ops.takes_fused(true)) << what;
    gemm_set_fused(false);
    std::vector<float> blocked = ops.C;
    ops.run(true, blocked);
    gemm_set_fused(true);
    const int64_t read_before = gemm_fused_rows_a_shared();
    for (int call = 0; call < 3; ++call) {
      std::vector<float> fused = ops.C;
      ops.run(true, fused);
      ASSERT_EQ(fused, blocked) << what << ", call " << call;
    }
    EXPECT_GT(gemm_fused_rows_a_shared(), read_before)
        << what << ": no row read its packed A from the shared slots";
  }
}

// The tuned blocking (gemm_tuning.h) decides only how a product is split into work items and
// packed blocks, never the order in which a tile sums its K: every tuning gives the default's
// bits. Forward, input-gradient and weight-gradient shapes with tails, over several column
// blocks, super-blocks and fused K blocks (and the bf16 fused path with A shared where its B
// block passes the tuning's threshold), under tunings at the edges of each field's range.
TEST_P(GemmTest, AnyTuningGivesTheDefaultsBits) {
  const GemmBackend backend = std::get<0>(GetParam());
  if (backend != GemmBackend::Avx512 && backend != GemmBackend::Amx)
    GTEST_SKIP() << "the tuning is our blocked kernels'";
  const ClearTunings clear;
  const int threads = std::get<1>(GetParam());
  const std::vector<GemmTuning> tunings = {
      {.row_panels = 1, .nc = 128, .super_block_kib = 64},
      {.row_panels = 3, .nc = 384, .super_block_kib = 64 << 10},
      {.shared_a_kib = 64, .fused_k_blocks = 1, .fused_panels = 64},
      {.fused_panels = 1},
      {.row_panels = 64, .nc = 1 << 16, .shared_a_kib = 64, .fused_k_blocks = 3, .fused_panels = 5},
  };
  const std::vector<Case> shapes = {
      Case{Transpose::No, Transpose::Yes, 300, 1100, 1100, 1, 0.0f},
      Case{Transpose::No, Transpose::No, 97, 700, 2100, 0, 1.0f},
      Case{Transpose::Yes, Transpose::No, 150, 545, 1031, 1, 1.0f},
      Case{Transpose::Yes, Transpose::No, 61, 1700, 2100, 0, 0.5f},
      Case{Transpose::Yes, Transpose::No, 301, 333, 1100, 2, 1.0f, true},
  };
  const int64_t a_shared_before = gemm_fused_rows_a_shared();
  for (const Case& c : shapes) {
    const WeightGradientOperands ops(c, 50);
    for (bool bf16 : {false, true}) {
      if (!bf16 && backend == GemmBackend::Amx) continue;  // AMX runs bf16 products only
      gemm_clear_tunings();
      std::vector<float> want = ops.C;
      ops.run(bf16, want);
      for (const GemmTuning& t : tunings) {
        for (int g = 0; g < kTunedGemms; ++g)
          gemm_set_tuning(static_cast<TunedGemm>(g), threads, t);
        std::vector<float> got = ops.C;
        ops.run(bf16, got);
        ASSERT_EQ(got, want) << (bf16 ? "bf16 " : "f32 ") << describe(c) << ", "
                             << gemm_tuning_string(gemm_tuning(TunedGemm::Bf16Avx512, threads));
      }
    }
  }
  // The tuning reached the plan: a low shared_a_kib has bf16 weight gradients share packed A
  // (where bf16 products run on vdpbf16ps rather than widened to FP32).
  if (backend == GemmBackend::Avx512 && threads > 1 && isa_usable(Isa::Avx512Bf16)) {
    EXPECT_GT(gemm_fused_rows_a_shared(), a_shared_before);
  }
}

// A tuning out of range is refused with the field's name; zeros keep the defaults.
TEST(GemmTuningValues, RangesAndDefaults) {
  const ClearTunings clear;
  const GemmTuning defaults = gemm_default_tuning(TunedGemm::Bf16Avx512);
  EXPECT_EQ(gemm_tuning(TunedGemm::Bf16Avx512, 2), defaults);
  EXPECT_EQ(defaults.shared_a_kib, cpu_caches().l2 >> 10);
  gemm_set_tuning(TunedGemm::Bf16Avx512, 2, {.nc = 256});
  GemmTuning want = defaults;
  want.nc = 256;
  EXPECT_EQ(gemm_tuning(TunedGemm::Bf16Avx512, 2), want);
  EXPECT_EQ(gemm_tuning(TunedGemm::Bf16Avx512, 1), defaults);  // set for 2 threads only
  EXPECT_EQ(gemm_tuning(TunedGemm::F32Avx512, 2), gemm_default_tuning(TunedGemm::F32Avx512));
  auto refused = [](const GemmTuning& t) -> std::string {
    try {
      gemm_set_tuning(TunedGemm::F32Avx512, 2, t, "tuning.json");
    } catch (const std::invalid_argument& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_EQ(refused({.nc = 200}),
            "tuning.json: nc 200 is not in 128..65536 or not a multiple of 128");
  EXPECT_EQ(refused({.row_panels = -1}), "tuning.json: row_panels -1 is not in 1..64");
  EXPECT_EQ(refused({.fused_k_blocks = 17}), "tuning.json: fused_k_blocks 17 is not in 1..16");
  EXPECT_THROW(gemm_set_tuning(TunedGemm::F32Avx512, 0, {}), std::invalid_argument);
  TunedGemm g{};
  ASSERT_TRUE(tuned_gemm_from_name("bf16_amx", &g));
  EXPECT_EQ(g, TunedGemm::Bf16Amx);
  EXPECT_FALSE(tuned_gemm_from_name("bf16", &g));
}

// cpuid's cache descriptors (leaf 4 / 0x8000001D): a Zen 4 core's L1d (32 KiB, 8-way), L1i, L2
// (1 MiB, 8-way) and L3 (32 MiB, 16-way, shared by 16 logical processors).
TEST(CpuCaches, ParsesTheCacheLeaves) {
  auto leaf = [](uint32_t type, uint32_t level, int64_t ways, int64_t bytes, uint32_t sharing) {
    const int64_t sets = bytes / ways / 64;
    return std::array<uint32_t, 3>{type | (level << 5) | ((sharing - 1) << 14),
                                   static_cast<uint32_t>(((ways - 1) << 22) | 63),
                                   static_cast<uint32_t>(sets - 1)};
  };
  const CpuCaches c = parse_cache_leaves({leaf(1, 1, 8, 32 << 10, 2), leaf(2, 1, 8, 32 << 10, 2),
                                          leaf(3, 2, 8, 1 << 20, 2), leaf(3, 3, 16, 32 << 20, 16)});
  EXPECT_TRUE(c.from_cpuid);
  EXPECT_EQ(c.l1d, 32 << 10);
  EXPECT_EQ(c.l1d_way, 4 << 10);
  EXPECT_EQ(c.l2, 1 << 20);
  EXPECT_EQ(c.l3, 32 << 20);
  EXPECT_EQ(c.l3_sharing, 16);
  EXPECT_FALSE(parse_cache_leaves({}).from_cpuid);  // the assumed figures
}

INSTANTIATE_TEST_SUITE_P(Backends, GemmTest,
                         ::testing::Combine(::testing::Values(GemmBackend::Reference,
                                                              GemmBackend::Eigen,
                                                              GemmBackend::Avx512, GemmBackend::Amx,
                                                              GemmBackend::Onednn),
                                            ::testing::Values(1, 2)),
                         [](const auto& info) {
                           std::ostringstream name;
                           name << gemm_backend_name(std::get<0>(info.param)) << "_"
                                << std::get<1>(info.param) << "threads";
                           return name.str();
                         });

TEST(GemmBackendNames, RoundTripAndAvailability) {
  for (GemmBackend b : {GemmBackend::Reference, GemmBackend::Eigen, GemmBackend::Avx512,
                        GemmBackend::Amx, GemmBackend::Onednn}) {
    GemmBackend parsed{};
    ASSERT_TRUE(gemm_backend_from_name(gemm_backend_name(b), &parsed));
    EXPECT_EQ(parsed, b);
  }
  GemmBackend parsed{};
  EXPECT_FALSE(gemm_backend_from_name("avx9000", &parsed));
  EXPECT_FALSE(gemm_backend_from_name("", &parsed));
  EXPECT_TRUE(gemm_backend_available(GemmBackend::Reference));
  EXPECT_EQ(gemm_backend_available(GemmBackend::Avx512), isa_usable(Isa::Avx512));
  // Where the CPU has AMX (and CPUTRAIN_ISA allows it), the AMX GEMM must pass its start-up
  // self-test and, unless a backend is forced, be the default.
  EXPECT_EQ(gemm_backend_available(GemmBackend::Amx), isa_usable(Isa::Amx));
  if (isa_usable(Isa::Amx) && !std::getenv("CPUTRAIN_GEMM")) {
    EXPECT_EQ(gemm_default_backend(), GemmBackend::Amx);
  }
  EXPECT_TRUE(gemm_backend_available(gemm_default_backend()));
}

}  // namespace
}  // namespace cputrain::kernels
