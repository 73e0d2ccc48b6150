// The router of a mixture-of-experts block: which k of its E experts each token goes to and with
// what weight, and the tokens grouped by expert for the experts' products.
#pragma once

#include <cstdint>

namespace cputrain::kernels {

// How the weights come from a token's router logits (E of them):
//   Softmax      softmax over all E, the k largest probabilities, with `normalize` divided by
//                their sum (Qwen3-MoE's norm_topk_prob; llama.cpp's norm_w, the sum clamped at
//                kMoeMinWeightSum);
//   SoftmaxTopK  the k largest logits, then softmax over those k (gpt-oss).
// Ties between equal logits go to the lower expert.
enum class MoeGating { Softmax, SoftmaxTopK };
constexpr float kMoeMinWeightSum = 6.103515625e-5f;

// logits (N, E) -> experts (N, k), weights (N, k) in order of weight, largest first; probs (N, E)
// receives what the backward pass reads (Softmax: the probabilities over all E; SoftmaxTopK: the
// k weights' softmax is all it needs, and probs is not written); where lse is not null (Softmax),
// each row's log-sum-exp of its logits.
void moe_route_forward(const float* logits, int64_t N, int64_t E, int64_t k, MoeGating gating,
                       bool normalize, float* probs, int32_t* experts, float* weights,
                       float* lse = nullptr);
// dlogits (N, E) (overwritten) from dweights (N, k), with what the forward pass wrote.
void moe_route_backward(const float* probs, const int32_t* experts, const float* weights,
                        const float* dweights, int64_t N, int64_t E, int64_t k, MoeGating gating,
                        bool normalize, float* dlogits);

// A Softmax routing's auxiliary losses, from its probabilities p (N, E), each row's log-sum-exp
// (N) and the experts chosen (N, k):
//   balance = E sum_e f_e P_e, f_e the rows that chose e over N (k for an even load, summed over
//             the k slots), P_e the mean of p over the rows: the load-balancing loss (Switch
//             Transformer; Qwen's aux_loss), whose gradient flows through P alone;
//   z       = the mean over rows of lse^2, the router z-loss (ST-MoE).
struct MoeRouterLosses {
  double balance = 0.0;
  double z = 0.0;
};
MoeRouterLosses moe_router_losses(const float* probs, const float* lse, const int32_t* experts,
                                  int64_t N, int64_t E, int64_t k);
// dlogits (N, E) += balance_weight d(balance)/dlogits + z_weight d(z)/dlogits.
void moe_router_losses_backward(const float* probs, const float* lse, const int32_t* experts,
                                int64_t N, int64_t E, int64_t k, float balance_weight,
                                float z_weight, float* dlogits);

// The N k (token, slot) pairs grouped by expert, each expert's in token order: offsets (E + 1),
// expert e's pairs at order[offsets[e] .. offsets[e + 1]), each the index token * k + slot.
void moe_group(const int32_t* experts, int64_t N, int64_t k, int64_t E, int64_t* offsets,
               int32_t* order);

}  // namespace cputrain::kernels
