// Embedding, RMSNorm, RoPE, SwiGLU, cross-entropy and the vector sums against double-precision
// references written here; backward kernels against numerical gradients of those references,
// starting from non-zero gradients since every backward kernel accumulates.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <iterator>
#include <limits>

#include "kernels/cpu/bf16.h"
#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/vec16.h"
#include "kernels/kernel_test_util.h"
#include "kernels/ops/cross_entropy.h"
#include "kernels/ops/cross_entropy_isa.h"
#include "kernels/ops/embedding.h"
#include "kernels/ops/rmsnorm.h"
#include "kernels/ops/rope.h"
#include "kernels/ops/swiglu.h"
#include "kernels/ops/swiglu_isa.h"
#include "kernels/ops/vector_add.h"

namespace cputrain::kernels {
namespace {

using test::max_error;
using test::numerical_gradient;
using test::plus;
using test::random_floats;
using test::ThreadCount;
using test::to_double;

// Adds `base` to a gradient so it can be compared with an accumulating kernel's output.
TEST(Embedding, ForwardGathersAndBackwardScattersRepeats) {
  const int64_t V = 11, C = 70, N = 9;  // C spans a column block and a tail
  const std::vector<int32_t> tokens = {3, 0, 10, 3, 3, 7, 0, 5, 10};
  const std::vector<float> table = random_floats(V * C, 1);
  std::vector<float> out(N * C);
  embedding_forward(out.data(), tokens.data(), table.data(), N, C);
  for (int64_t i = 0; i < N; ++i)
    for (int64_t c = 0; c < C; ++c) ASSERT_EQ(out[i * C + c], table[tokens[i] * C + c]);

  const std::vector<float> dout = random_floats(N * C, 2);
  const std::vector<float> base = random_floats(V * C, 3);
  std::vector<double> want(base.begin(), base.end());
  for (int64_t i = 0; i < N; ++i)
    for (int64_t c = 0; c < C; ++c) want[tokens[i] * C + c] += dout[i * C + c];
  for (int threads : {1, 2}) {
    ThreadCount tc(threads);
    std::vector<float> dtable = base;
    embedding_backward(dtable.data(), dout.data(), tokens.data(), N, C);
    EXPECT_LT(max_error(dtable, want), 1e-6) << threads << " threads";
  }
}

double rmsnorm_ref(const std::vector<double>& x, const std::vector<double>& w,
                   const std::vector<float>& dout, int64_t N, int64_t C, float eps,
                   std::vector<double>* y_out = nullptr) {
  double loss = 0.0;
  for (int64_t i = 0; i < N; ++i) {
    double ss = 0.0;
    for (int64_t c = 0; c < C; ++c) ss += x[i * C + c] * x[i * C + c];
    const double r = 1.0 / std::sqrt(ss / C + eps);
    for (int64_t c = 0; c < C; ++c) {
      const double y = x[i * C + c] * r * w[c];
      if (y_out) (*y_out)[i * C + c] = y;
      loss += y * dout[i * C + c];
    }
  }
  return loss;
}

TEST(RmsNorm, ForwardAndBackwardMatchReference) {
  const int64_t N = 37, C = 19;  // dweight sums over more than one row block
  const float eps = 1e-5f;
  const std::vector<float> x = random_floats(N * C, 4, -2.0f, 2.0f);
  const std::vector<float> w = random_floats(C, 5, 0.5f, 1.5f);
  const std::vector<float> dout = random_floats(N * C, 6);
  std::vector<double> y_ref(N * C);
  rmsnorm_ref(to_double(x), to_double(w), dout, N, C, eps, &y_ref);
  std::vector<float> y(N * C), rstd(N);
  rmsnorm_forward(y.data(), rstd.data(), x.data(), w.data(), N, C, eps);
  EXPECT_LT(max_error(y, y_ref), 1e-6);
  // The bf16-output forward: the roundings of y and of x, the same rstd.
  std::vector<uint16_t> y16(N * C), x16_fwd(N * C);
  std::vector<float> rstd16(N);
  rmsnorm_forward_bf16(y16.data(), x16_fwd.data(), rstd16.data(), x.data(), w.data(), N, C, eps);
  EXPECT_EQ(rstd16, rstd);
  for (int64_t i = 0; i < N * C; ++i) {
    ASSERT_EQ(y16[i], fp32_to_bf16(y[i])) << i;
    ASSERT_EQ(x16_fwd[i], fp32_to_bf16(x[i])) << i;
  }

  const auto fx = [&](const std::vector<double>& xv) {
    return rmsnorm_ref(xv, to_double(w), dout, N, C, eps);
  };
  const auto fw = [&](const std::vector<double>& wv) {
    return rmsnorm_ref(to_double(x), wv, dout, N, C, eps);
  };
  const std::vector<float> dx0 = random_floats(N * C, 7), dw0 = random_floats(C, 8);
  const std::vector<double> want_dx = plus(numerical_gradient(fx, to_double(x)), dx0);
  const std::vector<double> want_dw = plus(numerical_gradient(fw, to_double(w)), dw0);
  std::vector<float> first_dw;
  for (int threads : {1, 2}) {
    ThreadCount tc(threads);
    std::vector<float> dx = dx0, dw = dw0;
    rmsnorm_backward(dx.data(), dw.data(), dout.data(), x.data(), w.data(), rstd.data(), N, C,
                     true);
    EXPECT_LT(max_error(dx, want_dx), 1e-5);
    EXPECT_LT(max_error(dw, want_dw), 1e-5);
    if (first_dw.empty())
      first_dw = dw;
    else
      EXPECT_EQ(dw, first_dw) << "dweight depends on the thread count";
  }
  // From a bf16 input: exactly what the FP32 kernel gives on the same values.
  std::vector<uint16_t> x16(N * C);
  std::vector<float> xr(N * C);
  for (int64_t i = 0; i < N * C; ++i) {
    x16[i] = fp32_to_bf16(x[i]);
    xr[i] = bf16_to_fp32(x16[i]);
  }
  std::vector<float> dx32 = dx0, dw32 = dw0, dx16 = dx0, dw16 = dw0;
  rmsnorm_backward(dx32.data(), dw32.data(), dout.data(), xr.data(), w.data(), rstd.data(), N, C,
                   true);
  rmsnorm_backward(dx16.data(), dw16.data(), dout.data(), x16.data(), w.data(), rstd.data(), N, C,
                   true);
  EXPECT_EQ(dx16, dx32);
  EXPECT_EQ(dw16, dw32);
}

// Both pairings, each against a reference that rotates its own pairs: adjacent (x[2j],
// x[2j+1]) and half-split (x[j], x[j + D/2]), whose j-th pair turns at the j-th frequency.
class Rope : public ::testing::TestWithParam<bool> {};

TEST_P(Rope, TableForwardAndBackward) {
  const bool half_split = GetParam();
  const int64_t B = 2, T = 5, H = 3, D = 6;
  const double theta = half_split ? 1e6 : 10000.0;
  std::vector<float> table(T * D);
  rope_table(table.data(), T, D, theta);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < D / 2; ++j) {
      const double angle = t * std::pow(theta, -2.0 * j / D);
      ASSERT_FLOAT_EQ(table[(t * D / 2 + j) * 2], static_cast<float>(std::cos(angle)));
      ASSERT_FLOAT_EQ(table[(t * D / 2 + j) * 2 + 1], static_cast<float>(std::sin(angle)));
    }
  const int64_t n = B * T * H * D;
  const std::vector<float> x = random_floats(n, 9);
  const std::vector<float> dout = random_floats(n, 10);
  const auto ref = [&](const std::vector<double>& xv, std::vector<double>* y) {
    double loss = 0.0;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < T; ++t)
        for (int64_t h = 0; h < H; ++h)
          for (int64_t j = 0; j < D / 2; ++j) {
            const int64_t head = ((b * T + t) * H + h) * D;
            const int64_t i0 = half_split ? head + j : head + 2 * j;
            const int64_t i1 = half_split ? head + j + D / 2 : head + 2 * j + 1;
            const double c = table[(t * D / 2 + j) * 2], s = table[(t * D / 2 + j) * 2 + 1];
            const double y0 = xv[i0] * c - xv[i1] * s, y1 = xv[i0] * s + xv[i1] * c;
            if (y) (*y)[i0] = y0, (*y)[i1] = y1;
            loss += y0 * dout[i0] + y1 * dout[i1];
          }
    return loss;
  };
  std::vector<double> y_ref(n);
  ref(to_double(x), &y_ref);
  std::vector<float> y(n);
  rope_forward(y.data(), x.data(), table.data(), B, T, H, D, half_split);
  EXPECT_LT(max_error(y, y_ref), 1e-6);
  std::vector<float> inplace = x;
  rope_forward(inplace.data(), inplace.data(), table.data(), B, T, H, D, half_split);
  EXPECT_EQ(inplace, y);
  std::vector<uint16_t> y16(n);
  rope_forward_bf16(y16.data(), x.data(), table.data(), B, T, H, D, half_split);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(y16[i], fp32_to_bf16(y[i])) << i;

