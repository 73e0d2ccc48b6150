#include "models/finetune_step.h"

#include <algorithm>
#include <memory>

#include "engine/core/hash.h"
#include "engine/core/memory.h"
#include "engine/train/trainer.h"
#include "models/decoder.h"

namespace cputrain {
namespace {

// The seed of the adapters' dropout masks of micro-batch `slot` (of the job's) of step `step`
// under a run's `seed`: a resumed run draws the masks the uninterrupted one did.
uint64_t micro_batch_seed(uint64_t seed, int64_t step, int64_t slot) {
  return splitmix64(seed ^
                    splitmix64(static_cast<uint64_t>(step) * 4096 + static_cast<uint64_t>(slot)));
}

}  // namespace

std::shared_ptr<Packing> pack_batch(std::span<const PackedRow* const> rows,
                                    const std::vector<FinetuneExample>& examples, int32_t pad,
                                    const Tensor& inputs, const Tensor& targets,
                                    int64_t measured_targets) {
  auto packing = std::make_shared<Packing>();
  const int64_t ctx = inputs.dim(1);
  if (measuring()) {
    packing->lengths.assign(static_cast<size_t>(inputs.dim(0)), {ctx});
    packing->measured_targets = measured_targets;
  } else {
    fill_packed_batch(rows, examples, ctx, pad, inputs.i32(), targets.i32(), *packing);
  }
  return packing;
}

StepResult packed_rows_step(
    Trainer& trainer, DecoderModel& model, int64_t step, std::span<const PackedRow* const> rows,
    int64_t batch, int64_t ctx,
    const std::function<Variable(std::span<const PackedRow* const> rows)>& loss) {
  const Communicator* comm = trainer.options().comm;
  const int64_t ranks = comm ? comm->size() : 1, rank = comm ? comm->rank() : 0;
  return trainer.step_with(
      step,
      [&](int64_t micro) {
        const int64_t slot = micro * ranks + rank;  // the job's micro-batch of `batch` rows
        model.set_dropout_seed(micro_batch_seed(trainer.options().seed, step, slot));
        return loss(measuring() ? std::span<const PackedRow* const>()
                                : rows.subspan(static_cast<size_t>(slot * batch),
                                               static_cast<size_t>(batch)));
      },
      1, batch * trainer.options().accum * ctx * ranks);
}

StepResult finetune_step(Trainer& trainer, DecoderModel& model, int64_t step,
                         std::span<const PackedRow* const> rows,
                         const std::vector<FinetuneExample>& examples, int32_t pad,
                         const Tensor& inputs, const Tensor& targets, int64_t measured_targets) {
  const int64_t normalizer = count_targets(rows, examples);
  return packed_rows_step(trainer, model, step, rows, inputs.dim(0), inputs.dim(1),
                          [&](std::span<const PackedRow* const> mine) {
                            return model.loss(
                                inputs, targets,
                                pack_batch(mine, examples, pad, inputs, targets, measured_targets),
                                std::max<int64_t>(normalizer, 1));
                          });
}

void for_each_log_prob_batch(
    DecoderModel& model, const std::vector<PackedRow>& rows,
    const std::vector<FinetuneExample>& examples, int64_t ctx, int64_t batch, int32_t pad,
    size_t rank, size_t ranks, int64_t measure_rows, int64_t measured_targets,
    const std::function<void(std::span<const PackedRow* const> rows, const float* logps)>& each) {
  NoGradGuard no_grad;
  const Tensor inputs = Tensor::empty(Shape{batch, ctx}, DType::I32, MemoryCategory::Workspace);
  const Tensor targets = Tensor::empty(Shape{batch, ctx}, DType::I32, MemoryCategory::Workspace);
  const auto B = static_cast<size_t>(batch);
  const size_t count = measuring() ? static_cast<size_t>(measure_rows) : rows.size();
  std::vector<const PackedRow*> all;
  for (const PackedRow& r : rows) all.push_back(&r);
  for (size_t first = rank * B; first < count; first += B * ranks) {
    const size_t n = std::min(count - first, B);
    const Tensor in = inputs.view(0, Shape{static_cast<int64_t>(n), ctx});
    const Tensor tg = targets.view(0, Shape{static_cast<int64_t>(n), ctx});
    if (measuring()) {
      model.target_log_probs(in, tg, pack_batch({}, examples, pad, in, tg, measured_targets));
      continue;
    }
    const auto mine = std::span<const PackedRow* const>(all).subspan(first, n);
    const Variable logps =
        model.target_log_probs(in, tg, pack_batch(mine, examples, pad, in, tg, 0));
    each(mine, logps.value().f32());
  }
}

double packed_validation_loss(DecoderModel& model, const std::vector<FinetuneExample>& examples,
                              int64_t ctx, int64_t batch, int32_t pad, int64_t measure_rows,
                              const Communicator* comm, int64_t measured_targets) {
  NoGradGuard no_grad;
  const size_t ranks = comm ? static_cast<size_t>(comm->size()) : 1;
  const size_t rank = comm ? static_cast<size_t>(comm->rank()) : 0;
  std::vector<PackedRow> rows;
  if (measuring()) {
    rows.resize(static_cast<size_t>(measure_rows));
  } else {
    rows = pack_examples(examples, ctx);
  }
  std::vector<const PackedRow*> all;
  for (const PackedRow& r : rows) all.push_back(&r);
  const int64_t total = count_targets(all, examples);
  const Tensor inputs = Tensor::empty(Shape{batch, ctx}, DType::I32, MemoryCategory::Workspace);
  const Tensor targets = Tensor::empty(Shape{batch, ctx}, DType::I32, MemoryCategory::Workspace);
  const auto B = static_cast<size_t>(batch);
  // Each batch's sum in its own slot: over the ranks each slot has one addend, and the total
  // is summed in batch order whatever the ranks.
  std::vector<double> sums((all.size() + B - 1) / B, 0.0);
  for (size_t first = rank * B; first < all.size(); first += B * ranks) {
    const size_t n = std::min(all.size() - first, B);
    const Tensor in = inputs.view(0, Shape{static_cast<int64_t>(n), ctx});
    const Tensor tg = targets.view(0, Shape{static_cast<int64_t>(n), ctx});
    const auto packing = pack_batch(std::span<const PackedRow* const>(all).subspan(first, n),
                                    examples, pad, in, tg, measured_targets);
    // Each batch's sum over the targets: its loss with the whole set's count as divisor.
    const Variable loss = model.loss(in, tg, packing, std::max<int64_t>(total, 1));
    if (!measuring()) sums[first / B] = loss.value().f32()[0];
  }
  return (ranks > 1 && !measuring() ? *comm : Communicator::solo()).sum_slots(sums);
}

}  // namespace cputrain
