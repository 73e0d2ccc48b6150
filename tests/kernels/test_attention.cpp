// Causal attention, each ISA build, against a double-precision reference that builds the full
// score matrix; backward against numerical gradients of that reference on small shapes, and
// against its analytic gradients (themselves checked against the numerical ones) on shapes of
// several tiles, T not a multiple of the tile, T = 1, one head.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <sstream>

#include "kernel_test_util.h"
#include "kernels/attention.h"
#include "kernels/attention_isa.h"
#include "kernels/bf16.h"
#include "kernels/cpu_features.h"

namespace cputrain::kernels {
namespace {

using test::max_error;
using test::numerical_gradient;
using test::random_floats;
using test::ThreadCount;
using test::to_double;

struct Dims {
  int64_t B, T, H, D;
  int64_t n() const { return B * T * H * D; }
  int64_t at(int64_t b, int64_t t, int64_t h) const { return ((b * T + t) * H + h) * D; }
};

// out and lse of causal softmax(q k^T / sqrt(D)) v; returns sum(out * dout) when dout is given.
double attention_ref(const Dims& s, const std::vector<double>& q, const std::vector<double>& k,
                     const std::vector<double>& v, const std::vector<float>* dout,
                     std::vector<double>* out, std::vector<double>* lse) {
  double loss = 0.0;
  const double scale = 1.0 / std::sqrt(static_cast<double>(s.D));
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t h = 0; h < s.H; ++h)
      for (int64_t i = 0; i < s.T; ++i) {
        std::vector<double> score(s.T, 0.0);
        double max = -1e300;
        for (int64_t j = 0; j <= i; ++j) {
          for (int64_t d = 0; d < s.D; ++d)
            score[j] += q[s.at(b, i, h) + d] * k[s.at(b, j, h) + d] * scale;
          max = std::max(max, score[j]);
        }
        double sum = 0.0;
        for (int64_t j = 0; j <= i; ++j) sum += std::exp(score[j] - max);
        if (lse) (*lse)[(b * s.H + h) * s.T + i] = max + std::log(sum);
        for (int64_t d = 0; d < s.D; ++d) {
          double o = 0.0;
          for (int64_t j = 0; j <= i; ++j)
            o += std::exp(score[j] - max) / sum * v[s.at(b, j, h) + d];
          if (out) (*out)[s.at(b, i, h) + d] = o;
          if (dout) loss += o * (*dout)[s.at(b, i, h) + d];
        }
      }
  return loss;
}

// Gradients of sum(out * dout) by q, k, v, from the formulas of the softmax backward.
void attention_ref_backward(const Dims& s, const std::vector<double>& q,
                            const std::vector<double>& k, const std::vector<double>& v,
                            const std::vector<float>& dout, std::vector<double>& dq,
                            std::vector<double>& dk, std::vector<double>& dv) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(s.D));
  dq.assign(s.n(), 0.0);
  dk.assign(s.n(), 0.0);
  dv.assign(s.n(), 0.0);
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t h = 0; h < s.H; ++h)
      for (int64_t i = 0; i < s.T; ++i) {
        std::vector<double> p(i + 1, 0.0), dp(i + 1, 0.0);
        double max = -1e300, sum = 0.0, di = 0.0;
        for (int64_t j = 0; j <= i; ++j) {
          for (int64_t d = 0; d < s.D; ++d) p[j] += q[s.at(b, i, h) + d] * k[s.at(b, j, h) + d];
          p[j] *= scale;
          max = std::max(max, p[j]);
        }
        for (int64_t j = 0; j <= i; ++j) sum += std::exp(p[j] - max);
        for (int64_t j = 0; j <= i; ++j) {
          p[j] = std::exp(p[j] - max) / sum;
          for (int64_t d = 0; d < s.D; ++d) dp[j] += dout[s.at(b, i, h) + d] * v[s.at(b, j, h) + d];
          di += p[j] * dp[j];
        }
        for (int64_t j = 0; j <= i; ++j) {
          const double ds = p[j] * (dp[j] - di) * scale;
          for (int64_t d = 0; d < s.D; ++d) {
            dq[s.at(b, i, h) + d] += ds * k[s.at(b, j, h) + d];
            dk[s.at(b, j, h) + d] += ds * q[s.at(b, i, h) + d];
            dv[s.at(b, j, h) + d] += p[j] * dout[s.at(b, i, h) + d];
          }
        }
      }
}

