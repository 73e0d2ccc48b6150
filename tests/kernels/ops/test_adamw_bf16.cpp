// The fused AdamW update against torch.optim.AdamW's arithmetic spelled out in double, and the
// fp32 <-> bf16 conversions on their edge cases.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <limits>

#include "kernels/cpu/bf16.h"
#include "kernels/kernel_test_util.h"
#include "kernels/ops/adamw.h"

namespace cputrain::kernels {
namespace {

using test::random_floats;

TEST(AdamW, MatchesTorchArithmeticOverSteps) {
  const int64_t n = 1001;
  std::vector<float> p = random_floats(n, 1), m(n, 0.0f), v(n, 0.0f);
  std::vector<double> pd(p.begin(), p.end()), md(n, 0.0), vd(n, 0.0);
  std::vector<uint16_t> copy(n);
  AdamWHyper h;
  h.lr = 1e-2f;
  h.weight_decay = 0.1f;
  const float scale = 0.7f;
  for (int64_t step = 1; step <= 5; ++step) {
    h.step = step;
    const std::vector<float> g = random_floats(n, 100 + static_cast<uint32_t>(step));
    adamw_update(p.data(), g.data(), m.data(), v.data(), n, h, scale, copy.data());
    const double bc1 = 1.0 - std::pow(0.9, step), bc2 = 1.0 - std::pow(0.95, step);
    for (int64_t i = 0; i < n; ++i) {
      const double gi = static_cast<double>(g[i]) * scale;
      pd[i] *= 1.0 - 1e-2 * 0.1;
      md[i] = 0.9 * md[i] + 0.1 * gi;
      vd[i] = 0.95 * vd[i] + 0.05 * gi * gi;
      pd[i] -= 1e-2 / bc1 * md[i] / (std::sqrt(vd[i]) / std::sqrt(bc2) + 1e-8);
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_NEAR(p[i], pd[i], 1e-5) << i;
    ASSERT_NEAR(m[i], md[i], 1e-6) << i;
    ASSERT_NEAR(v[i], vd[i], 1e-6) << i;
    ASSERT_EQ(copy[i], fp32_to_bf16(p[i])) << i;
  }
}

TEST(AdamW, ZeroDecayLeavesZeroGradientParameterInPlace) {
  std::vector<float> p = {1.5f, -2.0f}, g = {0.0f, 0.0f}, m = {0.0f, 0.0f}, v = {0.0f, 0.0f};
  AdamWHyper h;
  h.lr = 0.1f;
  adamw_update(p.data(), g.data(), m.data(), v.data(), 2, h, 1.0f, nullptr);
  EXPECT_EQ(p, (std::vector<float>{1.5f, -2.0f}));
}

float bits_to_float(uint32_t b) {
  return std::bit_cast<float>(b);
}

TEST(Bf16, RoundsToNearestEvenAndKeepsSpecials) {
  EXPECT_EQ(fp32_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(fp32_to_bf16(bits_to_float(0x3f808000u)), 0x3f80);  // tie, even stays
  EXPECT_EQ(fp32_to_bf16(bits_to_float(0x3f818000u)), 0x3f82);  // tie, odd rounds up
  EXPECT_EQ(fp32_to_bf16(bits_to_float(0x3f808001u)), 0x3f81);  // above the tie
  EXPECT_EQ(fp32_to_bf16(bits_to_float(0x3f807fffu)), 0x3f80);  // below the tie
  EXPECT_EQ(fp32_to_bf16(-0.0f), 0x8000);
  EXPECT_EQ(fp32_to_bf16(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(fp32_to_bf16(-std::numeric_limits<float>::infinity()), 0xff80);
  EXPECT_EQ(fp32_to_bf16(std::numeric_limits<float>::max()), 0x7f80);  // overflows to inf
  EXPECT_EQ(fp32_to_bf16(bits_to_float(0x00010000u)), 0x0001);         // denormal
  EXPECT_EQ(fp32_to_bf16(bits_to_float(0x00018000u)), 0x0002);         // denormal tie, odd
  const uint16_t nan = fp32_to_bf16(std::numeric_limits<float>::quiet_NaN());
  EXPECT_TRUE(std::isnan(bf16_to_fp32(nan)));
  const uint16_t low_nan = fp32_to_bf16(bits_to_float(0x7f800001u));  // payload only in low bits
  EXPECT_TRUE(std::isnan(bf16_to_fp32(low_nan)));
  EXPECT_EQ(bf16_to_fp32(0x4049), bits_to_float(0x40490000u));
}

TEST(Bf16, ArraysMatchScalarsAndRoundTripIsExact) {
  const int64_t n = 70001;
  const std::vector<float> x = random_floats(n, 2, -100.0f, 100.0f);
  std::vector<uint16_t> b(n);
  fp32_to_bf16_array(b.data(), x.data(), n);
  std::vector<float> back(n);
  bf16_to_fp32_array(back.data(), b.data(), n);
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(b[i], fp32_to_bf16(x[i]));
    ASSERT_LE(std::abs(back[i] - x[i]), std::abs(x[i]) * (1.0f / 256.0f)) << x[i];
    ASSERT_EQ(fp32_to_bf16(back[i]), b[i]);  // bf16 values are exact in fp32
  }
}

}  // namespace
}  // namespace cputrain::kernels