  const std::vector<float> dx0 = random_floats(n, 11);
  const std::vector<double> want =
      plus(numerical_gradient([&](const std::vector<double>& v) { return ref(v, nullptr); },
                              to_double(x)),
           dx0);
  std::vector<float> dx = dx0;
  rope_backward(dx.data(), dout.data(), table.data(), B, T, H, D, half_split, true);
  EXPECT_LT(max_error(dx, want), 1e-6);
}

INSTANTIATE_TEST_SUITE_P(Pairs, Rope, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "HalfSplit" : "Adjacent"; });

TEST(SwiGlu, ForwardAndBackwardMatchReference) {
  const int64_t n = 101;
  const std::vector<float> gate = random_floats(n, 12, -6.0f, 6.0f);
  const std::vector<float> up = random_floats(n, 13, -2.0f, 2.0f);
  const std::vector<float> dout = random_floats(n, 14);
  const auto ref = [&](const std::vector<double>& g, const std::vector<double>& u) {
    double loss = 0.0;
    for (int64_t i = 0; i < n; ++i) loss += g[i] / (1.0 + std::exp(-g[i])) * u[i] * dout[i];
    return loss;
  };
  std::vector<float> out(n);
  swiglu_forward(out.data(), gate.data(), up.data(), n);
  for (int64_t i = 0; i < n; ++i)
    ASSERT_NEAR(out[i], gate[i] / (1.0 + std::exp(-static_cast<double>(gate[i]))) * up[i], 1e-5);
  const std::vector<float> dg0 = random_floats(n, 15), du0 = random_floats(n, 16);
  const auto want_dg =
      plus(numerical_gradient([&](const std::vector<double>& g) { return ref(g, to_double(up)); },
                              to_double(gate)),
           dg0);
  const auto want_du =
      plus(numerical_gradient([&](const std::vector<double>& u) { return ref(to_double(gate), u); },
                              to_double(up)),
           du0);
  std::vector<float> dg = dg0, du = du0;
  swiglu_backward(dg.data(), du.data(), dout.data(), gate.data(), up.data(), n, true);
  EXPECT_LT(max_error(dg, want_dg), 1e-5);
  EXPECT_LT(max_error(du, want_du), 1e-5);
}

