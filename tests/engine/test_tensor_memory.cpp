#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "engine/memory.h"
#include "engine/parameters.h"
#include "engine/tensor.h"
#include "kernels/bf16.h"
#include "kernels/cpu_features.h"
#include "kernels/gemm.h"
#include "kernels/gemm_isa.h"

namespace cputrain {
namespace {

int64_t live(MemoryCategory c) {
  return memory_stats().live_bytes[static_cast<int>(c)];
}
int64_t peak(MemoryCategory c) {
  return memory_stats().peak_bytes[static_cast<int>(c)];
}

TEST(Memory, TracksLiveAndPeakPerCategory) {
  memory_reset_peaks();
  const int64_t base = live(MemoryCategory::Activations);
  const int64_t base_ws = live(MemoryCategory::Workspace);
  {
    Tensor a = Tensor::empty(Shape{100, 10}, DType::F32, MemoryCategory::Activations);
    Tensor b = Tensor::empty(Shape{50}, DType::BF16, MemoryCategory::Activations);
    // Counted in whole 64-byte lines: 4000 bytes take 4032, 100 take 128.
    EXPECT_EQ(live(MemoryCategory::Activations), base + 4032 + 128);
    EXPECT_EQ(live(MemoryCategory::Workspace), base_ws);
    Tensor view = a.view(10, Shape{5, 2});  // a view allocates nothing
    EXPECT_EQ(live(MemoryCategory::Activations), base + 4160);
    a = Tensor();
    EXPECT_EQ(live(MemoryCategory::Activations), base + 4160);  // the view keeps the storage
  }
  EXPECT_EQ(live(MemoryCategory::Activations), base);
  EXPECT_EQ(peak(MemoryCategory::Activations), base + 4160);
  memory_reset_peaks();
  EXPECT_EQ(peak(MemoryCategory::Activations), base);
}

TEST(Memory, ProcessMemoryIsRead) {
  const ProcessMemory m = process_memory();
  EXPECT_GT(m.rss_bytes, 0);
  EXPECT_GE(m.peak_rss_bytes, m.rss_bytes);
  std::vector<char> big(64 << 20, 1);  // touch 64 MiB
  EXPECT_GE(process_memory().peak_rss_bytes, m.rss_bytes + (60 << 20));
  EXPECT_EQ(big[12345] + big.back(), 2);
  EXPECT_GT(available_memory_bytes(), 0);
}

TEST(Tensor, ViewsShareStorageAndReshapeChecksSize) {
  Tensor t = Tensor::zeros(Shape{2, 3, 4}, DType::F32, MemoryCategory::Workspace);
  for (int i = 0; i < 24; ++i) EXPECT_EQ(t.f32()[i], 0.0f);
  Tensor v = t.view(12, Shape{3, 4});
  v.f32()[0] = 5.0f;
  EXPECT_EQ(t.f32()[12], 5.0f);
  EXPECT_EQ(t.reshape(Shape{6, 4}).dim(0), 6);
  EXPECT_THROW(t.reshape(Shape{5, 5}), std::invalid_argument);
  EXPECT_THROW(t.view(20, Shape{2, 4}), std::invalid_argument);
  EXPECT_THROW((Shape{1, 2, 3, 4, 5}), std::invalid_argument);
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
    p.map_bf16(w, values, file);
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
  f.map_bf16(t, values, std::make_shared<int>(0));
  EXPECT_THROW(f.allocate(DType::F32), std::logic_error);
}

}  // namespace
}  // namespace cputrain

namespace cputrain {
namespace {

// GEMM packing buffers come from the accounted allocator, under Workspace.
TEST(Memory, GemmPackingBuffersAreWorkspace) {
  if (!kernels::cpu_features().avx512) GTEST_SKIP() << "no AVX-512: no packing buffers";
  const auto workspace = [] { return live(MemoryCategory::Workspace); };
  const int64_t before = workspace();
  const size_t kernel_before = kernels::gemm_workspace_bytes();
  const int64_t n = 700;  // larger than any product this process has run
  std::vector<float> a(n * n, 1.0f), b(n * n, 1.0f), c(n * n);
  kernels::gemm_f32_avx512(kernels::Transpose::No, kernels::Transpose::No, n, n, n, a.data(), n,
                           b.data(), n, 0.0f, c.data(), n);
  EXPECT_EQ(c[0], static_cast<float>(n));
  const int64_t grown = static_cast<int64_t>(kernels::gemm_workspace_bytes() - kernel_before);
  EXPECT_GT(grown, 0);
  EXPECT_EQ(workspace() - before, grown);
}

TEST(Memory, Bf16WideningBuffersAreWorkspace) {
  // The Eigen backend has no bf16 instructions: gemm_bf16 widens its operands into buffers
  // that must be counted like the packing buffers.
  const kernels::GemmBackend previous = kernels::gemm_backend();
  kernels::gemm_set_backend(kernels::GemmBackend::Eigen);
  ASSERT_FALSE(kernels::gemm_bf16_native(kernels::GemmBackend::Eigen));
  const int64_t before = live(MemoryCategory::Workspace);
  const size_t kernel_before = kernels::gemm_workspace_bytes();
  const int64_t n = 701;  // larger than any product this process has run
  const uint16_t one = 0x3f80, two = 0x4000;
  std::vector<uint16_t> a(n * n, one), b(n * n, two);
  std::vector<float> c(n * n);
  kernels::gemm_bf16(kernels::Transpose::No, kernels::Transpose::Yes, n, n, n, a.data(), n,
                     b.data(), n, 0.0f, c.data(), n);
  kernels::gemm_set_backend(previous);
  EXPECT_EQ(c[0], 2.0f * static_cast<float>(n));
  EXPECT_EQ(c[n * n - 1], 2.0f * static_cast<float>(n));
  const int64_t grown = static_cast<int64_t>(kernels::gemm_workspace_bytes() - kernel_before);
  EXPECT_GT(grown, 0);
  EXPECT_EQ(live(MemoryCategory::Workspace) - before, grown);
}

}  // namespace
}  // namespace cputrain
