#include "kernels/rmsnorm.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/bf16.h"

namespace cputrain::kernels {

namespace {

inline float value(float x) {
  return x;
}
inline float value(uint16_t x) {
  return bf16_to_fp32(x);
}

// sum of term(c) (a double) over c < C, as 8 partial sums (of c % 8, which the compiler keeps
// in vector lanes instead of one chain of dependent adds) added in a fixed order.
template <class Term>
inline double sum8(int64_t C, Term term) {
  double acc[8] = {};
  int64_t c = 0;
  for (; c + 8 <= C; c += 8)
    for (int l = 0; l < 8; ++l) acc[l] += term(c + l);
  for (int l = 0; c + l < C; ++l) acc[l] += term(c + l);
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

inline void put(float& out, float y) {
  out = y;
}
inline void put(uint16_t& out, float y) {
  out = fp32_to_bf16(y);
}

// Out FP32 or bf16 (rounded); inp16, where not null, receives the rounding of inp.
template <class Out>
void forward(Out* out, uint16_t* inp16, float* rstd, const float* inp, const float* weight,
             int64_t N, int64_t C, float eps) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < N; ++i) {
    const float* x = inp + i * C;
    Out* y = out + i * C;
    const double ss = sum8(C, [x](int64_t c) { return static_cast<double>(x[c]) * x[c]; });
    const float r = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(C) + eps));
    for (int64_t c = 0; c < C; ++c) put(y[c], x[c] * r * weight[c]);
    if (inp16 != nullptr)
      for (int64_t c = 0; c < C; ++c) inp16[i * C + c] = fp32_to_bf16(x[c]);
    rstd[i] = r;
  }
}

}  // namespace

void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int64_t N,
                     int64_t C, float eps) {
  forward(out, nullptr, rstd, inp, weight, N, C, eps);
}

void rmsnorm_forward_bf16(uint16_t* out, uint16_t* inp16, float* rstd, const float* inp,
                          const float* weight, int64_t N, int64_t C, float eps) {
  forward(out, inp16, rstd, inp, weight, N, C, eps);
}

namespace {

// inp FP32 or bf16.
template <class In>
void backward(float* dinp, float* dweight, const float* dout, const In* inp, const float* weight,
              const float* rstd, int64_t N, int64_t C, bool accumulate) {
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
      const double dot = sum8(C, [=](int64_t c) {  // sum_c dy * w * x
        return static_cast<double>(dy[c]) * weight[c] * value(x[c]);
      });
      const float k = static_cast<float>(dot / static_cast<double>(C)) * r * r * r;
      for (int64_t c = 0; c < C; ++c) {
        const float xc = value(x[c]);
        dx[c] = (accumulate ? dx[c] : 0.0f) + (dy[c] * weight[c] * r - k * xc);
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
                      const float* weight, const float* rstd, int64_t N, int64_t C,
                      bool accumulate) {
  backward(dinp, dweight, dout, inp, weight, rstd, N, C, accumulate);
}

void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const uint16_t* inp,
                      const float* weight, const float* rstd, int64_t N, int64_t C,
                      bool accumulate) {
  backward(dinp, dweight, dout, inp, weight, rstd, N, C, accumulate);
}

}  // namespace cputrain::kernels
