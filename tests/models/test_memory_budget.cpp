// The memory budget against the tracking allocator, to the byte: training steps of the tiny and
// mini presets, fp32 and bf16, with and without checkpointing, and of GQA, tied, biased, frozen,
// LoRA and mixture-of-experts configurations, each step followed by a validation pass as training
// makes them (three micro-batches, the last of one window). Every category's peak must equal the
// budget's, the steps after the second make no block afresh, and what the process holds for
// tensors, live and kept by the block cache, equals the budget's step peak plus its cache
// headroom.
#include <gtest/gtest.h>
#include <omp.h>

#include <functional>
#include <ostream>
#include <random>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "engine/core/memory.h"
#include "engine/train/trainer.h"
#include "kernels/gemm/gemm.h"
#include "models/decoder.h"
#include "models/finetune_step.h"
#include "models/memory_budget.h"
#include "tiny_architectures.h"

namespace cputrain {
namespace {

struct Case {
  std::string name;
  ModelConfig config;
  DType dtype;
  Checkpointing checkpoint;
  std::function<bool(const std::string&)> trainable;
  LoraConfig lora = {};
  int64_t ctx = 64;
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << c.name;
}

class BudgetVsMeasured : public ::testing::TestWithParam<Case> {};

TEST_P(BudgetVsMeasured, EveryCategoryPeakMatchesToTheByte) {
  const Case& k = GetParam();
  const ModelConfig& c = k.config;
  // Small batches keep the test quick; the measurement does not depend on their size.
  TrainOptions options;
  options.batch = c.d_model <= 64 ? 2 : 1;
  options.ctx = k.ctx;
  options.accum =
      3;  // the budget measures two micro-batches of a step: the third must hold no more
  options.lr.total_steps = 4;
  BudgetOptions bo;
  bo.dtype = k.dtype;
  bo.batch = options.batch;
  bo.ctx = options.ctx;
  bo.accum = options.accum;
  bo.checkpoint = k.checkpoint;
  bo.eval_windows = 2 * options.batch + 1;
  bo.threads = omp_get_max_threads();
  bo.trainable = k.trainable;
  bo.lora = k.lora;
  const MemoryBudget budget = memory_budget(c, bo);

  std::vector<int32_t> tokens(20000);
  std::mt19937 rng(1);
  for (int32_t& t : tokens) t = static_cast<int32_t>(rng() % c.vocab);

  // The GEMM buffers and the block cache start empty and the peaks from what is live, as in a
  // training process (the cache keeps blocks up to the peak).
  kernels::gemm_release_buffers();
  memory_release_cached();
  memory_reset_peaks();
  const MemoryStats before = memory_stats();
  MemoryStats after, fourth;
  {
    ModelOptions mo;
    mo.compute_dtype = k.dtype;
    mo.trainable = k.trainable;
    mo.lora = k.lora;
    DecoderModel model(c, mo);
    model.init_weights(1);
    model.set_checkpointing(k.checkpoint);
    Trainer trainer(
        model.parameters(),
        [&model](const Tensor& in, const Tensor& tgt) { return model.loss(in, tgt); }, options);
    const auto step = [&](int64_t n) {
      trainer.step(tokens, n);
      trainer.evaluate(tokens, bo.eval_windows);
    };
    step(1);
    memory_reset_peaks();
    step(2);
    after = memory_stats();
    step(3);
    memory_reset_peaks();
    step(4);
    fourth = memory_stats();
  }
  // A mixture's expert products run one expert a thread, each thread's GEMM buffers grown to
  // the products it happens to take: the budget counts every thread's as grown by the largest
  // an expert can meet (every token's rows), an upper bound on the workspace (and so on the
  // totals) within a fifth of it on these tiny models (where the GEMM has no bf16 instructions,
  // the bf16 operands' FP32 widenings, which grow with the rows, are in the bound too).
  const int64_t slack =
      c.moe() ? budget.peak_bytes[static_cast<int>(MemoryCategory::Workspace)] / 5 : 0;
  const auto expect_within = [slack](int64_t measured, int64_t budgeted, std::string_view what) {
    EXPECT_GE(budgeted, measured) << what;
    EXPECT_LE(budgeted, measured + slack) << what;
  };
  for (int i = 0; i < kMemoryCategoryCount; ++i) {
    const auto category = static_cast<MemoryCategory>(i);
    expect_within(after.peak_bytes[i] - before.live_bytes[i], budget.peak_bytes[i],
                  memory_category_name(category));
    if (category != MemoryCategory::Workspace) {
      EXPECT_EQ(after.peak_bytes[i] - before.live_bytes[i], budget.peak_bytes[i])
          << memory_category_name(category);
    }
  }
  expect_within(after.peak_total_bytes - before.live_total_bytes, budget.step_peak_bytes,
                "step peak");
  // From the third step on every block a step takes comes back from the block cache.
  EXPECT_EQ(fourth.fresh_blocks, after.fresh_blocks) << "blocks made afresh";
  expect_within(fourth.held_peak_bytes - before.live_total_bytes,
                budget.step_peak_bytes + budget.cache_headroom_bytes, "held");
}

// A fine-tune (finetune_step on packed rows of examples, LoRA with and without dropout, a
// validation pass after each step) against memory_budget's packed measurement: every category's
// peak to the byte. The LM head runs on the positions with a target alone, and the budget
// measures the batch with the most: every micro-batch is the rows with the most targets, and the
// validation set is their examples.
TEST(BudgetVsMeasuredFineTune, PackedLoraStepsMatchToTheByte) {
  ModelConfig c = find_preset("tiny")->config;
  c.n_kv_heads = 2;
  c.qkv_bias = true;
  for (const DType dtype : {DType::F32, DType::BF16}) {
    const int64_t batch = 2, accum = 3, ctx = 64;
    std::vector<FinetuneExample> examples, val;
    std::mt19937 rng(5);
    for (int i = 0; i < 32; ++i) {
      FinetuneExample e;
      const int n = 2 + static_cast<int>(rng() % 50);
      for (int j = 0; j < n; ++j) {
        e.tokens.push_back(static_cast<int32_t>(rng() % c.vocab));
        e.target.push_back(j > 0 && j % 3 != 0);
      }
      examples.push_back(e);
    }
    std::vector<PackedRow> rows = pack_examples(examples, ctx);
    ASSERT_GE(static_cast<int64_t>(rows.size()), batch * accum);
    const auto targets_of = [&examples](const PackedRow& r) {
      const PackedRow* one = &r;
      return count_targets(std::span<const PackedRow* const>(&one, 1), examples);
    };
    std::stable_sort(rows.begin(), rows.end(), [&](const PackedRow& a, const PackedRow& b) {
      return targets_of(a) > targets_of(b);
    });
    for (int64_t r = 0; r < batch; ++r)
      for (const int32_t i : rows[static_cast<size_t>(r)].examples)
        val.push_back(examples[static_cast<size_t>(i)]);
    const std::vector<PackedRow> val_rows = pack_examples(val, ctx);
    ASSERT_LE(static_cast<int64_t>(val_rows.size()), batch);
    LoraConfig lora;
    lora.rank = 4;
    lora.alpha = 8;
    lora.targets.fill(true);
    lora.dropout = dtype == DType::BF16 ? 0.1 : 0.0;  // its masked inputs are workspace
    BudgetOptions bo;
    bo.dtype = dtype;
    bo.batch = batch;
    bo.ctx = ctx;
    bo.accum = accum;
    bo.threads = omp_get_max_threads();
    bo.lora = lora;
    bo.packed = true;
    bo.eval_windows = static_cast<int64_t>(val_rows.size());
    bo.packed_targets = most_targets(rows, examples, batch);
    ASSERT_EQ(bo.packed_targets, most_targets(val_rows, val, batch));
    ASSERT_LT(bo.packed_targets, batch * ctx);
    const MemoryBudget budget = memory_budget(c, bo);

    kernels::gemm_release_buffers();
    memory_release_cached();
    memory_reset_peaks();
    const MemoryStats before = memory_stats();
    MemoryStats after;
    {
      ModelOptions mo;
      mo.compute_dtype = dtype;
      mo.lora = lora;
      DecoderModel model(c, mo);
      model.init_weights(1);
      TrainOptions options;
      options.batch = batch;
      options.accum = accum;
      options.ctx = ctx;
      options.lr.total_steps = 4;
      Trainer trainer(
          model.parameters(),
          [&model](const Tensor& in, const Tensor& tgt) { return model.loss(in, tgt); }, options);
      const Tensor inputs = Tensor::empty(Shape{batch, ctx}, DType::I32, MemoryCategory::Workspace);
      const Tensor targets =
          Tensor::empty(Shape{batch, ctx}, DType::I32, MemoryCategory::Workspace);
      const auto step = [&](int64_t n) {
        std::vector<const PackedRow*> step_rows;
        for (int64_t i = 0; i < batch * accum; ++i)
          step_rows.push_back(&rows[static_cast<size_t>(i % batch)]);
        finetune_step(trainer, model, n, step_rows, examples, 0, inputs, targets);
        packed_validation_loss(model, val, ctx, batch, 0);
      };
      step(1);
      memory_reset_peaks();
      step(2);
      after = memory_stats();
    }
    for (int i = 0; i < kMemoryCategoryCount; ++i)
      EXPECT_EQ(after.peak_bytes[i] - before.live_bytes[i], budget.peak_bytes[i])
          << dtype_name(dtype) << " " << memory_category_name(static_cast<MemoryCategory>(i));
    EXPECT_EQ(after.peak_total_bytes - before.live_total_bytes, budget.step_peak_bytes)
        << dtype_name(dtype);
  }
}

ModelConfig preset(const char* name) {
  return find_preset(name)->config;
}

// The tiny preset's width with another attention: GQA with a head dim of 24 (q_dim 96), tied
// embeddings, q/k/v biases, half-split RoPE.
ModelConfig shaped() {
  ModelConfig c = preset("tiny");
  c.n_kv_heads = 2;
  c.head_dim = 24;
  c.tie_embeddings = true;
  c.qkv_bias = true;
  c.rope_pairs = RopePairs::HalfSplit;
  c.rope_theta = 1e6;
  return c;
}

bool attention_projection(const std::string& name) {
  return name.find("attention.w") != std::string::npos;
}

std::vector<Case> cases() {
  std::vector<Case> all;
  constexpr Checkpointing kNone = Checkpointing::None, kLayer = Checkpointing::Layer,
                          kMlp = Checkpointing::Mlp;
  for (const char* name : {"tiny", "mini"})
    for (const DType dtype : {DType::F32, DType::BF16})
      for (const Checkpointing checkpoint : {kNone, kMlp, kLayer})
        all.push_back({std::string(name) + "_" + std::string(dtype_name(dtype)) +
                           (checkpoint == kLayer ? "_checkpoint"
                            : checkpoint == kMlp ? "_mlp"
                                                 : "_full"),
                       preset(name), dtype, checkpoint, nullptr});
  for (const DType dtype : {DType::F32, DType::BF16}) {
    const std::string d(dtype_name(dtype));
    all.push_back({"shaped_" + d, shaped(), dtype, kNone, nullptr});
    all.push_back({"shaped_" + d + "_checkpoint", shaped(), dtype, kLayer, nullptr});
    all.push_back({"shaped_" + d + "_frozen", shaped(), dtype, kNone, attention_projection});
    all.push_back({"mini_" + d + "_frozen", preset("mini"), dtype, kLayer, attention_projection});
    // LoRA, rank 8 on all seven projections (the base frozen) and rank 4 on some.
    LoraConfig lora;
    lora.rank = 8;
    lora.alpha = 16;
    lora.targets.fill(true);
    all.push_back({"shaped_" + d + "_lora", shaped(), dtype, kNone, nullptr, lora});
    all.push_back({"shaped_" + d + "_lora_mlp", shaped(), dtype, kMlp, nullptr, lora});
    lora.rank = 4;
    lora.targets = parse_lora_targets("q,v,down", "--lora-targets");
    all.push_back({"mini_" + d + "_lora_checkpoint", preset("mini"), dtype, kLayer, nullptr, lora});
    for (const char* arch : {"phi2", "gemma3", "qwen35", "qwen3moe", "qwen35moe", "gemma4"}) {
      all.push_back({std::string(arch) + "_" + d, test::tiny_as(arch), dtype, kNone, nullptr});
      all.push_back(
          {std::string(arch) + "_" + d + "_mlp", test::tiny_as(arch), dtype, kMlp, nullptr});
      lora.rank = 4;
      lora.targets.fill(true);
      all.push_back({std::string(arch) + "_" + d + "_lora_checkpoint", test::tiny_as(arch), dtype,
                     kLayer, nullptr, lora});
    }
    // A vocabulary whose LM head takes its rows in two chunks (in bf16 mode, W^T packed once
    // for both, beside them), trained and frozen under LoRA.
    ModelConfig wide = preset("tiny");
    wide.vocab = 40000;
    wide.ctx = 160;
    all.push_back({"wide_vocab_" + d, wide, dtype, kNone, nullptr, {}, wide.ctx});
    all.push_back({"wide_vocab_" + d + "_lora", wide, dtype, kNone, nullptr, lora, wide.ctx});
    // Gemma 4's experts beside the dense MLP, the global layers taking k as v.
    all.push_back({"gemma4_experts_" + d, test::tiny_gemma4_experts(), dtype, kNone, nullptr});
    all.push_back({"gemma4_experts_" + d + "_lora_mlp", test::tiny_gemma4_experts(), dtype, kMlp,
                   nullptr, lora});
  }
  return all;
}

INSTANTIATE_TEST_SUITE_P(Configurations, BudgetVsMeasured, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace cputrain

namespace cputrain {
namespace {

// GRPO's generation: the caches of its G sequences and their logits are counted in the budget,
// as many bytes as they hold allocated.
TEST(BudgetGrpo, GenerationCachesAreCounted) {
  ModelConfig c = find_preset("tiny")->config;
  c.ctx = 64;
  BudgetOptions bo;
  bo.batch = 2;
  bo.ctx = c.ctx;
  bo.threads = omp_get_max_threads();
  bo.packed = true;
  bo.lora.rank = 4;
  bo.lora.alpha = 8;
  bo.lora.targets.fill(true);
  const MemoryBudget without = memory_budget(c, bo);
  bo.generations = 8;
  const MemoryBudget with = memory_budget(c, bo);
  ModelOptions mo;
  mo.lora = bo.lora;
  DecoderModel model(c, mo);
  const MemoryStats before = memory_stats();
  int64_t held = 0;
  {
    const DecoderModel::KvCache cache = model.new_kv_cache(8);
    const Tensor logits = Tensor::empty(Shape{8, c.vocab}, DType::F32, MemoryCategory::Workspace);
    held = memory_stats().live_total_bytes - before.live_total_bytes;
  }
  ASSERT_GT(held, 8 * c.ctx * c.n_layers * 2 * 4);
  EXPECT_EQ(with.total_bytes() - without.total_bytes(), held);
}

}  // namespace
}  // namespace cputrain
