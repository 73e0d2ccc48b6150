// Causal attention, each ISA build, against a double-precision reference that builds the full
// score matrix; backward against numerical gradients of that reference on small shapes, and
// against its analytic gradients (themselves checked against the numerical ones) on shapes of
// several tiles, T not a multiple of the tile, T = 1, one head.
#include <gtest/gtest.h>

#include <cmath>
#include <sstream>

#include "kernel_test_util.h"
#include "kernels/attention.h"
#include "kernels/attention_isa.h"
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
                    out.data(), lse.data(), s.B, s.T, s.H, s.D);
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
      std::vector<float> dq(s.n()), dk(s.n()), dv(s.n());
      impl.backward(dq.data(), dk.data(), dv.data(), dout.data(), q.data(), k.data(), v.data(),
                    out.data(), lse.data(), s.B, s.T, s.H, s.D);
      EXPECT_LT(max_error(dq, want_dq), 1e-4) << impl.name;
      EXPECT_LT(max_error(dk, want_dk), 1e-4) << impl.name;
      EXPECT_LT(max_error(dv, want_dv), 1e-4) << impl.name;
      std::vector<float> all = out;
      for (const auto* g : {&lse, &dq, &dk, &dv}) all.insert(all.end(), g->begin(), g->end());
      if (first.empty())
        first = all;
      else
        EXPECT_EQ(all, first) << impl.name << ": results depend on the thread count";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, AttentionTiles,
                         ::testing::Values(Dims{1, 1, 1, 4}, Dims{2, 7, 3, 5}, Dims{1, 13, 2, 8},
                                           Dims{3, 4, 1, 3}, Dims{1, 1, 1, 64}, Dims{1, 64, 1, 64},
                                           Dims{2, 65, 2, 16}, Dims{1, 200, 1, 64},
                                           Dims{1, 130, 3, 12}, Dims{2, 129, 2, 40},
                                           Dims{1, 70, 1, 96}),
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
