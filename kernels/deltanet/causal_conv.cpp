#include "kernels/deltanet/causal_conv.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cpu/dispatch.h"
#include "kernels/deltanet/deltanet_isa.h"

namespace cputrain::kernels {
namespace {

// Input j of the window ending at position t (j = K - 1 is t itself): x, or the state before the
// sequence's start, or zero.
template <class T>
T tap_input(const CausalConvShape& s, const T* x, const T* state, int64_t b, int64_t t, int64_t j,
            int64_t c) {
  const int64_t p = t - (s.taps - 1) + j;
  if (p < s.first(b, t)) return T(0);  // before the window's own sequence
  if (p >= 0) return x[(b * s.length + p) * s.x_row() + c];
  if (state == nullptr) return T(0);
  return state[(b * s.channels + c) * (s.taps - 1) + (s.taps - 1) + p];
}

template <class T>
T pre_activation(const CausalConvShape& s, const T* x, const T* w, const T* state, int64_t b,
                 int64_t t, int64_t c) {
  T sum = 0;
  for (int64_t j = 0; j < s.taps; ++j)
    sum += w[c * s.taps + j] * tap_input(s, x, state, b, t, j, c);
  return sum;
}

template <class T>
T sigmoid(T v) {
  return T(1) / (T(1) + std::exp(-v));
}

}  // namespace

template <class T>
void causal_conv_silu_forward(const CausalConvShape& s, const T* x, const T* w, const T* state,
                              T* y) {
#pragma omp parallel for schedule(static)
  for (int64_t bt = 0; bt < s.batch * s.length; ++bt) {
    const int64_t b = bt / s.length, t = bt % s.length;
    T* row = y + bt * s.channels;
    for (int64_t c = 0; c < s.channels; ++c) {
      const T p = pre_activation(s, x, w, state, b, t, c);
      row[c] = p * sigmoid(p);
    }
  }
}

template <class T>
void causal_conv_silu_backward(const CausalConvShape& s, const T* x, const T* w, const T* state,
                               const T* dy, T* dx, T* dw, T* dstate) {
  const int64_t K = s.taps;
  // One work item a block of channels: it alone writes their dx, dw and dstate.
  constexpr int64_t kBlock = 64;
  const int64_t blocks = (s.channels + kBlock - 1) / kBlock;
#pragma omp parallel
  {
    std::vector<T> dpre(static_cast<size_t>(s.length * kBlock));
#pragma omp for schedule(static)
    for (int64_t cb = 0; cb < blocks; ++cb) {
      const int64_t c0 = cb * kBlock, c1 = std::min(s.channels, c0 + kBlock), n = c1 - c0;
      for (int64_t b = 0; b < s.batch; ++b) {
        for (int64_t t = 0; t < s.length; ++t)
          for (int64_t c = c0; c < c1; ++c) {
            const T p = pre_activation(s, x, w, state, b, t, c);
            const T sg = sigmoid(p);
            dpre[t * n + (c - c0)] =
                dy[(b * s.length + t) * s.channels + c] * sg * (1 + p * (1 - sg));
          }
        for (int64_t p = 0; p < s.length; ++p)
          for (int64_t c = c0; c < c1; ++c) {
            // x at p feeds the windows ending at p .. p + K - 1, as tap K - 1 - (t - p).
            T sum = 0;
            for (int64_t t = p; t < std::min(s.length, p + K); ++t)
              if (p >= s.first(b, t)) sum += w[c * K + (K - 1) - (t - p)] * dpre[t * n + (c - c0)];
            dx[(b * s.length + p) * s.x_row() + c] = sum;
          }
        for (int64_t c = c0; c < c1; ++c)
          for (int64_t j = 0; j < K; ++j) {
            T sum = 0;
            for (int64_t t = 0; t < s.length; ++t)
              sum += dpre[t * n + (c - c0)] * tap_input(s, x, state, b, t, j, c);
            dw[c * K + j] += sum;
          }
        if (dstate != nullptr)
          for (int64_t c = c0; c < c1; ++c)
            for (int64_t i = 0; i < K - 1; ++i) {
              // State element i is position i - (K - 1), tap j = i - (K - 1) - t + (K - 1) = i - t.
              T sum = 0;
              for (int64_t t = 0; t <= i && t < s.length; ++t)
                if (i - (K - 1) >= s.first(b, t))
                  sum += w[c * K + (i - t)] * dpre[t * n + (c - c0)];
              dstate[(b * s.channels + c) * (K - 1) + i] = sum;
            }
      }
    }
  }
}

template <class T>
void causal_conv_next_state(const CausalConvShape& shape, const T* x, const T* state, T* next) {
  CausalConvShape s = shape;  // (a decoded sequence is one a row)
  s.positions = nullptr;
  const int64_t K = s.taps;
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t c = 0; c < s.channels; ++c)
      for (int64_t i = 0; i < K - 1; ++i)
        // Element i of the state after the sequence is position T - (K - 1) + i: tap i of a
        // window ending one past the end.
        next[(b * s.channels + c) * (K - 1) + i] = tap_input(s, x, state, b, s.length, i, c);
}

namespace {

// The implementations, fastest first (kernels/cpu/dispatch.h).
using DeltanetRow = KernelChoice<const DeltanetKernels& (*)()>;
const DeltanetRow kDeltanet[] = {
    {{"amx", Isa::Amx}, deltanet_kernels_amx},
    {{"avx512_bf16", Isa::Avx512Bf16}, deltanet_kernels_avx512_bf16},
    {{"avx512", Isa::Avx512}, deltanet_kernels_avx512},
    {{"avx2", Isa::Avx2}, deltanet_kernels_avx2},
};

const DeltanetRow& chosen() {
  static const DeltanetRow& row = choose_kernel("deltanet", kDeltanet);
  return row;
}

}  // namespace

const DeltanetKernels& deltanet_kernels() {
  static const DeltanetKernels& k = chosen().entry();
  return k;
}

std::string_view deltanet_kernel() {
  return chosen().row.name;
}

void causal_conv_silu_forward_f32(const CausalConvShape& s, const float* x, const float* w,
                                  float* y) {
  deltanet_kernels().conv_forward(s, x, w, y);
}

void causal_conv_silu_backward_f32(const CausalConvShape& s, const float* x, const float* w,
                                   const float* dy, float* dx, float* dw) {
  deltanet_kernels().conv_backward(s, x, w, dy, dx, dw);
}

#define CPUTRAIN_CAUSAL_CONV(T)                                                                    \
  template void causal_conv_silu_forward<T>(const CausalConvShape&, const T*, const T*, const T*,  \
                                            T*);                                                   \
  template void causal_conv_silu_backward<T>(const CausalConvShape&, const T*, const T*, const T*, \
                                             const T*, T*, T*, T*);                                \
  template void causal_conv_next_state<T>(const CausalConvShape&, const T*, const T*, T*);
CPUTRAIN_CAUSAL_CONV(float)
CPUTRAIN_CAUSAL_CONV(double)
#undef CPUTRAIN_CAUSAL_CONV

}  // namespace cputrain::kernels
