// The kernels of the block variants beyond Llama's: GeGLU and GELU (the tanh approximation, gated
// and alone), RMSNorm scaling by 1 + w, LayerNorm with a bias, scaled embeddings and soft-capped
// logits (and the vector tanh under them and the attention's soft-capping), each against
// a double-precision reference written here from the formula; backward kernels against
// numerical gradients of it, accumulating onto non-zero gradients.
#include <gtest/gtest.h>

#include <cmath>
#include <iterator>
#include <limits>
#include <numbers>
#include <string>

#include "kernels/cpu/bf16.h"
#include "kernels/cpu/cpu_features.h"
#include "kernels/kernel_test_util.h"
#include "kernels/ops/cross_entropy.h"
#include "kernels/ops/cross_entropy_isa.h"
#include "kernels/ops/embedding.h"
#include "kernels/ops/rmsnorm.h"
#include "kernels/ops/swiglu.h"
#include "kernels/ops/swiglu_isa.h"

namespace cputrain::kernels {
namespace {

using test::max_error;
using test::numerical_gradient;
using test::plus;
using test::random_floats;
using test::ThreadCount;
using test::to_double;

// GELU as PyTorch's gelu(approximate="tanh") writes it, and SiLU.
double act_ref(Activation act, double x) {
  if (act == Activation::Silu) return x / (1.0 + std::exp(-x));
  const double k = std::sqrt(2.0 / std::numbers::pi);
  return 0.5 * x * (1.0 + std::tanh(k * (x + 0.044715 * x * x * x)));
}
// Its derivative, from the formula.
double act_grad_ref(Activation act, double x) {
  if (act == Activation::Silu) {
    const double s = 1.0 / (1.0 + std::exp(-x));
    return s * (1.0 + x * (1.0 - s));
  }
  const double k = std::sqrt(2.0 / std::numbers::pi);
  const double t = std::tanh(k * (x + 0.044715 * x * x * x));
  return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * x * x);
}

struct Kind {
  Activation act;
  bool gated;
  std::string name() const {
    return std::string(activation_name(act)) + (gated ? "_gated" : "_alone");
  }
};
const Kind kKinds[] = {
    {Activation::GeluTanh, true}, {Activation::GeluTanh, false}, {Activation::Silu, false}};

// Small: gradients against central differences of sum(act(g) * u * dout).
TEST(GatedActivation, EveryKindMatchesNumericalGradients) {
  const int64_t n = 101;
  const std::vector<float> gate = random_floats(n, 31, -6.0f, 6.0f);
  const std::vector<float> up = random_floats(n, 32, -2.0f, 2.0f);
  const std::vector<float> dout = random_floats(n, 33);
  for (const Kind& kind : kKinds) {
    const float* u = kind.gated ? up.data() : nullptr;
    const auto ref = [&](const std::vector<double>& g, const std::vector<double>& uv) {
      double loss = 0.0;
      for (int64_t i = 0; i < n; ++i)
        loss += act_ref(kind.act, g[i]) * (kind.gated ? uv[i] : 1.0) * dout[i];
      return loss;
    };
    std::vector<float> out(n);
    swiglu_forward(out.data(), gate.data(), u, n, kind.act);
    for (int64_t i = 0; i < n; ++i)
      ASSERT_NEAR(out[i], act_ref(kind.act, gate[i]) * (kind.gated ? up[i] : 1.0f), 1e-5)
          << kind.name() << " " << gate[i];
    const std::vector<float> dg0 = random_floats(n, 34), du0 = random_floats(n, 35);
    const auto want_dg =
        plus(numerical_gradient([&](const std::vector<double>& g) { return ref(g, to_double(up)); },
                                to_double(gate)),
             dg0);
    const auto want_du = plus(
        numerical_gradient([&](const std::vector<double>& uv) { return ref(to_double(gate), uv); },
                           to_double(up)),
        du0);
    std::vector<float> dg = dg0, du = du0;
    swiglu_backward(dg.data(), kind.gated ? du.data() : nullptr, dout.data(), gate.data(), u, n,
                    true, kind.act);
    EXPECT_LT(max_error(dg, want_dg), 1e-5) << kind.name();
    if (kind.gated) {
      EXPECT_LT(max_error(du, want_du), 1e-5) << kind.name();
    }
  }
}

// Large arrays (split over threads, a partial last run) and gates far outside exp's range,
// against the derivative's formula; the bf16-input backward gives the FP32 one's bits on the
// same values; the bf16-output forward and backward write the roundings of the FP32 ones.
TEST(GatedActivation, LargeExtremeAndBf16) {
  const int64_t n = 40013;
  std::vector<float> gate = random_floats(n, 36, -12.0f, 12.0f);
  const std::vector<float> up = random_floats(n, 37, -2.0f, 2.0f);
  const std::vector<float> dout = random_floats(n, 38);
  const float extremes[] = {100.0f, -100.0f, 1000.0f, -1000.0f, 88.0f, -88.0f, 0.0f, -0.0f};
  for (size_t i = 0; i < std::size(extremes); ++i) gate[n - 1 - i] = extremes[i];
  for (const Kind& kind : kKinds) {
    const float* u = kind.gated ? up.data() : nullptr;
    std::vector<float> out(n), dg(n, 0.5f), du(n, -0.5f);
    swiglu_forward(out.data(), gate.data(), u, n, kind.act);
    swiglu_backward(dg.data(), kind.gated ? du.data() : nullptr, dout.data(), gate.data(), u, n,
                    true, kind.act);
    for (int64_t i = 0; i < n; ++i) {
      const double g = gate[i], uv = kind.gated ? up[i] : 1.0;
      const double a = act_ref(kind.act, g), da = act_grad_ref(kind.act, g);
      ASSERT_NEAR(out[i], a * uv, 1e-5 * std::max(1.0, std::abs(a * uv))) << kind.name() << g;
      ASSERT_NEAR(dg[i], 0.5 + dout[i] * uv * da, 2e-5) << kind.name() << " " << g;
      if (kind.gated)
        ASSERT_NEAR(du[i], -0.5 + dout[i] * a, 1e-5 * std::max(1.0, std::abs(a)))
            << kind.name() << " " << g;
      else
        ASSERT_EQ(du[i], -0.5f) << "dup written without an up";
    }
    std::vector<uint16_t> gate16(n), up16(n);
    std::vector<float> gr(n), ur(n);
    for (int64_t i = 0; i < n; ++i) {
      gate16[i] = fp32_to_bf16(gate[i]);
      up16[i] = fp32_to_bf16(up[i]);
      gr[i] = bf16_to_fp32(gate16[i]);
      ur[i] = bf16_to_fp32(up16[i]);
    }
    const float* ur_or_null = kind.gated ? ur.data() : nullptr;
    const uint16_t* u16 = kind.gated ? up16.data() : nullptr;
    std::vector<float> dg32(n, 0.5f), du32(n, -0.5f), dg16(n, 0.5f), du16(n, -0.5f);
    swiglu_backward(dg32.data(), du32.data(), dout.data(), gr.data(), ur_or_null, n, true,
                    kind.act);
    swiglu_backward(dg16.data(), du16.data(), dout.data(), gate16.data(), u16, n, true, kind.act);
    EXPECT_EQ(dg16, dg32) << kind.name();
    EXPECT_EQ(du16, du32) << kind.name();
    // Rounded gradients: the roundings of the overwriting FP32 ones.
    std::vector<float> dgo(n), duo(n);
    swiglu_backward(dgo.data(), duo.data(), dout.data(), gate16.data(), u16, n, false, kind.act);
    std::vector<uint16_t> dgr(n), dur(n, 0xdead);
    swiglu_backward_rounded(dgr.data(), dur.data(), dout.data(), gate16.data(), u16, n, kind.act);
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(dgr[i], fp32_to_bf16(dgo[i])) << kind.name() << " " << i;
      if (kind.gated) {
        ASSERT_EQ(dur[i], fp32_to_bf16(duo[i])) << kind.name() << " " << i;
      }
    }
    // The bf16-output forward: the rounding of the FP32 output, and of gate and up.
    std::vector<uint16_t> out16(n), g16(n, 0xdead), u16_out(n, 0xdead);
    swiglu_forward_bf16(out16.data(), g16.data(), u16_out.data(), gate.data(), u, n, kind.act);
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(out16[i], fp32_to_bf16(out[i])) << kind.name() << " " << i;
      ASSERT_EQ(g16[i], gate16[i]) << kind.name() << " " << i;
      ASSERT_EQ(u16_out[i], kind.gated ? up16[i] : uint16_t{0xdead}) << kind.name() << " " << i;
    }
  }
}

