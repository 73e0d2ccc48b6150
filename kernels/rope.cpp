#include "kernels/rope.h"

#include <cmath>

namespace cputrain::kernels {

void rope_table(float* table, int64_t T, int64_t D, double theta) {
  const int64_t half = D / 2;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < half; ++j) {
      const double freq = std::pow(theta, -2.0 * static_cast<double>(j) / static_cast<double>(D));
      const double angle = static_cast<double>(t) * freq;
      table[(t * half + j) * 2] = static_cast<float>(std::cos(angle));
      table[(t * half + j) * 2 + 1] = static_cast<float>(std::sin(angle));
    }
  }
}

void rope_forward(float* out, const float* inp, const float* table, int64_t B, int64_t T,
                  int64_t H, int64_t D) {
  const int64_t half = D / 2;
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < T; ++t) {
      const float* cs = table + t * half * 2;
      for (int64_t h = 0; h < H; ++h) {
        const int64_t base = ((b * T + t) * H + h) * D;
        for (int64_t j = 0; j < half; ++j) {
          const float c = cs[2 * j], s = cs[2 * j + 1];
          const float x0 = inp[base + 2 * j], x1 = inp[base + 2 * j + 1];
          out[base + 2 * j] = x0 * c - x1 * s;
          out[base + 2 * j + 1] = x0 * s + x1 * c;
        }
      }
    }
  }
}

void rope_backward(float* dinp, const float* dout, const float* table, int64_t B, int64_t T,
                   int64_t H, int64_t D) {
  const int64_t half = D / 2;
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < T; ++t) {
      const float* cs = table + t * half * 2;
      for (int64_t h = 0; h < H; ++h) {
        const int64_t base = ((b * T + t) * H + h) * D;
        for (int64_t j = 0; j < half; ++j) {
          const float c = cs[2 * j], s = cs[2 * j + 1];
          const float g0 = dout[base + 2 * j], g1 = dout[base + 2 * j + 1];
          dinp[base + 2 * j] += g0 * c + g1 * s;
          dinp[base + 2 * j + 1] += -g0 * s + g1 * c;
        }
      }
    }
  }
}

}  // namespace cputrain::kernels
