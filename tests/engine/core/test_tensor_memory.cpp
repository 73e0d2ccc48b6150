#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "engine/core/memory.h"
#include "engine/core/tensor.h"
#include "kernels/cpu/bf16.h"
#include "kernels/cpu/cpu_features.h"
#include "kernels/gemm/gemm.h"
#include "kernels/gemm/gemm_isa.h"

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