// The AVX2 and AVX-512 builds give the same bits for GELU, gated and alone.
TEST(GatedActivation, IsaBuildsAgreeBitwise) {
  if (!cpu_features().avx512) GTEST_SKIP() << "no AVX-512 here: only the AVX2 build runs";
  const int64_t n = 40013;
  std::vector<float> gate = random_floats(n, 39, -12.0f, 12.0f);
  const std::vector<float> up = random_floats(n, 40, -2.0f, 2.0f);
  const std::vector<float> dout = random_floats(n, 41);
  gate[n - 1] = 100.0f;
  gate[n - 2] = -100.0f;
  for (const Kind& kind : kKinds) {
    const float* u = kind.gated ? up.data() : nullptr;
    const auto run = [&](const SwigluKernels& k) {
      std::vector<float> out(n), dg(n, 0.5f), du(n, -0.5f);
      std::vector<uint16_t> out16(n);
      k.forward(out.data(), gate.data(), u, n);
      k.forward_bf16(out16.data(), nullptr, nullptr, gate.data(), u, n);
      k.backward(dg.data(), du.data(), dout.data(), gate.data(), u, n, true);
      std::vector<float> bits(out);
      bits.insert(bits.end(), dg.begin(), dg.end());
      bits.insert(bits.end(), du.begin(), du.end());
      for (const uint16_t b : out16) bits.push_back(bf16_to_fp32(b));
      return bits;
    };
    EXPECT_EQ(run(swiglu_kernels_avx2(kind.act)), run(swiglu_kernels_avx512(kind.act)))
        << kind.name();
  }
}

