// Gated DeltaNet's elementwise loops, compiled once per ISA (deltanet_avx2.cpp,
// deltanet_avx512.cpp: two ymm or one zmm per vector of vec16.h) and reached through the dispatch
// in causal_conv.cpp and deltanet_ops.cpp: the causal convolution with SiLU (without a state) and
// the gated RMSNorm, forward and backward, vectorised over channels. Everything here has internal
// linkage, so each ISA's file keeps its own copy.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels/cpu/vec16.h"
#include "kernels/deltanet/deltanet_isa.h"

namespace cputrain::kernels::detail {
namespace {

using vec::kLanes;
using vec::vf;

inline vf sigmoid(vf v) {
  return 1.0f / (1.0f + vec::exp(-v));
}

// The channels a work item of the convolution takes: four vectors.
constexpr int64_t kConvBlock = 4 * kLanes;

// The K taps of channels [c0, c0 + m) as rows of m: wt[j * m + i] = w[(c0 + i) * K + j].
inline void taps_of(const float* w, int64_t K, int64_t c0, int64_t m, float* wt) {
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < K; ++j) wt[j * m + i] = w[(c0 + i) * K + j];
}

// pre for the m channels from c0 at position t of sequence b, and the lanes' counts.
inline void conv_pre(const CausalConvShape& s, const float* x, const float* wt, int64_t b,
                     int64_t t, int64_t c0, int64_t m, vf* pre) {
  const int64_t K = s.taps, row = s.x_row();
  for (int64_t v = 0; v * kLanes < m; ++v) pre[v] = vec::splat(0.0f);
  const int64_t first = std::max<int64_t>(0, s.first(b, t));
  for (int64_t j = 0; j < K; ++j) {
    const int64_t p = t - (K - 1) + j;
    if (p < first) continue;
    const float* xp = x + (b * s.length + p) * row + c0;
    for (int64_t v = 0; v * kLanes < m; ++v) {
      const int n = static_cast<int>(std::min<int64_t>(kLanes, m - v * kLanes));
      pre[v] += vec::load_n(wt + j * m + v * kLanes, n) * vec::load_n(xp + v * kLanes, n);
    }
  }
}

void conv_forward(const CausalConvShape& s, const float* x, const float* w, float* y) {
  const int64_t blocks = (s.channels + kConvBlock - 1) / kConvBlock;
  const int64_t K = s.taps;
#pragma omp parallel
  {
    std::vector<float> wt(static_cast<size_t>(K * kConvBlock));
#pragma omp for schedule(static)
    for (int64_t item = 0; item < s.batch * blocks; ++item) {
      const int64_t b = item / blocks, c0 = (item % blocks) * kConvBlock;
      const int64_t m = std::min(kConvBlock, s.channels - c0);
      taps_of(w, K, c0, m, wt.data());
      vf pre[kConvBlock / kLanes];
      for (int64_t t = 0; t < s.length; ++t) {
        conv_pre(s, x, wt.data(), b, t, c0, m, pre);
        float* yt = y + (b * s.length + t) * s.channels + c0;
        for (int64_t v = 0; v * kLanes < m; ++v) {
          const int n = static_cast<int>(std::min<int64_t>(kLanes, m - v * kLanes));
          vec::store_n(yt + v * kLanes, pre[v] * sigmoid(pre[v]), n);
        }
      }
    }
  }
}

void conv_backward(const CausalConvShape& s, const float* x, const float* w, const float* dy,
                   float* dx, float* dw) {
  const int64_t blocks = (s.channels + kConvBlock - 1) / kConvBlock;
  const int64_t K = s.taps, T = s.length, row = s.x_row();
  // Each item a sequence's block of channels; dw summed over the sequences in order after.
  std::vector<float> dw_parts(static_cast<size_t>(s.batch * s.channels * K));
#pragma omp parallel
  {
    std::vector<float> wt(static_cast<size_t>(K * kConvBlock));
    std::vector<float> dpre(static_cast<size_t>(T * kConvBlock));
#pragma omp for schedule(static)
    for (int64_t item = 0; item < s.batch * blocks; ++item) {
      const int64_t b = item / blocks, c0 = (item % blocks) * kConvBlock;
      const int64_t m = std::min(kConvBlock, s.channels - c0);
      const int64_t vecs = (m + kLanes - 1) / kLanes;
      taps_of(w, K, c0, m, wt.data());
      const auto lanes = [&](int64_t v) {
        return static_cast<int>(std::min<int64_t>(kLanes, m - v * kLanes));
      };
      // dpre = dy silu'(pre), silu'(p) = sg (1 + p (1 - sg)).
      vf pre[kConvBlock / kLanes];
      for (int64_t t = 0; t < T; ++t) {
        conv_pre(s, x, wt.data(), b, t, c0, m, pre);
        const float* dyt = dy + (b * T + t) * s.channels + c0;
        for (int64_t v = 0; v < vecs; ++v) {
          const vf sg = sigmoid(pre[v]);
          const vf d = vec::load_n(dyt + v * kLanes, lanes(v)) * sg * (1.0f + pre[v] * (1.0f - sg));
          vec::store(dpre.data() + t * kConvBlock + v * kLanes, d);
        }
      }
      // dx[p] = sum over the windows t = p .. p + K - 1 reading it, as tap K - 1 - (t - p).
      for (int64_t p = 0; p < T; ++p) {
        float* dxp = dx + (b * T + p) * row + c0;
        for (int64_t v = 0; v < vecs; ++v) {
          vf sum = vec::splat(0.0f);
          for (int64_t t = p; t < std::min(T, p + K); ++t)
            if (p >= s.first(b, t))
              sum += vec::load_n(wt.data() + (K - 1 - (t - p)) * m + v * kLanes, lanes(v)) *
                     vec::load(dpre.data() + t * kConvBlock + v * kLanes);
          vec::store_n(dxp + v * kLanes, sum, lanes(v));
        }
      }
      // dw[c, j] = sum_t dpre[t] x[t - (K - 1) + j].
      float* part = dw_parts.data() + b * s.channels * K;
      for (int64_t j = 0; j < K; ++j)
        for (int64_t v = 0; v < vecs; ++v) {
          vf sum = vec::splat(0.0f);
          for (int64_t t = std::max<int64_t>(0, (K - 1) - j); t < T; ++t)
            if (t - (K - 1) + j >= s.first(b, t))
              sum += vec::load(dpre.data() + t * kConvBlock + v * kLanes) *
                     vec::load_n(x + (b * T + t - (K - 1) + j) * row + c0 + v * kLanes, lanes(v));
          float out[kLanes];
          vec::store(out, sum);
          for (int i = 0; i < lanes(v); ++i) part[(c0 + v * kLanes + i) * K + j] = out[i];
        }
    }
  }
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t i = 0; i < s.channels * K; ++i)
      dw[i] += dw_parts[static_cast<size_t>(b * s.channels * K + i)];
}

