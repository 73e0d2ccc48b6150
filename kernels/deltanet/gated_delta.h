// The gated delta rule (Yang, Kautz and Hatamizadeh 2024, "Gated Delta Networks"), the linear
// attention of Qwen3.5's Gated DeltaNet layers. Each value head h carries a state S (dk x dv)
// from position to position; at position t, with its key head's q_t, k_t (dk), its v_t (dv), a
// log decay g_t (<= 0) and a write strength beta_t in (0, 1):
//   S   = exp(g_t) S
//   u_t = beta_t (v_t - S^T k_t)           the correction the state makes to v_t
//   S   = S + k_t u_t^T
//   o_t = S^T (scale q_t)
// Value head h reads key head h % Hk (llama.cpp's tiled order of value heads; Hv a multiple of
// Hk).
//
// Two forms, the same function: the recurrent one above, one position at a time (decoding, and
// the reference), and the chunked one for training (chunks of C positions, 64 by default). Within
// a chunk, with the decay summed from its start, G_i = g_1 + ... + g_i, and S0 the state it begins
// with, the corrections solve a unit lower-triangular system
//   (I + X) U = beta (V - exp(G) K S0),    X_ij = beta_i exp(G_i - G_j) k_i.k_j  (j < i),
// taken as U = U~ - W S0 with U~ = (I + X)^-1 (beta V) and W = (I + X)^-1 (beta exp(G) K) (the WY
// form), after which
//   O = exp(G) Q S0 + (A U),  A_ij = exp(G_i - G_j) q_i.k_j  (j <= i)
//   S = exp(G_C) S0 + sum_j exp(G_C - G_j) k_j u_j^T.
// Every exponent is of a difference G_i - G_j with j <= i, or of G_i itself: at most 0, so no
// chunk overflows whatever its decay. The backward pass runs the chunks in reverse from the state
// each began with (kept by the forward pass), recomputing the chunk's U~, W and A.
//
// Layouts (element strides): q, k (B, T, Hk, dk) with a row of `qk_stride` elements between
// positions; v (B, T, Hv, dv), row stride `v_stride`; g, beta (B, T, Hv); a state (B, Hv, dk, dv);
// out (B, T, Hv, dv). Templates for float and double (double: the tests' ground truth).
//
// Packed rows: with `positions` (B, T), each position's index within its sequence, a row holds
// several sequences one after another, and each that begins (position 0) starts from a zero
// state, as if it were a row of its own. In the chunked form a sequence start within a chunk
// splits it: the decay sums restart there, the products between positions of different
// sequences are masked out (E below is zero across a start), and only the positions before the
// chunk's first start read S0; the states kept are still one a chunk of the row.
#pragma once

#include <cstdint>

namespace cputrain::kernels {

struct GatedDeltaShape {
  int64_t batch = 1;
  int64_t length = 1;       // T, positions a sequence
  int64_t key_heads = 1;    // Hk
  int64_t value_heads = 1;  // Hv, a multiple of Hk
  int64_t key_dim = 1;      // dk
  int64_t value_dim = 1;    // dv
  int64_t qk_stride = 0;    // elements between one position's q (or k) row and the next; 0: Hk dk
  int64_t v_stride = 0;     // the same for v; 0: Hv dv
  int64_t chunk = 64;       // C, the chunked form's positions a chunk
  // (B, T): each position's index within its sequence (packed rows); nullptr: one a row.
  const int32_t* positions = nullptr;
  // The float chunked form's matrix products with their operands rounded to bf16 and summed in
  // FP32 (vdpbf16ps, AMX where present: deltanet_isa.h), where the CPU has them; else FP32.
  bool bf16_products = false;

  int64_t qk_row() const { return qk_stride != 0 ? qk_stride : key_heads * key_dim; }
  int64_t v_row() const { return v_stride != 0 ? v_stride : value_heads * value_dim; }
  int64_t chunks() const { return (length + chunk - 1) / chunk; }
  int64_t state_elements() const { return batch * value_heads * key_dim * value_dim; }
  // The states the chunked forward pass keeps: each chunk's initial state, and the final one.
  int64_t saved_state_elements() const { return (chunks() + 1) * state_elements(); }
};

// The recurrent form. `state` (B, Hv, dk, dv) holds the initial state (nullptr: zeros and no
// final state kept) and receives the final one.
template <class T>
void gated_delta_recurrent(const GatedDeltaShape& s, T scale, const T* q, const T* k, const T* v,
                           const T* g, const T* beta, T* state, T* out);

// The chunked form. `initial` (B, Hv, dk, dv) or nullptr (zeros). `states` receives
// saved_state_elements(): per sequence and value head, the state at the start of each chunk and
// after the last, (B, Hv, chunks + 1, dk, dv).
template <class T>
void gated_delta_chunked_forward(const GatedDeltaShape& s, T scale, const T* q, const T* k,
                                 const T* v, const T* g, const T* beta, const T* initial, T* states,
                                 T* out);

// The gradients of the chunked form, from the states its forward pass kept, dout (B, T, Hv, dv)
// and the final state's gradient `dfinal` (B, Hv, dk, dv; nullptr: zero). dq, dk (strided as q,
// k), dv (strided as v), dg, dbeta and `dinitial` (nullptr: not wanted) are overwritten.
template <class T>
void gated_delta_chunked_backward(const GatedDeltaShape& s, T scale, const T* q, const T* k,
                                  const T* v, const T* g, const T* beta, const T* states,
                                  const T* dout, const T* dfinal, T* dq, T* dk, T* dv, T* dg,
                                  T* dbeta, T* dinitial);

}  // namespace cputrain::kernels
