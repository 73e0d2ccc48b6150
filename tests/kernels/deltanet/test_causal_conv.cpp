// The causal convolution with SiLU against the formula in double, across a sequence split in two
// through its state, and its gradients against central differences; the vectorised float forms
// (and the gated RMSNorm's) against the reference.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "kernels/cpu/cpu_features.h"
#include "kernels/deltanet/causal_conv.h"
#include "kernels/deltanet/deltanet_isa.h"
#include "kernels/deltanet/deltanet_ops.h"

namespace cputrain::kernels {
namespace {

struct Case {
  CausalConvShape s;
  std::vector<double> x, w, state;
};

Case draw(int64_t T, int64_t C, int64_t K, int64_t pad, bool with_state, uint32_t seed) {
  Case c;
  c.s.batch = 2;
  c.s.length = T;
  c.s.channels = C;
  c.s.taps = K;
  c.s.x_stride = pad != 0 ? C + pad : 0;
  std::mt19937 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  c.x.resize(c.s.batch * T * c.s.x_row());
  c.w.resize(C * K);
  for (double& v : c.x) v = normal(rng);
  for (double& v : c.w) v = 0.5 * normal(rng);
  if (with_state) {
    c.state.resize(c.s.state_elements());
    for (double& v : c.state) v = normal(rng);
  }
  return c;
}

std::vector<double> forward(const Case& c) {
  std::vector<double> y(c.s.batch * c.s.length * c.s.channels);
  causal_conv_silu_forward<double>(c.s, c.x.data(), c.w.data(),
                                   c.state.empty() ? nullptr : c.state.data(), y.data());
  return y;
}

TEST(CausalConv, ForwardIsTheFormula) {
  for (const int64_t T : {1, 2, 3, 9})
    for (const bool with_state : {false, true}) {
      const Case c = draw(T, 37, 4, 3, with_state, 3);
      const std::vector<double> y = forward(c);
      const int64_t K = c.s.taps;
      for (int64_t b = 0; b < c.s.batch; ++b)
        for (int64_t t = 0; t < T; ++t)
          for (int64_t ch = 0; ch < c.s.channels; ++ch) {
            double pre = 0;
            for (int64_t j = 0; j < K; ++j) {
              const int64_t p = t - (K - 1) + j;
              const double in = p >= 0 ? c.x[(b * T + p) * c.s.x_row() + ch]
                                : with_state
                                    ? c.state[(b * c.s.channels + ch) * (K - 1) + (K - 1) + p]
                                    : 0.0;
              pre += c.w[ch * K + j] * in;
            }
            EXPECT_NEAR(y[(b * T + t) * c.s.channels + ch], pre / (1 + std::exp(-pre)), 1e-12);
          }
    }
}

TEST(CausalConv, ASequenceSplitThroughItsStateIsTheWhole) {
  for (const int64_t first : {1, 2, 5}) {
    const Case whole = draw(8, 19, 4, 0, true, 7);
    const std::vector<double> want = forward(whole);
    Case a = whole, b = whole;
    a.s.length = first;
    b.s.length = whole.s.length - first;
    a.x.clear();
    b.x.clear();
    for (int64_t s = 0; s < whole.s.batch; ++s) {
      const auto row = [&](int64_t t) { return whole.x.begin() + (s * 8 + t) * 19; };
      a.x.insert(a.x.end(), row(0), row(first));
      b.x.insert(b.x.end(), row(first), row(8));
    }
    causal_conv_next_state<double>(a.s, a.x.data(), whole.state.data(), b.state.data());
    const std::vector<double> ya = forward(a), yb = forward(b);
    for (int64_t s = 0; s < whole.s.batch; ++s)
      for (int64_t t = 0; t < 8; ++t)
        for (int64_t ch = 0; ch < 19; ++ch) {
          const double got = t < first ? ya[(s * first + t) * 19 + ch]
                                       : yb[(s * (8 - first) + t - first) * 19 + ch];
          EXPECT_NEAR(got, want[(s * 8 + t) * 19 + ch], 1e-12) << "split at " << first;
        }
  }
}

TEST(CausalConv, GradientsMatchCentralDifferences) {
  for (const int64_t T : {2, 7})
    for (const bool with_state : {false, true}) {
      Case c = draw(T, 70, 4, 2, with_state, 11);  // two blocks of channels, the second partial
      std::mt19937 rng(5);
      std::normal_distribution<double> normal(0.0, 1.0);
      std::vector<double> dy(c.s.batch * T * c.s.channels);
      for (double& v : dy) v = normal(rng);
      const auto loss = [&](const Case& k) {
        const std::vector<double> y = forward(k);
        double l = 0;
        for (size_t i = 0; i < y.size(); ++i) l += dy[i] * y[i];
        return l;
      };
      std::vector<double> dx(c.x.size(), 9.0), dw(c.w.size(), 0.25),
          dstate(c.s.state_elements(), 9.0);
      causal_conv_silu_backward<double>(c.s, c.x.data(), c.w.data(),
                                        with_state ? c.state.data() : nullptr, dy.data(), dx.data(),
                                        dw.data(), with_state ? dstate.data() : nullptr);
      for (double& v : dw) v -= 0.25;  // accumulated
      const auto check = [&](std::vector<double> Case::*field, const std::vector<double>& grad,
                             const char* name, int64_t row, int64_t used) {
        Case k = c;
        std::vector<double>& data = k.*field;
        for (size_t i = 0; i < data.size(); ++i) {
          if (row != 0 && static_cast<int64_t>(i % row) >= used) continue;
          const double keep = data[i], h = 1e-6;
          data[i] = keep + h;
          const double up = loss(k);
          data[i] = keep - h;
          const double down = loss(k);
          data[i] = keep;
          ASSERT_NEAR(grad[i], (up - down) / (2 * h), 1e-6) << name << "[" << i << "] T " << T;
        }
      };
      check(&Case::x, dx, "x", c.s.x_row(), c.s.channels);
      check(&Case::w, dw, "w", 0, 0);
      if (with_state) check(&Case::state, dstate, "state", 0, 0);
    }
}

}  // namespace
}  // namespace cputrain::kernels