// The rows a block of the gated RMSNorm's dw sums: its partial sums are added in block order,
// whatever the threads.
constexpr int64_t kNormBlock = 256;

void gated_rmsnorm_forward(float* y, float* rstd, const float* x, const float* z, const float* w,
                           int64_t N, int64_t D, float eps) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < N; ++r) {
    const float *xr = x + r * D, *zr = z + r * D;
    double sum = 0;
    for (int64_t i = 0; i < D; ++i) sum += double(xr[i]) * xr[i];
    const float s = static_cast<float>(1.0 / std::sqrt(sum / double(D) + eps));
    rstd[r] = s;
    for (int64_t i = 0; i < D; i += kLanes) {
      const int n = static_cast<int>(std::min<int64_t>(kLanes, D - i));
      const vf zv = vec::load_n(zr + i, n);
      vec::store_n(y + r * D + i,
                   vec::load_n(xr + i, n) * s * vec::load_n(w + i, n) * zv * sigmoid(zv), n);
    }
  }
}

void gated_rmsnorm_backward(float* dx, float* dz, float* dw, const float* dy, const float* x,
                            const float* z, const float* w, const float* rstd, int64_t N, int64_t D,
                            bool accumulate) {
  const int64_t blocks = (N + kNormBlock - 1) / kNormBlock;
  std::vector<float> dw_parts(static_cast<size_t>(blocks * D), 0.0f);
  const auto put = [accumulate](float* p, vf v, int n) {
    vec::store_n(p, accumulate ? vec::load_n(p, n) + v : v, n);
  };
#pragma omp parallel
  {
    std::vector<float> silu_row(static_cast<size_t>(D));  // silu(z) of the row, computed once
#pragma omp for schedule(static)
    for (int64_t blk = 0; blk < blocks; ++blk) {
      float* part = dw_parts.data() + blk * D;
      for (int64_t r = blk * kNormBlock; r < std::min(N, (blk + 1) * kNormBlock); ++r) {
        const float *xr = x + r * D, *zr = z + r * D, *dyr = dy + r * D;
        const float s = rstd[r];
        // n = x s w, y = n silu(z): dn = dy silu(z), dz = dy n silu'(z); dx from dn through the
        // norm, with c = s^3 / D sum_i dn_i w_i x_i.
        vf dot = vec::splat(0.0f);
        for (int64_t i = 0; i < D; i += kLanes) {
          const int n = static_cast<int>(std::min<int64_t>(kLanes, D - i));
          const vf zv = vec::load_n(zr + i, n), xv = vec::load_n(xr + i, n);
          const vf wv = vec::load_n(w + i, n), dyv = vec::load_n(dyr + i, n);
          const vf sg = sigmoid(zv), silu = zv * sg;
          vec::store_n(silu_row.data() + i, silu, n);
          put(dz + r * D + i, dyv * (xv * s * wv) * sg * (1.0f + zv * (1.0f - sg)), n);
          dot += dyv * silu * wv * xv;
          vec::store_n(part + i, vec::load_n(part + i, n) + dyv * xv * s * silu, n);
        }
        float lanes[kLanes];
        vec::store(lanes, dot);
        double total = 0;
        for (const float l : lanes) total += l;
        const float c = static_cast<float>(total) * s * s * s / static_cast<float>(D);
        for (int64_t i = 0; i < D; i += kLanes) {
          const int n = static_cast<int>(std::min<int64_t>(kLanes, D - i));
          put(dx + r * D + i,
              vec::load_n(dyr + i, n) * vec::load_n(silu_row.data() + i, n) *
                      vec::load_n(w + i, n) * s -
                  vec::load_n(xr + i, n) * c,
              n);
        }
      }
    }
  }
  for (int64_t blk = 0; blk < blocks; ++blk)
    for (int64_t i = 0; i < D; ++i) dw[i] += dw_parts[static_cast<size_t>(blk * D + i)];
}

const DeltanetKernels kDeltanetKernels = {conv_forward, conv_backward, gated_rmsnorm_forward,
                                          gated_rmsnorm_backward, nullptr};

}  // namespace
}  // namespace cputrain::kernels::detail
