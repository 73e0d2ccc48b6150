// The analytic budget against the tracking allocator: one training step of the tiny and mini
// presets, fp32 and bf16, with and without checkpointing, each step followed by a validation
// pass as training makes them (three micro-batches, the last of one window); every category's
// peak must match, the steps after it make no block afresh, and what the process holds for
// tensors, live and kept by the block cache, matches the step peak plus the cache's headroom
// the budget replays (to the byte, here).
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "engine/memory.h"
#include "engine/trainer.h"
#include "kernels/gemm.h"
#include "models/llama.h"
#include "models/memory_budget.h"

namespace cputrain {
namespace {

using Case = std::tuple<std::string, DType, bool>;  // preset, dtype, checkpointing

class BudgetVsMeasured : public ::testing::TestWithParam<Case> {};

TEST_P(BudgetVsMeasured, EveryCategoryPeakMatches) {
  const auto& [preset, dtype, checkpoint] = GetParam();
  const LlamaConfig c = find_preset(preset)->config;
  // Small batches keep the test quick; the replay does not depend on their size.
  TrainOptions options;
  options.batch = preset == "tiny" ? 2 : 1;
  options.ctx = 64;
  options.accum = 2;
  options.lr.total_steps = 4;
  BudgetOptions bo;
  bo.dtype = dtype;
  bo.batch = options.batch;
  bo.ctx = options.ctx;
  bo.accum = options.accum;
  bo.checkpoint = checkpoint;
  bo.eval_windows = 2 * options.batch + 1;
  const MemoryBudget budget = memory_budget(c, bo);

  std::vector<int32_t> tokens(20000);
  std::mt19937 rng(1);
  for (int32_t& t : tokens) t = static_cast<int32_t>(rng() % c.vocab);

  memory_release_cached();  // the cache starts empty, as training's does (and as the replay)
  const MemoryStats before = memory_stats();
  const int64_t gemm_before = static_cast<int64_t>(kernels::gemm_workspace_bytes());
  MemoryStats after;
  int64_t gemm_after = 0;
  {
    LlamaModel model(c);
    model.init_weights(1);
    model.set_compute_dtype(dtype);
    model.set_checkpointing(checkpoint);
    Trainer trainer(model.parameters(),
                    [&model](const Tensor& in, const Tensor& tgt) { return model.loss(in, tgt); },
                    options);
    const auto step = [&](int64_t n) {
      trainer.step(tokens, n);
      trainer.evaluate(tokens, bo.eval_windows);
    };
    step(1);  // the GEMM buffers reach their steady size
    memory_reset_peaks();
    step(2);
    after = memory_stats();
    gemm_after = static_cast<int64_t>(kernels::gemm_workspace_bytes());
    // From here on every block a step takes comes back from the block cache: no fresh pages.
    step(3);
    memory_reset_peaks();
    step(4);
    const MemoryStats fourth = memory_stats();
    EXPECT_EQ(fourth.fresh_blocks, after.fresh_blocks) << "blocks made afresh";
    // What the process holds for tensors, live and kept, against the budget's step peak plus
    // what its replay of the cache keeps (the GEMM buffers at this step's size, as below).
    const int64_t held = fourth.held_peak_bytes - before.live_total_bytes + gemm_before -
                         static_cast<int64_t>(kernels::gemm_workspace_bytes()) +
                         budget.gemm_buffer_bytes;
    const int64_t want = budget.step_peak_bytes + budget.cache_headroom_bytes;
    EXPECT_NEAR(static_cast<double>(held), static_cast<double>(want),
                0.02 * static_cast<double>(want))
        << "held " << held << ", budget " << want << " (headroom " << budget.cache_headroom_bytes
        << ")";
  }
  for (int i = 0; i < kMemoryCategoryCount; ++i) {
    const auto category = static_cast<MemoryCategory>(i);
    int64_t measured = after.peak_bytes[i] - before.live_bytes[i];
    if (category == MemoryCategory::Workspace) {
      // The GEMM buffers are kept across tests: count them at the size this step needs, not
      // at what earlier tests of this process grew them to.
      measured += gemm_before - gemm_after + budget.gemm_buffer_bytes;
    }
    const int64_t want = budget.peak_bytes[i];
    EXPECT_NEAR(static_cast<double>(measured), static_cast<double>(want),
                0.02 * static_cast<double>(want))
        << memory_category_name(category) << ": measured " << measured << ", budget " << want;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Presets, BudgetVsMeasured,
    ::testing::Combine(::testing::Values("tiny", "mini"), ::testing::Values(DType::F32, DType::BF16),
                       ::testing::Bool()),
    [](const auto& info) {
      return std::get<0>(info.param) + "_" + std::string(dtype_name(std::get<1>(info.param))) +
             (std::get<2>(info.param) ? "_checkpoint" : "_full");
    });

}  // namespace
}  // namespace cputrain
