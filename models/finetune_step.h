// Fine-tuning steps over DecoderModel: the packed rows of engine/data/finetune_data.h through the
// trainer's step, and their validation loss.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "engine/data/finetune_data.h"

namespace cputrain {

class Communicator;
class DecoderModel;
class Trainer;
struct StepResult;

// The seed of the adapters' dropout masks of micro-batch `slot` (of the job's) of step `step`
// under a run's `seed`: a resumed run draws the masks the uninterrupted one did.
uint64_t micro_batch_seed(uint64_t seed, int64_t step, int64_t slot);

// The packing of a batch of `rows` (packed rows), written into `inputs` and `targets` ((rows,
// ctx) i32) by fill_packed_batch. While measuring, `rows` is not read: each of inputs' rows is one
// sequence of ctx positions, the batch with `measured_targets` targets (0: all).
std::shared_ptr<Packing> pack_batch(std::span<const PackedRow* const> rows,
                                    const std::vector<FinetuneExample>& examples, int32_t pad,
                                    const Tensor& inputs, const Tensor& targets,
                                    int64_t measured_targets);

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

// The mean loss over every target of `examples`, packed into rows of ctx, batch rows at a time,
// without gradients. While measuring, `measure_rows` rows of one sequence each, a batch of them
// with `measured_targets` positions with a target (0: all). Over the ranks of `comm`, rank r
// evaluates batches r, r + N, ...; every rank gets the loss one process gets.
double packed_validation_loss(DecoderModel& model, const std::vector<FinetuneExample>& examples,
                              int64_t ctx, int64_t batch, int32_t pad, int64_t measure_rows = 0,
                              const Communicator* comm = nullptr, int64_t measured_targets = 0);

}  // namespace cputrain
