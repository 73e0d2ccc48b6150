// Softmax cross-entropy over a vocabulary.
#pragma once

#include <cstdint>
#include <string_view>

namespace cputrain::kernels {

// The implementation the functions below run: "avx512" or "avx2" (kernels/cpu/dispatch.h).
std::string_view cross_entropy_kernel();

// logits (N, V); targets (N), each in [0, V). losses (N) receives -log softmax(logits)[target],
// lse (N) receives log(sum exp(logits)) for backward.
void cross_entropy_forward(float* losses, float* lse, const float* logits, const int32_t* targets,
                           int64_t N, int64_t V);
// dlogits (N, V) += dlosses[i] * (softmax(logits_i) - onehot(target_i)).
void cross_entropy_backward(float* dlogits, const float* logits, const float* lse,
                            const int32_t* targets, const float* dlosses, int64_t N, int64_t V);

// out (N, V) = scale * (softmax(logits_i) - onehot(target_i)), from the lse of the forward;
// out may be logits itself.
void cross_entropy_gradient(float* out, const float* logits, const float* lse,
                            const int32_t* targets, float scale, int64_t N, int64_t V);

// cross_entropy_forward and then cross_entropy_gradient(out, ...) in one pass over each row, with
// one exponential per element: losses (N) bitwise as the forward gives them; out (N, V) the
// gradient scale * exp(x - max) / sum (minus scale at the target), which differs from
// cross_entropy_gradient's exp(x - lse) by a rounding; out may be logits. lse is not kept.
void cross_entropy_forward_gradient(float* out, float* losses, const float* logits,
                                    const int32_t* targets, float scale, int64_t N, int64_t V);
// The same with out_bf16 (N, V) receiving the bf16 rounding (fp32_to_bf16) of that gradient; the
// logits are overwritten (with each row's exp(x - max)).
void cross_entropy_forward_gradient_bf16(uint16_t* out_bf16, float* losses, float* logits,
                                         const int32_t* targets, float scale, int64_t N, int64_t V);

// Soft-capping of logits (Gemma 2's final one): x (n) = cap * tanh(x / cap) in place; and a
// gradient by the capped values g (n) turned into one by the uncapped, times 1 - (capped / cap)^2.
void logit_soft_cap(float* x, int64_t n, float cap);
void logit_soft_cap_gradient(float* g, const float* capped, int64_t n, float cap);

}  // namespace cputrain::kernels
