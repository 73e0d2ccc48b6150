// The short causal convolution of Gated DeltaNet (and Mamba): each channel c of x (B, T, C)
// filtered by its own K taps w (C, K), over the K - 1 positions before t and t itself, then SiLU:
//   pre[b, t, c] = sum_j w[c, j] x[b, t - (K - 1) + j, c]      y = silu(pre)
// Positions before the sequence's start read the convolution's state (B, C, K - 1; the K - 1
// inputs before it, oldest first), or zeros without one. x's rows are `x_stride` elements apart
// (0: C); y and its gradient are dense (B, T, C). With `positions` (B, T: each position's index
// within its sequence, packed rows), a window reads zeros before its own sequence's start.
#pragma once

#include <climits>
#include <cstdint>

namespace cputrain::kernels {

struct CausalConvShape {
  int64_t batch = 1;
  int64_t length = 1;    // T
  int64_t channels = 1;  // C
  int64_t taps = 4;      // K
  int64_t x_stride = 0;
  const int32_t* positions = nullptr;  // (B, T); nullptr: one sequence a row

  // The earliest position the window ending at t of row b reads: its sequence's start.
  int64_t first(int64_t b, int64_t t) const {
    return positions != nullptr ? t - positions[b * length + t] : INT64_MIN;
  }

  int64_t x_row() const { return x_stride != 0 ? x_stride : channels; }
  int64_t state_elements() const { return batch * channels * (taps - 1); }
};

// y = silu(conv(x)). `state` (nullptr: zeros) is read, not changed.
template <class T>
void causal_conv_silu_forward(const CausalConvShape& s, const T* x, const T* w, const T* state,
                              T* y);

// The gradients from dy: dx (strided as x) overwritten, dw (C, K) accumulated, dstate
// (B, C, K - 1; nullptr: not wanted) overwritten. The pre-activation is recomputed from x.
template <class T>
void causal_conv_silu_backward(const CausalConvShape& s, const T* x, const T* w, const T* state,
                               const T* dy, T* dx, T* dw, T* dstate);

// The float forms without a state, vectorised (deltanet_rows.h, by runtime dispatch): the
// templates above are their reference. dx overwritten, dw accumulated.
void causal_conv_silu_forward_f32(const CausalConvShape& s, const float* x, const float* w,
                                  float* y);
void causal_conv_silu_backward_f32(const CausalConvShape& s, const float* x, const float* w,
                                   const float* dy, float* dx, float* dw);

// The state after the sequence: the last K - 1 inputs of each channel, reaching into `state` for
// a sequence shorter than that. `next` (B, C, K - 1) may not alias `state`.
template <class T>
void causal_conv_next_state(const CausalConvShape& s, const T* x, const T* state, T* next);

}  // namespace cputrain::kernels
