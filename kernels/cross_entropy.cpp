#include "kernels/cross_entropy.h"

#include <algorithm>
#include <cmath>

#include "kernels/exp_approx.h"

namespace cputrain::kernels {

void cross_entropy_forward(float* losses, float* lse, const float* logits, const int32_t* targets,
                           int64_t N, int64_t V) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < N; ++i) {
    const float* x = logits + i * V;
    float max = x[0];
#pragma omp simd reduction(max : max)
    for (int64_t j = 1; j < V; ++j) max = std::max(max, x[j]);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < V; ++j) sum += exp_approx(x[j] - max);
    const double l = static_cast<double>(max) + std::log(static_cast<double>(sum));
    lse[i] = static_cast<float>(l);
    losses[i] = static_cast<float>(l - x[targets[i]]);
  }
}

void cross_entropy_backward(float* dlogits, const float* logits, const float* lse,
                            const int32_t* targets, const float* dlosses, int64_t N, int64_t V) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < N; ++i) {
    const float* x = logits + i * V;
    float* dx = dlogits + i * V;
    const float l = lse[i], g = dlosses[i];
#pragma omp simd
    for (int64_t j = 0; j < V; ++j) dx[j] += g * exp_approx(x[j] - l);
    dx[targets[i]] -= g;
  }
}

}  // namespace cputrain::kernels
