// Causal multi-head scaled dot-product attention in 64 x 64 tiles with an online softmax, so no
// (T, T) score matrix is ever stored; backward recomputes the probabilities from the saved
// log-sum-exp (kernels/attention/attention_tiled.h). Runs the implementation attention_kernel()
// names: amx, avx512_bf16, avx512 or avx2, the fastest this CPU has unless forced
// (kernels/cpu/dispatch.h).
//
// Grouped-query attention: H query heads share KVH key/value heads (H % KVH == 0, KVH == H is
// plain multi-head, KVH == 1 multi-query); query head h reads key/value head h / (H / KVH), so
// consecutive query heads share one (Hugging Face's repeat_kv order). Queries, outputs and
// their gradients are (B, T, H, D); keys, values and their gradients (B, T, KVH, D), rows of
// KVH * D floats. The kernels read the shared heads in place, never repeated.
#pragma once

#include <cstdint>
#include <string_view>

namespace cputrain::kernels {

// The implementation the functions below run.
std::string_view attention_kernel();

// Variants of the scores (Gemma 2 and 3): a scale other than 1/sqrt(D) (Gemma 2's
// query_pre_attn_scalar^-1/2), soft-capping, s = cap * tanh(s / cap) (Gemma 2's 50), and a
// sliding window, query i attending keys i - window < j <= i (whose tiles wholly outside it are
// never computed, so a windowed layer's cost grows with the window, not the sequence).
//
// Attention sinks (gpt-oss): each query head h has a learnt logit sinks[h], a key of zero value
// that every row attends beside its keys, so a row's probabilities sum to
// 1 - exp(sinks[h] - lse); lse includes it.
struct AttentionOptions {
  float scale = 0.0f;            // 0: 1 / sqrt(D)
  float softcap = 0.0f;          // 0: none
  int64_t window = 0;            // 0: every key up to the query
  const float* sinks = nullptr;  // (H); null: none
  bool plain() const { return scale == 0.0f && softcap == 0.0f && window == 0 && sinks == nullptr; }
};

// q, out (B, T, H, D); k, v (B, T, KVH, D); lse (B, H, T) receives log(sum_j exp(s_ij)) of the
// scaled scores s_ij = q_i . k_j / sqrt(D) over j <= i (k of the query head's key/value head),
// or as `options` has them.
void attention_forward(float* out, float* lse, const float* q, const float* k, const float* v,
                       int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t D,
                       const AttentionOptions& options = {});
// dq (B, T, H, D), dk, dv (B, T, KVH, D) += gradients (accumulate), or = gradients (not: they
// may hold garbage, and must not overlap), given dout and the forward's q, k, v, out and lse.
// dk and dv of a key/value head sum its query heads' contributions in the order of those heads.
void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* q,
                        const float* k, const float* v, const float* out, const float* lse,
                        int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t D, bool accumulate,
                        const AttentionOptions& options = {});

// The same on bf16 q, k, v, with the output written rounded to bf16 (as the backward takes it),
// and bf16 dot products into FP32 accumulators (vdpbf16ps); the probabilities, dout and the
// score gradients are rounded to bf16 where they enter a product (dQ and dK multiply the score
// gradients by K and Q less their means, see attention_bf16_avx512.cpp), scores and softmax
// statistics stay FP32, with the options' scale, soft-capping and window applied in FP32 as
// above. Only where attention_bf16_native() is true: the amx implementation (products on AMX
// tiles) or avx512_bf16 (vdpbf16ps); elsewhere (avx512 or avx2, chosen on a CPU without
// AVX512_BF16 or forced with CPUTRAIN_ATTENTION or CPUTRAIN_ISA) callers widen the inputs to
// FP32 and use the functions above.
bool attention_bf16_native();
void attention_forward_bf16(uint16_t* out, float* lse, const uint16_t* q, const uint16_t* k,
                            const uint16_t* v, int64_t B, int64_t T, int64_t H, int64_t KVH,
                            int64_t D, const AttentionOptions& options = {});
void attention_backward_bf16(float* dq, float* dk, float* dv, const float* dout, const uint16_t* q,
                             const uint16_t* k, const uint16_t* v, const uint16_t* out,
                             const float* lse, int64_t B, int64_t T, int64_t H, int64_t KVH,
                             int64_t D, bool accumulate, const AttentionOptions& options = {});

// Incremental decoding: m new queries q (m, H * D) at positions n .. n + m - 1 against the keys
// and values of positions 0 .. n + m - 1 (rows of KVH * D in `keys`, `values`), causal: query i
// attends positions 0 .. n + i (with a window, after n + i - window), query head h key/value head
// h / (H / KVH). out (m, H * D).
void attention_decode(float* out, const float* q, const float* keys, const float* values, int64_t n,
                      int64_t m, int64_t H, int64_t KVH, int64_t D,
                      const AttentionOptions& options = {});

}  // namespace cputrain::kernels
