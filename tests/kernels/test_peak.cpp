#include <gtest/gtest.h>

#include "kernels/cpu_features.h"
#include "kernels/peak.h"

namespace cputrain::kernels {
namespace {

TEST(Peak, EachRateIsMeasuredExactlyWhereItsInstructionRuns) {
  const Peak p = measure_peak(200'000, 1);
  const CpuFeatures& cpu = cpu_features();
  EXPECT_EQ(p.f32_all_threads > 0, cpu.avx2);
  EXPECT_EQ(p.bf16_all_threads > 0, cpu.avx512_bf16);
  EXPECT_EQ(p.amx_all_threads > 0, cpu.amx_bf16);
  EXPECT_EQ(p.amx_one_thread > 0, cpu.amx_bf16);
  // The best BF16 rate is AMX's where the CPU has it, else vdpbf16ps's.
  EXPECT_EQ(p.bf16_best_all_threads(), cpu.amx_bf16 ? p.amx_all_threads : p.bf16_all_threads);
  EXPECT_STREQ(p.bf16_best_instruction(), cpu.amx_bf16 ? "AMX tdpbf16ps" : "vdpbf16ps");
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
