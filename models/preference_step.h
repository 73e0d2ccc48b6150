// Preference tuning over DecoderModel: rows packed with preference pairs (engine/data/
// preference_data.h) through the trainer's step with DPO's or ORPO's loss
// (engine/train/preference_loss.h), the reference's log-probabilities, and validation on held-out
// pairs. A micro-batch holds whole pairs, so one forward pass gives each completion's sum of
// token log-probabilities and one backward pass weighs each token by what its sum does to the
// loss: a step costs what a fine-tuning step over the same rows costs.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "engine/data/finetune_data.h"
#include "engine/train/preference_loss.h"

namespace cputrain {

class Communicator;
class DecoderModel;
class Tensor;
class Trainer;
class Variable;
struct StepResult;

// What a step or pass computes the loss with: the pairs' examples (two a pair, as
// PreferenceData holds them), the reference's sums of target log-probabilities per example
// (DPO; ORPO takes none: empty), the loss's options, and where the figures of its pairs add up.
struct PreferenceBatches {
  const std::vector<FinetuneExample>* examples = nullptr;
  std::span<const double> reference;
  PreferenceLossOptions loss;
  PreferenceStats* stats = nullptr;
};

// One preference step (Trainer::step_with) over `rows` (whole pairs each), accum micro-batches
// of batch rows written into `inputs` and `targets` ((batch, ctx) i32, the caller's): each
// micro-batch's loss is the sum of its pairs' terms over the count of the step's pairs (ORPO:
// plus the chosen tokens' NLL over the count of the step's chosen tokens), so the step's loss is
// their mean whatever the accumulation. Over the ranks of the trainer's communicator, rows are
// the job's step and micro-batch m of rank r takes rows (m N + r) batch onwards (as
// finetune_step); the divisors and the figures (`batches.stats`) are the job's. While measuring
// `rows` may be empty: each row is one sequence of ctx positions with `measured_targets` targets
// a micro-batch (0: all).
StepResult preference_step(Trainer& trainer, DecoderModel& model, int64_t step,
                           std::span<const PackedRow* const> rows, const PreferenceBatches& batches,
                           int32_t pad, const Tensor& inputs, const Tensor& targets,
                           int64_t measured_targets = 0);

// The loss of one micro-batch, `rows` (whole pairs) written into `inputs` and `targets` (the
// caller's, of rows.size() rows), recorded for backward: the sum of its pairs' terms over `pairs`
// (ORPO: plus its chosen tokens' NLL over `chosen_tokens`), each pair's figures added to
// `batches.stats`. While measuring, `rows` is not read (inputs' rows of one sequence each).
Variable preference_batch_loss(DecoderModel& model, std::span<const PackedRow* const> rows,
                               const PreferenceBatches& batches, int32_t pad, const Tensor& inputs,
                               const Tensor& targets, double pairs, double chosen_tokens,
                               int64_t measured_targets = 0);

// Each example's sum of its targets' log-probabilities under `model` as it is (a reference with
// its adapters switched off), without gradients: `rows` (packed as pack_pairs packs) in batches
// of `batch`; over the ranks of `comm` rank r computes batches r, r + N, ... and every rank gets
// every sum. The result is indexed like `examples`. While measuring, `measure_rows` rows of one
// sequence each (`measured_targets` targets a batch; 0: all) and an empty result.
std::vector<double> sequence_log_probs(DecoderModel& model, const std::vector<PackedRow>& rows,
                                       const std::vector<FinetuneExample>& examples, int64_t ctx,
                                       int64_t batch, int32_t pad,
                                       const Communicator* comm = nullptr, int64_t measure_rows = 0,
                                       int64_t measured_targets = 0);

// The preference loss of held-out pairs (the mean of their terms; ORPO: with the chosen tokens'
// mean NLL), their figures added to `batches.stats`, without gradients, as sequence_log_probs
// computes.
double preference_validation_loss(DecoderModel& model, const std::vector<PackedRow>& rows,
                                  const PreferenceBatches& batches, int64_t ctx, int64_t batch,
                                  int32_t pad, const Communicator* comm = nullptr,
                                  int64_t measure_rows = 0, int64_t measured_targets = 0);

// The loss of every pair of `examples` from each example's sum of target log-probabilities
// (`logps`, indexed like `examples`), each pair's figures added to `stats`: what the step's loss
// computes, from sums already made.
double preference_loss_of(std::span<const double> logps,
                          const std::vector<FinetuneExample>& examples,
                          std::span<const double> reference, const PreferenceLossOptions& options,
                          PreferenceStats* stats);

}  // namespace cputrain