// Large arrays (split over threads, a partial last run) and gates far outside exp's range.
TEST(SwiGlu, LargeAndExtremeGates) {
  const int64_t n = 40013;
  std::vector<float> gate = random_floats(n, 17, -12.0f, 12.0f);
  const std::vector<float> up = random_floats(n, 18, -2.0f, 2.0f);
  const std::vector<float> dout = random_floats(n, 19);
  const float extremes[] = {100.0f, -100.0f, 1000.0f, -1000.0f, 88.0f, -88.0f, 0.0f};
  for (size_t i = 0; i < std::size(extremes); ++i) gate[n - 1 - i] = extremes[i];
  std::vector<float> out(n), dg(n, 0.5f), du(n, -0.5f);
  swiglu_forward(out.data(), gate.data(), up.data(), n);
  swiglu_backward(dg.data(), du.data(), dout.data(), gate.data(), up.data(), n, true);
  for (int64_t i = 0; i < n; ++i) {
    const double g = gate[i], sig = 1.0 / (1.0 + std::exp(-g));
    const double silu = g * sig, dsilu = sig * (1.0 + g * (1.0 - sig));
    ASSERT_NEAR(out[i], silu * up[i], 1e-5 * std::max(1.0, std::abs(silu * up[i]))) << g;
    ASSERT_NEAR(dg[i], 0.5 + dout[i] * up[i] * dsilu, 1e-5) << g;
    ASSERT_NEAR(du[i], -0.5 + dout[i] * silu, 1e-5 * std::max(1.0, std::abs(silu))) << g;
  }
  // From bf16 gate and up: exactly what the FP32 kernel gives on the same values.
  std::vector<uint16_t> gate16(n), up16(n);
  for (int64_t i = 0; i < n; ++i) {
    gate16[i] = fp32_to_bf16(gate[i]);
    up16[i] = fp32_to_bf16(up[i]);
    gate[i] = bf16_to_fp32(gate16[i]);
  }
  std::vector<float> upr(n);
  for (int64_t i = 0; i < n; ++i) upr[i] = bf16_to_fp32(up16[i]);
  std::vector<float> dg32(n, 0.5f), du32(n, -0.5f), dg16(n, 0.5f), du16(n, -0.5f);
  swiglu_backward(dg32.data(), du32.data(), dout.data(), gate.data(), upr.data(), n, true);
  swiglu_backward(dg16.data(), du16.data(), dout.data(), gate16.data(), up16.data(), n, true);
  EXPECT_EQ(dg16, dg32);
  EXPECT_EQ(du16, du32);
}

// The bf16-output forward writes fp32_to_bf16 of what the FP32 forward writes, and of gate and
// up: over threads, a partial last run, ties, NaN, infinities and denormals.
TEST(SwiGlu, Bf16ForwardRoundsWhatFp32ForwardWrites) {
  const int64_t n = 40013;
  std::vector<float> gate = random_floats(n, 20, -12.0f, 12.0f);
  std::vector<float> up = random_floats(n, 21, -2.0f, 2.0f);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  const float denormal = std::numeric_limits<float>::denorm_min() * 3.0f;
  // 1 + 2^-8 is a tie between two bf16 values (rounds to even: 1); 1 + 3 * 2^-8 rounds up. NaNs
  // whose rounding would carry into the sign, or drop the payload to infinity, stay quiet NaNs.
  const float full_payload = std::bit_cast<float>(0xffffffffu);
  const float signaling = std::bit_cast<float>(0x7f800001u);
  const float specials[] = {nan,   inf,     -inf,         denormal,  -denormal,   1.00390625f,
                            -0.0f, 3.0e38f, full_payload, signaling, 1.01171875f, -100.0f};
  for (size_t i = 0; i < std::size(specials); ++i) {
    gate[n - 1 - i] = specials[i];
    up[n - 1 - 2 * i] = specials[i];
  }
  std::vector<float> out(n);
  swiglu_forward(out.data(), gate.data(), up.data(), n);
  std::vector<uint16_t> out16(n, 0xdead), gate16(n, 0xdead), up16(n, 0xdead);
  swiglu_forward_bf16(out16.data(), gate16.data(), up16.data(), gate.data(), up.data(), n);
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(out16[i], fp32_to_bf16(out[i])) << "out " << i << ": " << gate[i] << ", " << up[i];
    ASSERT_EQ(gate16[i], fp32_to_bf16(gate[i])) << "gate " << i << " " << gate[i];
    ASSERT_EQ(up16[i], fp32_to_bf16(up[i])) << "up " << i << " " << up[i];
  }
  // Without the input roundings, the output alone.
  std::vector<uint16_t> alone(n, 0xdead);
  swiglu_forward_bf16(alone.data(), nullptr, nullptr, gate.data(), up.data(), n);
  EXPECT_EQ(alone, out16);
}