struct Impl {
  const char* name;
  decltype(&attention_forward) forward;
  decltype(&attention_backward) backward;
};

// The builds this CPU can run, and the dispatching entry points.
std::vector<Impl> implementations() {
  std::vector<Impl> impls{{"dispatch", attention_forward, attention_backward},
                          {"avx2", attention_forward_avx2, attention_backward_avx2}};
  if (cpu_features().avx512)
    impls.push_back({"avx512", attention_forward_avx512, attention_backward_avx512});
  return impls;
}

class Attention : public ::testing::TestWithParam<Dims> {};

TEST_P(Attention, BackwardMatchesNumericalGradient) {
  const Dims s = GetParam();
  const std::vector<float> q = random_floats(s.n(), 4, -2.0f, 2.0f);
  const std::vector<float> k = random_floats(s.n(), 5, -2.0f, 2.0f);
  const std::vector<float> v = random_floats(s.n(), 6);
  const std::vector<float> dout = random_floats(s.n(), 7);
  std::vector<float> out(s.n()), lse(s.B * s.H * s.T);
  attention_forward(out.data(), lse.data(), q.data(), k.data(), v.data(), s.B, s.T, s.H, s.D);
  const auto qd = to_double(q), kd = to_double(k), vd = to_double(v);
  auto want_dq = numerical_gradient(
      [&](const auto& x) { return attention_ref(s, x, kd, vd, &dout, nullptr, nullptr); }, qd);
  auto want_dk = numerical_gradient(
      [&](const auto& x) { return attention_ref(s, qd, x, vd, &dout, nullptr, nullptr); }, kd);
  auto want_dv = numerical_gradient(
      [&](const auto& x) { return attention_ref(s, qd, kd, x, &dout, nullptr, nullptr); }, vd);
  const std::vector<float> base = random_floats(s.n(), 8);
  for (size_t i = 0; i < base.size(); ++i) {
    want_dq[i] += base[i];
    want_dk[i] += base[i];
    want_dv[i] += base[i];
  }
  for (const Impl& impl : implementations()) {
    std::vector<float> first;
    for (int threads : {1, 2}) {
      ThreadCount tc(threads);
      std::vector<float> dq = base, dk = base, dv = base;
      impl.backward(dq.data(), dk.data(), dv.data(), dout.data(), q.data(), k.data(), v.data(),
                    out.data(), lse.data(), s.B, s.T, s.H, s.D, true);
      EXPECT_LT(max_error(dq, want_dq), 1e-4) << impl.name;
      EXPECT_LT(max_error(dk, want_dk), 1e-4) << impl.name;
      EXPECT_LT(max_error(dv, want_dv), 1e-4) << impl.name;
      std::vector<float> all = dq;
      all.insert(all.end(), dk.begin(), dk.end());
      all.insert(all.end(), dv.begin(), dv.end());
      if (first.empty())
        first = all;
      else
        EXPECT_EQ(all, first) << impl.name << ": gradients depend on the thread count";
    }
  }
  // The analytic reference used on larger shapes agrees with the numerical gradients.
  std::vector<double> ref_dq, ref_dk, ref_dv;
  attention_ref_backward(s, qd, kd, vd, dout, ref_dq, ref_dk, ref_dv);
  for (size_t i = 0; i < base.size(); ++i) {
    EXPECT_NEAR(ref_dq[i] + base[i], want_dq[i], 1e-6);
    EXPECT_NEAR(ref_dk[i] + base[i], want_dk[i], 1e-6);
    EXPECT_NEAR(ref_dv[i] + base[i], want_dv[i], 1e-6);
  }
}

