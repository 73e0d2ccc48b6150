// Fine-tuning steps over DecoderModel: the packed rows of engine/data/finetune_data.h through the
// trainer's step, and their validation loss.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "engine/data/finetune_data.h"

namespace cputrain {

class Communicator;
class DecoderModel;
class Trainer;
class Variable;
struct StepResult;

// The packing of a batch of `rows` (packed rows), written into `inputs` and `targets` ((rows,
// ctx) i32) by fill_packed_batch. While measuring, `rows` is not read: each of inputs' rows is one
// sequence of ctx positions, the batch with `measured_targets` targets (0: all).
std::shared_ptr<Packing> pack_batch(std::span<const PackedRow* const> rows,
                                    const std::vector<FinetuneExample>& examples, int32_t pad,
                                    const Tensor& inputs, const Tensor& targets,
                                    int64_t measured_targets);

// Trainer::step_with over `rows`, the job's step of packed rows: micro-batch m of rank r of N takes
// the `batch` rows from (m N + r) batch on (none while measuring), with the adapters' dropout
// seeded for it (micro_batch_seed), and `loss` gives its loss from them; the step moves
// batch x accum x ctx x N positions.
StepResult packed_rows_step(
    Trainer& trainer, DecoderModel& model, int64_t step, std::span<const PackedRow* const> rows,
    int64_t batch, int64_t ctx,
    const std::function<Variable(std::span<const PackedRow* const> rows)>& loss);

// One fine-tuning step (Trainer::step_with) over `rows`: accum micro-batches of batch rows, each
// written into `inputs` and `targets` ((batch, ctx) i32, the caller's) and packed, the loss of
// each divided by the count of the step's targets. While measuring (the memory budget) `rows`
// may be empty: each row is then one sequence of ctx positions, as packing makes no allocation
// that depends on the lengths. Over the ranks of the trainer's communicator, `rows` are the whole
// job's step (batch x accum x N) and micro-batch m of rank r takes its rows (m N + r) batch
// onwards, as Trainer::step takes windows; the divisor is the count of the whole step's targets.
// While measuring, each micro-batch has `measured_targets` positions with a target (0: all).
StepResult finetune_step(Trainer& trainer, DecoderModel& model, int64_t step,
                         std::span<const PackedRow* const> rows,
                         const std::vector<FinetuneExample>& examples, int32_t pad,
                         const Tensor& inputs, const Tensor& targets, int64_t measured_targets = 0);

// Runs `rows` through `model` without gradients, `batch` rows at a time (over `ranks`, rank r
// takes batches r, r + N, ...), giving each batch's rows and its targets' log-probabilities (in
// the order of the rows' examples' targets) to `each`. While measuring, `measure_rows` rows of one
// sequence each (a batch with `measured_targets` targets; 0: all), and `each` is not called.
void for_each_log_prob_batch(
    DecoderModel& model, const std::vector<PackedRow>& rows,
    const std::vector<FinetuneExample>& examples, int64_t ctx, int64_t batch, int32_t pad,
    size_t rank, size_t ranks, int64_t measure_rows, int64_t measured_targets,
    const std::function<void(std::span<const PackedRow* const> rows, const float* logps)>& each);

// The mean loss over every target of `examples`, packed into rows of ctx, batch rows at a time,
// without gradients. While measuring, `measure_rows` rows of one sequence each, a batch of them
// with `measured_targets` positions with a target (0: all). Over the ranks of `comm`, rank r
// evaluates batches r, r + N, ...; every rank gets the loss one process gets.
double packed_validation_loss(DecoderModel& model, const std::vector<FinetuneExample>& examples,
                              int64_t ctx, int64_t batch, int32_t pad, int64_t measure_rows = 0,
                              const Communicator* comm = nullptr, int64_t measured_targets = 0);

}  // namespace cputrain
