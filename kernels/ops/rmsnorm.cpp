#include "kernels/ops/rmsnorm.h"

#include <algorithm>
#include <cmath>
#include <cstring>
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

// One row of the norm: y (C) from x (C), x16 (where not null) the rounding of x; returns the
// reciprocal norm.
template <class Out>
inline float norm_row(Out* y, uint16_t* x16, const float* x, const float* weight, int64_t C,
                      float eps, float offset) {
  const double ss = sum8(C, [x](int64_t c) { return static_cast<double>(x[c]) * x[c]; });
  const float r = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(C) + eps));
  for (int64_t c = 0; c < C; ++c) put(y[c], x[c] * r * (weight[c] + offset));
  if (x16 != nullptr)
    for (int64_t c = 0; c < C; ++c) x16[c] = fp32_to_bf16(x[c]);
  return r;
}

// Out FP32 or bf16 (rounded); inp16, where not null, receives the rounding of inp.
template <class Out>
void forward(Out* out, uint16_t* inp16, float* rstd, const float* inp, const float* weight,
             int64_t N, int64_t C, float eps, float offset) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < N; ++i)
    rstd[i] = norm_row(out + i * C, inp16 != nullptr ? inp16 + i * C : nullptr, inp + i * C, weight,
                       C, eps, offset);
}

inline void add_row(float* __restrict s, const float* __restrict x, const float* __restrict y,
                    int64_t C) {
  for (int64_t c = 0; c < C; ++c) s[c] = x[c] + y[c];
}

// The sum a + b written to `sum`, each row normed while it is in cache.
template <class Out>
void add_forward(float* sum, Out* out, uint16_t* sum16, float* rstd, const float* a, const float* b,
                 const float* weight, int64_t N, int64_t C, float eps, float offset) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < N; ++i) {
    float* s = sum + i * C;
    add_row(s, a + i * C, b + i * C, C);
    rstd[i] = norm_row(out + i * C, sum16 != nullptr ? sum16 + i * C : nullptr, s, weight, C, eps,
                       offset);
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

// The norm's row term: k, where x's gradient is dy (w + offset) r - k x.
template <class In>
inline float row_k(const float* dy, const In* x, const float* weight, float r, int64_t C,
                   float offset) {
  const double dot = sum8(C, [=](int64_t c) {  // sum_c dy * w * x
    return static_cast<double>(dy[c]) * (weight[c] + offset) * value(x[c]);
  });
  return static_cast<float>(dot / static_cast<double>(C)) * r * r * r;
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
    const float k = row_k(dy, x, weight, r, C, offset);
    for (int64_t c = 0; c < C; ++c) {
      const float xc = value(x[c]);
      dx[c] = (accumulate ? dx[c] : 0.0f) + (dy[c] * (weight[c] + offset) * r - k * xc);
      dw[c] += dy[c] * xc * r;
    }
  });
}

// Writes one row's gradient g (C) to a side's, at element j: its rounding, a copy, or added on.
inline void put_side(const SumGradient& side, int64_t j, const float* g, int64_t C) {
  if (side.rounded != nullptr) {
    uint16_t* d = side.rounded + j;
    for (int64_t c = 0; c < C; ++c) d[c] = fp32_to_bf16(g[c]);
  } else if (side.grad != nullptr && side.accumulate) {
    float* d = side.grad + j;
    for (int64_t c = 0; c < C; ++c) d[c] += g[c];
  } else if (side.grad != nullptr) {
    std::memcpy(side.grad + j, g, static_cast<size_t>(C) * sizeof(float));
  }
}

// One row of the sum's gradient: g = (the sum's other gradient ds, or 0 where null) + the
// norm's, as rmsnorm_backward adds them; dw += the row's part of the weight's.
template <class In>
inline void sum_gradient_row(float* __restrict g, float* __restrict dw, const float* __restrict ds,
                             const float* __restrict dy, const In* __restrict x,
                             const float* __restrict weight, float r, float k, int64_t C,
                             float offset) {
  if (ds != nullptr) {
    for (int64_t c = 0; c < C; ++c) {
      const float xc = value(x[c]);
      g[c] = ds[c] + (dy[c] * (weight[c] + offset) * r - k * xc);
      dw[c] += dy[c] * xc * r;
    }
  } else {
    for (int64_t c = 0; c < C; ++c) {
      const float xc = value(x[c]);
      g[c] = 0.0f + (dy[c] * (weight[c] + offset) * r - k * xc);
      dw[c] += dy[c] * xc * r;
    }
  }
}

template <class In>
void add_backward(const SumGradient& da, const SumGradient& db, float* dweight, const float* dsum,
                  const float* dout, const In* inp, const float* weight, const float* rstd,
                  int64_t N, int64_t C, float offset) {
  rows_with_weight_sums(N, C, dweight, nullptr, [=](int64_t i, float* dw) {
    // The row's gradient of the sum, in cache while it goes to both sides.
    thread_local std::vector<float> row;
    row.resize(static_cast<size_t>(C));
    float* g = row.data();
    const In* x = inp + i * C;
    const float* dy = dout + i * C;
    const float r = rstd[i];
    const float k = row_k(dy, x, weight, r, C, offset);
    sum_gradient_row(g, dw, dsum != nullptr ? dsum + i * C : nullptr, dy, x, weight, r, k, C,
                     offset);
    put_side(da, i * C, g, C);
    put_side(db, i * C, g, C);
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

void add_rmsnorm_forward(float* sum, float* out, float* rstd, const float* a, const float* b,
                         const float* weight, int64_t N, int64_t C, float eps, float offset) {
  add_forward(sum, out, nullptr, rstd, a, b, weight, N, C, eps, offset);
}

void add_rmsnorm_forward_bf16(float* sum, uint16_t* out, uint16_t* sum16, float* rstd,
                              const float* a, const float* b, const float* weight, int64_t N,
                              int64_t C, float eps, float offset) {
  add_forward(sum, out, sum16, rstd, a, b, weight, N, C, eps, offset);
}

void add_rmsnorm_backward(const SumGradient& da, const SumGradient& db, float* dweight,
                          const float* dsum, const float* dout, const float* sum,
                          const float* weight, const float* rstd, int64_t N, int64_t C,
                          float offset) {
  add_backward(da, db, dweight, dsum, dout, sum, weight, rstd, N, C, offset);
}

void add_rmsnorm_backward(const SumGradient& da, const SumGradient& db, float* dweight,
                          const float* dsum, const float* dout, const uint16_t* sum,
                          const float* weight, const float* rstd, int64_t N, int64_t C,
                          float offset) {
  add_backward(da, db, dweight, dsum, dout, sum, weight, rstd, N, C, offset);
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
