// Causal attention, each ISA build, against a double-precision reference that builds the full
// score matrix; backward against numerical gradients of that reference on small shapes, and
// against its analytic gradients (themselves checked against the numerical ones) on shapes of
// several tiles, T not a multiple of the tile, T = 1, one head. Grouped-query shapes (KVH < H
// key/value heads) run through the same tests; the decode kernel against the full forward.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/attention/attention.h"
#include "kernels/attention/attention_isa.h"
#include "kernels/cpu/bf16.h"
#include "kernels/cpu/cpu_features.h"
#include "kernels/kernel_test_util.h"

namespace cputrain::kernels {
namespace {

using test::max_error;
using test::numerical_gradient;
using test::random_floats;
using test::ThreadCount;
using test::to_double;

// H query heads, KVH key/value heads; query head h reads key/value head h / (H / KVH).
struct Dims {
  int64_t B, T, H, KVH, D;
  int64_t n() const { return B * T * H * D; }       // q, out, dq, dout
  int64_t kv_n() const { return B * T * KVH * D; }  // k, v, dk, dv
  int64_t at(int64_t b, int64_t t, int64_t h) const { return ((b * T + t) * H + h) * D; }
  // The key/value row that query head h reads at position t.
  int64_t kv_at(int64_t b, int64_t t, int64_t h) const {
    return ((b * T + t) * KVH + h / (H / KVH)) * D;
  }
};

std::string dims_name(const Dims& d) {
  std::ostringstream name;
  name << "B" << d.B << "T" << d.T << "H" << d.H;
  if (d.KVH != d.H) name << "KV" << d.KVH;
  name << "D" << d.D;
  return name.str();
}

// How gtest prints a shape in a failure message.
void PrintTo(const Dims& d, std::ostream* os) {
  *os << dims_name(d);
}

// The scores' scale, and the first key query i attends, as `o` has them.
double ref_scale(const Dims& s, const AttentionOptions& o) {
  return o.scale > 0.0f ? o.scale : 1.0 / std::sqrt(static_cast<double>(s.D));
}
int64_t ref_first(int64_t i, const AttentionOptions& o) {
  return o.window > 0 ? std::max<int64_t>(0, i - o.window + 1) : 0;
}
// A scaled score, soft-capped where `o` caps it.
double ref_cap(double score, const AttentionOptions& o) {
  return o.softcap > 0.0f ? o.softcap * std::tanh(score / o.softcap) : score;
}

// out and lse of causal softmax(q k^T / sqrt(D)) v (or with `o`'s scale, cap and window);
// returns sum(out * dout) when dout is given.
double attention_ref(const Dims& s, const std::vector<double>& q, const std::vector<double>& k,
                     const std::vector<double>& v, const std::vector<float>* dout,
                     std::vector<double>* out, std::vector<double>* lse,
                     const AttentionOptions& o = {}) {
  double loss = 0.0;
  const double scale = ref_scale(s, o);
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t h = 0; h < s.H; ++h)
      for (int64_t i = 0; i < s.T; ++i) {
        std::vector<double> score(s.T, 0.0);
        double max = -1e300;
        const int64_t first = ref_first(i, o);
        for (int64_t j = first; j <= i; ++j) {
          for (int64_t d = 0; d < s.D; ++d)
            score[j] += q[s.at(b, i, h) + d] * k[s.kv_at(b, j, h) + d] * scale;
          score[j] = ref_cap(score[j], o);
          max = std::max(max, score[j]);
        }
        // A sink: one more key of the head's logit and value zero.
        if (o.sinks) max = std::max(max, static_cast<double>(o.sinks[h]));
        double sum = o.sinks ? std::exp(o.sinks[h] - max) : 0.0;
        for (int64_t j = first; j <= i; ++j) sum += std::exp(score[j] - max);
        if (lse) (*lse)[(b * s.H + h) * s.T + i] = max + std::log(sum);
        for (int64_t d = 0; d < s.D; ++d) {
          double o_d = 0.0;
          for (int64_t j = first; j <= i; ++j)
            o_d += std::exp(score[j] - max) / sum * v[s.kv_at(b, j, h) + d];
          if (out) (*out)[s.at(b, i, h) + d] = o_d;
          if (dout) loss += o_d * (*dout)[s.at(b, i, h) + d];
        }
      }
  return loss;
}

// Gradients of sum(out * dout) by q, k, v, from the formulas of the softmax backward; dk and dv
// of a key/value head sum over the query heads that read it.
void attention_ref_backward(const Dims& s, const std::vector<double>& q,
                            const std::vector<double>& k, const std::vector<double>& v,
                            const std::vector<float>& dout, std::vector<double>& dq,
                            std::vector<double>& dk, std::vector<double>& dv,
                            const AttentionOptions& o = {}) {
  const double scale = ref_scale(s, o);
  dq.assign(s.n(), 0.0);
  dk.assign(s.kv_n(), 0.0);
  dv.assign(s.kv_n(), 0.0);
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t h = 0; h < s.H; ++h)
      for (int64_t i = 0; i < s.T; ++i) {
        std::vector<double> p(i + 1, 0.0), dp(i + 1, 0.0), capped(i + 1, 1.0);
        double max = -1e300, sum = 0.0, di = 0.0;
        const int64_t first = ref_first(i, o);
        for (int64_t j = first; j <= i; ++j) {
          for (int64_t d = 0; d < s.D; ++d) p[j] += q[s.at(b, i, h) + d] * k[s.kv_at(b, j, h) + d];
          p[j] *= scale;
          if (o.softcap > 0.0f) {  // d(cap tanh(x / cap)) / dx = 1 - tanh^2
            const double t = std::tanh(p[j] / o.softcap);
            capped[j] = 1.0 - t * t;
          }
          p[j] = ref_cap(p[j], o);
          max = std::max(max, p[j]);
        }
        if (o.sinks) max = std::max(max, static_cast<double>(o.sinks[h]));
        if (o.sinks) sum = std::exp(o.sinks[h] - max);
        for (int64_t j = first; j <= i; ++j) sum += std::exp(p[j] - max);
        for (int64_t j = first; j <= i; ++j) {
          p[j] = std::exp(p[j] - max) / sum;
          for (int64_t d = 0; d < s.D; ++d)
            dp[j] += dout[s.at(b, i, h) + d] * v[s.kv_at(b, j, h) + d];
          di += p[j] * dp[j];
        }
        for (int64_t j = first; j <= i; ++j) {
          const double ds = p[j] * (dp[j] - di) * capped[j] * scale;
          for (int64_t d = 0; d < s.D; ++d) {
            dq[s.at(b, i, h) + d] += ds * k[s.kv_at(b, j, h) + d];
            dk[s.kv_at(b, j, h) + d] += ds * q[s.at(b, i, h) + d];
            dv[s.kv_at(b, j, h) + d] += p[j] * dout[s.at(b, i, h) + d];
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
  const std::vector<float> k = random_floats(s.kv_n(), 5, -2.0f, 2.0f);
  const std::vector<float> v = random_floats(s.kv_n(), 6);
  const std::vector<float> dout = random_floats(s.n(), 7);
  std::vector<float> out(s.n()), lse(s.B * s.H * s.T);
  attention_forward(out.data(), lse.data(), q.data(), k.data(), v.data(), s.B, s.T, s.H, s.KVH,
                    s.D);
  const auto qd = to_double(q), kd = to_double(k), vd = to_double(v);
  auto want_dq = numerical_gradient(
      [&](const auto& x) { return attention_ref(s, x, kd, vd, &dout, nullptr, nullptr); }, qd);
  auto want_dk = numerical_gradient(
      [&](const auto& x) { return attention_ref(s, qd, x, vd, &dout, nullptr, nullptr); }, kd);
  auto want_dv = numerical_gradient(
      [&](const auto& x) { return attention_ref(s, qd, kd, x, &dout, nullptr, nullptr); }, vd);
  // What the gradients accumulate onto: q's shape, and the keys' (the first kv_n() of it).
  const std::vector<float> base = random_floats(s.n(), 8);
  const std::vector<float> kv_base(base.begin(), base.begin() + s.kv_n());
  for (size_t i = 0; i < base.size(); ++i) want_dq[i] += base[i];
  for (size_t i = 0; i < kv_base.size(); ++i) {
    want_dk[i] += kv_base[i];
    want_dv[i] += kv_base[i];
  }
  for (const Impl& impl : implementations()) {
    std::vector<float> first;
    for (int threads : {1, 2}) {
      ThreadCount tc(threads);
      std::vector<float> dq = base, dk = kv_base, dv = kv_base;
      impl.backward(dq.data(), dk.data(), dv.data(), dout.data(), q.data(), k.data(), v.data(),
                    out.data(), lse.data(), s.B, s.T, s.H, s.KVH, s.D, true, {});
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
  for (size_t i = 0; i < base.size(); ++i) EXPECT_NEAR(ref_dq[i] + base[i], want_dq[i], 1e-6);
  for (size_t i = 0; i < kv_base.size(); ++i) {
    EXPECT_NEAR(ref_dk[i] + kv_base[i], want_dk[i], 1e-6);
    EXPECT_NEAR(ref_dv[i] + kv_base[i], want_dv[i], 1e-6);
  }
}

// Forward and backward against the reference, on the small shapes above and on shapes of
// several tiles (64 queries x 64 keys).
class AttentionTiles : public ::testing::TestWithParam<Dims> {};

TEST_P(AttentionTiles, MatchesReference) {
  const Dims s = GetParam();
  const std::vector<float> q = random_floats(s.n(), 11, -2.0f, 2.0f);
  const std::vector<float> k = random_floats(s.kv_n(), 12, -2.0f, 2.0f);
  const std::vector<float> v = random_floats(s.kv_n(), 13);
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
      impl.forward(out.data(), lse.data(), q.data(), k.data(), v.data(), s.B, s.T, s.H, s.KVH, s.D,
                   {});
      EXPECT_LT(max_error(out, want), 1e-5) << impl.name;
      EXPECT_LT(max_error(lse, want_lse), 1e-5) << impl.name;
      // Overwriting: what the buffers held (NaN here) must not show through.
      std::vector<float> dq(s.n(), std::numeric_limits<float>::quiet_NaN()),
          dk(s.kv_n(), std::numeric_limits<float>::quiet_NaN()),
          dv(s.kv_n(), std::numeric_limits<float>::quiet_NaN());
      impl.backward(dq.data(), dk.data(), dv.data(), dout.data(), q.data(), k.data(), v.data(),
                    out.data(), lse.data(), s.B, s.T, s.H, s.KVH, s.D, false, {});
      EXPECT_LT(max_error(dq, want_dq), 1e-4) << impl.name;
      EXPECT_LT(max_error(dk, want_dk), 1e-4) << impl.name;
      EXPECT_LT(max_error(dv, want_dv), 1e-4) << impl.name;
      // Accumulating onto zeros gives the same bits.
      std::vector<float> zq(s.n()), zk(s.kv_n()), zv(s.kv_n());
      impl.backward(zq.data(), zk.data(), zv.data(), dout.data(), q.data(), k.data(), v.data(),
                    out.data(), lse.data(), s.B, s.T, s.H, s.KVH, s.D, true, {});
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

// Random bf16 q, k, v (seeds seed .. seed + 2, q and k in [-2, 2]) and FP32 dout (seed + 3),
// and the double reference's output, lse and gradients on the bf16 values, with options o.
struct Bf16Inputs {
  Bf16Inputs(const Dims& s, uint32_t seed, const AttentionOptions& o = {})
      : q(to_bf16(random_floats(s.n(), seed, -2.0f, 2.0f))),
        k(to_bf16(random_floats(s.kv_n(), seed + 1, -2.0f, 2.0f))),
        v(to_bf16(random_floats(s.kv_n(), seed + 2))),
        dout(random_floats(s.n(), seed + 3)),
        qd(from_bf16(q)),
        kd(from_bf16(k)),
        vd(from_bf16(v)),
        want(s.n()),
        want_lse(s.B * s.H * s.T) {
    attention_ref(s, qd, kd, vd, nullptr, &want, &want_lse, o);
    attention_ref_backward(s, qd, kd, vd, dout, want_dq, want_dk, want_dv, o);
  }
  std::vector<uint16_t> q, k, v;
  std::vector<float> dout;
  std::vector<double> qd, kd, vd, want, want_lse, want_dq, want_dk, want_dv;
};

// The bf16 forward on `in` with options o: its bf16 output, that output widened, and lse.
struct Bf16Forward {
  std::vector<uint16_t> out16;
  std::vector<float> out, lse;
};
Bf16Forward forward_bf16(const Dims& s, const Bf16Inputs& in, const AttentionOptions& o = {}) {
  Bf16Forward f{std::vector<uint16_t>(s.n()), std::vector<float>(s.n()),
                std::vector<float>(s.B * s.H * s.T)};
  attention_forward_bf16(f.out16.data(), f.lse.data(), in.q.data(), in.k.data(), in.v.data(), s.B,
                         s.T, s.H, s.KVH, s.D, o);
  for (int64_t i = 0; i < s.n(); ++i) f.out[i] = bf16_to_fp32(f.out16[i]);
  return f;
}

// The bf16 kernels (vdpbf16ps, or AMX tiles where the GEMM runs on AMX) against the double
// reference on the bf16 values of q, k, v. P, dout and dS are rounded to bf16 inside (relative
// error up to 2^-9 each) and so is the output, so the tolerance is that of a few bf16 roundings,
// not of FP32; lse comes from FP32 scores.
TEST_P(AttentionTiles, Bf16MatchesReference) {
  if (!attention_bf16_native()) GTEST_SKIP() << "the attention chosen has no bf16 instructions";
  const Dims s = GetParam();
  const Bf16Inputs in(s, 11);
  const auto &q = in.q, &k = in.k, &v = in.v;
  const auto& dout = in.dout;
  const auto &want = in.want, &want_lse = in.want_lse, &want_dq = in.want_dq, &want_dk = in.want_dk,
             &want_dv = in.want_dv;
  const std::vector<float> base = random_floats(s.n(), 15);
  const std::vector<float> kv_base(base.begin(), base.begin() + s.kv_n());
  std::vector<float> first;
  for (int threads : {1, 2}) {
    ThreadCount tc(threads);
    auto [out16, out, lse] = forward_bf16(s, in);
    EXPECT_LT(max_error(out, want), 4e-3);
    EXPECT_LT(max_error(lse, want_lse), 1e-5);
    // Gradients accumulate into what is there.
    std::vector<float> dq = base, dk = kv_base, dv = kv_base;
    attention_backward_bf16(dq.data(), dk.data(), dv.data(), dout.data(), q.data(), k.data(),
                            v.data(), out16.data(), lse.data(), s.B, s.T, s.H, s.KVH, s.D, true);
    // Overwriting buffers of NaN gives what accumulating onto zeros gives.
    std::vector<float> nq(s.n(), std::numeric_limits<float>::quiet_NaN()),
        nk(s.kv_n(), std::numeric_limits<float>::quiet_NaN()),
        nv(s.kv_n(), std::numeric_limits<float>::quiet_NaN());
    std::vector<float> zq(s.n()), zk(s.kv_n()), zv(s.kv_n());
    attention_backward_bf16(nq.data(), nk.data(), nv.data(), dout.data(), q.data(), k.data(),
                            v.data(), out16.data(), lse.data(), s.B, s.T, s.H, s.KVH, s.D, false);
    attention_backward_bf16(zq.data(), zk.data(), zv.data(), dout.data(), q.data(), k.data(),
                            v.data(), out16.data(), lse.data(), s.B, s.T, s.H, s.KVH, s.D, true);
    EXPECT_EQ(nq, zq);
    EXPECT_EQ(nk, zk);
    EXPECT_EQ(nv, zv);
    for (size_t i = 0; i < base.size(); ++i) dq[i] -= base[i];
    for (size_t i = 0; i < kv_base.size(); ++i) {
      dk[i] -= kv_base[i];
      dv[i] -= kv_base[i];
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
// much smaller than |dS| |K|; likewise dK = dS^T Q next to |dS| |Q| where queries do. The
// reference: FP32 attention's gradients on the same bf16 inputs, D_i from its FP32 output as the
// softmax's gradient has it. The bf16 backward is given the output rounded to bf16 (and, at
// sigma 12, the bf16 forward's output and lse). Multiplying the rounded dS by K and Q as they
// are doubled the errors in dQ and dK (5.8e-3 and 2.8e-3 against a reference with D_i from the
// rounded output). With K and Q less their means, dQ without m_K times dS's row sums (0, but not
// as computed, D_i coming from the rounded output): relative RMS errors 3.5e-3 in dQ, 3.4e-3 in
// dK, 2.3e-3 in dV at sigma 3, 8.1e-3, 7.5e-3, 2.0e-3 at sigma 12; with the row sums added, dQ's
// were 1.0e-2 and 0.10. dK keeps m_Q times dS's column sums, which are not 0.
TEST(AttentionBf16, GradientsAccurateWhenKeysAndQueriesShareAComponent) {
  if (!attention_bf16_native()) GTEST_SKIP() << "the attention chosen has no bf16 instructions";
  auto relative_rms = [](const std::vector<float>& got, const std::vector<float>& want) {
    double err = 0.0, norm = 0.0;
    for (size_t i = 0; i < got.size(); ++i) {
      err += (got[i] - want[i]) * double{got[i] - want[i]};
      norm += want[i] * double{want[i]};
    }
    return std::sqrt(err / norm);
  };
  struct Case {
    float sigma;        // of the component q and k share
    bool bf16_forward;  // the bf16 forward's output and lse feed the bf16 backward
    double dq, dk, dv;  // the largest relative RMS errors accepted
  };
  for (const Case& c :
       {Case{3.0f, false, 5e-3, 4.5e-3, 3e-3}, Case{12.0f, true, 1.5e-2, 1e-2, 3e-3}}) {
    const Dims s{1, 256, 4, 4, 64};
    std::mt19937 rng(5);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> common(s.D);
    for (float& x : common) x = c.sigma * normal(rng);
    std::vector<float> q(s.n()), k(s.n()), v(s.n()), dout(s.n());
    for (int64_t i = 0; i < s.n(); ++i) {
      q[i] = bf16_to_fp32(fp32_to_bf16(normal(rng) + common[i % s.D]));
      k[i] = bf16_to_fp32(fp32_to_bf16(normal(rng) + common[i % s.D]));
      v[i] = bf16_to_fp32(fp32_to_bf16(normal(rng)));
      dout[i] = normal(rng);
    }
    std::vector<float> out(s.n()), lse(s.B * s.H * s.T);
    attention_forward(out.data(), lse.data(), q.data(), k.data(), v.data(), s.B, s.T, s.H, s.KVH,
                      s.D);
    std::vector<float> want_dq(s.n()), want_dk(s.n()), want_dv(s.n());
    attention_backward(want_dq.data(), want_dk.data(), want_dv.data(), dout.data(), q.data(),
                       k.data(), v.data(), out.data(), lse.data(), s.B, s.T, s.H, s.KVH, s.D,
                       false);
    const std::vector<uint16_t> q16 = to_bf16(q), k16 = to_bf16(k), v16 = to_bf16(v);
    std::vector<uint16_t> out16 = to_bf16(out);
    if (c.bf16_forward)
      attention_forward_bf16(out16.data(), lse.data(), q16.data(), k16.data(), v16.data(), s.B, s.T,
                             s.H, s.KVH, s.D);
    std::vector<float> dq(s.n()), dk(s.n()), dv(s.n());
    attention_backward_bf16(dq.data(), dk.data(), dv.data(), dout.data(), q16.data(), k16.data(),
                            v16.data(), out16.data(), lse.data(), s.B, s.T, s.H, s.KVH, s.D, false);
    EXPECT_LT(relative_rms(dq, want_dq), c.dq) << "sigma " << c.sigma;
    EXPECT_LT(relative_rms(dk, want_dk), c.dk) << "sigma " << c.sigma;
    EXPECT_LT(relative_rms(dv, want_dv), c.dv) << "sigma " << c.sigma;
  }
}

// Grouped-query attention is multi-head attention on keys and values repeated to every query
// head (Hugging Face's repeat_kv), with dk and dv of a key/value head the sum of the repeated
// heads' gradients. The kernels read the shared heads in place and add the group's query heads
// in order, so each build gives the bits it gives on the repeated keys and values, and dk, dv
// those of the repeated heads' gradients summed in the order of the heads.
TEST_P(AttentionTiles, GroupedEqualsRepeatedKeysAndValues) {
  const Dims s = GetParam();
  const Dims rep{s.B, s.T, s.H, s.H, s.D};
  const std::vector<float> q = random_floats(s.n(), 21, -2.0f, 2.0f);
  const std::vector<float> k = random_floats(s.kv_n(), 22, -2.0f, 2.0f);
  const std::vector<float> v = random_floats(s.kv_n(), 23);
  const std::vector<float> dout = random_floats(s.n(), 24);
  // k, v repeated to (B, T, H, D); a key/value head's gradient: its query heads' summed in order.
  auto repeat = [&](const std::vector<float>& x) {
    std::vector<float> r(s.n());
    for (int64_t b = 0; b < s.B; ++b)
      for (int64_t t = 0; t < s.T; ++t)
        for (int64_t h = 0; h < s.H; ++h)
          std::copy_n(x.begin() + s.kv_at(b, t, h), s.D, r.begin() + rep.at(b, t, h));
    return r;
  };
  auto sum_group = [&](const std::vector<float>& g) {
    std::vector<float> r(s.kv_n());
    std::vector<bool> seen(s.kv_n());
    for (int64_t b = 0; b < s.B; ++b)
      for (int64_t t = 0; t < s.T; ++t)
        for (int64_t h = 0; h < s.H; ++h)
          for (int64_t d = 0; d < s.D; ++d) {
            const int64_t i = s.kv_at(b, t, h) + d;
            r[i] = seen[i] ? r[i] + g[rep.at(b, t, h) + d] : g[rep.at(b, t, h) + d];
            seen[i] = true;
          }
    return r;
  };
  const std::vector<float> kr = repeat(k), vr = repeat(v);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (const Impl& impl : implementations()) {
    std::vector<float> out(s.n()), lse(s.B * s.H * s.T), want(s.n()), want_lse(s.B * s.H * s.T);
    impl.forward(out.data(), lse.data(), q.data(), k.data(), v.data(), s.B, s.T, s.H, s.KVH, s.D,
                 {});
    impl.forward(want.data(), want_lse.data(), q.data(), kr.data(), vr.data(), s.B, s.T, s.H, s.H,
                 s.D, {});
    EXPECT_EQ(out, want) << impl.name;
    EXPECT_EQ(lse, want_lse) << impl.name;
    std::vector<float> dq(s.n(), nan), dk(s.kv_n(), nan), dv(s.kv_n(), nan);
    impl.backward(dq.data(), dk.data(), dv.data(), dout.data(), q.data(), k.data(), v.data(),
                  out.data(), lse.data(), s.B, s.T, s.H, s.KVH, s.D, false, {});
    std::vector<float> rq(s.n(), nan), rk(s.n(), nan), rv(s.n(), nan);
    impl.backward(rq.data(), rk.data(), rv.data(), dout.data(), q.data(), kr.data(), vr.data(),
                  out.data(), lse.data(), s.B, s.T, s.H, s.H, s.D, false, {});
    EXPECT_EQ(dq, rq) << impl.name;
    EXPECT_EQ(dk, sum_group(rk)) << impl.name;
    EXPECT_EQ(dv, sum_group(rv)) << impl.name;
  }
  if (!attention_bf16_native()) return;
  const auto q16 = to_bf16(q), k16 = to_bf16(k), v16 = to_bf16(v);
  const auto kr16 = to_bf16(kr), vr16 = to_bf16(vr);
  std::vector<uint16_t> out(s.n()), want(s.n());
  std::vector<float> lse(s.B * s.H * s.T), want_lse(s.B * s.H * s.T);
  attention_forward_bf16(out.data(), lse.data(), q16.data(), k16.data(), v16.data(), s.B, s.T, s.H,
                         s.KVH, s.D);
  attention_forward_bf16(want.data(), want_lse.data(), q16.data(), kr16.data(), vr16.data(), s.B,
                         s.T, s.H, s.H, s.D);
  EXPECT_EQ(out, want) << "bf16";
  EXPECT_EQ(lse, want_lse) << "bf16";
  std::vector<float> dq(s.n(), nan), dk(s.kv_n(), nan), dv(s.kv_n(), nan);
  attention_backward_bf16(dq.data(), dk.data(), dv.data(), dout.data(), q16.data(), k16.data(),
                          v16.data(), out.data(), lse.data(), s.B, s.T, s.H, s.KVH, s.D, false);
  std::vector<float> rq(s.n(), nan), rk(s.n(), nan), rv(s.n(), nan);
  attention_backward_bf16(rq.data(), rk.data(), rv.data(), dout.data(), q16.data(), kr16.data(),
                          vr16.data(), out.data(), lse.data(), s.B, s.T, s.H, s.H, s.D, false);
  EXPECT_EQ(dq, rq) << "bf16";
  EXPECT_EQ(dk, sum_group(rk)) << "bf16";
  EXPECT_EQ(dv, sum_group(rv)) << "bf16";
}

// Decoding one position at a time, or m at a time, gives each position the output the full
// forward gives it (summed in another order, so to FP32 rounding), and the double reference's.
// The cache holds only the positions decoded so far, NaN past them: a read past the causal
// window shows.
TEST(AttentionDecode, MatchesFullForwardAtEveryPosition) {
  for (const Dims s : {Dims{1, 70, 4, 2, 12}, Dims{1, 70, 4, 1, 12}, Dims{1, 70, 4, 2, 64},
                       Dims{1, 70, 4, 1, 64}, Dims{1, 70, 4, 4, 64}, Dims{1, 70, 1, 1, 12}}) {
    const std::vector<float> q = random_floats(s.n(), 31, -2.0f, 2.0f);
    const std::vector<float> k = random_floats(s.kv_n(), 32, -2.0f, 2.0f);
    const std::vector<float> v = random_floats(s.kv_n(), 33);
    std::vector<float> full(s.n()), lse(s.H * s.T);
    attention_forward(full.data(), lse.data(), q.data(), k.data(), v.data(), s.B, s.T, s.H, s.KVH,
                      s.D);
    std::vector<double> ref(s.n());
    attention_ref(s, to_double(q), to_double(k), to_double(v), nullptr, &ref, nullptr);
    const int64_t row = s.H * s.D, kv_row = s.KVH * s.D;
    for (const int64_t chunk : {int64_t{1}, int64_t{5}}) {
      const float nan = std::numeric_limits<float>::quiet_NaN();
      std::vector<float> keys(s.kv_n(), nan), values(s.kv_n(), nan), out(s.n(), nan);
      for (int64_t n = 0; n < s.T; n += chunk) {
        const int64_t m = std::min(chunk, s.T - n);
        std::copy_n(k.begin() + n * kv_row, m * kv_row, keys.begin() + n * kv_row);
        std::copy_n(v.begin() + n * kv_row, m * kv_row, values.begin() + n * kv_row);
        attention_decode(out.data() + n * row, q.data() + n * row, keys.data(), values.data(), n, m,
                         s.H, s.KVH, s.D);
      }
      for (int64_t t = 0; t < s.T; ++t) {
        const std::vector<float> got(out.begin() + t * row, out.begin() + (t + 1) * row);
        const std::vector<double> want(full.begin() + t * row, full.begin() + (t + 1) * row);
        const std::vector<double> want_ref(ref.begin() + t * row, ref.begin() + (t + 1) * row);
        EXPECT_LT(max_error(got, want), 1e-5) << dims_name(s) << " chunk " << chunk << " t " << t;
        EXPECT_LT(max_error(got, want_ref), 1e-5)
            << dims_name(s) << " chunk " << chunk << " t " << t;
      }
    }
  }
}

// Scores with options (Gemma 2 and 3): a scale of their own, soft-capping and a sliding window,
// each alone and together.
// gpt-oss's sinks (a logit per query head, up to 4 heads), alone and with a window.
const float kSinks[] = {0.7f, -1.3f, 2.5f, 0.1f};
const AttentionOptions kScoreOptions[] = {
    {0.3f, 0.0f, 0}, {0.0f, 2.0f, 0},         {0.0f, 0.0f, 3},        {0.3f, 2.0f, 3},
    {0.0f, 0.0f, 1}, {0.0f, 0.0f, 0, kSinks}, {0.3f, 0.0f, 3, kSinks}};

std::string options_name(const AttentionOptions& o) {
  std::ostringstream name;
  name << "scale " << o.scale << " cap " << o.softcap << " window " << o.window
       << (o.sinks ? " sinks" : "");
  return name.str();
}

// On small shapes, forward against the double reference and backward against its numerical
// gradients (and the analytic reference gradients against the same).
TEST(AttentionOptions, MatchNumericalGradients) {
  for (const Dims s : {Dims{1, 7, 2, 1, 5}, Dims{2, 9, 2, 2, 4}}) {
    for (const AttentionOptions& o : kScoreOptions) {
      const std::vector<float> q = random_floats(s.n(), 41, -2.0f, 2.0f);
      const std::vector<float> k = random_floats(s.kv_n(), 42, -2.0f, 2.0f);
      const std::vector<float> v = random_floats(s.kv_n(), 43);
      const std::vector<float> dout = random_floats(s.n(), 44);
      const auto qd = to_double(q), kd = to_double(k), vd = to_double(v);
      const auto f = [&](const std::vector<double>& qx, const std::vector<double>& kx,
                         const std::vector<double>& vx) {
        return attention_ref(s, qx, kx, vx, &dout, nullptr, nullptr, o);
      };
      const auto num_dq = numerical_gradient([&](const auto& x) { return f(x, kd, vd); }, qd);
      const auto num_dk = numerical_gradient([&](const auto& x) { return f(qd, x, vd); }, kd);
      const auto num_dv = numerical_gradient([&](const auto& x) { return f(qd, kd, x); }, vd);
      std::vector<double> ref_dq, ref_dk, ref_dv, want(s.n()), want_lse(s.B * s.H * s.T);
      attention_ref_backward(s, qd, kd, vd, dout, ref_dq, ref_dk, ref_dv, o);
      attention_ref(s, qd, kd, vd, nullptr, &want, &want_lse, o);
      for (size_t i = 0; i < ref_dq.size(); ++i) EXPECT_NEAR(ref_dq[i], num_dq[i], 1e-6);
      for (size_t i = 0; i < ref_dk.size(); ++i) EXPECT_NEAR(ref_dk[i], num_dk[i], 1e-6);
      for (size_t i = 0; i < ref_dv.size(); ++i) EXPECT_NEAR(ref_dv[i], num_dv[i], 1e-6);
      for (const Impl& impl : implementations()) {
        std::vector<float> out(s.n()), lse(s.B * s.H * s.T);
        impl.forward(out.data(), lse.data(), q.data(), k.data(), v.data(), s.B, s.T, s.H, s.KVH,
                     s.D, o);
        EXPECT_LT(max_error(out, want), 1e-5) << impl.name << " " << options_name(o);
        EXPECT_LT(max_error(lse, want_lse), 1e-5) << impl.name << " " << options_name(o);
        std::vector<float> dq(s.n()), dk(s.kv_n()), dv(s.kv_n());
        impl.backward(dq.data(), dk.data(), dv.data(), dout.data(), q.data(), k.data(), v.data(),
                      out.data(), lse.data(), s.B, s.T, s.H, s.KVH, s.D, false, o);
        EXPECT_LT(max_error(dq, num_dq), 1e-4) << impl.name << " " << options_name(o);
        EXPECT_LT(max_error(dk, num_dk), 1e-4) << impl.name << " " << options_name(o);
        EXPECT_LT(max_error(dv, num_dv), 1e-4) << impl.name << " " << options_name(o);
      }
    }
  }
}

// Over tiles: windows of 1, at and around the tile (63, 64, 65) and across several, sequences
// shorter and longer than the window with tails; soft-capped scores large enough to saturate.
// Forward and backward against the double reference, every build, one and two threads the same
// bits; a window no shorter than the sequence gives the bits of none.
struct OptionsCase {
  Dims s;
  AttentionOptions o;
};
const OptionsCase kOptionsCases[] = {
    {{1, 200, 2, 1, 16}, {0.0f, 0.0f, 1}},        {{1, 200, 2, 1, 16}, {0.0f, 0.0f, 63}},
    {{1, 200, 2, 2, 16}, {0.0f, 0.0f, 64}},       {{2, 130, 2, 1, 24}, {0.0f, 0.0f, 65}},
    {{1, 260, 4, 2, 16}, {0.0f, 50.0f, 100}},     {{1, 150, 2, 1, 40}, {0.0f, 5.0f, 0}},
    {{1, 90, 2, 2, 64}, {0.0625f, 5.0f, 70}},     {{1, 40, 2, 1, 16}, {0.0f, 0.0f, 100}},
    {{1, 1, 1, 1, 8}, {0.2f, 3.0f, 1}},           {{1, 7, 2, 1, 5}, {0.3f, 2.0f, 3}},
    {{2, 9, 2, 2, 4}, {0.0f, 2.0f, 0}},           {{1, 200, 2, 1, 16}, {0.0f, 0.0f, 63, kSinks}},
    {{1, 260, 4, 2, 16}, {0.0f, 0.0f, 0, kSinks}}};

TEST(AttentionOptions, WindowEdgesTailsAndCapsOverTiles) {
  for (const auto& [s, o] : kOptionsCases) {
    const std::string what = dims_name(s) + " " + options_name(o);
    const std::vector<float> q = random_floats(s.n(), 51, -2.0f, 2.0f);
    const std::vector<float> k = random_floats(s.kv_n(), 52, -2.0f, 2.0f);
    const std::vector<float> v = random_floats(s.kv_n(), 53);
    const std::vector<float> dout = random_floats(s.n(), 54);
    const auto qd = to_double(q), kd = to_double(k), vd = to_double(v);
    std::vector<double> want(s.n()), want_lse(s.B * s.H * s.T), want_dq, want_dk, want_dv;
    attention_ref(s, qd, kd, vd, nullptr, &want, &want_lse, o);
    attention_ref_backward(s, qd, kd, vd, dout, want_dq, want_dk, want_dv, o);
    for (const Impl& impl : implementations()) {
      std::vector<float> first;
      for (int threads : {1, 2}) {
        ThreadCount tc(threads);
        std::vector<float> out(s.n()), lse(s.B * s.H * s.T);
        impl.forward(out.data(), lse.data(), q.data(), k.data(), v.data(), s.B, s.T, s.H, s.KVH,
                     s.D, o);
        EXPECT_LT(max_error(out, want), 1e-5) << impl.name << " " << what;
        EXPECT_LT(max_error(lse, want_lse), 1e-5) << impl.name << " " << what;
        const float nan = std::numeric_limits<float>::quiet_NaN();
        std::vector<float> dq(s.n(), nan), dk(s.kv_n(), nan), dv(s.kv_n(), nan);
        impl.backward(dq.data(), dk.data(), dv.data(), dout.data(), q.data(), k.data(), v.data(),
                      out.data(), lse.data(), s.B, s.T, s.H, s.KVH, s.D, false, o);
        EXPECT_LT(max_error(dq, want_dq), 1e-4) << impl.name << " " << what;
        EXPECT_LT(max_error(dk, want_dk), 1e-4) << impl.name << " " << what;
        EXPECT_LT(max_error(dv, want_dv), 1e-4) << impl.name << " " << what;
        std::vector<float> all = out;
        for (const auto* g : {&lse, &dq, &dk, &dv}) all.insert(all.end(), g->begin(), g->end());
        if (first.empty())
          first = all;
        else
          EXPECT_EQ(all, first) << impl.name << " " << what << ": depends on the thread count";
      }
      if (o.window < s.T || o.softcap > 0.0f || o.scale > 0.0f || o.sinks) continue;
      std::vector<float> plain(s.n()), plain_lse(s.B * s.H * s.T), windowed(s.n()),
          windowed_lse(s.B * s.H * s.T);
      impl.forward(plain.data(), plain_lse.data(), q.data(), k.data(), v.data(), s.B, s.T, s.H,
                   s.KVH, s.D, {});
      impl.forward(windowed.data(), windowed_lse.data(), q.data(), k.data(), v.data(), s.B, s.T,
                   s.H, s.KVH, s.D, o);
      EXPECT_EQ(windowed, plain) << impl.name << " " << what;
      EXPECT_EQ(windowed_lse, plain_lse) << impl.name << " " << what;
    }
  }
}

// The bf16 kernels with options, over the same cases, against the double reference on the bf16
// values of q, k and v, to the tolerances of Bf16MatchesReference; one and two threads the same
// bits; a window no shorter than the sequence gives the bits of none; the FP32 kernels' lse on
// the same inputs to FP32 rounding (the scores and their statistics are FP32 on both).
TEST(AttentionOptions, Bf16WindowEdgesTailsAndCapsOverTiles) {
  if (!attention_bf16_native()) GTEST_SKIP() << "the attention chosen has no bf16 instructions";
  for (const auto& [s, o] : kOptionsCases) {
    const std::string what = dims_name(s) + " " + options_name(o);
    const Bf16Inputs in(s, 51, o);
    const auto &q = in.q, &k = in.k, &v = in.v;
    const auto& dout = in.dout;
    const auto &qd = in.qd, &kd = in.kd, &vd = in.vd;
    std::vector<float> first;
    Bf16Forward f;
    for (int threads : {1, 2}) {
      ThreadCount tc(threads);
      f = forward_bf16(s, in, o);
      auto& [out16, out, lse] = f;
      EXPECT_LT(max_error(out, in.want), 4e-3) << what;
      EXPECT_LT(max_error(lse, in.want_lse), 1e-5) << what;
      const float nan = std::numeric_limits<float>::quiet_NaN();
      std::vector<float> dq(s.n(), nan), dk(s.kv_n(), nan), dv(s.kv_n(), nan);
      attention_backward_bf16(dq.data(), dk.data(), dv.data(), dout.data(), q.data(), k.data(),
                              v.data(), out16.data(), lse.data(), s.B, s.T, s.H, s.KVH, s.D, false,
                              o);
      EXPECT_LT(max_error(dq, in.want_dq), 1e-2) << what;
      EXPECT_LT(max_error(dk, in.want_dk), 1e-2) << what;
      EXPECT_LT(max_error(dv, in.want_dv), 1e-2) << what;
      std::vector<float> all = out;
      for (const auto* g : {&lse, &dq, &dk, &dv}) all.insert(all.end(), g->begin(), g->end());
      if (first.empty())
        first = all;
      else
        EXPECT_EQ(all, first) << what << ": depends on the thread count";
    }
    // Against the FP32 kernels on the same inputs.
    std::vector<float> out32(s.n()), lse32(s.B * s.H * s.T);
    const std::vector<float> qf(qd.begin(), qd.end()), kf(kd.begin(), kd.end()),
        vf(vd.begin(), vd.end());
    attention_forward(out32.data(), lse32.data(), qf.data(), kf.data(), vf.data(), s.B, s.T, s.H,
                      s.KVH, s.D, o);
    const std::vector<double> lse32d(lse32.begin(), lse32.end());
    EXPECT_LT(max_error(f.lse, lse32d), 1e-5) << what;
    if (o.window < s.T || o.softcap > 0.0f || o.scale > 0.0f || o.sinks) continue;
    const Bf16Forward plain = forward_bf16(s, in);
    EXPECT_EQ(f.out16, plain.out16) << what;
    EXPECT_EQ(f.lse, plain.lse) << what;
  }
}

// Decoding with options gives each position what the full forward with them gives.
TEST(AttentionOptions, DecodeMatchesFullForward) {
  const Dims s{1, 90, 4, 2, 16};
  const std::vector<float> q = random_floats(s.n(), 61, -2.0f, 2.0f);
  const std::vector<float> k = random_floats(s.kv_n(), 62, -2.0f, 2.0f);
  const std::vector<float> v = random_floats(s.kv_n(), 63);
  for (const AttentionOptions& o :
       {AttentionOptions{0.3f, 2.0f, 3}, AttentionOptions{0.0f, 5.0f, 70},
        AttentionOptions{0.0f, 0.0f, 1}, AttentionOptions{0.0f, 0.0f, 64},
        AttentionOptions{0.0f, 0.0f, 64, kSinks}}) {
    std::vector<float> full(s.n()), lse(s.H * s.T);
    attention_forward(full.data(), lse.data(), q.data(), k.data(), v.data(), s.B, s.T, s.H, s.KVH,
                      s.D, o);
    const int64_t row = s.H * s.D;
    std::vector<float> out(s.n());
    for (int64_t n = 0; n < s.T; n += 7) {
      const int64_t m = std::min<int64_t>(7, s.T - n);
      attention_decode(out.data() + n * row, q.data() + n * row, k.data(), v.data(), n, m, s.H,
                       s.KVH, s.D, o);
    }
    std::vector<double> want(full.begin(), full.end());
    EXPECT_LT(max_error(out, want), 1e-5) << options_name(o);
  }
}

TEST(AttentionHeads, RejectsKeyValueHeadsNotDividingQueryHeads) {
  for (const int64_t kvh : {int64_t{0}, int64_t{3}}) {
    EXPECT_THROW(attention_forward(nullptr, nullptr, nullptr, nullptr, nullptr, 1, 1, 4, kvh, 8),
                 std::invalid_argument);
    EXPECT_THROW(attention_backward(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                                    nullptr, nullptr, 1, 1, 4, kvh, 8, false),
                 std::invalid_argument);
    EXPECT_THROW(attention_decode(nullptr, nullptr, nullptr, nullptr, 0, 1, 4, kvh, 8),
                 std::invalid_argument);
  }
}

std::string dims_param_name(const ::testing::TestParamInfo<Dims>& info) {
  return dims_name(info.param);
}

INSTANTIATE_TEST_SUITE_P(Shapes, AttentionTiles,
                         ::testing::Values(Dims{1, 1, 1, 1, 4}, Dims{2, 7, 3, 3, 5},
                                           Dims{1, 13, 2, 2, 8}, Dims{3, 4, 1, 1, 3},
                                           Dims{1, 1, 1, 1, 64}, Dims{1, 64, 1, 1, 64},
                                           Dims{2, 65, 2, 2, 16}, Dims{1, 200, 1, 1, 64},
                                           Dims{1, 130, 3, 3, 12}, Dims{2, 129, 2, 2, 40},
                                           Dims{1, 70, 1, 1, 96}, Dims{1, 100, 2, 2, 64}),
                         dims_param_name);

// Grouped-query shapes: H = 4 query heads on 4, 2 and 1 key/value heads at T = 1, 63, 65 and
// 200; one head; groups of 3 and 4 query heads, D = 128.
INSTANTIATE_TEST_SUITE_P(Grouped, AttentionTiles,
                         ::testing::Values(Dims{2, 1, 4, 4, 16}, Dims{2, 1, 4, 2, 16},
                                           Dims{2, 1, 4, 1, 16}, Dims{2, 63, 4, 4, 24},
                                           Dims{2, 63, 4, 2, 24}, Dims{2, 63, 4, 1, 24},
                                           Dims{1, 65, 4, 4, 64}, Dims{1, 65, 4, 2, 64},
                                           Dims{1, 65, 4, 1, 64}, Dims{1, 200, 4, 4, 40},
                                           Dims{1, 200, 4, 2, 40}, Dims{1, 200, 4, 1, 40},
                                           Dims{2, 65, 1, 1, 32}, Dims{1, 130, 6, 2, 12},
                                           Dims{2, 70, 6, 3, 20}, Dims{1, 100, 8, 2, 128}),
                         dims_param_name);

INSTANTIATE_TEST_SUITE_P(Shapes, Attention,
                         ::testing::Values(Dims{1, 1, 1, 1, 4}, Dims{2, 7, 3, 3, 5},
                                           Dims{1, 13, 2, 2, 8}, Dims{3, 4, 1, 1, 3}),
                         dims_param_name);

INSTANTIATE_TEST_SUITE_P(Grouped, Attention,
                         ::testing::Values(Dims{2, 7, 4, 2, 6}, Dims{2, 7, 4, 1, 6},
                                           Dims{1, 13, 6, 3, 8}, Dims{1, 1, 2, 1, 4}),
                         dims_param_name);

}  // namespace
}  // namespace cputrain::kernels
