#include "kernels/moe/moe_route.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace cputrain::kernels {
namespace {

// The k largest of row (E values), largest first, ties to the lower index.
void top_k(const float* row, int64_t E, int64_t k, int32_t* chosen) {
  for (int64_t j = 0; j < k; ++j) {
    int32_t best = -1;
    for (int64_t e = 0; e < E; ++e) {
      bool taken = false;
      for (int64_t i = 0; i < j; ++i) taken = taken || chosen[i] == e;
      if (taken) continue;
      if (best < 0 || row[e] > row[best]) best = static_cast<int32_t>(e);
    }
    chosen[j] = best;
  }
}

}  // namespace

void moe_route_forward(const float* logits, int64_t N, int64_t E, int64_t k, MoeGating gating,
                       bool normalize, float* probs, int32_t* experts, float* weights, float* lse) {
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < N; ++t) {
    const float* l = logits + t * E;
    int32_t* chosen = experts + t * k;
    float* w = weights + t * k;
    if (gating == MoeGating::SoftmaxTopK) {
      top_k(l, E, k, chosen);
      const float top = l[chosen[0]];
      float sum = 0;
      for (int64_t j = 0; j < k; ++j) sum += w[j] = std::exp(l[chosen[j]] - top);
      for (int64_t j = 0; j < k; ++j) w[j] /= sum;
      continue;
    }
    float* p = probs + t * E;
    const float top = *std::max_element(l, l + E);
    float sum = 0;
    for (int64_t e = 0; e < E; ++e) sum += p[e] = std::exp(l[e] - top);
    for (int64_t e = 0; e < E; ++e) p[e] /= sum;
    if (lse != nullptr) lse[t] = top + std::log(sum);
    top_k(p, E, k, chosen);
    float chosen_sum = 0;
    for (int64_t j = 0; j < k; ++j) chosen_sum += w[j] = p[chosen[j]];
    if (normalize) {
      const float d = std::max(chosen_sum, kMoeMinWeightSum);
      for (int64_t j = 0; j < k; ++j) w[j] /= d;
    }
  }
}

void moe_route_backward(const float* probs, const int32_t* experts, const float* weights,
                        const float* dweights, int64_t N, int64_t E, int64_t k, MoeGating gating,
                        bool normalize, float* dlogits) {
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < N; ++t) {
    const int32_t* chosen = experts + t * k;
    const float* w = weights + t * k;
    const float* dw = dweights + t * k;
    float* dl = dlogits + t * E;
    std::fill_n(dl, E, 0.0f);
    if (gating == MoeGating::SoftmaxTopK) {
      // w = softmax of the chosen logits: dl_j = w_j (dw_j - sum_i dw_i w_i).
      float dot = 0;
      for (int64_t j = 0; j < k; ++j) dot += dw[j] * w[j];
      for (int64_t j = 0; j < k; ++j) dl[chosen[j]] = w[j] * (dw[j] - dot);
      continue;
    }
    const float* p = probs + t * E;
    // The gradient by each chosen probability: dw itself, or through w_j = p_j / S with S the
    // chosen probabilities' sum, (dw_j - sum_i dw_i w_i) / S (while S is above its clamp).
    float S = 0;
    for (int64_t j = 0; j < k; ++j) S += p[chosen[j]];
    float dot = 0;
    for (int64_t j = 0; j < k; ++j) dot += dw[j] * w[j];
    const auto dp = [&](int64_t j) {
      if (!normalize) return dw[j];
      return S > kMoeMinWeightSum ? (dw[j] - dot) / S : dw[j] / kMoeMinWeightSum;
    };
    // Through the softmax: dl_e = p_e (dp_e - sum_i dp_i p_i), dp zero off the chosen.
    float pd = 0;
    for (int64_t j = 0; j < k; ++j) pd += dp(j) * p[chosen[j]];
    for (int64_t e = 0; e < E; ++e) dl[e] = -p[e] * pd;
    for (int64_t j = 0; j < k; ++j) dl[chosen[j]] += p[chosen[j]] * dp(j);
  }
}

namespace {

// f_e: the rows that chose each expert, over N.
std::vector<double> expert_shares(const int32_t* experts, int64_t N, int64_t E, int64_t k) {
  std::vector<double> f(static_cast<size_t>(E), 0.0);
  for (int64_t i = 0; i < N * k; ++i) f[static_cast<size_t>(experts[i])] += 1.0;
  for (double& v : f) v /= static_cast<double>(N);
  return f;
}

}  // namespace

MoeRouterLosses moe_router_losses(const float* probs, const float* lse, const int32_t* experts,
                                  int64_t N, int64_t E, int64_t k) {
  MoeRouterLosses out;
  if (N == 0) return out;
  const std::vector<double> f = expert_shares(experts, N, E, k);
  for (int64_t t = 0; t < N; ++t) {
    for (int64_t e = 0; e < E; ++e) out.balance += f[static_cast<size_t>(e)] * probs[t * E + e];
    out.z += static_cast<double>(lse[t]) * lse[t];
  }
  out.balance *= static_cast<double>(E) / static_cast<double>(N);
  out.z /= static_cast<double>(N);
  return out;
}

void moe_router_losses_backward(const float* probs, const float* lse, const int32_t* experts,
                                int64_t N, int64_t E, int64_t k, float balance_weight,
                                float z_weight, float* dlogits) {
  if (N == 0) return;
  const std::vector<double> f = expert_shares(experts, N, E, k);
  const double wb = static_cast<double>(balance_weight) * static_cast<double>(E) / N,
               wz = 2.0 * static_cast<double>(z_weight) / N;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < N; ++t) {
    const float* p = probs + t * E;
    double mean_f = 0.0;  // sum over e of f_e p_e
    for (int64_t e = 0; e < E; ++e) mean_f += f[static_cast<size_t>(e)] * p[e];
    for (int64_t e = 0; e < E; ++e)
      dlogits[t * E + e] += static_cast<float>(
          p[e] * (wb * (f[static_cast<size_t>(e)] - mean_f) + wz * static_cast<double>(lse[t])));
  }
}

void moe_group(const int32_t* experts, int64_t N, int64_t k, int64_t E, int64_t* offsets,
               int32_t* order) {
  std::fill_n(offsets, E + 1, int64_t{0});
  for (int64_t i = 0; i < N * k; ++i) ++offsets[experts[i] + 1];
  for (int64_t e = 0; e < E; ++e) offsets[e + 1] += offsets[e];
  std::vector<int64_t> next(offsets, offsets + E);
  for (int64_t i = 0; i < N * k; ++i) order[next[experts[i]]++] = static_cast<int32_t>(i);
}

}  // namespace cputrain::kernels
