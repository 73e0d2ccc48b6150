#include "kernels/rmsnorm.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/bf16.h"

namespace cputrain::kernels {

void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int64_t N,
                     int64_t C, float eps) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < N; ++i) {
    const float* x = inp + i * C;
    float* y = out + i * C;
    double ss = 0.0;
    for (int64_t c = 0; c < C; ++c) ss += static_cast<double>(x[c]) * x[c];
    const float r = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(C) + eps));
    for (int64_t c = 0; c < C; ++c) y[c] = x[c] * r * weight[c];
    rstd[i] = r;
  }
}

namespace {

inline float value(float x) { return x; }
inline float value(uint16_t x) { return bf16_to_fp32(x); }

// inp FP32 or bf16.
template <class In>
void backward(float* dinp, float* dweight, const float* dout, const In* inp, const float* weight,
              const float* rstd, int64_t N, int64_t C) {
  // dweight sums over rows in fixed blocks, then the blocks in order: deterministic for any
  // thread count.
  constexpr int64_t kRowBlock = 32;
  const int64_t blocks = (N + kRowBlock - 1) / kRowBlock;
  std::vector<float> partial(static_cast<size_t>(blocks * C), 0.0f);
#pragma omp parallel for schedule(static)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    float* dw = partial.data() + blk * C;
    for (int64_t i = blk * kRowBlock; i < std::min(N, (blk + 1) * kRowBlock); ++i) {
      const In* x = inp + i * C;
      const float* dy = dout + i * C;
      float* dx = dinp + i * C;
      const float r = rstd[i];
      double dot = 0.0;  // sum_c dy * w * x
      for (int64_t c = 0; c < C; ++c) dot += static_cast<double>(dy[c]) * weight[c] * value(x[c]);
      const float k = static_cast<float>(dot / static_cast<double>(C)) * r * r * r;
      for (int64_t c = 0; c < C; ++c) {
        const float xc = value(x[c]);
        dx[c] += dy[c] * weight[c] * r - k * xc;
        dw[c] += dy[c] * xc * r;
      }
    }
  }
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const float* dw = partial.data() + blk * C;
    for (int64_t c = 0; c < C; ++c) dweight[c] += dw[c];
  }
}

}  // namespace

void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp,
                      const float* weight, const float* rstd, int64_t N, int64_t C) {
  backward(dinp, dweight, dout, inp, weight, rstd, N, C);
}

void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const uint16_t* inp,
                      const float* weight, const float* rstd, int64_t N, int64_t C) {
  backward(dinp, dweight, dout, inp, weight, rstd, N, C);
}

}  // namespace cputrain::kernels
