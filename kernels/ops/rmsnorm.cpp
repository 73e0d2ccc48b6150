#include "kernels/ops/rmsnorm.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cpu/bf16.h"

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
             int64_t N, int64_t C, float eps, float offset) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < N; ++i) {
    const float* x = inp + i * C;
    Out* y = out + i * C;
    const double ss = sum8(C, [x](int64_t c) { return static_cast<double>(x[c]) * x[c]; });
    const float r = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(C) + eps));
    for (int64_t c = 0; c < C; ++c) put(y[c], x[c] * r * (weight[c] + offset));
    if (inp16 != nullptr)
      for (int64_t c = 0; c < C; ++c) inp16[i * C + c] = fp32_to_bf16(x[c]);
    rstd[i] = r;
  }
}

// Per-row work whose weight gradients sum over rows: row(i, dw) for each row i adds its part
// to dw (C), in fixed blocks of rows, then the blocks in order into dweight: deterministic for
// any thread count. Two sums (dweight, dbias) where `second` is not null.
template <class Row>
void rows_with_weight_sums(int64_t N, int64_t C, float* dweight, float* second, Row row) {
  constexpr int64_t kRowBlock = 32;
  const int64_t blocks = (N + kRowBlock - 1) / kRowBlock;
  const int64_t sums = second != nullptr ? 2 : 1;
  std::vector<float> partial(static_cast<size_t>(blocks * C * sums), 0.0f);
#pragma omp parallel for schedule(static)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    float* dw = partial.data() + blk * C * sums;
    for (int64_t i = blk * kRowBlock; i < std::min(N, (blk + 1) * kRowBlock); ++i) row(i, dw);
  }
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const float* dw = partial.data() + blk * C * sums;
    for (int64_t c = 0; c < C; ++c) dweight[c] += dw[c];
    if (second != nullptr)
      for (int64_t c = 0; c < C; ++c) second[c] += dw[C + c];
  }
}

// inp FP32 or bf16.
template <class In>
void backward(float* dinp, float* dweight, const float* dout, const In* inp, const float* weight,
              const float* rstd, int64_t N, int64_t C, bool accumulate, float offset) {
  rows_with_weight_sums(N, C, dweight, nullptr, [=](int64_t i, float* dw) {
    const In* x = inp + i * C;
    const float* dy = dout + i * C;
    float* dx = dinp + i * C;
    const float r = rstd[i];
    const double dot = sum8(C, [=](int64_t c) {  // sum_c dy * w * x
      return static_cast<double>(dy[c]) * (weight[c] + offset) * value(x[c]);
    });
    const float k = static_cast<float>(dot / static_cast<double>(C)) * r * r * r;
    for (int64_t c = 0; c < C; ++c) {
      const float xc = value(x[c]);
      dx[c] = (accumulate ? dx[c] : 0.0f) + (dy[c] * (weight[c] + offset) * r - k * xc);
      dw[c] += dy[c] * xc * r;
    }
  });
}

template <class Out>
void layer_forward(Out* out, uint16_t* inp16, float* mean, float* rstd, const float* inp,
                   const float* weight, const float* bias, int64_t N, int64_t C, float eps) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < N; ++i) {
    const float* x = inp + i * C;
    Out* y = out + i * C;
    const double mu =
        sum8(C, [x](int64_t c) { return static_cast<double>(x[c]); }) / static_cast<double>(C);
    const double var = sum8(C,
                            [x, mu](int64_t c) {
                              const double d = x[c] - mu;
                              return d * d;
                            }) /
                       static_cast<double>(C);
    const auto m = static_cast<float>(mu);
    const auto r = static_cast<float>(1.0 / std::sqrt(var + eps));
    for (int64_t c = 0; c < C; ++c) put(y[c], (x[c] - m) * r * weight[c] + bias[c]);
    if (inp16 != nullptr)
      for (int64_t c = 0; c < C; ++c) inp16[i * C + c] = fp32_to_bf16(x[c]);
    mean[i] = m;
    rstd[i] = r;
  }
}

// dx = r (g - mean(g) - xhat mean(g xhat)), g = dy w, xhat = (x - mean) r.
template <class In>
void layer_backward(float* dinp, float* dweight, float* dbias, const float* dout, const In* inp,
                    const float* weight, const float* mean, const float* rstd, int64_t N, int64_t C,
                    bool accumulate) {
  rows_with_weight_sums(N, C, dweight, dbias, [=](int64_t i, float* dw) {
    const In* x = inp + i * C;
    const float* dy = dout + i * C;
    float* dx = dinp + i * C;
    float* db = dw + C;
    const float m = mean[i], r = rstd[i];
    const double sum_g = sum8(C, [=](int64_t c) { return static_cast<double>(dy[c]) * weight[c]; });
    const double sum_gx = sum8(C, [=](int64_t c) {
      return static_cast<double>(dy[c]) * weight[c] * ((value(x[c]) - m) * r);
    });
    const auto mg = static_cast<float>(sum_g / static_cast<double>(C));
    const auto mgx = static_cast<float>(sum_gx / static_cast<double>(C));
    for (int64_t c = 0; c < C; ++c) {
      const float xhat = (value(x[c]) - m) * r;
      dx[c] = (accumulate ? dx[c] : 0.0f) + r * (dy[c] * weight[c] - mg - xhat * mgx);
      dw[c] += dy[c] * xhat;
      db[c] += dy[c];
    }
  });
}

}  // namespace

void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int64_t N,
                     int64_t C, float eps, float offset) {
  forward(out, nullptr, rstd, inp, weight, N, C, eps, offset);
}

void rmsnorm_forward_bf16(uint16_t* out, uint16_t* inp16, float* rstd, const float* inp,
                          const float* weight, int64_t N, int64_t C, float eps, float offset) {
  forward(out, inp16, rstd, inp, weight, N, C, eps, offset);
}

void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp,
                      const float* weight, const float* rstd, int64_t N, int64_t C, bool accumulate,
                      float offset) {
  backward(dinp, dweight, dout, inp, weight, rstd, N, C, accumulate, offset);
}

void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const uint16_t* inp,
                      const float* weight, const float* rstd, int64_t N, int64_t C, bool accumulate,
                      float offset) {
  backward(dinp, dweight, dout, inp, weight, rstd, N, C, accumulate, offset);
}

void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                       const float* bias, int64_t N, int64_t C, float eps) {
  layer_forward(out, nullptr, mean, rstd, inp, weight, bias, N, C, eps);
}

void layernorm_forward_bf16(uint16_t* out, uint16_t* inp16, float* mean, float* rstd,
                            const float* inp, const float* weight, const float* bias, int64_t N,
                            int64_t C, float eps) {
  layer_forward(out, inp16, mean, rstd, inp, weight, bias, N, C, eps);
}

void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                        const float* inp, const float* weight, const float* mean, const float* rstd,
                        int64_t N, int64_t C, bool accumulate) {
  layer_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C, accumulate);
}

void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                        const uint16_t* inp, const float* weight, const float* mean,
                        const float* rstd, int64_t N, int64_t C, bool accumulate) {
  layer_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C, accumulate);
}

}  // namespace cputrain::kernels