// gpt-oss's clamped SwiGLU: g sigmoid(1.702 g) (clamp(up, -7, 7) + 1), g = min(gate, 7), against
// the formula in double and central differences away from the clamps' corners, over threads and
// a partial last run, gate and up both reaching past the clamps; the bf16 forward rounds what the
// FP32 one writes, and the AVX2 and AVX-512 builds agree bit for bit.
TEST(SwiGlu, ClampedIsGptOss) {
  const int64_t n = 40013;
  const std::vector<float> gate = random_floats(n, 31, -12.0f, 12.0f);
  const std::vector<float> up = random_floats(n, 32, -12.0f, 12.0f);
  const std::vector<float> dout = random_floats(n, 33);
  const Activation act = Activation::SiluClamped;
  const auto value = [](double g, double u) {
    const double gc = std::min(g, 7.0), uc = std::clamp(u, -7.0, 7.0);
    return gc / (1.0 + std::exp(-1.702 * gc)) * (uc + 1.0);
  };
  std::vector<float> out(n), dg(n, 0.5f), du(n, -0.5f);
  swiglu_forward(out.data(), gate.data(), up.data(), n, act);
  swiglu_backward(dg.data(), du.data(), dout.data(), gate.data(), up.data(), n, true, act);
  int64_t clamped_g = 0, clamped_u = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double g = gate[i], u = up[i], want = value(g, u);
    ASSERT_NEAR(out[i], want, 1e-5 * std::max(1.0, std::abs(want))) << g << " " << u;
    clamped_g += g > 7.0;
    clamped_u += std::abs(u) > 7.0;
    // Central differences of the formula, where a step of h crosses no clamp.
    const double h = 1e-4;
    if (std::abs(g - 7.0) < 2 * h || std::abs(std::abs(u) - 7.0) < 2 * h) continue;
    const double want_dg = (value(g + h, u) - value(g - h, u)) / (2 * h);
    const double want_du = (value(g, u + h) - value(g, u - h)) / (2 * h);
    ASSERT_NEAR(dg[i], 0.5 + dout[i] * want_dg, 1e-4 * std::max(1.0, std::abs(want_dg))) << g;
    ASSERT_NEAR(du[i], -0.5 + dout[i] * want_du, 1e-4 * std::max(1.0, std::abs(want_du))) << u;
  }
  EXPECT_GT(clamped_g, n / 10);
  EXPECT_GT(clamped_u, n / 10);
  std::vector<uint16_t> out16(n), gate16(n), up16(n);
  swiglu_forward_bf16(out16.data(), gate16.data(), up16.data(), gate.data(), up.data(), n, act);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(out16[i], fp32_to_bf16(out[i])) << i;
  if (!cpu_features().avx512) return;
  for (const bool bf16 : {false, true}) {
    std::vector<float> a(n), b(n), ga(n), ua(n), gb(n), ub(n);
    const SwigluKernels &x = swiglu_kernels_avx2(act), &y = swiglu_kernels_avx512(act);
    if (bf16) {
      x.backward_bf16(ga.data(), ua.data(), dout.data(), gate16.data(), up16.data(), n, false);
      y.backward_bf16(gb.data(), ub.data(), dout.data(), gate16.data(), up16.data(), n, false);
    } else {
      x.forward(a.data(), gate.data(), up.data(), n);
      y.forward(b.data(), gate.data(), up.data(), n);
      x.backward(ga.data(), ua.data(), dout.data(), gate.data(), up.data(), n, false);
      y.backward(gb.data(), ub.data(), dout.data(), gate.data(), up.data(), n, false);
    }
    EXPECT_EQ(a, b);
    EXPECT_EQ(ga, gb);
    EXPECT_EQ(ua, ub);
  }
}

