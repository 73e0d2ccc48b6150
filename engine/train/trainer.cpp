#include "engine/train/trainer.h"

#include <algorithm>
#include <chrono>
#include <vector>

#include "engine/core/moe_ops.h"
#include "engine/core/profiler.h"
#include "engine/data/batch_sampler.h"

namespace cputrain {

Trainer::Trainer(const ParameterSet& params, LossFn loss_fn, const TrainOptions& options)
    : params_(params),
      loss_fn_(std::move(loss_fn)),
      options_(options),
      optimizer_(params, options.adamw, options.shard_optimizer ? options.comm : nullptr),
      inputs_(
          Tensor::empty(Shape{options.batch, options.ctx}, DType::I32, MemoryCategory::Workspace)),
      targets_(
          Tensor::empty(Shape{options.batch, options.ctx}, DType::I32, MemoryCategory::Workspace)) {
  if (options.comm && options.comm->size() > 1 && params.gradients().defined())
    reducer_ = std::make_unique<GradientReducer>(
        *options.comm, params.gradients().measured() ? nullptr : params.gradients().f32(),
        params.gradients().numel(), options.reduce_bucket, optimizer_.shards());
}

StepResult Trainer::step(std::span<const int32_t> tokens, int64_t step) {
  const int64_t B = options_.batch;
  const int64_t ranks = options_.comm ? options_.comm->size() : 1;
  const int64_t rank = options_.comm ? options_.comm->rank() : 0;
  return step_with(
      step,
      [&](int64_t micro) {
        if (!measuring()) {
          profiler::Scope scope("sample batch", profiler::Pass::Step);
          sample_windows(tokens, options_.ctx, options_.seed, static_cast<uint64_t>(step),
                         (micro * ranks + rank) * B, B, inputs_.i32(), targets_.i32());
        }
        return loss_fn_(inputs_, targets_);
      },
      options_.accum * ranks, B * options_.accum * options_.ctx * ranks);
}

StepResult Trainer::step_with(int64_t step, const std::function<Variable(int64_t)>& micro_loss,
                              int64_t divisor, int64_t positions) {
  const auto start = std::chrono::steady_clock::now();
  double loss_sum = 0.0;
  {
    profiler::Scope scope("zero gradients", profiler::Pass::Step);
    params_.zero_grad();
  }
  // Over several ranks the last micro-batch's backward pass sums the gradients as it makes them
  // final, bucket by bucket; the micro-batches before it only accumulate.
  const bool reduce = reducer_ && !measuring();
  // Measuring, two micro-batches stand for all: the first follows the optimizer's update, and
  // every later one follows a micro-batch and allocates what the one before it freed, so a
  // budget at any --accum takes two micro-batches' time. (One alone can leave the block cache
  // holding other blocks than a step of several does.)
  const int64_t micro_batches = measuring() ? std::min<int64_t>(options_.accum, 2) : options_.accum;
  const int64_t ranks = options_.comm ? options_.comm->size() : 1;
  moe_load_take();  // counts of forward passes outside a step are not this step's
  for (int64_t micro = 0; micro < micro_batches; ++micro) {
    // The router losses' share of this micro-batch: their coefficients over the step's
    // micro-batches on every rank, as the loss's mean is.
    const float share = 1.0f / static_cast<float>(options_.accum * ranks);
    const MoeRouterLossScope router_losses(options_.moe_balance * share, options_.moe_z * share);
    Variable loss;
    {
      const MoeLoadCount count;  // the forward pass's routing; not a recomputation's
      loss = micro_loss(micro);
    }
    if (!measuring()) loss_sum += loss.value().f32()[0];
    const bool last = micro == micro_batches - 1;
    if (reduce && last) {
      reducer_->begin();
      params_.set_gradient_watcher([this](int64_t offset) { reducer_->final_from(offset); });
    }
    struct Unwatch {
      const ParameterSet& params;
      ~Unwatch() { params.set_gradient_watcher(nullptr); }
    } unwatch{params_};
    backward(loss, 1.0f / static_cast<float>(divisor));
  }
  double comm_ms = 0.0, reducing_ms = 0.0;
  if (options_.comm && options_.comm->size() > 1 && !measuring()) {
    profiler::Scope scope("gradients' sum, unhidden", profiler::Pass::Step);
    if (reducer_) {
      comm_ms = reducer_->finish();
      reducing_ms = reducer_->reducing_ms();
    }
    options_.comm->all_reduce_sum(&loss_sum, 1);
  }
  StepResult r;
  r.lr = learning_rate(options_.lr, step);
  const std::vector<MoeLoad> loads = moe_load_take();
  for (const MoeLoad& load : loads) {
    int64_t most = 0, sum = 0;
    for (const int64_t n : load.tokens) {
      most = std::max(most, n);
      sum += n;
    }
    r.expert_spread.push_back(sum > 0 ? static_cast<double>(most) *
                                            static_cast<double>(load.tokens.size()) /
                                            static_cast<double>(sum)
                                      : 0.0);
    const auto passes = static_cast<double>(std::max<int64_t>(load.passes, 1));
    r.router_losses = r.router_losses || load.losses;
    r.moe_balance += load.balance / passes / static_cast<double>(loads.size());
    r.moe_z += load.z / passes / static_cast<double>(loads.size());
  }
  r.loss = loss_sum / static_cast<double>(divisor);
  {
    profiler::Scope scope("gradient norm", profiler::Pass::Step);
    r.grad_norm = optimizer_.gradient_norm();
  }
  if (filter_ && !filter_(r)) {
    r.skipped = true;
  } else {
    profiler::Scope scope("adamw", profiler::Pass::Step);
    optimizer_.step(static_cast<float>(r.lr), r.grad_norm);
  }
  r.ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  r.tokens_per_s = static_cast<double>(positions) / (r.ms / 1000.0);
  r.comm_ms = comm_ms;
  r.reducing_ms = reducing_ms;
  r.gather_ms = r.skipped ? 0.0 : optimizer_.gather_ms();
  return r;
}

double evaluate_loss(const std::function<Variable(const Tensor&, const Tensor&)>& loss_fn,
                     std::span<const int32_t> tokens, int64_t ctx, int64_t batch, int64_t windows,
                     const std::function<void(int64_t, int64_t)>& progress,
                     const Communicator* comm) {
  NoGradGuard no_grad;
  const int64_t ranks = comm ? comm->size() : 1;
  const int64_t rank = comm ? comm->rank() : 0;
  windows = std::min(windows, eval_window_count(tokens, ctx));
  Tensor inputs = Tensor::empty(Shape{batch, ctx}, DType::I32, MemoryCategory::Workspace);
  Tensor targets = Tensor::empty(Shape{batch, ctx}, DType::I32, MemoryCategory::Workspace);
  // Each batch's sum, in its own slot: over the ranks each slot has one addend, so the mean is
  // summed in batch order whatever the ranks.
  std::vector<double> sums(static_cast<size_t>((windows + batch - 1) / batch), 0.0);
  for (int64_t first = rank * batch; first < windows; first += batch * ranks) {
    const int64_t rows = std::min(batch, windows - first);
    Tensor in = inputs.view(0, Shape{rows, ctx});
    Tensor tgt = targets.view(0, Shape{rows, ctx});
    if (!measuring()) eval_windows(tokens, ctx, first, rows, in.i32(), tgt.i32());
    const Variable loss = loss_fn(in, tgt);
    if (!measuring())
      sums[static_cast<size_t>(first / batch)] =
          static_cast<double>(loss.value().f32()[0]) * static_cast<double>(rows);
    if (progress) progress(std::min(windows, first + rows * ranks), windows);
  }
  const double sum = (ranks > 1 && !measuring() ? *comm : Communicator::solo()).sum_slots(sums);
  return windows > 0 ? sum / static_cast<double>(windows) : 0.0;
}

double Trainer::evaluate(std::span<const int32_t> tokens, int64_t windows) const {
  return evaluate_loss(loss_fn_, tokens, options_.ctx, options_.batch, windows, nullptr,
                       options_.comm);
}

}  // namespace cputrain
