// The gated-activation loops, compiled once per ISA (swiglu_avx2.cpp, swiglu_avx512.cpp: one zmm
// or two ymm per vector of vec16.h) and reached through the dispatch in swiglu.cpp. Everything
// here has internal linkage, so each ISA's file keeps its own copy.
#pragma once

#include <algorithm>
#include <cstdint>

#include "kernels/cpu/vec16.h"
#include "kernels/ops/swiglu_isa.h"

namespace cputrain::kernels::detail {
namespace {

using vec::kLanes;
using vec::vf;

inline vf sigmoid(vf g) {
  return 1.0f / (1.0f + vec::exp(-g));
}

// 2 sqrt(2/pi): GELU's tanh approximation is 0.5 (1 + tanh(u)) = sigmoid(2u), u = sqrt(2/pi)
// (g + 0.044715 g^3).
constexpr float kGelu2 = 2.0f * 0.7978845608028654f;

// act(g); SiluClamped's g at most kSiluClampedLimit.
template <Activation A>
inline vf activation(vf g) {
  if constexpr (A == Activation::Silu)
    return g * sigmoid(g);
  else if constexpr (A == Activation::SiluClamped) {
    g = vec::min_of(vec::splat(kSiluClampedLimit), g);
    return g * sigmoid(kSiluClampedAlpha * g);
  } else
    return g * sigmoid(kGelu2 * (g + 0.044715f * g * g * g));
}
// What multiplies act(g): up, or SiluClamped's clamp(up, -kSiluClampedLimit, kSiluClampedLimit)
// + 1.
template <Activation A>
inline vf up_factor(vf u) {
  if constexpr (A == Activation::SiluClamped)
    return vec::min_of(vec::splat(kSiluClampedLimit),
                       vec::max_of(vec::splat(-kSiluClampedLimit), u)) +
           1.0f;
  else
    return u;
}
// GELU's, and its derivative s + g s (1 - s) 2 sqrt(2/pi) (1 + 3 * 0.044715 g^2).
inline vf gelu(vf g, vf& derivative) {
  const vf s = sigmoid(kGelu2 * (g + 0.044715f * g * g * g));
  derivative = s + g * s * (1.0f - s) * (kGelu2 * (1.0f + 3.0f * 0.044715f * g * g));
  return g * s;
}

// The m (<= kLanes) values at p, FP32 or bf16 widened, zeros after them; and their store.
inline vf get(const float* p, int m) {
  return vec::load_n(p, m);
}
inline void put(float* p, vf v, int m) {
  vec::store_n(p, v, m);
}
inline vf get(const uint16_t* p, int m) {
  return vec::load_bf16(p, m);
}

// up's values, or ones where there is no up (the activation alone).
template <class In>
inline vf get_up(const In* up, int64_t i, int m) {
  return up != nullptr ? get(up + i, m) : vec::splat(1.0f);
}

// A gradient's lanes: FP32 added onto (accumulate) or overwriting what is there, or its bf16
// rounding (always overwriting). The sum takes v rounded, never fused with the product that
// gives it, in every ISA build alike.
inline void store_grad(float* p, vf v, int m, bool accumulate) {
  put(p, (accumulate ? get(p, m) : vf{}) + vec::unfused(v), m);
}
inline void store_grad(uint16_t* p, vf v, int m, bool) {
  vec::store_bf16(p, vf{} + v, m);
}

// gate and up FP32 or bf16; the gradients FP32 or (Out uint16_t) their bf16 roundings.
template <Activation A, class In, class Out>
void backward_runs(Out* dgate, Out* dup, const float* dout, const In* gate, const In* up, int64_t n,
                   bool accumulate) {
  const int64_t runs = (n + kLanes - 1) / kLanes;
#pragma omp parallel for schedule(static) if (n > 16384)
  for (int64_t r = 0; r < runs; ++r) {
    const int64_t i = r * kLanes;
    const int m = static_cast<int>(std::min<int64_t>(kLanes, n - i));
    const vf g = get(gate + i, m), dy = get(dout + i, m);
    if constexpr (A == Activation::SiluClamped) {
      // Through the clamps: no gradient where g > limit or |up| > limit.
      const vf limit = vec::splat(kSiluClampedLimit), zero{};
      const vf gc = vec::min_of(limit, g), sig = sigmoid(kSiluClampedAlpha * gc), a = gc * sig;
      const vf da =
          vec::select_less(limit, g, zero, sig * (1.0f + kSiluClampedAlpha * gc * (1.0f - sig)));
      const vf u = get(up + i, m);
      store_grad(dgate + i, dy * up_factor<A>(u) * da, m, accumulate);
      store_grad(dup + i,
                 vec::select_less(limit, u, zero, vec::select_less(u, -limit, zero, dy * a)), m,
                 accumulate);
    } else if constexpr (A == Activation::Silu) {
      // d silu / dg = sig * (1 + g * (1 - sig))
      const vf sig = sigmoid(g);
      store_grad(dgate + i, dy * get_up(up, i, m) * sig * (1.0f + g * (1.0f - sig)), m, accumulate);
      if (up != nullptr) store_grad(dup + i, dy * (g * sig), m, accumulate);
    } else {
      vf derivative;
      const vf a = gelu(g, derivative);
      store_grad(dgate + i, dy * get_up(up, i, m) * derivative, m, accumulate);
      if (up != nullptr) store_grad(dup + i, dy * a, m, accumulate);
    }
  }
}

template <Activation A>
void backward_rounded(uint16_t* dgate, uint16_t* dup, const float* dout, const uint16_t* gate,
                      const uint16_t* up, int64_t n) {
  backward_runs<A>(dgate, dup, dout, gate, up, n, false);
}

// Runs of kLanes elements (the last one partial), split over threads.
template <Activation A>
void forward(float* out, const float* gate, const float* up, int64_t n) {
  const int64_t runs = (n + kLanes - 1) / kLanes;
#pragma omp parallel for schedule(static) if (n > 16384)
  for (int64_t r = 0; r < runs; ++r) {
    const int64_t i = r * kLanes;
    const int m = static_cast<int>(std::min<int64_t>(kLanes, n - i));
    put(out + i, activation<A>(get(gate + i, m)) * up_factor<A>(get_up(up, i, m)), m);
  }
}

template <Activation A>
void forward_bf16(uint16_t* out, uint16_t* gate16, uint16_t* up16, const float* gate,
                  const float* up, int64_t n) {
  const int64_t runs = (n + kLanes - 1) / kLanes;
#pragma omp parallel for schedule(static) if (n > 16384)
  for (int64_t r = 0; r < runs; ++r) {
    const int64_t i = r * kLanes;
    const int m = static_cast<int>(std::min<int64_t>(kLanes, n - i));
    const vf g = get(gate + i, m), u = get_up(up, i, m);
    vec::store_bf16(out + i, activation<A>(g) * up_factor<A>(u), m);
    if (gate16 != nullptr) vec::store_bf16(gate16 + i, g, m);
    if (up16 != nullptr && up != nullptr) vec::store_bf16(up16 + i, u, m);
  }
}

template <Activation A>
constexpr SwigluKernels kernels_of = {forward<A>, forward_bf16<A>, backward_runs<A, float, float>,
                                      backward_runs<A, uint16_t, float>, backward_rounded<A>};

// By Activation.
constexpr SwigluKernels kSwigluKernels[] = {kernels_of<Activation::Silu>,
                                            kernels_of<Activation::GeluTanh>,
                                            kernels_of<Activation::SiluClamped>};

}  // namespace
}  // namespace cputrain::kernels::detail