// Forward and backward against the reference, on the small shapes above and on shapes of
// several tiles (64 queries x 64 keys).
class AttentionTiles : public ::testing::TestWithParam<Dims> {};

TEST_P(AttentionTiles, MatchesReference) {
  const Dims s = GetParam();
  const std::vector<float> q = random_floats(s.n(), 11, -2.0f, 2.0f);
  const std::vector<float> k = random_floats(s.n(), 12, -2.0f, 2.0f);
  const std::vector<float> v = random_floats(s.n(), 13);
  const std::vector<float> dout = random_floats(s.n(), 14);
  const auto qd = to_double(q), kd = to_double(k), vd = to_double(v);
  std::vector<double> want(s.n()), want_lse(s.B * s.H * s.T), want_dq, want_dk, want_dv;
  attention_ref(s, qd, kd, vd, nullptr, &want, &want_lse);
  attention_ref_backward(s, qd, kd, vd, dout, want_dq, want_dk, want_dv);
  for (const Impl& impl : implementations()) {
    std::vector<float> first;
    for (int threads : {1, 2}) {
      ThreadCount tc(threads);
      std::vector<float> out(s.n()), lse(s.B * s.H * s.T);
      impl.forward(out.data(), lse.data(), q.data(), k.data(), v.data(), s.B, s.T, s.H, s.D);
      EXPECT_LT(max_error(out, want), 1e-5) << impl.name;
      EXPECT_LT(max_error(lse, want_lse), 1e-5) << impl.name;
      // Overwriting: what the buffers held (NaN here) must not show through.
      std::vector<float> dq(s.n(), std::numeric_limits<float>::quiet_NaN()),
          dk(s.n(), std::numeric_limits<float>::quiet_NaN()),
          dv(s.n(), std::numeric_limits<float>::quiet_NaN());
      impl.backward(dq.data(), dk.data(), dv.data(), dout.data(), q.data(), k.data(), v.data(),
                    out.data(), lse.data(), s.B, s.T, s.H, s.D, false);
      EXPECT_LT(max_error(dq, want_dq), 1e-4) << impl.name;
      EXPECT_LT(max_error(dk, want_dk), 1e-4) << impl.name;
      EXPECT_LT(max_error(dv, want_dv), 1e-4) << impl.name;
      // Accumulating onto zeros gives the same bits.
      std::vector<float> zq(s.n()), zk(s.n()), zv(s.n());
      impl.backward(zq.data(), zk.data(), zv.data(), dout.data(), q.data(), k.data(), v.data(),
                    out.data(), lse.data(), s.B, s.T, s.H, s.D, true);
      EXPECT_EQ(zq, dq) << impl.name;
      EXPECT_EQ(zk, dk) << impl.name;
      EXPECT_EQ(zv, dv) << impl.name;
      std::vector<float> all = out;
      for (const auto* g : {&lse, &dq, &dk, &dv}) all.insert(all.end(), g->begin(), g->end());
      if (first.empty())
        first = all;
      else
        EXPECT_EQ(all, first) << impl.name << ": results depend on the thread count";
    }
  }
}

std::vector<uint16_t> to_bf16(const std::vector<float>& x) {
  std::vector<uint16_t> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = fp32_to_bf16(x[i]);
  return out;
}

std::vector<double> from_bf16(const std::vector<uint16_t>& x) {
  std::vector<double> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = bf16_to_fp32(x[i]);
  return out;
}

