#include <gtest/gtest.h>

#include <cstdlib>

#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/dispatch.h"
#include "kernels/cpu/peak.h"

namespace cputrain::kernels {
namespace {

// Each rate where the level peak_kernel() chose has its instruction: the CPU's highest, or the
// CPUTRAIN_ISA ceiling.
TEST(Peak, EachRateIsMeasuredExactlyWhereItsInstructionRuns) {
  const Peak p = measure_peak(200'000, 1);
  Isa level;
  ASSERT_TRUE(isa_from_name(peak_kernel(), &level)) << peak_kernel();
  if (!std::getenv("CPUTRAIN_PEAK")) {
    EXPECT_EQ(level, isa_ceiling());
  }
  EXPECT_GT(p.f32_all_threads, 0);
  EXPECT_EQ(p.bf16_all_threads > 0, level >= Isa::Avx512Bf16);
  EXPECT_EQ(p.amx_all_threads > 0, level == Isa::Amx);
  EXPECT_EQ(p.amx_one_thread > 0, level == Isa::Amx);
  // The best BF16 rate is AMX's where it is measured, else vdpbf16ps's.
  const bool amx = level == Isa::Amx;
  EXPECT_EQ(p.bf16_best_all_threads(), amx ? p.amx_all_threads : p.bf16_all_threads);
  EXPECT_STREQ(p.bf16_best_instruction(), amx ? "AMX tdpbf16ps" : "vdpbf16ps");
}

TEST(Peak, HigherPeakTakesEachRateFromWhicheverMeasurementIsHigher) {
  Peak a, b;
  a.f32_one_thread = 1, b.f32_one_thread = 2;
  a.f32_all_threads = 4, b.f32_all_threads = 3;
  a.bf16_one_thread = 5, b.bf16_one_thread = 6;
  a.bf16_all_threads = 8, b.bf16_all_threads = 7;
  a.amx_one_thread = 0, b.amx_one_thread = 0;
  a.amx_all_threads = 9, b.amx_all_threads = 10;
  for (const Peak& p : {higher_peak(a, b), higher_peak(b, a)}) {
    EXPECT_EQ(p.f32_one_thread, 2);
    EXPECT_EQ(p.f32_all_threads, 4);
    EXPECT_EQ(p.bf16_one_thread, 6);
    EXPECT_EQ(p.bf16_all_threads, 8);
    EXPECT_EQ(p.amx_one_thread, 0);
    EXPECT_EQ(p.amx_all_threads, 10);
  }
}

TEST(Peak, AmxLoopCountsTwoTilesOf16x16x32MultiplyAddsPerRound) {
  if (!cpu_features().amx_bf16)
    GTEST_SKIP() << "AMX is absent on this CPU (" << cpu_features_string() << ")";
  EXPECT_DOUBLE_EQ(tdpbf16_amx_loop(40), 10.0 * 2 * 16 * 16 * 32 * 2);
  EXPECT_DOUBLE_EQ(tdpbf16_amx_loop(1), 1.0 * 2 * 16 * 16 * 32 * 2);  // at least one round
}

}  // namespace
}  // namespace cputrain::kernels