// The AVX2 and AVX-512 builds of the SwiGLU loops give the same bits, for every entry.
TEST(SwiGlu, IsaBuildsAgreeBitwise) {
  if (!cpu_features().avx512) GTEST_SKIP() << "no AVX-512 here: only the AVX2 build runs";
  const int64_t n = 40013;
  std::vector<float> gate = random_floats(n, 22, -12.0f, 12.0f);
  const std::vector<float> up = random_floats(n, 23, -2.0f, 2.0f);
  const std::vector<float> dout = random_floats(n, 24);
  gate[n - 1] = 100.0f;
  gate[n - 2] = -100.0f;
  std::vector<uint16_t> gate16(n), up16(n);
  for (int64_t i = 0; i < n; ++i) {
    gate16[i] = fp32_to_bf16(gate[i]);
    up16[i] = fp32_to_bf16(up[i]);
  }
  struct Result {
    std::vector<float> out, dg, du, dg16, du16;
    std::vector<uint16_t> out16, g16, u16;
  };
  auto run = [&](const SwigluKernels& k) {
    Result r{std::vector<float>(n),        std::vector<float>(n, 0.5f),
             std::vector<float>(n, -0.5f), std::vector<float>(n, 0.5f),
             std::vector<float>(n, -0.5f), std::vector<uint16_t>(n),
             std::vector<uint16_t>(n),     std::vector<uint16_t>(n)};
    k.forward(r.out.data(), gate.data(), up.data(), n);
    k.forward_bf16(r.out16.data(), r.g16.data(), r.u16.data(), gate.data(), up.data(), n);
    k.backward(r.dg.data(), r.du.data(), dout.data(), gate.data(), up.data(), n, true);
    k.backward_bf16(r.dg16.data(), r.du16.data(), dout.data(), gate16.data(), up16.data(), n, true);
    return r;
  };
  const Result a = run(swiglu_kernels_avx2()), b = run(swiglu_kernels_avx512());
  EXPECT_EQ(a.out, b.out);
  EXPECT_EQ(a.out16, b.out16);
  EXPECT_EQ(a.g16, b.g16);
  EXPECT_EQ(a.u16, b.u16);
  EXPECT_EQ(a.dg, b.dg);
  EXPECT_EQ(a.du, b.du);
  EXPECT_EQ(a.dg16, b.dg16);
  EXPECT_EQ(a.du16, b.du16);
}

TEST(VecExp, WithinTwoUlpOverItsRange) {
  using vec::exp;
  double worst = 0.0;
  for (float x = -87.3f; x <= 88.3f; x = std::nextafter(x + 1e-3f, 100.0f)) {
    const double want = std::exp(static_cast<double>(x));
    worst = std::max(worst, std::abs(exp(x) - want) / want);
  }
  EXPECT_LT(worst, 2.0 * 0x1p-23);  // 2 ulp of a float in [1, 2)
  EXPECT_EQ(exp(0.0f), 1.0f);
  EXPECT_NEAR(exp(1.0f), std::exp(1.0), 2.0 * 0x1p-23 * std::exp(1.0));
  EXPECT_GE(exp(-1000.0f), 0.0f);
  EXPECT_LT(exp(-1000.0f), 1e-37f);
  EXPECT_LT(exp(-std::numeric_limits<float>::infinity()), 1e-37f);
  // NaN stays NaN, in every lane independently.
  vec::vf xs = vec::splat(0.5f);
  xs[7] = std::numeric_limits<float>::quiet_NaN();
  const vec::vf ys = exp(xs);
  EXPECT_TRUE(std::isnan(ys[7]));
  EXPECT_EQ(ys[6], exp(0.5f));
  EXPECT_EQ(ys[8], exp(0.5f));
}

struct CrossEntropyImpl {
  const char* name;
  decltype(&cross_entropy_forward) forward;
  decltype(&cross_entropy_backward) backward;
  decltype(&cross_entropy_gradient) gradient;
};

// The builds this CPU runs, and the dispatching entry points.
std::vector<CrossEntropyImpl> cross_entropy_impls() {
  const CrossEntropyKernels& avx2 = cross_entropy_kernels_avx2();
  std::vector<CrossEntropyImpl> impls{
      {"dispatch", cross_entropy_forward, cross_entropy_backward, cross_entropy_gradient},
      {"avx2", avx2.forward, avx2.backward, avx2.gradient}};
  if (cpu_features().avx512) {
    const CrossEntropyKernels& avx512 = cross_entropy_kernels_avx512();
    impls.push_back({"avx512", avx512.forward, avx512.backward, avx512.gradient});
  }
  return impls;
}