// RMSNorm of weights held less 1 (offset 1) computes what RMSNorm of the gains 1 + w does, and
// its backward the same input gradient and the same weight gradient.
TEST(RmsNormPlusOne, EqualsTheNormOfTheGains) {
  const int64_t N = 37, C = 19;
  const float eps = 1e-6f;
  const std::vector<float> x = random_floats(N * C, 42, -2.0f, 2.0f);
  const std::vector<float> w = random_floats(C, 43, -0.5f, 0.5f);
  std::vector<float> gains(C);
  for (int64_t c = 0; c < C; ++c) gains[c] = w[c] + 1.0f;
  const std::vector<float> dout = random_floats(N * C, 44);
  std::vector<float> y(N * C), y1(N * C), rstd(N), rstd1(N);
  rmsnorm_forward(y.data(), rstd.data(), x.data(), gains.data(), N, C, eps);
  rmsnorm_forward(y1.data(), rstd1.data(), x.data(), w.data(), N, C, eps, 1.0f);
  EXPECT_EQ(y1, y);
  EXPECT_EQ(rstd1, rstd);
  std::vector<uint16_t> y16(N * C), y16_1(N * C);
  rmsnorm_forward_bf16(y16.data(), nullptr, rstd.data(), x.data(), gains.data(), N, C, eps);
  rmsnorm_forward_bf16(y16_1.data(), nullptr, rstd1.data(), x.data(), w.data(), N, C, eps, 1.0f);
  EXPECT_EQ(y16_1, y16);
  std::vector<float> dx(N * C, 0.25f), dw(C, 0.5f), dx1(N * C, 0.25f), dw1(C, 0.5f);
  rmsnorm_backward(dx.data(), dw.data(), dout.data(), x.data(), gains.data(), rstd.data(), N, C,
                   true);
  rmsnorm_backward(dx1.data(), dw1.data(), dout.data(), x.data(), w.data(), rstd.data(), N, C, true,
                   1.0f);
  EXPECT_EQ(dx1, dx);
  EXPECT_EQ(dw1, dw);
}

// LayerNorm with a bias over rows of one to 70 elements (one, a tail, several of sum8's runs),
// against the double-precision formula and its numerical gradients.
double layernorm_ref(const std::vector<double>& x, const std::vector<double>& w,
                     const std::vector<double>& b, const std::vector<float>& dout, int64_t N,
                     int64_t C, float eps, std::vector<double>* y_out = nullptr) {
  double loss = 0.0;
  for (int64_t i = 0; i < N; ++i) {
    double mean = 0.0, var = 0.0;
    for (int64_t c = 0; c < C; ++c) mean += x[i * C + c];
    mean /= static_cast<double>(C);
    for (int64_t c = 0; c < C; ++c) var += (x[i * C + c] - mean) * (x[i * C + c] - mean);
    var /= static_cast<double>(C);
    const double r = 1.0 / std::sqrt(var + eps);
    for (int64_t c = 0; c < C; ++c) {
      const double y = (x[i * C + c] - mean) * r * w[c] + b[c];
      if (y_out) (*y_out)[i * C + c] = y;
      loss += y * dout[i * C + c];
    }
  }
  return loss;
}

