// ParameterSet: the layout of weights and gradients, and frozen bf16 weights read in place.
#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "engine/core/memory.h"
#include "engine/train/parameters.h"
#include "kernels/cpu/bf16.h"

namespace cputrain {
namespace {

int64_t live(MemoryCategory c) {
  return memory_stats().live_bytes[static_cast<int>(c)];
}

TEST(ParameterSet, SlicesAreAlignedAndGradientsBound) {
  ParameterSet p;
  p.add("a", Shape{3, 5}, true);
  p.add("b", Shape{7}, false);
  p.allocate();
  EXPECT_EQ(p.infos()[1].offset % 16, 0);
  EXPECT_EQ(p.find("b"), 1);
  EXPECT_EQ(p.find("c"), -1);
  EXPECT_EQ(p.var(1).value().f32(), p.weights().f32() + p.infos()[1].offset);
  EXPECT_EQ(p.var(1).grad().f32(), p.gradients().f32() + p.infos()[1].offset);
}

// A frozen bf16 weight mapped onto values it does not own (a model file's tensor): its value is
// those values in place, at an odd address; nothing is allocated for it, yet its bytes are
// counted under Bf16Weights while the set lives, and the set keeps their owner alive. Its values
// read back widened and cannot be written; the other parameters are allocated as before.
TEST(ParameterSet, MappedBf16WeightsAreReadInPlace) {
  const int64_t rows = 5, cols = 7, n = rows * cols;
  auto file = std::make_shared<std::vector<uint16_t>>(n + 1);
  for (int64_t i = 0; i < n; ++i)
    (*file)[static_cast<size_t>(i) + 1] = kernels::fp32_to_bf16(0.25f * static_cast<float>(i - 9));
  const uint16_t* values = file->data() + 1;
  const int64_t before = live(MemoryCategory::Bf16Weights);
  std::weak_ptr<std::vector<uint16_t>> watch = file;
  {
    ParameterSet p;
    const int w = p.add("w", Shape{rows, cols}, true, true);
    const int u = p.add("u", Shape{rows, cols}, true, true);
    p.set_trainable(w, false);
    p.set_trainable(u, false);
    p.map_in_place(w, values, DType::BF16, file);
    file.reset();
    p.allocate(DType::BF16);
    EXPECT_TRUE(p.mapped(w));
    EXPECT_FALSE(p.mapped(u));
    EXPECT_TRUE(p.bf16_only(w));
    EXPECT_EQ(p.var(w).value().bf16(), values);
    EXPECT_EQ(p.var(w).value().dtype(), DType::BF16);
    // The allocated copies hold u alone (35 values padded to 64); w's 70 bytes count as two
    // 64-byte lines.
    EXPECT_EQ(p.bf16_weights().bytes(), 128u);
    EXPECT_EQ(live(MemoryCategory::Bf16Weights) - before, 128 + 128);
    std::vector<float> read(static_cast<size_t>(n));
    p.read_values(w, read.data());
    for (int64_t i = 0; i < n; ++i)
      EXPECT_EQ(read[static_cast<size_t>(i)], 0.25f * static_cast<float>(i - 9));
    EXPECT_THROW(p.write_values(w, read.data()), std::logic_error);
    EXPECT_THROW(p.write_bf16_values(w, values), std::logic_error);
    p.write_values(u, read.data());
    std::vector<float> back(static_cast<size_t>(n));
    p.read_values(u, back.data());
    EXPECT_EQ(back, read);
    EXPECT_FALSE(watch.expired());
  }
  EXPECT_TRUE(watch.expired());
  EXPECT_EQ(live(MemoryCategory::Bf16Weights), before);
  // Only a frozen weight with a bf16 copy, in a bf16 set, can be mapped.
  ParameterSet f;
  const int t = f.add("t", Shape{rows, cols}, true, true);
  f.set_trainable(t, false);
  f.map_in_place(t, values, DType::BF16, std::make_shared<int>(0));
  EXPECT_THROW(f.allocate(DType::F32), std::logic_error);
}

}  // namespace
}  // namespace cputrain