TEST(CrossEntropy, ForwardAndBackwardMatchReference) {
  const int64_t N = 7, V = 53;
  const std::vector<float> logits = random_floats(N * V, 17, -8.0f, 8.0f);
  const std::vector<int32_t> targets = {0, 52, 17, 17, 3, 40, 26};
  const std::vector<float> dlosses = random_floats(N, 18, 0.1f, 1.0f);
  const auto ref = [&](const std::vector<double>& x, std::vector<double>* losses) {
    double total = 0.0;
    for (int64_t i = 0; i < N; ++i) {
      double sum = 0.0;
      for (int64_t j = 0; j < V; ++j) sum += std::exp(x[i * V + j]);
      const double l = std::log(sum) - x[i * V + targets[i]];
      if (losses) (*losses)[i] = l;
      total += l * dlosses[i];
    }
    return total;
  };
  std::vector<double> want(N);
  ref(to_double(logits), &want);
  const std::vector<float> d0 = random_floats(N * V, 19);
  const auto want_d =
      plus(numerical_gradient([&](const std::vector<double>& x) { return ref(x, nullptr); },
                              to_double(logits)),
           d0);
  std::vector<float> first;
  for (const CrossEntropyImpl& impl : cross_entropy_impls()) {
    std::vector<float> losses(N), lse(N);
    impl.forward(losses.data(), lse.data(), logits.data(), targets.data(), N, V);
    EXPECT_LT(max_error(losses, want), 1e-6) << impl.name;

    // Large logits must not overflow.
    std::vector<float> big = logits;
    for (float& x : big) x += 1000.0f;
    std::vector<float> big_losses(N), big_lse(N);
    impl.forward(big_losses.data(), big_lse.data(), big.data(), targets.data(), N, V);
    for (int64_t i = 0; i < N; ++i) ASSERT_NEAR(big_losses[i], want[i], 1e-3) << impl.name;

    std::vector<float> d = d0;
    impl.backward(d.data(), logits.data(), lse.data(), targets.data(), dlosses.data(), N, V);
    EXPECT_LT(max_error(d, want_d), 1e-5) << impl.name;
    // The gradient alone, scaled, in place over a copy of the logits: backward's increment.
    std::vector<float> g = logits;
    impl.gradient(g.data(), g.data(), lse.data(), targets.data(), 0.5f, N, V);
    std::vector<float> d_half(N * V, 0.0f);
    const std::vector<float> half(N, 0.5f);
    impl.backward(d_half.data(), logits.data(), lse.data(), targets.data(), half.data(), N, V);
    EXPECT_EQ(g, d_half) << impl.name;
    // Every build gives the same bits: the same vector arithmetic, lane for lane.
    std::vector<float> all = losses;
    for (const auto* v : {&lse, &d, &g}) all.insert(all.end(), v->begin(), v->end());
    if (first.empty())
      first = all;
    else
      EXPECT_EQ(all, first) << impl.name;
  }
}

// The fused kernel, per build: losses bitwise what the forward gives; the gradient within a few
// ulp of scale * (softmax - onehot) computed in double (one exponential per element, so not the
// bits of the gradient kernel's exp(x - lse)); in place over the logits the same bits; the bf16
// output their rounding; every build the same bits.
TEST(CrossEntropy, FusedForwardGradientIsTheForwardsLossesAndTheGradient) {
  struct Build {
    const char* name;
    const CrossEntropyKernels& k;
  };
  std::vector<Build> builds{{"avx2", cross_entropy_kernels_avx2()}};
  if (cpu_features().avx512) builds.push_back({"avx512", cross_entropy_kernels_avx512()});
  for (const int64_t V : {int64_t{53}, int64_t{32}, int64_t{7}, int64_t{1000}}) {
    const int64_t N = 5;  // tails, none, only a tail, a row with many small probabilities
    const std::vector<float> logits = random_floats(N * V, 23, -9.0f, 9.0f);
    // First column, last column (in the tail where there is one), and between.
    const std::vector<int32_t> targets = {0, static_cast<int32_t>(V - 1),
                                          static_cast<int32_t>(V / 2), static_cast<int32_t>(V - 2),
                                          1};
    const float scale = 0.37f;
    std::vector<float> want(N * V);
    for (int64_t i = 0; i < N; ++i) {
      const float* x = logits.data() + i * V;
      double max = x[0], sum = 0.0;
      for (int64_t j = 0; j < V; ++j) max = std::max(max, static_cast<double>(x[j]));
      for (int64_t j = 0; j < V; ++j) sum += std::exp(x[j] - max);
      for (int64_t j = 0; j < V; ++j)
        want[i * V + j] = static_cast<float>(
            scale * (std::exp(x[j] - max) / sum - (j == targets[i] ? 1.0 : 0.0)));
    }
    std::vector<float> first;
    for (const Build& b : builds) {
      const CrossEntropyKernels& k = b.k;
      std::vector<float> want_losses(N), lse(N);
      k.forward(want_losses.data(), lse.data(), logits.data(), targets.data(), N, V);

      std::vector<float> losses(N), out(N * V);
      k.forward_gradient(out.data(), nullptr, losses.data(), logits.data(), out.data(),
                         targets.data(), scale, N, V);
      EXPECT_EQ(losses, want_losses) << b.name << " V " << V;
      for (int64_t i = 0; i < N * V; ++i) {
        // Within 2^-19 of each probability times scale (the exponential's, the float sum's and
        // the product's roundings), and of scale itself at the target (the subtraction's).
        const bool target = i % V == targets[i / V];
        const float p = std::abs(want[i] + (target ? scale : 0.0f));
        const float tolerance = 0x1p-19f * (p + (target ? scale : 0.0f));
        ASSERT_NEAR(out[i], want[i], tolerance) << b.name << " V " << V << " at " << i;
      }

      std::vector<float> in_place = logits, losses2(N);
      k.forward_gradient(in_place.data(), nullptr, losses2.data(), in_place.data(), in_place.data(),
                         targets.data(), scale, N, V);
      EXPECT_EQ(in_place, out) << b.name << " in place, V " << V;
      EXPECT_EQ(losses2, want_losses) << b.name << " in place, V " << V;

      // bf16: the work rows over a copy of the logits, as the LM head's chunk is used.
      std::vector<float> scratch = logits;
      std::vector<uint16_t> out16(N * V + 3, 0xBEEF);  // past the end stays untouched
      std::vector<float> losses3(N);
      k.forward_gradient(nullptr, out16.data(), losses3.data(), scratch.data(), scratch.data(),
                         targets.data(), scale, N, V);
      for (int64_t i = 0; i < N * V; ++i)
        ASSERT_EQ(out16[i], fp32_to_bf16(out[i])) << b.name << " V " << V << " at " << i;
      for (int64_t i = N * V; i < N * V + 3; ++i) EXPECT_EQ(out16[i], 0xBEEF) << b.name;
      EXPECT_EQ(losses3, want_losses) << b.name;
      if (first.empty())
        first = out;
      else
        EXPECT_EQ(out, first) << b.name << " V " << V;
    }
  }
  // The dispatching entry points are the fused kernel (every build's bits are the same).
  const int64_t N = 3, V = 41;
  const std::vector<float> logits = random_floats(N * V, 24, -5.0f, 5.0f);
  const std::vector<int32_t> targets = {40, 0, 20};
  std::vector<float> want_losses(N), want(N * V), out(N * V), losses(N);
  cross_entropy_kernels_avx2().forward_gradient(want.data(), nullptr, want_losses.data(),
                                                logits.data(), want.data(), targets.data(), 2.0f, N,
                                                V);
  cross_entropy_forward_gradient(out.data(), losses.data(), logits.data(), targets.data(), 2.0f, N,
                                 V);
  EXPECT_EQ(out, want);
  EXPECT_EQ(losses, want_losses);
  std::vector<float> scratch = logits;
  std::vector<uint16_t> out16(N * V);
  cross_entropy_forward_gradient_bf16(out16.data(), losses.data(), scratch.data(), targets.data(),
                                      2.0f, N, V);
  for (int64_t i = 0; i < N * V; ++i) ASSERT_EQ(out16[i], fp32_to_bf16(want[i])) << i;
  EXPECT_EQ(losses, want_losses);
}

