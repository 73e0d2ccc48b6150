// The softmax cross-entropy row loops, written with GCC vector types of 16 floats; the file that
// includes this header picks the ISA by its compile flags (one zmm, or two ymm per vector).
// Each includer gets its own copy (internal linkage), so an AVX-512 build can never be linked
// into the AVX2 one.
#pragma once

#include <omp.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "kernels/cross_entropy_isa.h"
#include "kernels/vec16.h"

namespace cputrain::kernels::detail {
namespace {

inline void ce_forward(float* losses, float* lse, const float* logits, const int32_t* targets,
                       int64_t N, int64_t V) {
  using vec::kLanes, vec::vf;
  const int64_t whole = V / kLanes * kLanes;
  const int tail = static_cast<int>(V - whole);
  const float lowest = -std::numeric_limits<float>::infinity();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < N; ++i) {
    const float* x = logits + i * V;
    vf vmax = vec::splat(lowest);
    for (int64_t j = 0; j < whole; j += kLanes) vmax = vec::max(vmax, vec::load(x + j));
    if (tail) vmax = vec::max(vmax, vec::load_partial(x + whole, tail, lowest));
    const float max = vec::hmax(vmax);
    vf vsum{};
    for (int64_t j = 0; j < whole; j += kLanes) vsum += vec::exp(vec::load(x + j) - max);
    if (tail) {
      vf e = vec::exp(vec::load_partial(x + whole, tail, 0.0f) - max);
      for (int l = tail; l < kLanes; ++l) e[l] = 0.0f;
      vsum += e;
    }
    const double l = static_cast<double>(max) + std::log(static_cast<double>(vec::hsum(vsum)));
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

constexpr CrossEntropyKernels kCrossEntropyKernels = {ce_forward, ce_backward, ce_gradient};

}  // namespace
}  // namespace cputrain::kernels::detail
