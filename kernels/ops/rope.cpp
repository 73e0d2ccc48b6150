#include "kernels/ops/rope.h"

#include <cmath>

#include "kernels/cpu/bf16.h"

namespace cputrain::kernels {
namespace {

inline void put(float& out, float y, bool accumulate) {
  out = accumulate ? out + y : y;
}
inline void put(uint16_t& out, float y, bool) {
  out = fp32_to_bf16(y);
}

// Rotates every pair of the first R elements of each head of `in` (adjacent, or half-split
// within those R) by the table's angle for its position, or by minus that angle (the inverse,
// for backward) when Inverse; the elements from R on pass unrotated. Stores into or (FP32 only)
// adds onto `out`, rounding to bf16 where Out is bf16.
template <bool Inverse, bool Accumulate, bool HalfSplit, class Out>
void rotate(Out* out, const float* in, const float* table, int64_t B, int64_t T, int64_t H,
            int64_t D, int64_t R) {
  const int64_t half = R / 2;
  const float sign = Inverse ? -1.0f : 1.0f;
  // Pair j is (x[first * j], x[first * j + second]).
  constexpr int64_t first = HalfSplit ? 1 : 2;
  const int64_t second = HalfSplit ? half : 1;
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < T; ++t) {
      const float* cs = table + t * half * 2;
      for (int64_t h = 0; h < H; ++h) {
        const int64_t base = ((b * T + t) * H + h) * D;
        for (int64_t j = 0; j < half; ++j) {
          const float c = cs[2 * j], s = sign * cs[2 * j + 1];
          const int64_t i0 = base + first * j, i1 = i0 + second;
          const float x0 = in[i0], x1 = in[i1];
          const float y0 = x0 * c - x1 * s, y1 = x0 * s + x1 * c;
          put(out[i0], y0, Accumulate);
          put(out[i1], y1, Accumulate);
        }
        for (int64_t i = R; i < D; ++i) put(out[base + i], in[base + i], Accumulate);
      }
    }
  }
}

template <bool Inverse, bool Accumulate, class Out>
void rotate_pairs(Out* out, const float* in, const float* table, int64_t B, int64_t T, int64_t H,
                  int64_t D, bool half_split, int64_t R) {
  if (R <= 0) R = D;
  if (half_split) return rotate<Inverse, Accumulate, true>(out, in, table, B, T, H, D, R);
  rotate<Inverse, Accumulate, false>(out, in, table, B, T, H, D, R);
}

}  // namespace

void rope_table(float* table, int64_t T, int64_t D, double theta, const float* freq_factors,
                double attn_factor) {
  const int64_t half = D / 2;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < half; ++j) {
      double freq = std::pow(theta, -2.0 * static_cast<double>(j) / static_cast<double>(D));
      if (freq_factors) freq /= static_cast<double>(freq_factors[j]);
      const double angle = static_cast<double>(t) * freq;
      table[(t * half + j) * 2] = static_cast<float>(attn_factor * std::cos(angle));
      table[(t * half + j) * 2 + 1] = static_cast<float>(attn_factor * std::sin(angle));
    }
  }
}

void rope_forward(float* out, const float* inp, const float* table, int64_t B, int64_t T, int64_t H,
                  int64_t D, bool half_split, int64_t R) {
  rotate_pairs<false, false>(out, inp, table, B, T, H, D, half_split, R);
}

void rope_forward_bf16(uint16_t* out, const float* inp, const float* table, int64_t B, int64_t T,
                       int64_t H, int64_t D, bool half_split, int64_t R) {
  rotate_pairs<false, false>(out, inp, table, B, T, H, D, half_split, R);
}

void rope_backward(float* dinp, const float* dout, const float* table, int64_t B, int64_t T,
                   int64_t H, int64_t D, bool half_split, bool accumulate, int64_t R) {
  if (accumulate) return rotate_pairs<true, true>(dinp, dout, table, B, T, H, D, half_split, R);
  rotate_pairs<true, false>(dinp, dout, table, B, T, H, D, half_split, R);
}

void rope_backward_bf16(uint16_t* dinp, const float* dout, const float* table, int64_t B, int64_t T,
                        int64_t H, int64_t D, bool half_split, int64_t R) {
  rotate_pairs<true, false>(dinp, dout, table, B, T, H, D, half_split, R);
}

}  // namespace cputrain::kernels