// Backward kernels told not to accumulate write their gradient over whatever the buffer held
// (NaN here): the same bits as accumulating onto zeros. Over threads and partial runs.
TEST(Backward, OverwritingEqualsAccumulatingOntoZeros) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  auto bf16_of = [](const std::vector<float>& v) {
    std::vector<uint16_t> out(v.size());
    for (size_t i = 0; i < v.size(); ++i) out[i] = fp32_to_bf16(v[i]);
    return out;
  };
  {  // SwiGLU, both builds, FP32 and bf16 inputs
    const int64_t n = 40013;
    const std::vector<float> gate = random_floats(n, 30, -8.0f, 8.0f), up = random_floats(n, 31);
    const std::vector<float> dout = random_floats(n, 32);
    const std::vector<uint16_t> gate16 = bf16_of(gate), up16 = bf16_of(up);
    std::vector<const SwigluKernels*> builds{&swiglu_kernels_avx2()};
    if (cpu_features().avx512) builds.push_back(&swiglu_kernels_avx512());
    for (const SwigluKernels* k : builds) {
      std::vector<float> zg(n), zu(n), ng(n, nan), nu(n, nan);
      k->backward(zg.data(), zu.data(), dout.data(), gate.data(), up.data(), n, true);
      k->backward(ng.data(), nu.data(), dout.data(), gate.data(), up.data(), n, false);
      EXPECT_EQ(ng, zg);
      EXPECT_EQ(nu, zu);
      std::vector<float> zg16(n), zu16(n), ng16(n, nan), nu16(n, nan);
      k->backward_bf16(zg16.data(), zu16.data(), dout.data(), gate16.data(), up16.data(), n, true);
      k->backward_bf16(ng16.data(), nu16.data(), dout.data(), gate16.data(), up16.data(), n, false);
      EXPECT_EQ(ng16, zg16);
      EXPECT_EQ(nu16, zu16);
    }
  }
  {  // RMSNorm, FP32 and bf16 input; dweight still accumulates
    const int64_t N = 70, C = 37;
    const std::vector<float> x = random_floats(N * C, 33, -2.0f, 2.0f), w = random_floats(C, 34);
    const std::vector<float> dout = random_floats(N * C, 35);
    const std::vector<uint16_t> x16 = bf16_of(x);
    std::vector<float> y(N * C), rstd(N);
    rmsnorm_forward(y.data(), rstd.data(), x.data(), w.data(), N, C, 1e-5f);
    for (int threads : {1, 2}) {
      ThreadCount tc(threads);
      const std::vector<float> dw0 = random_floats(C, 36);
      std::vector<float> zx(N * C), nx(N * C, nan), zw = dw0, nw = dw0;
      rmsnorm_backward(zx.data(), zw.data(), dout.data(), x.data(), w.data(), rstd.data(), N, C,
                       true);
      rmsnorm_backward(nx.data(), nw.data(), dout.data(), x.data(), w.data(), rstd.data(), N, C,
                       false);
      EXPECT_EQ(nx, zx);
      EXPECT_EQ(nw, zw);
      std::vector<float> zx16(N * C), nx16(N * C, nan), w16a = dw0, w16b = dw0;
      rmsnorm_backward(zx16.data(), w16a.data(), dout.data(), x16.data(), w.data(), rstd.data(), N,
                       C, true);
      rmsnorm_backward(nx16.data(), w16b.data(), dout.data(), x16.data(), w.data(), rstd.data(), N,
                       C, false);
      EXPECT_EQ(nx16, zx16);
    }
  }
  {  // RoPE
    const int64_t B = 2, T = 9, H = 3, D = 8, n = B * T * H * D;
    std::vector<float> table(T * D);
    rope_table(table.data(), T, D, 10000.0);
    const std::vector<float> dout = random_floats(n, 37);
    for (const bool half_split : {false, true}) {
      std::vector<float> z(n), nn(n, nan);
      rope_backward(z.data(), dout.data(), table.data(), B, T, H, D, half_split, true);
      rope_backward(nn.data(), dout.data(), table.data(), B, T, H, D, half_split, false);
      EXPECT_EQ(nn, z);
    }
  }
}