namespace cputrain::kernels {
namespace {

// Packed rows: each window reads zeros before its own sequence's start, as each sequence alone
// would; its gradients those of each sequence alone.
TEST(CausalConv, PackedRowsComputeEachSequenceAlone) {
  const int64_t T = 12, C = 5;
  // Row 0: sequences of 1, 3, 2 and 6 positions; row 1: one of 12.
  const std::vector<int32_t> positions = {0, 0, 1, 2, 0, 1, 0, 1, 2, 3, 4,  5,
                                          0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11};
  Case c = draw(T, C, 4, 2, false, 21);
  c.s.positions = positions.data();
  const std::vector<double> y = forward(c);
  std::vector<double> dy(y.size()), dx(c.x.size()), dw(c.w.size(), 0.0);
  for (size_t i = 0; i < dy.size(); ++i) dy[i] = std::sin(0.7 * static_cast<double>(i));
  causal_conv_silu_backward<double>(c.s, c.x.data(), c.w.data(), nullptr, dy.data(), dx.data(),
                                    dw.data(), nullptr);
  std::vector<double> dw_alone(c.w.size(), 0.0);
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t t0 = 0; t0 < T;) {
      int64_t n = 1;
      while (t0 + n < T && positions[static_cast<size_t>(b * T + t0 + n)] != 0) ++n;
      Case one = c;
      one.s.batch = 1;
      one.s.length = n;
      one.s.positions = nullptr;
      one.x.assign(c.x.begin() + (b * T + t0) * c.s.x_row(),
                   c.x.begin() + (b * T + t0 + n) * c.s.x_row());
      const std::vector<double> want = forward(one);
      std::vector<double> dy1(dy.begin() + (b * T + t0) * C, dy.begin() + (b * T + t0 + n) * C);
      std::vector<double> dx1(one.x.size());
      causal_conv_silu_backward<double>(one.s, one.x.data(), one.w.data(), nullptr, dy1.data(),
                                        dx1.data(), dw_alone.data(), nullptr);
      for (int64_t i = 0; i < n * C; ++i)
        EXPECT_NEAR(y[static_cast<size_t>((b * T + t0) * C + i)], want[static_cast<size_t>(i)],
                    1e-12);
      for (int64_t t = 0; t < n; ++t)
        for (int64_t ch = 0; ch < C; ++ch)
          EXPECT_NEAR(dx[static_cast<size_t>((b * T + t0 + t) * c.s.x_row() + ch)],
                      dx1[static_cast<size_t>(t * c.s.x_row() + ch)], 1e-12);
      t0 += n;
    }
  for (size_t i = 0; i < dw.size(); ++i) EXPECT_NEAR(dw[i], dw_alone[i], 1e-12);
}

// The vectorised float forms of each ISA (deltanet_rows.h) against the double reference: the
// convolution over odd channel counts (a partial vector, a partial block of four) and lengths
// shorter than its taps, strided x, one sequence a row and packed rows; the gated RMSNorm over
// heads of odd widths.
TEST(DeltanetRows, EachIsaTracksTheDoubleReference) {
  std::vector<const DeltanetKernels*> builds = {&deltanet_kernels_avx2()};
  if (cpu_features().avx512) builds.push_back(&deltanet_kernels_avx512());
  for (const DeltanetKernels* k : builds)
    for (const int64_t T : {1, 3, 17})
      for (const int64_t C : {5, 37, 64, 131})
        for (const bool packed : {false, true}) {
          Case c = draw(T, C, 4, C % 2 == 1 ? 3 : 0, false, 7);
          // Packed: sequences of 2 positions, then one of the rest.
          std::vector<int32_t> positions(static_cast<size_t>(c.s.batch * T));
          for (int64_t i = 0; i < c.s.batch * T; ++i) {
            const int64_t t = i % T;
            positions[static_cast<size_t>(i)] =
                static_cast<int32_t>(t < T - T / 2 ? t % 2 : t - (T - T / 2));
          }
          if (packed) c.s.positions = positions.data();
          const std::vector<double> want = forward(c);
          const std::vector<float> x(c.x.begin(), c.x.end()), w(c.w.begin(), c.w.end());
          std::vector<float> y(want.size());
          k->conv_forward(c.s, x.data(), w.data(), y.data());
          for (size_t i = 0; i < y.size(); ++i) ASSERT_NEAR(y[i], want[i], 1e-5) << T << " " << C;
          // Gradients: the double reference's from the same dy.
          std::vector<double> dy(want.size()), dx(c.x.size()), dw(c.w.size(), 0.5);
          std::mt19937 rng(11);
          std::normal_distribution<double> normal(0.0, 1.0);
          for (double& v : dy) v = normal(rng);
          causal_conv_silu_backward<double>(c.s, c.x.data(), c.w.data(), nullptr, dy.data(),
                                            dx.data(), dw.data(), nullptr);
          const std::vector<float> dyf(dy.begin(), dy.end());
          std::vector<float> dxf(dx.size(), 0.0f), dwf(dw.size(), 0.5f);
          k->conv_backward(c.s, x.data(), w.data(), dyf.data(), dxf.data(), dwf.data());
          for (int64_t b = 0; b < c.s.batch; ++b)
            for (int64_t t = 0; t < T; ++t)
              for (int64_t ch = 0; ch < C; ++ch) {
                const size_t i = static_cast<size_t>((b * T + t) * c.s.x_row() + ch);
                ASSERT_NEAR(dxf[i], dx[i], 1e-4) << T << " " << C;
              }
          for (size_t i = 0; i < dw.size(); ++i) ASSERT_NEAR(dwf[i], dw[i], 1e-4) << T << " " << C;
        }
  for (const DeltanetKernels* k : builds)
    for (const int64_t D : {7, 16, 40, 128}) {
      const int64_t N = 300;
      std::mt19937 rng(static_cast<uint32_t>(D));
      std::normal_distribution<float> normal(0.0f, 1.0f);
      std::vector<float> x(N * D), z(N * D), w(D), dy(N * D);
      for (float& v : x) v = normal(rng);
      for (float& v : z) v = 2.0f * normal(rng);
      for (float& v : w) v = 1.0f + 0.1f * normal(rng);
      for (float& v : dy) v = normal(rng);
      std::vector<float> y(N * D), rstd(N), y_ref(N * D), rstd_ref(N);
      k->gated_rmsnorm_forward(y.data(), rstd.data(), x.data(), z.data(), w.data(), N, D, 1e-6f);
      gated_rmsnorm_forward_reference(y_ref.data(), rstd_ref.data(), x.data(), z.data(), w.data(),
                                      N, D, 1e-6f);
      for (size_t i = 0; i < y.size(); ++i) ASSERT_NEAR(y[i], y_ref[i], 1e-5) << D;
      for (const bool accumulate : {false, true}) {
        std::vector<float> dx(N * D, 0.25f), dz(N * D, 0.25f), dw(D, 0.5f);
        std::vector<float> dx_ref = dx, dz_ref = dz, dw_ref = dw;
        k->gated_rmsnorm_backward(dx.data(), dz.data(), dw.data(), dy.data(), x.data(), z.data(),
                                  w.data(), rstd.data(), N, D, accumulate);
        gated_rmsnorm_backward_reference(dx_ref.data(), dz_ref.data(), dw_ref.data(), dy.data(),
                                         x.data(), z.data(), w.data(), rstd.data(), N, D,
                                         accumulate);
        for (size_t i = 0; i < dx.size(); ++i) {
          ASSERT_NEAR(dx[i], dx_ref[i], 1e-4) << D;
          ASSERT_NEAR(dz[i], dz_ref[i], 1e-4) << D;
        }
        for (int64_t i = 0; i < D; ++i) ASSERT_NEAR(dw[i], dw_ref[i], 2e-3) << D;
      }
    }
}

}  // namespace
}  // namespace cputrain::kernels
