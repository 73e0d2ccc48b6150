// Data parallelism, run by mpirun as ranks of one job (CMakeLists.txt: DataParallel.TwoRanks):
// N ranks at batch B against one process at batch B N over the same sequences, and the ranks
// against each other and against a second run.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "engine/communicator.h"
#include "engine/trainer.h"
#include "models/llama.h"
#include "models/llama_config.h"

namespace cputrain {
namespace {

struct Trained {
  std::vector<double> losses;
  std::vector<float> weights;
};

// 10 steps of the tiny preset (fp32, 2 micro-batches a step of `batch` rows each) on a
// patterned stream, as a rank of `comm`.
Trained train(const Communicator& comm, int64_t batch) {
  LlamaConfig config = find_preset("tiny")->config;
  config.ctx = 32;
  LlamaModel model(config);
  model.init_weights(7);
  std::vector<int32_t> tokens(4096);
  for (size_t i = 0; i < tokens.size(); ++i)
    tokens[i] = static_cast<int32_t>((i * 7 + i / 13) % static_cast<size_t>(config.vocab));
  TrainOptions options;
  options.batch = batch;
  options.accum = 2;
  options.ctx = config.ctx;
  options.seed = 3;
  options.lr.peak = 3e-3;
  options.lr.warmup_steps = 2;
  options.lr.total_steps = 10;
  options.comm = &comm;
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