// The backward kernels that write a gradient as its bf16 rounding alone: fp32_to_bf16 of what
// their FP32 form writes, per build, over a partial last run and a NaN.
TEST(Backward, RoundedGradientsAreTheRoundingOfTheFp32Ones) {
  auto bf16_of = [](const std::vector<float>& v) {
    std::vector<uint16_t> out(v.size());
    for (size_t i = 0; i < v.size(); ++i) out[i] = fp32_to_bf16(v[i]);
    return out;
  };
  const int64_t n = 40013;
  std::vector<float> dout = random_floats(n, 40);
  dout[n - 3] = std::numeric_limits<float>::quiet_NaN();
  const std::vector<uint16_t> gate16 = bf16_of(random_floats(n, 41, -8.0f, 8.0f));
  const std::vector<uint16_t> up16 = bf16_of(random_floats(n, 42));
  std::vector<const SwigluKernels*> builds{&swiglu_kernels_avx2()};
  if (cpu_features().avx512) builds.push_back(&swiglu_kernels_avx512());
  for (const SwigluKernels* k : builds) {
    std::vector<float> dg(n), du(n);
    k->backward_bf16(dg.data(), du.data(), dout.data(), gate16.data(), up16.data(), n, false);
    std::vector<uint16_t> dg16(n + 1, 0xBEEF), du16(n + 1, 0xBEEF);
    k->backward_rounded(dg16.data(), du16.data(), dout.data(), gate16.data(), up16.data(), n);
    EXPECT_EQ(std::vector<uint16_t>(dg16.begin(), dg16.end() - 1), bf16_of(dg));
    EXPECT_EQ(std::vector<uint16_t>(du16.begin(), du16.end() - 1), bf16_of(du));
    EXPECT_EQ(dg16[n], 0xBEEF);
    EXPECT_EQ(du16[n], 0xBEEF);
  }
  std::vector<uint16_t> dg16(n), du16(n);
  swiglu_backward_rounded(dg16.data(), du16.data(), dout.data(), gate16.data(), up16.data(), n);
  std::vector<float> dg(n), du(n);
  swiglu_backward(dg.data(), du.data(), dout.data(), gate16.data(), up16.data(), n, false);
  EXPECT_EQ(dg16, bf16_of(dg));
  EXPECT_EQ(du16, bf16_of(du));

  const int64_t B = 2, T = 9, H = 3, D = 8, m = B * T * H * D;
  std::vector<float> table(T * D);
  rope_table(table.data(), T, D, 10000.0);
  const std::vector<float> g = random_floats(m, 43, -3.0f, 3.0f);
  for (const bool half_split : {false, true}) {
    std::vector<float> want(m);
    rope_backward(want.data(), g.data(), table.data(), B, T, H, D, half_split, false);
    std::vector<uint16_t> got(m);
    rope_backward_bf16(got.data(), g.data(), table.data(), B, T, H, D, half_split);
    EXPECT_EQ(got, bf16_of(want));
  }
}

TEST(VectorOps, AddAccumulateAndSumOfSquares) {
  const int64_t n = 100003;  // several blocks and a tail
  const std::vector<float> a = random_floats(n, 20), b = random_floats(n, 21);
  std::vector<float> out(n);
  vector_add(out.data(), a.data(), b.data(), n);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(out[i], a[i] + b[i]);
  std::vector<float> alias = a;
  vector_add(alias.data(), alias.data(), b.data(), n);
  EXPECT_EQ(alias, out);
  std::vector<float> acc = a;
  vector_accumulate(acc.data(), b.data(), n);
  EXPECT_EQ(acc, out);

  double want = 0.0;
  for (float x : a) want += static_cast<double>(x) * x;
  double first = 0.0;
  for (int threads : {1, 2}) {
    ThreadCount tc(threads);
    const double got = vector_sum_squares(a.data(), n);
    EXPECT_NEAR(got, want, 1e-9 * want);
    if (threads == 1)
      first = got;
    else
      EXPECT_EQ(got, first) << "depends on the thread count";
  }
  EXPECT_EQ(vector_sum_squares(a.data(), 0), 0.0);
  EXPECT_EQ(vector_sum_squares(a.data(), 3), static_cast<double>(a[0]) * a[0] +
                                                 static_cast<double>(a[1]) * a[1] +
                                                 static_cast<double>(a[2]) * a[2]);
}

}  // namespace
}  // namespace cputrain::kernels