TEST(LayerNorm, ForwardAndBackwardMatchReference) {
  const float eps = 1e-5f;
  for (const int64_t C : {1, 7, 19, 70}) {
    const int64_t N = 37;  // the weight sums span more than one row block
    const std::vector<float> x = random_floats(N * C, 45, -2.0f, 3.0f);
    const std::vector<float> w = random_floats(C, 46, 0.5f, 1.5f);
    const std::vector<float> b = random_floats(C, 47, -0.5f, 0.5f);
    const std::vector<float> dout = random_floats(N * C, 48);
    std::vector<double> y_ref(N * C);
    layernorm_ref(to_double(x), to_double(w), to_double(b), dout, N, C, eps, &y_ref);
    std::vector<float> y(N * C), mean(N), rstd(N);
    layernorm_forward(y.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C, eps);
    EXPECT_LT(max_error(y, y_ref), 1e-5) << C;
    std::vector<uint16_t> y16(N * C), x16(N * C);
    std::vector<float> mean16(N), rstd16(N);
    layernorm_forward_bf16(y16.data(), x16.data(), mean16.data(), rstd16.data(), x.data(), w.data(),
                           b.data(), N, C, eps);
    EXPECT_EQ(mean16, mean);
    EXPECT_EQ(rstd16, rstd);
    for (int64_t i = 0; i < N * C; ++i) {
      ASSERT_EQ(y16[i], fp32_to_bf16(y[i])) << C << " " << i;
      ASSERT_EQ(x16[i], fp32_to_bf16(x[i])) << C << " " << i;
    }
    if (C == 1) continue;  // one element: the output is the bias, whatever x
    const auto dx_of = [&](const std::vector<double>& xv) {
      return layernorm_ref(xv, to_double(w), to_double(b), dout, N, C, eps);
    };
    const auto dw_of = [&](const std::vector<double>& wv) {
      return layernorm_ref(to_double(x), wv, to_double(b), dout, N, C, eps);
    };
    const auto db_of = [&](const std::vector<double>& bv) {
      return layernorm_ref(to_double(x), to_double(w), bv, dout, N, C, eps);
    };
    const std::vector<float> dx0 = random_floats(N * C, 49), dw0 = random_floats(C, 50),
                             db0 = random_floats(C, 51);
    const auto want_dx = plus(numerical_gradient(dx_of, to_double(x)), dx0);
    const auto want_dw = plus(numerical_gradient(dw_of, to_double(w)), dw0);
    const auto want_db = plus(numerical_gradient(db_of, to_double(b)), db0);
    std::vector<float> first;
    for (int threads : {1, 2}) {
      ThreadCount tc(threads);
      std::vector<float> dx = dx0, dw = dw0, db = db0;
      layernorm_backward(dx.data(), dw.data(), db.data(), dout.data(), x.data(), w.data(),
                         mean.data(), rstd.data(), N, C, true);
      EXPECT_LT(max_error(dx, want_dx), 2e-5) << C;
      EXPECT_LT(max_error(dw, want_dw), 1e-5) << C;
      EXPECT_LT(max_error(db, want_db), 1e-5) << C;
      std::vector<float> all = dw;
      all.insert(all.end(), db.begin(), db.end());
      if (first.empty())
        first = all;
      else
        EXPECT_EQ(all, first) << "weight sums depend on the thread count";
    }
    // From a bf16 input: exactly what the FP32 kernel gives on the same values; and overwriting
    // equals accumulating onto zeros.
    std::vector<float> xr(N * C);
    for (int64_t i = 0; i < N * C; ++i) xr[i] = bf16_to_fp32(x16[i]);
    std::vector<float> dx32(N * C, 0.0f), dw32 = dw0, db32 = db0, dx16(N * C, 7.0f), dw16 = dw0,
                                          db16 = db0;
    layernorm_backward(dx32.data(), dw32.data(), db32.data(), dout.data(), xr.data(), w.data(),
                       mean.data(), rstd.data(), N, C, true);
    layernorm_backward(dx16.data(), dw16.data(), db16.data(), dout.data(), x16.data(), w.data(),
                       mean.data(), rstd.data(), N, C, false);
    EXPECT_EQ(dx16, dx32) << C;
    EXPECT_EQ(dw16, dw32) << C;
    EXPECT_EQ(db16, db32) << C;
  }
}

