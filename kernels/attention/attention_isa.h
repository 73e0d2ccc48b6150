// The attention implementations behind the dispatch in attention.cpp, one table per ISA, each
// entry with the contract of its function in attention.h (H % KVH == 0). A table may only be
// used where the CPU has its ISA (the AVX-512 functions where cpu_features().avx512 is set, the
// bf16 ones where avx512_bf16 is, the AMX products where amx_bf16 is).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels/attention/attention.h"

namespace cputrain::kernels {

// The scores' scale: the options', or 1/sqrt(D).
inline float attention_score_scale(const AttentionOptions& o, int64_t D) {
  return o.scale > 0.0f ? o.scale : 1.0f / std::sqrt(static_cast<float>(D));
}

// Queries and keys per tile of every implementation.
constexpr int64_t kAttentionTile = 64;

// A sliding window's tiles: the first key tile a query tile from i0 reaches (the one holding key
// i0 - window + 1), and the end of the query tiles that reach the key tile from j0 (cols keys,
// T queries); without a window (0), 0 and T.
inline int64_t window_first_key_tile(int64_t i0, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, i0 - window + 1) / kAttentionTile * kAttentionTile : 0;
}
inline int64_t window_query_end(int64_t j0, int64_t cols, int64_t T, int64_t window) {
  return window > 0 ? std::min(T, j0 + cols - 1 + window) : T;
}

struct AttentionKernels {
  void (*forward)(float* out, float* lse, const float* q, const float* k, const float* v, int64_t B,
                  int64_t T, int64_t H, int64_t KVH, int64_t D, const AttentionOptions& options);
  void (*backward)(float* dq, float* dk, float* dv, const float* dout, const float* q,
                   const float* k, const float* v, const float* out, const float* lse, int64_t B,
                   int64_t T, int64_t H, int64_t KVH, int64_t D, bool accumulate,
                   const AttentionOptions& options);
  // Null where the ISA has no bf16 instructions (callers widen to FP32 and use the above).
  void (*forward_bf16)(uint16_t* out, float* lse, const uint16_t* q, const uint16_t* k,
                       const uint16_t* v, int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t D,
                       const AttentionOptions& options);
  void (*backward_bf16)(float* dq, float* dk, float* dv, const float* dout, const uint16_t* q,
                        const uint16_t* k, const uint16_t* v, const uint16_t* out, const float* lse,
                        int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t D, bool accumulate,
                        const AttentionOptions& options);
};

const AttentionKernels& attention_kernels_avx2();         // attention_avx2.cpp
const AttentionKernels& attention_kernels_avx512();       // attention_avx512.cpp
const AttentionKernels& attention_kernels_avx512_bf16();  // attention_bf16_avx512.cpp
const AttentionKernels& attention_kernels_amx();          // attention_amx.cpp

void attention_forward_avx2(float* out, float* lse, const float* q, const float* k, const float* v,
                            int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t D,
                            const AttentionOptions& options);
void attention_backward_avx2(float* dq, float* dk, float* dv, const float* dout, const float* q,
                             const float* k, const float* v, const float* out, const float* lse,
                             int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t D,
                             bool accumulate, const AttentionOptions& options);
void attention_forward_avx512(float* out, float* lse, const float* q, const float* k,
                              const float* v, int64_t B, int64_t T, int64_t H, int64_t KVH,
                              int64_t D, const AttentionOptions& options);
void attention_backward_avx512(float* dq, float* dk, float* dv, const float* dout, const float* q,
                               const float* k, const float* v, const float* out, const float* lse,
                               int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t D,
                               bool accumulate, const AttentionOptions& options);
// amx: the products on AMX tiles (kernels/cpu/pairs_amx.h), only where cpu_features().amx_bf16.
void attention_forward_bf16_avx512(uint16_t* out, float* lse, const uint16_t* q, const uint16_t* k,
                                   const uint16_t* v, int64_t B, int64_t T, int64_t H, int64_t KVH,
                                   int64_t D, const AttentionOptions& options, bool amx);
void attention_backward_bf16_avx512(float* dq, float* dk, float* dv, const float* dout,
                                    const uint16_t* q, const uint16_t* k, const uint16_t* v,
                                    const uint16_t* out, const float* lse, int64_t B, int64_t T,
                                    int64_t H, int64_t KVH, int64_t D, bool accumulate,
                                    const AttentionOptions& options, bool amx);

// The bf16 entries of the avx512_bf16 (Amx false) and amx (Amx true) tables.
template <bool Amx>
void attention_forward_bf16_on(uint16_t* out, float* lse, const uint16_t* q, const uint16_t* k,
                               const uint16_t* v, int64_t B, int64_t T, int64_t H, int64_t KVH,
                               int64_t D, const AttentionOptions& options) {
  attention_forward_bf16_avx512(out, lse, q, k, v, B, T, H, KVH, D, options, Amx);
}
template <bool Amx>
void attention_backward_bf16_on(float* dq, float* dk, float* dv, const float* dout,
                                const uint16_t* q, const uint16_t* k, const uint16_t* v,
                                const uint16_t* out, const float* lse, int64_t B, int64_t T,
                                int64_t H, int64_t KVH, int64_t D, bool accumulate,
                                const AttentionOptions& options) {
  attention_backward_bf16_avx512(dq, dk, dv, dout, q, k, v, out, lse, B, T, H, KVH, D, accumulate,
                                 options, Amx);
}

}  // namespace cputrain::kernels
