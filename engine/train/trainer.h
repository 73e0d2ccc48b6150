// One training step and one evaluation, independent of the model: the model is a ParameterSet
// and a function from (inputs, targets) to a scalar loss Variable.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "engine/dist/communicator.h"
#include "engine/dist/gradient_reducer.h"
#include "engine/train/adamw.h"
#include "engine/train/lr_schedule.h"
#include "engine/train/parameters.h"

namespace cputrain {

struct TrainOptions {
  int64_t batch = 8;  // sequences per micro-batch
  int64_t accum = 1;  // micro-batches per optimizer step
  int64_t ctx = 256;  // tokens per sequence
  uint64_t seed = 1;
  LrSchedule lr;
  AdamWConfig adamw;
  // Data parallelism: this process is one rank of `comm` (engine/dist/communicator.h). `batch` is
  // each rank's rows a micro-batch; the step's gradients and loss are summed over the ranks
  // before the update, which every rank applies alike. Null: this process alone.
  const Communicator* comm = nullptr;
  // Elements of the gradients summed over the ranks by one collective call (a bucket,
  // engine/dist/gradient_reducer.h): 4 Mi (16 MiB) by default.
  int64_t reduce_bucket = int64_t{1} << 22;
  // Over several ranks: AdamW's state sharded (ZeRO-1; engine/train/adamw.h), else every rank holds
  // and updates the whole of it.
  bool shard_optimizer = true;
  // A mixture of experts' router losses (engine/core/moe_ops.h): the load-balancing loss's
  // coefficient (Switch Transformer; Qwen's router_aux_loss_coef) and the z-loss's (ST-MoE), each
  // loss the mean of the MoE layers'. 0: none.
  float moe_balance = 0.0f;
  float moe_z = 0.0f;
};

struct StepResult {
  double loss = 0.0;  // mean over the step's batch * accum sequences
  double lr = 0.0;
  double grad_norm = 0.0;  // before clipping
  double ms = 0.0;
  double tokens_per_s = 0.0;
  double comm_ms = 0.0;      // of ms, spent waiting for the gradients' sum over the ranks
  double reducing_ms = 0.0;  // the sum's own time, most of it behind the backward pass
  double gather_ms = 0.0;    // of ms, gathering the ranks' updated weights (AdamW sharded)
  bool skipped = false;      // the step filter refused the update: the weights are as before
  // A mixture of experts': each MoE layer's busiest expert's tokens over the mean of its experts
  // (1: an even load; E: every token to one expert), over the step's micro-batches on this rank.
  std::vector<double> expert_spread;
  // Its router losses, each the mean over the MoE layers and micro-batches (unweighted: the
  // coefficients scale their gradients, which `loss` leaves out), where its routers have them
  // (router_losses; gpt-oss's has none).
  bool router_losses = false;
  double moe_balance = 0.0;
  double moe_z = 0.0;
};

// Mean loss of loss_fn over the first `windows` consecutive evaluation windows of `tokens`
// (fewer if the stream is shorter), in batches of `batch`, without recording gradients.
// `progress`, when set, is called after each batch with the windows done and their total.
// Over the ranks of `comm`, rank r evaluates batches r, r + N, ...; every rank gets the mean,
// the same value as one process.
double evaluate_loss(const std::function<Variable(const Tensor&, const Tensor&)>& loss_fn,
                     std::span<const int32_t> tokens, int64_t ctx, int64_t batch, int64_t windows,
                     const std::function<void(int64_t, int64_t)>& progress = nullptr,
                     const Communicator* comm = nullptr);

class Trainer {
 public:
  using LossFn = std::function<Variable(const Tensor& inputs, const Tensor& targets)>;

  Trainer(const ParameterSet& params, LossFn loss_fn, const TrainOptions& options);

  // Step `step` (1-based): accum micro-batches of windows sampled from `tokens` by
  // (seed, step, row), gradients summed with each micro-batch's loss scaled by 1 / accum, one
  // AdamW update at the scheduled rate. Over N ranks, micro-batch m of rank r takes the rows
  // m B N + r B .. + B - 1: the N ranks see the sequences one process sees at batch B N, and
  // each loss is scaled by 1 / (accum N).
  StepResult step(std::span<const int32_t> tokens, int64_t step);
  // Step `step` over batches a caller makes (a fine-tune's packed rows): `micro_loss(micro)` for
  // micro 0 .. accum - 1 gives each micro-batch's loss, whose gradient is summed divided by
  // `divisor`; the step's loss is their sum over `divisor`. `positions` is what tokens_per_s
  // counts. Over several ranks, `divisor` and `positions` are the whole job's, and the losses
  // and gradients are summed over the ranks.
  StepResult step_with(int64_t step, const std::function<Variable(int64_t micro)>& micro_loss,
                       int64_t divisor, int64_t positions);

  // Called once the step's loss and gradient norm are known and before the update; returning
  // false skips the update (a non-finite loss, a spike). No filter: every update is applied.
  void set_step_filter(std::function<bool(const StepResult&)> filter) {
    filter_ = std::move(filter);
  }

  // Mean loss over the first `windows` consecutive evaluation windows of `tokens` (fewer if
  // the split is shorter), without recording gradients; shared among the ranks, which all call
  // it.
  double evaluate(std::span<const int32_t> tokens, int64_t windows) const;

  const AdamW& optimizer() const { return optimizer_; }
  AdamW& optimizer() { return optimizer_; }
  const TrainOptions& options() const { return options_; }

 private:
  const ParameterSet& params_;
  LossFn loss_fn_;
  TrainOptions options_;
  AdamW optimizer_;
  std::function<bool(const StepResult&)> filter_;
  std::unique_ptr<GradientReducer> reducer_;  // over several ranks
  Tensor inputs_;                             // (batch, ctx) i32
  Tensor targets_;                            // (batch, ctx) i32
};

}  // namespace cputrain
