// Data parallelism, run by mpirun as ranks of one job (CMakeLists.txt: DataParallel.TwoRanks):
// N ranks at batch B against one process at batch B N over the same sequences, and the ranks
// against each other and against a second run.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "engine/core/memory.h"
#include "engine/dist/communicator.h"
#include "engine/dist/gradient_reducer.h"
#include "engine/train/adamw.h"
#include "engine/train/trainer.h"
#include "models/architecture.h"
#include "models/decoder.h"
#include "models/model_config.h"

namespace cputrain {
namespace {

struct Trained {
  std::vector<double> losses;
  std::vector<float> weights;
};

// A stream of 4096 tokens in a pattern the model can learn.
std::vector<int32_t> patterned_tokens(int64_t vocab) {
  std::vector<int32_t> tokens(4096);
  for (size_t i = 0; i < tokens.size(); ++i)
    tokens[i] = static_cast<int32_t>((i * 7 + i / 13) % static_cast<size_t>(vocab));
  return tokens;
}

// 10 steps of the tiny preset (fp32, `accum` micro-batches a step of `batch` rows each) on a
// patterned stream, as a rank of `comm`, its gradients summed in buckets of `bucket` elements;
// of architecture `arch` (tiny's own where empty), with router losses of `moe_balance` and
// `moe_z` for a mixture.
Trained train(const Communicator& comm, int64_t batch, int64_t bucket = int64_t{1} << 22,
              bool shard = true, const std::string& arch = "", float moe_balance = 0.0f,
              float moe_z = 0.0f, int64_t accum = 2) {
  ModelConfig config = find_preset("tiny")->config;
  if (!arch.empty()) config = with_architecture(config, *find_architecture(arch));
  config.ctx = 32;
  DecoderModel model(config);
  model.init_weights(7);
  const std::vector<int32_t> tokens = patterned_tokens(config.vocab);
  TrainOptions options;
  options.batch = batch;
  options.accum = accum;
  options.ctx = config.ctx;
  options.seed = 3;
  options.lr.peak = 3e-3;
  options.lr.warmup_steps = 2;
  options.lr.total_steps = 10;
  options.comm = &comm;
  options.reduce_bucket = bucket;
  options.shard_optimizer = shard;
  options.moe_balance = moe_balance;
  options.moe_z = moe_z;
  Trainer trainer(
      model.parameters(), [&model](const Tensor& x, const Tensor& y) { return model.loss(x, y); },
      options);
  Trained run;
  for (int64_t step = 1; step <= 10; ++step) run.losses.push_back(trainer.step(tokens, step).loss);
  const Tensor& w = model.parameters().weights();
  run.weights.assign(w.f32(), w.f32() + w.numel());
  return run;
}

const Communicator& world() {
  return Communicator::world();
}

TEST(DataParallel, RanksAtBatchBAreOneProcessAtBatchBN) {
  const int n = world().size();
  ASSERT_GE(n, 2) << "run under mpirun -np 2 or more";
  const Trained ranks = train(world(), 2);
  const Trained alone = train(Communicator::solo(), 2 * n);
  for (size_t s = 0; s < alone.losses.size(); ++s)
    EXPECT_NEAR(ranks.losses[s], alone.losses[s], 1e-6 * std::abs(alone.losses[s]))
        << "step " << s + 1;
  // The losses fall: the steps learn.
  EXPECT_LT(alone.losses.back(), alone.losses.front() - 0.1);
  double max_diff = 0.0;
  for (size_t i = 0; i < alone.weights.size(); ++i)
    max_diff =
        std::max(max_diff, std::abs(static_cast<double>(ranks.weights[i] - alone.weights[i])));
  // The sums differ in their last bits (B rows a GEMM, not B N), which AdamW's normalised steps
  // carry into the weights: within 1e-4 after 10 steps of up to 3e-3 each.
  EXPECT_LT(max_diff, 1e-4);
}

// A mixture of experts (qwen3moe: 8 experts, 2 a token) over the ranks: its router and experts'
// gradients summed as any others', N ranks at batch B are one process at batch B N. With router
// losses, each micro-batch computes them over its own rows (the load's fractions are its rows'),
// so N ranks of 2 micro-batches are one process of 2 N micro-batches of batch B, the micro-batch
// of rank r being that process's (micro N + r)th: the losses' share of each is theirs.
TEST(DataParallel, AMixtureOfExpertsOverRanksIsOneProcess) {
  const int n = world().size();
  ASSERT_GE(n, 2) << "run under mpirun -np 2 or more";
  const int64_t bucket = int64_t{1} << 22;
  const auto max_difference = [](const Trained& a, const Trained& b) {
    double d = 0.0;
    for (size_t i = 0; i < a.weights.size(); ++i)
      d = std::max(d, std::abs(static_cast<double>(a.weights[i] - b.weights[i])));
    return d;
  };
  const Trained ranks = train(world(), 2, bucket, true, "qwen3moe");
  const Trained alone = train(Communicator::solo(), 2 * n, bucket, true, "qwen3moe");
  for (size_t s = 0; s < alone.losses.size(); ++s)
    EXPECT_NEAR(ranks.losses[s], alone.losses[s], 1e-6 * std::abs(alone.losses[s]))
        << "step " << s + 1;
  EXPECT_LT(alone.losses.back(), alone.losses.front() - 0.1);
  EXPECT_LT(max_difference(ranks, alone), 1e-4);
  const Trained routed = train(world(), 2, bucket, true, "qwen3moe", 0.05f, 0.01f);
  const Trained routed_alone =
      train(Communicator::solo(), 2, bucket, true, "qwen3moe", 0.05f, 0.01f, 2 * n);
  for (size_t s = 0; s < routed.losses.size(); ++s)
    EXPECT_NEAR(routed.losses[s], routed_alone.losses[s], 1e-6 * std::abs(routed_alone.losses[s]))
        << "step " << s + 1;
  EXPECT_LT(max_difference(routed, routed_alone), 1e-4);
  // The router losses change the run: their gradients reach every weight below the routers.
  EXPECT_GT(max_difference(routed, ranks), 1e-3);
}

TEST(DataParallel, RanksHoldTheSameWeightsAndRunsRepeat) {
  const Trained first = train(world(), 2);
  const Trained second = train(world(), 2);
  EXPECT_EQ(first.losses, second.losses);
  EXPECT_EQ(std::memcmp(first.weights.data(), second.weights.data(), first.weights.size() * 4), 0);
  // Rank 0's weights and losses, sent to every rank, equal each rank's own, bit for bit.
  std::vector<float> weights = first.weights;
  std::vector<double> losses = first.losses;
  world().broadcast(weights.data(), static_cast<int64_t>(weights.size() * sizeof(float)), 0);
  world().broadcast(losses.data(), static_cast<int64_t>(losses.size() * sizeof(double)), 0);
  EXPECT_EQ(losses, first.losses) << "rank " << world().rank();
  EXPECT_EQ(std::memcmp(weights.data(), first.weights.data(), weights.size() * 4), 0)
      << "rank " << world().rank();
}

// Buckets of 1000 elements, most of them summed while the backward pass goes on below them,
// give the step one sum of the whole buffer gives: the same losses and weights, bit for bit
// (two ranks: each element is a + b however the buffer is cut).
TEST(DataParallel, BucketsSummedDuringTheBackwardPassAreOneSum) {
  if (world().size() != 2) GTEST_SKIP() << "bitwise for two ranks";
  const Trained whole = train(world(), 2);
  const Trained buckets = train(world(), 2, 1000);
  EXPECT_EQ(whole.losses, buckets.losses);
  EXPECT_EQ(std::memcmp(whole.weights.data(), buckets.weights.data(), whole.weights.size() * 4), 0);
}

// The reducer starts a bucket once the gradients are final from its start, in order from the
// buffer's end, and finish() sums the rest: every element is the sum over the ranks.
TEST(DataParallel, GradientReducerStartsBucketsAsTheyBecomeFinal) {
  const int n = world().size(), r = world().rank();
  std::vector<float> g(10'500);
  for (size_t i = 0; i < g.size(); ++i) g[i] = static_cast<float>(i % 97) + static_cast<float>(r);
  GradientReducer reducer(world(), g.data(), static_cast<int64_t>(g.size()), 1000);
  EXPECT_EQ(reducer.buckets(), 11);
  reducer.begin();
  reducer.final_from(10'500);
  EXPECT_EQ(reducer.started(), 0);
  reducer.final_from(7'501);  // buckets [9500, 10500) and [8500, 9500) are final; [7500, 8500) not
  EXPECT_EQ(reducer.started(), world().serialized_threads() ? 2 : 0);
  reducer.final_from(500);
  EXPECT_EQ(reducer.started(), world().serialized_threads() ? 10 : 0);
  EXPECT_GE(reducer.finish(), 0.0);
  EXPECT_EQ(reducer.started(), 11);
  for (size_t i = 0; i < g.size(); ++i)
    ASSERT_EQ(g[i], static_cast<float>(n) * static_cast<float>(i % 97) +
                        static_cast<float>(n * (n - 1) / 2))
        << i;
  EXPECT_GE(reducer.reducing_ms(), 0.0);
}

// Sharded, a bucket's sum reaches the ranks whose shards it covers: each rank ends with the sum
// over the ranks in its shard and its own values elsewhere.
TEST(DataParallel, ShardedReducerSumsEachShardIntoItsRank) {
  const int n = world().size(), r = world().rank();
  std::vector<float> g(10'512);
  for (size_t i = 0; i < g.size(); ++i) g[i] = static_cast<float>(i % 89) + static_cast<float>(r);
  const std::vector<int64_t> shards = shard_bounds(static_cast<int64_t>(g.size()), n);
  GradientReducer reducer(world(), g.data(), static_cast<int64_t>(g.size()), 1000, shards);
  reducer.begin();
  reducer.final_from(3000);
  reducer.finish();
  for (size_t i = 0; i < g.size(); ++i) {
    const bool mine = static_cast<int64_t>(i) >= shards[static_cast<size_t>(r)] &&
                      static_cast<int64_t>(i) < shards[static_cast<size_t>(r) + 1];
    ASSERT_EQ(g[i], mine ? static_cast<float>(n) * static_cast<float>(i % 89) +
                               static_cast<float>(n * (n - 1) / 2)
                         : static_cast<float>(i % 89) + static_cast<float>(r))
        << i;
  }
}

// ZeRO-1: each rank's AdamW holds m and v of its shard alone: the allocator counts half the
// optimizer state of one process on each of two ranks (to 16 elements), the ranks' shards
// adding up to the whole; without sharding each rank holds the whole.
TEST(DataParallel, ShardedOptimizerStateIsOneNthOnEachRank) {
  const int n = world().size();
  ModelConfig config = find_preset("tiny")->config;
  config.ctx = 32;
  DecoderModel model(config);
  const auto optimizer_bytes = [&](const Communicator& comm, bool shard) {
    const int64_t before =
        memory_stats().live_bytes[static_cast<size_t>(MemoryCategory::OptimizerState)];
    TrainOptions options;
    options.ctx = config.ctx;
    options.comm = &comm;
    options.shard_optimizer = shard;
    Trainer trainer(
        model.parameters(), [&model](const Tensor& x, const Tensor& y) { return model.loss(x, y); },
        options);
    return memory_stats().live_bytes[static_cast<size_t>(MemoryCategory::OptimizerState)] - before;
  };
  const int64_t one = optimizer_bytes(Communicator::solo(), true);
  const int64_t mine = optimizer_bytes(world(), true);
  EXPECT_EQ(one, 2 * 4 * model.parameters().trainable_numel());
  EXPECT_NEAR(static_cast<double>(mine), static_cast<double>(one) / n, 2 * 4 * 16);
  double all = static_cast<double>(mine);
  world().all_reduce_sum(&all, 1);
  EXPECT_EQ(all, static_cast<double>(one));
  EXPECT_EQ(optimizer_bytes(world(), false), one);
}

// Sharded and not, the ranks make the same steps: the losses within 1e-6 (the gradient norm is
// summed in another order), and the weights of every rank alike, bit for bit.
TEST(DataParallel, ShardedStepsAreTheUnshardedOnes) {
  const Trained sharded = train(world(), 2);
  const Trained whole = train(world(), 2, int64_t{1} << 22, false);
  for (size_t s = 0; s < whole.losses.size(); ++s)
    EXPECT_NEAR(sharded.losses[s], whole.losses[s], 1e-6 * std::abs(whole.losses[s]))
        << "step " << s + 1;
  std::vector<float> weights = sharded.weights;
  world().broadcast(weights.data(), static_cast<int64_t>(weights.size() * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(weights.data(), sharded.weights.data(), weights.size() * 4), 0)
      << "rank " << world().rank();
}

// ZeRO-1's masters: in bf16 each rank holds the FP32 masters of its shard of the GEMM weights
// alone (the allocator counts them so), and the steps are the ones with every master whole, bit
// for bit: the same losses, the same bf16 copies, and the masters read back whole on rank 0.
TEST(DataParallel, ShardedMastersMakeTheSameSteps) {
  const int n = world().size();
  ModelConfig config = find_preset("tiny")->config;
  config.ctx = 32;
  const std::vector<int32_t> tokens = patterned_tokens(config.vocab);
  struct Run {
    std::vector<double> losses;
    std::vector<uint16_t> copies;
    std::vector<float> masters;  // rank 0: every trainable parameter's, read back whole
    int64_t weights_bytes = 0;
  };
  const auto run = [&](bool shard) {
    const int64_t before = memory_stats().live_bytes[static_cast<size_t>(MemoryCategory::Weights)];
    ModelOptions o;
    o.compute_dtype = DType::BF16;
    if (shard) o.shard = &world();
    DecoderModel model(config, o);
    Run out;
    out.weights_bytes =
        memory_stats().live_bytes[static_cast<size_t>(MemoryCategory::Weights)] - before;
    model.init_weights(7);
    TrainOptions options;
    options.batch = 2;
    options.accum = 2;
    options.ctx = config.ctx;
    options.lr.peak = 3e-3;
    options.lr.total_steps = 6;
    options.comm = &world();
    Trainer trainer(
        model.parameters(), [&model](const Tensor& x, const Tensor& y) { return model.loss(x, y); },
        options);
    for (int64_t step = 1; step <= 6; ++step) out.losses.push_back(trainer.step(tokens, step).loss);
    const ParameterSet& p = model.parameters();
    out.copies.assign(p.bf16_weights().bf16(), p.bf16_weights().bf16() + p.bf16_weights().numel());
    for (size_t i = 0; i < p.infos().size(); ++i) {
      std::vector<float> values(static_cast<size_t>(p.infos()[i].shape.numel()));
      p.read_values(static_cast<int>(i), values.data());
      out.masters.insert(out.masters.end(), values.begin(), values.end());
    }
    return out;
  };
  const Run whole = run(false), sharded = run(true);
  EXPECT_EQ(whole.losses, sharded.losses);
  EXPECT_EQ(whole.copies, sharded.copies);
  if (world().rank() == 0) {
    EXPECT_EQ(whole.masters, sharded.masters);
  }
  // The masters left whole are the embedding's (its rows are looked up in FP32) and the norms';
  // of the others each element is held by one rank alone: the ranks' parts add up to them (to
  // the padding of each part), and no rank holds them all.
  DecoderModel probe(config);
  int64_t sharded_bytes = 0;
  for (const ParameterInfo& info : probe.parameters().infos())
    if (info.bf16_copy && !info.master_read)
      sharded_bytes += (info.shape.numel() + 15) / 16 * 16 * 4;
  const int64_t mine = sharded.weights_bytes - (whole.weights_bytes - sharded_bytes);
  EXPECT_GT(mine, 0);
  EXPECT_LT(mine, sharded_bytes);
  double all = static_cast<double>(mine);
  world().all_reduce_sum(&all, 1);
  EXPECT_NEAR(all, static_cast<double>(sharded_bytes), 64.0 * n)
      << "whole " << whole.weights_bytes << ", sharded " << sharded.weights_bytes;
}

TEST(DataParallel, AllReduceSumsOverRanks) {
  const int n = world().size(), r = world().rank();
  std::vector<float> f(1000);
  for (size_t i = 0; i < f.size(); ++i) f[i] = static_cast<float>(i) + 0.5f * static_cast<float>(r);
  world().all_reduce_sum(f.data(), static_cast<int64_t>(f.size()));
  for (size_t i = 0; i < f.size(); ++i)
    EXPECT_EQ(f[i], static_cast<float>(n * i) + 0.25f * static_cast<float>(n * (n - 1))) << i;
  double d = r + 1.0;
  world().all_reduce_sum(&d, 1);
  EXPECT_EQ(d, n * (n + 1) / 2.0);
}

}  // namespace
}  // namespace cputrain

int main(int argc, char** argv) {
  cputrain::Communicator::world();  // MPI first: every rank runs the same tests in step
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