// Scaled rows (Gemma's sqrt(C)), and the backward scatters the scaled gradient.
TEST(Embedding, ScaledForwardAndBackward) {
  const int64_t V = 11, C = 70, N = 9;
  const float scale = std::sqrt(70.0f);
  const std::vector<int32_t> tokens = {3, 0, 10, 3, 3, 7, 0, 5, 10};
  const std::vector<float> table = random_floats(V * C, 52);
  std::vector<uint16_t> table16(V * C);
  for (int64_t i = 0; i < V * C; ++i) table16[i] = fp32_to_bf16(table[i]);
  std::vector<float> out(N * C), out16(N * C);
  embedding_forward(out.data(), tokens.data(), table.data(), N, C, scale);
  embedding_forward_bf16(out16.data(), tokens.data(), table16.data(), N, C, scale);
  for (int64_t i = 0; i < N; ++i)
    for (int64_t c = 0; c < C; ++c) {
      ASSERT_EQ(out[i * C + c], table[tokens[i] * C + c] * scale);
      ASSERT_EQ(out16[i * C + c], bf16_to_fp32(table16[tokens[i] * C + c]) * scale);
    }
  const std::vector<float> dout = random_floats(N * C, 53), base = random_floats(V * C, 54);
  std::vector<double> want(base.begin(), base.end());
  for (int64_t i = 0; i < N; ++i)
    for (int64_t c = 0; c < C; ++c)
      want[tokens[i] * C + c] += static_cast<double>(scale) * dout[i * C + c];
  std::vector<float> dtable = base;
  embedding_backward(dtable.data(), dout.data(), tokens.data(), N, C, scale);
  EXPECT_LT(max_error(dtable, want), 1e-5);
}

// Soft-capped logits cap * tanh(x / cap) against std::tanh in double, from 1e-30 to far past the
// cap (the vector tanh's polynomial below 0.25 and its exp form above, signs, zeros, a partial
// last run); the gradient times 1 - (capped / cap)^2; both ISA builds the same bits.
TEST(SoftCap, LogitsAndGradientMatchReference) {
  const int64_t n = 40013;
  const float cap = 30.0f;
  std::vector<float> x = random_floats(n, 55, -200.0f, 200.0f);
  const float specials[] = {0.0f, -0.0f,   1e-30f, -1e-30f, 1e-4f, -1e-4f, 7.4999f,
                            7.5f, 7.5001f, -7.5f,  1e4f,    -1e4f, 3e38f};
  for (size_t i = 0; i < std::size(specials); ++i) x[n - 1 - i] = specials[i];
  for (int64_t i = 0; i < 2000; ++i) x[i] = x[i] * 1e-3f;  // |x / cap| below 0.25 and near it
  const std::vector<float> g = random_floats(n, 56);
  std::vector<float> capped = x, dg = g;
  logit_soft_cap(capped.data(), n, cap);
  logit_soft_cap_gradient(dg.data(), capped.data(), n, cap);
  for (int64_t i = 0; i < n; ++i) {
    const double want = cap * std::tanh(static_cast<double>(x[i]) / cap);
    ASSERT_NEAR(capped[i], want, 4e-7 * std::max(std::abs(want), 1e-30)) << x[i];
    const double t = capped[i] / static_cast<double>(cap);
    ASSERT_NEAR(dg[i], g[i] * (1.0 - t * t), 1e-6) << x[i];
  }
  EXPECT_FALSE(std::signbit(capped[n - 1]));  // +0 stays +0, -0 stays -0
  EXPECT_TRUE(std::signbit(capped[n - 2]));
  if (!cpu_features().avx512) GTEST_SKIP() << "no AVX-512 here: only the AVX2 build runs";
  std::vector<float> a = x, b = x, ga = g, gb = g;
  cross_entropy_kernels_avx2().soft_cap(a.data(), n, cap);
  cross_entropy_kernels_avx512().soft_cap(b.data(), n, cap);
  cross_entropy_kernels_avx2().soft_cap_gradient(ga.data(), a.data(), n, cap);
  cross_entropy_kernels_avx512().soft_cap_gradient(gb.data(), b.data(), n, cap);
  EXPECT_EQ(a, b);
  EXPECT_EQ(ga, gb);
}

}  // namespace
}  // namespace cputrain::kernels
