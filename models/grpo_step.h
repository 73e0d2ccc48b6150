// GRPO's update over DecoderModel (engine/train/grpo_loss.h): completions, each an example whose
// targets are its completion's tokens, packed into rows through the trainer's step. One forward
// pass gives every completion token's log-probability, and one backward pass weighs each by what
// its term does to the loss.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "engine/data/finetune_data.h"
#include "engine/train/grpo_loss.h"

namespace cputrain {

class DecoderModel;
class Tensor;
class Trainer;
class Variable;
struct StepResult;

// What a step's loss is computed with, indexed like `examples` (the completions): each one's
// advantage, the weight of each of its tokens' terms (the loss type's normalisation, the job's),
// and per target in order the log-probabilities of the policy that generated it (`old`; empty:
// on policy, the ratio 1) and of the reference (`reference`; read where beta > 0). The figures
// of the tokens add up in `stats`.
struct GrpoBatches {
  const std::vector<FinetuneExample>* examples = nullptr;
  std::span<const double> advantages;
  std::span<const double> weights;
  const std::vector<std::vector<float>>* old = nullptr;
  const std::vector<std::vector<float>>* reference = nullptr;
  GrpoLossOptions loss;
  GrpoStats* stats = nullptr;
};

// The loss of one micro-batch, `rows` written into `inputs` and `targets` (the caller's), recorded
// for backward: the sum of its completion tokens' terms, each times its completion's weight.
// While measuring, `rows` is not read (inputs' rows of one sequence each).
Variable grpo_batch_loss(DecoderModel& model, std::span<const PackedRow* const> rows,
                         const GrpoBatches& batches, int32_t pad, const Tensor& inputs,
                         const Tensor& targets, int64_t measured_targets = 0);

// One GRPO step (Trainer::step_with) over `rows`, the job's step as finetune_step takes it.
StepResult grpo_step(Trainer& trainer, DecoderModel& model, int64_t step,
                     std::span<const PackedRow* const> rows, const GrpoBatches& batches,
                     int32_t pad, const Tensor& inputs, const Tensor& targets,
                     int64_t measured_targets = 0);

// Each example's targets' log-probabilities under `model` as it is, in order, without
// gradients: `rows` in batches of `batch` (while measuring, `measure_rows` rows of one sequence
// each, and an empty result).
std::vector<std::vector<float>> target_log_probs_of(DecoderModel& model,
                                                    const std::vector<PackedRow>& rows,
                                                    const std::vector<FinetuneExample>& examples,
                                                    int64_t ctx, int64_t batch, int32_t pad,
                                                    int64_t measure_rows = 0,
                                                    int64_t measured_targets = 0);

}  // namespace cputrain
