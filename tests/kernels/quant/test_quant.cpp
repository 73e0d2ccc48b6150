// ggml's quantised formats: the decoders against values worked out element by element from
// each format's definition (bit positions, scales and offsets written afresh here, on random
// blocks); the products of a linear layer over a quantised W against the double-precision GEMM
// of the dequantised W, over odd M (and the few rows of decoding), N across panels, every
// format, FP32 and bf16 activations, beta 0 over NaN and beta 1. (tests/tools/test_interop.cpp
// checks the decoders on llama.cpp's own quantised files against gguf-py's.)
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/bf16.h"
#include "kernels/gemm/gemm.h"
#include "kernels/kernel_test_util.h"
#include "kernels/quant/quant.h"

namespace cputrain::kernels {
namespace {

const QuantType kTypes[] = {QuantType::Q4_0, QuantType::Q5_0, QuantType::Q5_1, QuantType::Q8_0,
                            QuantType::Q4_K, QuantType::Q5_K, QuantType::Q6_K, QuantType::MXFP4};

std::string type_name(QuantType t) {
  const char* names[] = {"Q4_0", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4"};
  return names[static_cast<int>(t)];
}

// IEEE half from its fields.
double half_value(const uint8_t* p) {
  const int h = p[0] | (p[1] << 8);
  const int e = (h >> 10) & 31, m = h & 1023;
  const double v = e == 0 ? std::ldexp(m, -24) : std::ldexp(1024 + m, e - 25);
  return (h >> 15) ? -v : v;
}

// The 6-bit scale (which 0) or minimum (which 1) of sub-block j of a K-quant's 12 scale bytes:
// j < 4 the low 6 bits of byte j (scales) or j + 4 (minimums); j >= 4 four bits of byte j + 4
// (low nibble for scales, high for minimums) under the top 2 bits of byte j - 4 (scales) or j.
int k_field(const uint8_t* s, int j, int which) {
  if (j < 4) return s[j + 4 * which] & 63;
  const int low = which == 0 ? s[j + 4] & 15 : s[j + 4] >> 4;
  return low | ((s[j - 4 * (1 - which)] >> 6) << 4);
}

// Element i of one block, from the definitions in kernels/quant/quant.h; in `size` the sum of the
// magnitudes of its terms (scale times value, and the minimum).
double element(QuantType t, const uint8_t* b, int i, double* size) {
  *size = 0.0;
  switch (t) {
    case QuantType::Q4_0: {
      const int byte = b[2 + i % 16];
      const double v = half_value(b) * ((i < 16 ? byte & 15 : byte >> 4) - 8);
      *size = std::abs(v);
      return v;
    }
    case QuantType::Q5_0:
    case QuantType::Q5_1: {
      // Bit i of the four bytes after the scale(s) over value i's nibble (Q4_0's places).
      const bool one = t == QuantType::Q5_1;
      const uint8_t* h = b + (one ? 4 : 2);
      const int byte = h[4 + i % 16];
      const int q = (i < 16 ? byte & 15 : byte >> 4) | (((h[i / 8] >> (i % 8)) & 1) << 4);
      const double v = one ? half_value(b) * q + half_value(b + 2) : half_value(b) * (q - 16);
      *size = one ? std::abs(half_value(b) * q) + std::abs(half_value(b + 2)) : std::abs(v);
      return v;
    }
    case QuantType::Q8_0:
      *size = std::abs(half_value(b) * static_cast<int8_t>(b[2 + i]));
      return half_value(b) * static_cast<int8_t>(b[2 + i]);
    case QuantType::Q4_K:
    case QuantType::Q5_K: {
      const bool five = t == QuantType::Q5_K;
      const int j = i / 32, g = i / 64, l = i % 32;
      const int byte = b[(five ? 48 : 16) + 32 * g + l];
      int q = j % 2 == 0 ? byte & 15 : byte >> 4;
      if (five) q += ((b[16 + l] >> j) & 1) * 16;
      const double scaled = half_value(b) * k_field(b + 4, j, 0) * q;
      const double min = half_value(b + 2) * k_field(b + 4, j, 1);
      *size = std::abs(scaled) + std::abs(min);
      return scaled - min;
    }
    case QuantType::Q6_K: {
      // Halves of 128; within one, value l + 32 * s (s = 0..3) takes low nibble s / 2 ? high :
      // low of byte l + 32 * (s % 2), and bits 2s, 2s + 1 of high byte l.
      const int h = i / 128, r = i % 128, s = r / 32, l = r % 32;
      const int lo = b[64 * h + l + 32 * (s % 2)];
      const int q = ((s / 2 ? lo >> 4 : lo & 15) | (((b[128 + 32 * h + l] >> (2 * s)) & 3) << 4));
      const int scale = static_cast<int8_t>(b[192 + 8 * h + s * 2 + l / 16]);
      *size = std::abs(half_value(b + 208) * scale * (q - 32));
      return half_value(b + 208) * scale * (q - 32);
    }
    case QuantType::MXFP4: {
      // E2M1: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0; exponent 0 subnormal
      // (m / 2). Times 2^(e - 127), e the E8M0 byte.
      const int code = i < 16 ? b[1 + i] & 15 : b[1 + i - 16] >> 4;
      const int ex = (code >> 1) & 3, m = code & 1;
      const double magnitude = ex == 0 ? 0.5 * m : (1.0 + 0.5 * m) * std::ldexp(1.0, ex - 1);
      const double v = (code & 8 ? -magnitude : magnitude) * std::ldexp(1.0, b[0] - 127);
      *size = std::abs(v);
      return v;
    }
  }
  return 0.0;
}

std::vector<uint8_t> random_blocks(QuantType t, int64_t blocks, uint32_t seed) {
  return test::random_quant_blocks(t, blocks, seed);
}

TEST(Quant, BlocksDecodeAsTheirFormatsDefineThem) {
  for (const QuantType t : kTypes) {
    const int64_t blocks = 9, n = blocks * quant_block_values(t);
    const std::vector<uint8_t> data = random_blocks(t, blocks, 3);
    std::vector<float> got(static_cast<size_t>(n));
    dequantize_blocks(t, data.data(), blocks, got.data());
    for (int64_t i = 0; i < n; ++i) {
      const int64_t b = i / quant_block_values(t);
      double size = 0.0;
      const double want = element(t, data.data() + b * quant_block_bytes(t),
                                  static_cast<int>(i % quant_block_values(t)), &size);
      // A few FP32 roundings of its terms from the exact value.
      ASSERT_LE(std::abs(got[i] - want), size * 3e-7) << type_name(t) << " at " << i;
    }
  }
}

// Rows of a matrix, as FP32 and as bf16 (the FP32 values rounded).
TEST(Quant, RowsDequantiseToFp32AndBf16) {
  for (const QuantType t : kTypes) {
    const int64_t rows = 37, cols = 2 * quant_block_values(t);
    const std::vector<uint8_t> data = random_blocks(t, rows * cols / quant_block_values(t), 4);
    const QuantMatrix w{t, data.data(), rows, cols};
    std::vector<float> all(static_cast<size_t>(rows * cols)), some(static_cast<size_t>(5 * cols));
    dequantize_blocks(t, data.data(), rows * cols / quant_block_values(t), all.data());
    dequantize_rows(w, 11, 5, some.data());
    EXPECT_EQ(some, std::vector<float>(all.begin() + 11 * cols, all.begin() + 16 * cols));
    std::vector<uint16_t> half(static_cast<size_t>(rows * cols));
    dequantize_rows_bf16(w, 0, rows, half.data());
    for (int64_t i = 0; i < rows * cols; ++i)
      ASSERT_EQ(half[i], fp32_to_bf16(all[i])) << type_name(t) << " at " << i;
  }
}

// |C - want| within FP32 rounding of the sum of |terms| of each element.
void expect_product(const std::vector<float>& got, const std::vector<double>& want,
                    const std::vector<double>& magnitude, const std::string& what) {
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_LE(std::abs(got[i] - want[i]), 2e-6 * magnitude[i] + 1e-30) << what << " at " << i;
}

TEST(Quant, LinearProductsOverAQuantisedWeight) {
  for (const QuantType t : kTypes) {
    const int64_t bv = quant_block_values(t);
    for (const int64_t K : {bv, 3 * bv}) {
      const int64_t panel = quant_panel_rows(K);
      for (const int64_t N : {int64_t{1}, int64_t{17}, panel + 19}) {
        const std::vector<uint8_t> data = random_blocks(t, N * K / bv, 5);
        const QuantMatrix W{t, data.data(), N, K};
        std::vector<float> w(static_cast<size_t>(N * K));
        dequantize_rows(W, 0, N, w.data());
        std::vector<double> w16(w.size());
        for (size_t i = 0; i < w.size(); ++i) w16[i] = bf16_to_fp32(fp32_to_bf16(w[i]));
        for (const int64_t M : {int64_t{1}, int64_t{4}, int64_t{7}, int64_t{33}}) {
          const std::string what = type_name(t) + " M" + std::to_string(M) + " N" +
                                   std::to_string(N) + " K" + std::to_string(K);
          const std::vector<float> x = test::random_floats(static_cast<size_t>(M * K), 6);
          const std::vector<float> dy = test::random_floats(static_cast<size_t>(M * N), 7);
          std::vector<uint16_t> x16(x.size()), dy16(dy.size());
          fp32_to_bf16_array(x16.data(), x.data(), M * K);
          fp32_to_bf16_array(dy16.data(), dy.data(), M * N);
          for (const bool bf16 : {false, true}) {
            const auto xv = [&](int64_t i) { return bf16 ? bf16_to_fp32(x16[i]) : x[i]; };
            const auto dyv = [&](int64_t i) { return bf16 ? bf16_to_fp32(dy16[i]) : dy[i]; };
            const auto wv = [&](int64_t i) { return bf16 ? w16[i] : static_cast<double>(w[i]); };
            // Y = X W^T (onto a Y of ones with beta 1), dX = dY W (over NaN with beta 0).
            std::vector<double> want_y(static_cast<size_t>(M * N), 1.0), mag_y(want_y.size(), 1.0);
            std::vector<double> want_dx(static_cast<size_t>(M * K)), mag_dx(want_dx.size());
            for (int64_t m = 0; m < M; ++m)
              for (int64_t n = 0; n < N; ++n)
                for (int64_t k = 0; k < K; ++k) {
                  const double a = xv(m * K + k) * wv(n * K + k);
                  want_y[m * N + n] += a;
                  mag_y[m * N + n] += std::abs(a);
                  const double g = dyv(m * N + n) * wv(n * K + k);
                  want_dx[m * K + k] += g;
                  mag_dx[m * K + k] += std::abs(g);
                }
            std::vector<float> y(static_cast<size_t>(M * N), 1.0f);
            std::vector<float> dx(static_cast<size_t>(M * K),
                                  std::numeric_limits<float>::quiet_NaN());
            if (bf16) {
              gemm_quant_forward_bf16(M, x16.data(), K, W, 1.0f, y.data(), N);
              gemm_quant_backward_input_bf16(M, dy16.data(), N, W, 0.0f, dx.data(), K);
            } else {
              gemm_quant_forward(M, x.data(), K, W, 1.0f, y.data(), N);
              gemm_quant_backward_input(M, dy.data(), N, W, 0.0f, dx.data(), K);
            }
            expect_product(y, want_y, mag_y, what + (bf16 ? " bf16 forward" : " forward"));
            expect_product(dx, want_dx, mag_dx, what + (bf16 ? " bf16 dX" : " dX"));
          }
        }
      }
    }
  }
}

TEST(Quant, RefusesRowsOfPartBlocks) {
  const std::vector<uint8_t> data(1000);
  const QuantMatrix w{QuantType::Q4_K, data.data(), 2, 100};
  std::vector<float> y(2);
  EXPECT_THROW(gemm_quant_forward(1, y.data(), 100, w, 0.0f, y.data(), 2), std::invalid_argument);
}

// Quantising to Q4_K, Q6_K and Q5_0 (export's q4_k), read back with the decoders tested above, over
// blocks of sizes 10^-3 to 10 whose sub-blocks differ by up to 4 times: each value within 1.5 steps
// of its sub-block's level grid (the step read from the written scales: d times the 6-bit scale for
// Q4_K, d times the int8 scale's magnitude for Q6_K), and the error's RMS a small part of the
// values' (4 and 6 bits: about 1/15 and 1/63 of a range of some 5 standard deviations); a block of
// zeros is zeros.
TEST(Quant, QuantisedBlocksHoldTheNearestLevels) {
  std::mt19937 rng(12);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> exponent(-3.0f, 1.0f);
  for (const QuantType t : {QuantType::Q4_K, QuantType::Q6_K, QuantType::Q5_0}) {
    const int64_t blocks = 64 * 256 / quant_block_values(t), n = 64 * 256;
    const int sub = t == QuantType::Q6_K ? 16 : 32;
    std::vector<float> x(static_cast<size_t>(n));
    std::uniform_real_distribution<float> part(0.25f, 1.0f);
    float block_size = 1.0f;
    for (int64_t i = 0; i < n; i += sub) {
      if (i % 256 == 0) block_size = std::pow(10.0f, exponent(rng));
      const float size = block_size * part(rng);
      for (int l = 0; l < sub; ++l) x[static_cast<size_t>(i + l)] = size * normal(rng);
    }
    std::fill_n(x.begin(), 256, 0.0f);  // block 0: zeros
    std::vector<uint8_t> q(static_cast<size_t>(blocks * quant_block_bytes(t)));
    quantize_blocks(t, x.data(), blocks, q.data());
    std::vector<float> y(static_cast<size_t>(n));
    dequantize_blocks(t, q.data(), blocks, y.data());
    for (int64_t i = 0; i < n; ++i) {
      const uint8_t* b = q.data() + i / quant_block_values(t) * quant_block_bytes(t);
      const int j = static_cast<int>(i % quant_block_values(t)) / sub;
      const double step = t == QuantType::Q4_K ? half_value(b) * k_field(b + 4, j, 0)
                          : t == QuantType::Q6_K
                              ? std::abs(half_value(b + 208) * static_cast<int8_t>(b[192 + j]))
                              : std::abs(half_value(b));
      const double e = std::abs(static_cast<double>(y[i]) - x[i]);
      ASSERT_LE(e, step * 1.5 + 1e-30) << type_name(t) << " value " << i << " of " << x[i];
      if (i < 256) {
        ASSERT_EQ(y[i], 0.0f) << type_name(t);
      }
    }
    // Each sub-block's error against its own size, so that the large ones do not hide the rest.
    double err2 = 0.0, x2 = 0.0;
    for (int64_t i0 = 256; i0 < n; i0 += sub) {
      double e2 = 0.0, v2 = 0.0;
      for (int64_t i = i0; i < i0 + sub; ++i) {
        e2 += (static_cast<double>(y[i]) - x[i]) * (static_cast<double>(y[i]) - x[i]);
        v2 += static_cast<double>(x[i]) * x[i];
      }
      err2 += e2 / v2;
      x2 += 1.0;
    }
    const double rms = std::sqrt(err2 / x2);
    std::printf("%s: RMS error over RMS value, per sub-block %.4f\n", type_name(t).c_str(), rms);
    EXPECT_LT(rms, t == QuantType::Q4_K   ? 0.085
                   : t == QuantType::Q6_K ? 0.022
                                          : 0.05)
        << type_name(t);
    // Values that are a quantised file's quantise to themselves (a merged export writes the base's
    // untouched tensors as they were): blocks whose largest scale (and minimum) takes all the
    // scales' bits (63; Q6_K's -128) and whose sub-blocks reach their lowest and highest level
    // (Q6_K's and Q5_0's lowest), as a quantiser that spends the format's range writes them.
    std::vector<uint8_t> grid = random_blocks(t, blocks, 13);
    for (int64_t k = 0; k < blocks; ++k) {
      uint8_t* b = grid.data() + k * quant_block_bytes(t);
      if (t == QuantType::Q4_K) {
        b[4] |= 63;  // sub-block 0's scale and minimum
        b[8] |= 63;
        for (int j = 0; j < 8; ++j) {  // values 0 and 1 of each sub-block at levels 0 and 15
          uint8_t* p = b + 16 + 32 * (j / 2);
          const int shift = j % 2 ? 4 : 0;
          p[0] = static_cast<uint8_t>(p[0] & ~(15 << shift));
          p[1] = static_cast<uint8_t>(p[1] | (15 << shift));
        }
      } else if (t == QuantType::Q5_0) {
        b[2] &= 0xfe;  // value 0 at level 0 (-16)
        b[6] &= 0xf0;
      } else {
        b[192] = 0x80;
        for (int j = 0; j < 16; ++j) {  // value 16 j at level 0 (-32)
          const int h = j / 8, r = (16 * j) % 128, sub = r / 32, l = r % 32;
          b[64 * h + l + 32 * (sub % 2)] &= static_cast<uint8_t>(sub / 2 ? 0x0f : 0xf0);
          b[128 + 32 * h + l] &= static_cast<uint8_t>(~(3 << (2 * sub)));
        }
      }
    }
    std::vector<float> on_grid(static_cast<size_t>(n)), again(static_cast<size_t>(n));
    dequantize_blocks(t, grid.data(), blocks, on_grid.data());
    std::vector<uint8_t> requantized(grid.size());
    quantize_blocks(t, on_grid.data(), blocks, requantized.data());
    dequantize_blocks(t, requantized.data(), blocks, again.data());
    EXPECT_EQ(again, on_grid) << type_name(t);
  }
}

// Quantising to MXFP4: each block's exponent the smallest whose largest code (6) covers its
// largest magnitude (so that it is above 3 2^(e - 127)), each value within half the spacing of
// the E2M1 codes around it (0.5 below 2, 1 below 4, 2 above, times 2^(e - 127)), over blocks of
// sizes 10^-3 to 10; a block of zeros is zeros; decoded blocks whose largest code is 6 quantise
// to themselves.
TEST(Quant, Mxfp4BlocksHoldTheNearestCodes) {
  std::mt19937 rng(14);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> exponent(-3.0f, 1.0f);
  const QuantType t = QuantType::MXFP4;
  const int64_t blocks = 512, n = blocks * 32;
  std::vector<float> x(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; i += 32) {
    const float size = std::pow(10.0f, exponent(rng));
    for (int l = 0; l < 32; ++l) x[static_cast<size_t>(i + l)] = size * normal(rng);
  }
  std::fill_n(x.begin(), 32, 0.0f);
  std::vector<uint8_t> q(static_cast<size_t>(blocks * 17));
  quantize_blocks(t, x.data(), blocks, q.data());
  std::vector<float> y(static_cast<size_t>(n));
  dequantize_blocks(t, q.data(), blocks, y.data());
  for (int64_t k = 1; k < blocks; ++k) {
    const double d = std::ldexp(1.0, q[static_cast<size_t>(k * 17)] - 127);
    double largest = 0.0;
    for (int l = 0; l < 32; ++l) largest = std::max(largest, std::abs(double(x[k * 32 + l])));
    ASSERT_LE(largest, 6.0 * d) << "block " << k;
    ASSERT_GT(largest, 3.0 * d) << "block " << k;
    for (int l = 0; l < 32; ++l) {
      const int64_t i = k * 32 + l;
      const double m = std::abs(double(x[i])) / d;
      const double spacing = m < 2.0 ? 0.5 : m < 4.0 ? 1.0 : 2.0;
      ASSERT_LE(std::abs(double(y[i]) - x[i]), 0.5 * spacing * d * (1 + 1e-6)) << i;
    }
  }
  for (int l = 0; l < 32; ++l) ASSERT_EQ(y[l], 0.0f);
  std::vector<uint8_t> grid = random_blocks(t, blocks, 15);
  for (int64_t k = 0; k < blocks; ++k) grid[static_cast<size_t>(k * 17 + 1)] |= 7;  // a 6
  std::vector<float> on_grid(static_cast<size_t>(n)), again(static_cast<size_t>(n));
  dequantize_blocks(t, grid.data(), blocks, on_grid.data());
  std::vector<uint8_t> requantized(grid.size());
  quantize_blocks(t, on_grid.data(), blocks, requantized.data());
  dequantize_blocks(t, requantized.data(), blocks, again.data());
  EXPECT_EQ(again, on_grid);
}

}  // namespace
}  // namespace cputrain::kernels