// The bf16 kernels (vdpbf16ps, or AMX tiles where the GEMM runs on AMX) against the double
// reference on the bf16 values of q, k, v. P, dout and dS are rounded to bf16 inside (relative
// error up to 2^-9 each) and so is the output, so the tolerance is that of a few bf16 roundings,
// not of FP32; lse comes from FP32 scores.
TEST_P(AttentionTiles, Bf16MatchesReference) {
  if (!attention_bf16_native()) GTEST_SKIP() << "no AVX-512 BF16 here, or a lower GEMM path forced";
  const Dims s = GetParam();
  const auto q = to_bf16(random_floats(s.n(), 11, -2.0f, 2.0f));
  const auto k = to_bf16(random_floats(s.n(), 12, -2.0f, 2.0f));
  const auto v = to_bf16(random_floats(s.n(), 13));
  const std::vector<float> dout = random_floats(s.n(), 14);
  const auto qd = from_bf16(q), kd = from_bf16(k), vd = from_bf16(v);
  std::vector<double> want(s.n()), want_lse(s.B * s.H * s.T), want_dq, want_dk, want_dv;
  attention_ref(s, qd, kd, vd, nullptr, &want, &want_lse);
  attention_ref_backward(s, qd, kd, vd, dout, want_dq, want_dk, want_dv);
  const std::vector<float> base = random_floats(s.n(), 15);
  std::vector<float> first;
  for (int threads : {1, 2}) {
    ThreadCount tc(threads);
    std::vector<uint16_t> out16(s.n());
    std::vector<float> lse(s.B * s.H * s.T);
    attention_forward_bf16(out16.data(), lse.data(), q.data(), k.data(), v.data(), s.B, s.T, s.H,
                           s.D);
    std::vector<float> out(s.n());
    for (int64_t i = 0; i < s.n(); ++i) out[i] = bf16_to_fp32(out16[i]);
    EXPECT_LT(max_error(out, want), 4e-3);
    EXPECT_LT(max_error(lse, want_lse), 1e-5);
    // Gradients accumulate into what is there.
    std::vector<float> dq = base, dk = base, dv = base;
    attention_backward_bf16(dq.data(), dk.data(), dv.data(), dout.data(), q.data(), k.data(),
                            v.data(), out16.data(), lse.data(), s.B, s.T, s.H, s.D, true);
    // Overwriting buffers of NaN gives what accumulating onto zeros gives.
    std::vector<float> nq(s.n(), std::numeric_limits<float>::quiet_NaN()),
        nk(s.n(), std::numeric_limits<float>::quiet_NaN()),
        nv(s.n(), std::numeric_limits<float>::quiet_NaN());
    std::vector<float> zq(s.n()), zk(s.n()), zv(s.n());
    attention_backward_bf16(nq.data(), nk.data(), nv.data(), dout.data(), q.data(), k.data(),
                            v.data(), out16.data(), lse.data(), s.B, s.T, s.H, s.D, false);
    attention_backward_bf16(zq.data(), zk.data(), zv.data(), dout.data(), q.data(), k.data(),
                            v.data(), out16.data(), lse.data(), s.B, s.T, s.H, s.D, true);
    EXPECT_EQ(nq, zq);
    EXPECT_EQ(nk, zk);
    EXPECT_EQ(nv, zv);
    for (size_t i = 0; i < base.size(); ++i) {
      dq[i] -= base[i];
      dk[i] -= base[i];
      dv[i] -= base[i];
    }
    EXPECT_LT(max_error(dq, want_dq), 1e-2);
    EXPECT_LT(max_error(dk, want_dk), 1e-2);
    EXPECT_LT(max_error(dv, want_dv), 1e-2);
    std::vector<float> all = out;
    for (const auto* g : {&lse, &dq, &dk, &dv}) all.insert(all.end(), g->begin(), g->end());
    if (first.empty())
      first = all;
    else
      EXPECT_EQ(all, first) << "results depend on the thread count";
  }
}

