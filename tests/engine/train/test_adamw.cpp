// AdamW in a bf16 run: the step writes the bf16 copies of the parameters that have them.
#include <gtest/gtest.h>

#include <random>

#include "engine/train/adamw.h"
#include "kernels/cpu/bf16.h"

namespace cputrain {
namespace {

TEST(AdamW, WritesTheBf16CopiesOfFlaggedParameters) {
  ParameterSet params;
  const int matrix = params.add("matrix", Shape{5, 7}, true, true);
  const int gain = params.add("gain", Shape{7}, false);
  params.allocate();
  std::mt19937 rng(7);
  std::normal_distribution<float> dist;
  for (int64_t i = 0; i < params.numel(); ++i) params.weights().f32()[i] = dist(rng);
  params.enable_bf16_copies();
  const ParameterInfo& m = params.infos()[matrix];
  ASSERT_GE(m.bf16_offset, 0);
  EXPECT_LT(params.infos()[gain].bf16_offset, 0);
  EXPECT_EQ(params.bf16_weights().numel(), 64);  // 35 elements, padded to 64 bytes
  const Tensor copy = params.var(matrix).bf16_value();
  EXPECT_EQ(copy.bf16(), params.bf16_weights().bf16() + m.bf16_offset);
  AdamW adamw(params, AdamWConfig{});
  for (int64_t i = 0; i < params.numel(); ++i) params.gradients().f32()[i] = dist(rng);
  adamw.step(0.1f);
  for (int64_t i = 0; i < m.shape.numel(); ++i) {
    const float w = params.weights().f32()[m.offset + i];
    ASSERT_EQ(copy.bf16()[i], kernels::fp32_to_bf16(w)) << i;
  }
  // Writing the weights otherwise leaves the copies stale until synced.
  params.weights().f32()[m.offset] = 3.0f;
  params.sync_bf16_copies();
  EXPECT_EQ(copy.bf16()[0], kernels::fp32_to_bf16(3.0f));
}

}  // namespace
}  // namespace cputrain
