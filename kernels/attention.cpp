#include "kernels/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace cputrain::kernels {
namespace {

inline float dot(const float* a, const float* b, int64_t D) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t d = 0; d < D; ++d) s += a[d] * b[d];
  return s;
}

}  // namespace

void attention_forward(float* out, float* lse, const float* q, const float* k, const float* v,
                       int64_t B, int64_t T, int64_t H, int64_t D) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const int64_t row = H * D;  // stride between consecutive positions
#pragma omp parallel
  {
    std::vector<float> p(static_cast<size_t>(T));
    std::vector<float> acc(static_cast<size_t>(D));
    // Query rows are independent; later rows attend to more keys, hence dynamic scheduling.
#pragma omp for collapse(3) schedule(dynamic, 16)
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t h = 0; h < H; ++h) {
        for (int64_t i = 0; i < T; ++i) {
          const float* qi = q + (b * T + i) * row + h * D;
          const float* kb = k + b * T * row + h * D;
          const float* vb = v + b * T * row + h * D;
          float max = -std::numeric_limits<float>::infinity();
          for (int64_t j = 0; j <= i; ++j) {
            p[j] = dot(qi, kb + j * row, D) * scale;
            max = std::max(max, p[j]);
          }
          float sum = 0.0f;
          std::fill(acc.begin(), acc.end(), 0.0f);
          for (int64_t j = 0; j <= i; ++j) {
            const float e = std::exp(p[j] - max);
            sum += e;
            const float* vj = vb + j * row;
            for (int64_t d = 0; d < D; ++d) acc[d] += e * vj[d];
          }
          float* oi = out + (b * T + i) * row + h * D;
          const float inv = 1.0f / sum;
          for (int64_t d = 0; d < D; ++d) oi[d] = acc[d] * inv;
          lse[(b * H + h) * T + i] = max + std::log(sum);
        }
      }
    }
  }
}

void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* q,
                        const float* k, const float* v, const float* out, const float* lse,
                        int64_t B, int64_t T, int64_t H, int64_t D) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const int64_t row = H * D;
  // One (batch, head) per task: dk and dv of a head sum over its queries in order, so the
  // result does not depend on the thread count.
#pragma omp parallel
  {
    std::vector<float> p(static_cast<size_t>(T));
#pragma omp for collapse(2) schedule(dynamic, 1)
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t h = 0; h < H; ++h) {
        const int64_t off = b * T * row + h * D;
        const float* lse_bh = lse + (b * H + h) * T;
        for (int64_t i = 0; i < T; ++i) {
          const float* qi = q + off + i * row;
          const float* gi = dout + off + i * row;
          float* dqi = dq + off + i * row;
          const float di = dot(gi, out + off + i * row, D);  // sum_j p_ij dP_ij
          for (int64_t j = 0; j <= i; ++j)
            p[j] = std::exp(dot(qi, k + off + j * row, D) * scale - lse_bh[i]);
          for (int64_t j = 0; j <= i; ++j) {
            const float* kj = k + off + j * row;
            float* dkj = dk + off + j * row;
            float* dvj = dv + off + j * row;
            const float ds = p[j] * (dot(gi, v + off + j * row, D) - di) * scale;
            for (int64_t d = 0; d < D; ++d) {
              dqi[d] += ds * kj[d];
              dkj[d] += ds * qi[d];
              dvj[d] += p[j] * gi[d];
            }
          }
        }
      }
    }
  }
}

}  // namespace cputrain::kernels