// Where keys share a large common component, a row of dS sums to zero while dQ = dS K is
// much smaller than |dS| |K|; likewise dK = dS^T Q next to |dS| |Q| where queries do. Against
// FP32 attention on the same bf16 inputs (and the same bf16 forward output), multiplying the
// rounded dS by K and Q as they are leaves relative RMS errors of 5.8e-3 in dQ and 2.8e-3 in
// dK; by K and Q less their means (the kernel) 2.9e-3 and 1.9e-3, about what the rounding of dO
// leaves in dV (2.3e-3).
TEST(AttentionBf16, GradientsAccurateWhenKeysAndQueriesShareAComponent) {
  if (!attention_bf16_native()) GTEST_SKIP() << "no AVX-512 BF16 here, or a lower GEMM path forced";
  const Dims s{1, 256, 4, 64};
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> common(s.D);
  for (float& c : common) c = 3.0f * normal(rng);
  std::vector<float> q(s.n()), k(s.n()), v(s.n()), dout(s.n());
  for (int64_t i = 0; i < s.n(); ++i) {
    q[i] = bf16_to_fp32(fp32_to_bf16(normal(rng) + common[i % s.D]));
    k[i] = bf16_to_fp32(fp32_to_bf16(normal(rng) + common[i % s.D]));
    v[i] = bf16_to_fp32(fp32_to_bf16(normal(rng)));
    dout[i] = normal(rng);
  }
  std::vector<float> out(s.n()), lse(s.B * s.H * s.T);
  attention_forward(out.data(), lse.data(), q.data(), k.data(), v.data(), s.B, s.T, s.H, s.D);
  const std::vector<uint16_t> out16 = to_bf16(out);
  for (int64_t i = 0; i < s.n(); ++i) out[i] = bf16_to_fp32(out16[i]);
  std::vector<float> want_dq(s.n()), want_dk(s.n()), want_dv(s.n());
  attention_backward(want_dq.data(), want_dk.data(), want_dv.data(), dout.data(), q.data(),
                     k.data(), v.data(), out.data(), lse.data(), s.B, s.T, s.H, s.D, false);
  std::vector<float> dq(s.n()), dk(s.n()), dv(s.n());
  attention_backward_bf16(dq.data(), dk.data(), dv.data(), dout.data(), to_bf16(q).data(),
                          to_bf16(k).data(), to_bf16(v).data(), out16.data(), lse.data(), s.B, s.T,
                          s.H, s.D, false);
  auto relative_rms = [](const std::vector<float>& got, const std::vector<float>& want) {
    double err = 0.0, norm = 0.0;
    for (size_t i = 0; i < got.size(); ++i) {
      err += (got[i] - want[i]) * double{got[i] - want[i]};
      norm += want[i] * double{want[i]};
    }
    return std::sqrt(err / norm);
  };
  EXPECT_LT(relative_rms(dq, want_dq), 4e-3);
  EXPECT_LT(relative_rms(dk, want_dk), 2.4e-3);
  EXPECT_LT(relative_rms(dv, want_dv), 3e-3);
}

INSTANTIATE_TEST_SUITE_P(Shapes, AttentionTiles,
                         ::testing::Values(Dims{1, 1, 1, 4}, Dims{2, 7, 3, 5}, Dims{1, 13, 2, 8},
                                           Dims{3, 4, 1, 3}, Dims{1, 1, 1, 64}, Dims{1, 64, 1, 64},
                                           Dims{2, 65, 2, 16}, Dims{1, 200, 1, 64},
                                           Dims{1, 130, 3, 12}, Dims{2, 129, 2, 40},
                                           Dims{1, 70, 1, 96}, Dims{1, 100, 2, 64}),
                         [](const auto& info) {
                           const Dims& d = info.param;
                           std::ostringstream name;
                           name << "B" << d.B << "T" << d.T << "H" << d.H << "D" << d.D;
                           return name.str();
                         });

INSTANTIATE_TEST_SUITE_P(Shapes, Attention,
                         ::testing::Values(Dims{1, 1, 1, 4}, Dims{2, 7, 3, 5}, Dims{1, 13, 2, 8},
                                           Dims{3, 4, 1, 3}),
                         [](const auto& info) {
                           const Dims& d = info.param;
                           std::ostringstream name;
                           name << "B" << d.B << "T" << d.T << "H" << d.H << "D" << d.D;
                           return name.str();
                         });

}  // namespace
}  // namespace cputrain::kernels
