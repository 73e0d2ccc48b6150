// The softmax cross-entropy row loops, written with GCC vector types of 16 floats; the file that
// includes this header picks the ISA by its compile flags (one zmm, or two ymm per vector).
// Each includer gets its own copy (internal linkage), so an AVX-512 build can never be linked
// into the AVX2 one.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "kernels/cpu/vec16.h"
#include "kernels/ops/cross_entropy_isa.h"

namespace cputrain::kernels::detail {
namespace {

// One row of V: its max, and the sum of exp(x - max) over it, each exponential also stored in
// keep[0:V] where keep is given (keep may be x itself: each element is read before it is written).
inline void row_max_exp_sum(const float* x, int64_t V, float* keep, float* max_out,
                            float* sum_out) {
  using vec::kLanes, vec::vf;
  const int64_t whole = V / kLanes * kLanes;
  const int tail = static_cast<int>(V - whole);
  const float lowest = -std::numeric_limits<float>::infinity();
  vf vmax = vec::splat(lowest);
  for (int64_t j = 0; j < whole; j += kLanes) vmax = vec::max(vmax, vec::load(x + j));
  if (tail) vmax = vec::max(vmax, vec::load_partial(x + whole, tail, lowest));
  const float max = vec::hmax(vmax);
  vf vsum{};
  for (int64_t j = 0; j < whole; j += kLanes) {
    const vf e = vec::exp(vec::load(x + j) - max);
    if (keep != nullptr) vec::store(keep + j, e);
    vsum += e;
  }
  if (tail) {
    vf e = vec::exp(vec::load_partial(x + whole, tail, 0.0f) - max);
    for (int l = tail; l < kLanes; ++l) e[l] = 0.0f;
    if (keep != nullptr) vec::store_partial(keep + whole, e, tail);
    vsum += e;
  }
  *max_out = max;
  *sum_out = vec::hsum(vsum);
}

// log(sum_j exp(x[j])) over one row of V, as max + log(sum exp(x - max)).
inline double row_lse(const float* x, int64_t V) {
  float max, sum;
  row_max_exp_sum(x, V, nullptr, &max, &sum);
  return static_cast<double>(max) + std::log(static_cast<double>(sum));
}

inline void ce_forward(float* losses, float* lse, const float* logits, const int32_t* targets,
                       int64_t N, int64_t V) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < N; ++i) {
    const float* x = logits + i * V;
    const double l = row_lse(x, V);
    lse[i] = static_cast<float>(l);
    losses[i] = static_cast<float>(l - x[targets[i]]);
  }
}

// dx[0:V] = (accumulate ? dx : 0) + scale * exp(x - l) over one row.
inline void scaled_softmax_row(float* dx, const float* x, float l, float scale, int64_t V,
                               bool accumulate) {
  using vec::kLanes, vec::vf;
  const int64_t whole = V / kLanes * kLanes;
  const int tail = static_cast<int>(V - whole);
  for (int64_t j = 0; j < whole; j += kLanes) {
    const vf e = scale * vec::exp(vec::load(x + j) - l);
    vec::store(dx + j, accumulate ? vec::load(dx + j) + e : e);
  }
  if (tail) {
    const vf e = scale * vec::exp(vec::load_partial(x + whole, tail, 0.0f) - l);
    vec::store_partial(dx + whole, accumulate ? vec::load_partial(dx + whole, tail, 0.0f) + e : e,
                       tail);
  }
}

inline void ce_backward(float* dlogits, const float* logits, const float* lse,
                        const int32_t* targets, const float* dlosses, int64_t N, int64_t V) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < N; ++i) {
    scaled_softmax_row(dlogits + i * V, logits + i * V, lse[i], dlosses[i], V, true);
    dlogits[i * V + targets[i]] -= dlosses[i];
  }
}

inline void ce_gradient(float* out, const float* logits, const float* lse, const int32_t* targets,
                        float scale, int64_t N, int64_t V) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < N; ++i) {
    scaled_softmax_row(out + i * V, logits + i * V, lse[i], scale, V, false);
    out[i * V + targets[i]] -= scale;
  }
}

// ce_forward and then the gradient scale * (softmax - onehot) of one row at a time, with one
// exponential per element: exp(x - max) goes to `work` (which may be out or the logits) as the
// row's sum is taken, and the gradient is that times scale / sum, then minus scale at the target,
// written as FP32 (out may be logits) or as its bf16 rounding. The losses are ce_forward's bits;
// the gradient differs from ce_gradient's exp(x - lse) by a rounding (here exp sees x - max,
// exact near the top of the row, not x - lse with lse's own rounding). The row stays in cache
// across the three passes, where the separate kernels stream the whole chunk three times.
inline void ce_forward_gradient(float* out, uint16_t* out_bf16, float* losses, const float* logits,
                                float* work, const int32_t* targets, float scale, int64_t N,
                                int64_t V) {
  using vec::kLanes, vec::vf;
  const int64_t whole = V / kLanes * kLanes;
  const int tail = static_cast<int>(V - whole);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < N; ++i) {
    const float* x = logits + i * V;
    float* e = work + i * V;
    const int64_t t = targets[i];
    const float xt = x[t];
    float max, sum;
    row_max_exp_sum(x, V, e, &max, &sum);  // as row_lse, keeping each exponential
    losses[i] = static_cast<float>(static_cast<double>(max) + std::log(static_cast<double>(sum)) -
                                   static_cast<double>(xt));
    const float c = scale / sum;
    auto grad = [&](int64_t j, int n) {
      vf g = vec::load_n(e + j, n) * c;
      if (t >= j && t < j + n) g[t - j] -= scale;
      if (out_bf16 != nullptr)
        vec::store_bf16(out_bf16 + i * V + j, g, n);
      else
        vec::store_n(out + i * V + j, g, n);
    };
    for (int64_t j = 0; j < whole; j += kLanes) grad(j, kLanes);
    if (tail) grad(whole, tail);
  }
}

// x = cap * tanh(x / cap); g *= 1 - (capped / cap)^2.
void soft_cap(float* x, int64_t n, float cap) {
  const float inv = 1.0f / cap;
  vec::for_each_run(n, [=](int64_t i, int m) {
    vec::store_n(x + i, cap * vec::tanh(vec::load_n(x + i, m) * inv), m);
  });
}

void soft_cap_gradient(float* g, const float* capped, int64_t n, float cap) {
  const float inv = 1.0f / cap;
  vec::for_each_run(n, [=](int64_t i, int m) {
    const vec::vf t = vec::load_n(capped + i, m) * inv;
    vec::store_n(g + i, vec::load_n(g + i, m) * (1.0f - t * t), m);
  });
}

constexpr CrossEntropyKernels kCrossEntropyKernels = {
    ce_forward, ce_backward, ce_gradient, ce_forward_gradient, soft_cap, soft_cap_gradient};

}  // namespace
}  // namespace cputrain::kernels::detail
