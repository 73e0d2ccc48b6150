#include "models/memory_budget.h"

#include <omp.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "engine/train/trainer.h"
#include "models/decoder.h"
#include "models/finetune_step.h"
#include "models/preference_step.h"

namespace cputrain {
namespace {

// The OpenMP thread count for a scope (the GEMM's buffers depend on it).
class Threads {
 public:
  explicit Threads(int n) : saved_(omp_get_max_threads()) {
    if (n > 0) omp_set_num_threads(n);
  }
  ~Threads() { omp_set_num_threads(saved_); }
  Threads(const Threads&) = delete;
  Threads& operator=(const Threads&) = delete;

 private:
  int saved_;
};

}  // namespace

MemoryBudget memory_budget(const ModelConfig& c, const BudgetOptions& o) {
  const Threads threads(o.threads);
  MeasureScope measure;
  MemoryStats stats;
  int64_t disk_bytes = 0, mapped_bytes = 0;
  std::array<int64_t, kMemoryCategoryCount> mapped_peak{};
  MemoryBudget b;
  {
    // What training builds, in the order it builds it: the model (its parameters and RoPE
    // table), the trainer (AdamW's state and the token buffers).
    ModelOptions model_options;
    model_options.compute_dtype = o.dtype;
    model_options.trainable = o.trainable;
    model_options.lora = o.lora;
    model_options.offload = o.offload;
    if (o.in_place)
      model_options.in_place = [&o](const ParameterInfo& p) {
        InPlaceWeight w = o.in_place(p);
        w.data = nullptr;  // measured, not read
        return w;
      };
    // A trainer's rank holds the masters of its shard (a fine-tune's, all of them). The last
    // rank's: every rank holds the embedding's master whole, and it lies in rank 0's shard, so
    // the last holds the most.
    const Communicator ranks = Communicator::shape_of(o.ranks - 1, o.ranks);
    if (o.ranks > 1 && !o.packed) model_options.shard = &ranks;
    DecoderModel model(c, model_options);
    for (size_t i = 0; i < model.parameters().infos().size(); ++i)
      if (model.parameters().mapped(static_cast<int>(i))) {
        const Tensor& w = model.parameters().var(static_cast<int>(i)).value();
        mapped_bytes += static_cast<int64_t>(w.bytes());
        mapped_peak[static_cast<size_t>(w.category())] +=
            static_cast<int64_t>(memory_counted_bytes(w.bytes()));
      }
    if (const int table = model.parameters().find("per_layer.embeddings.weight"); table >= 0) {
      const Tensor& w = model.parameters().var(table).value();
      b.per_layer_table_bytes = static_cast<int64_t>(memory_counted_bytes(w.bytes()));
      b.per_layer_table_category = w.category();
      b.per_layer_table_mapped = model.parameters().mapped(table);
    }
    if (o.offload)
      disk_bytes =
          (model.parameters().offloaded_numel() + 2 * model.parameters().trainable_numel()) * 4;
    model.set_checkpointing(o.checkpoint);
    TrainOptions t;
    t.batch = o.batch;
    t.ctx = o.ctx;
    t.accum = o.accum;
    t.lr.total_steps = 3;
    if (o.ranks > 1) t.comm = &ranks;
    Trainer trainer(
        model.parameters(),
        [&model](const Tensor& in, const Tensor& tgt) { return model.loss(in, tgt); }, t);
    // A fine-tune's batch buffers, made after the trainer as `cputrain finetune` makes them.
    Tensor inputs, targets;
    if (o.packed) {
      inputs = Tensor::empty(Shape{o.batch, o.ctx}, DType::I32, MemoryCategory::Workspace);
      targets = Tensor::empty(Shape{o.batch, o.ctx}, DType::I32, MemoryCategory::Workspace);
    }
    // A full fine-tune's GRPO reference: the base again, frozen, beside the model that trains.
    std::unique_ptr<DecoderModel> reference;
    if (o.reference_copy) {
      ModelOptions frozen;
      frozen.compute_dtype = o.dtype;
      frozen.trainable = [](const std::string&) { return false; };
      if (o.reference_in_place)
        frozen.in_place = [&o](const ParameterInfo& p) {
          InPlaceWeight w = o.reference_in_place(p);
          w.data = nullptr;  // measured, not read
          return w;
        };
      reference = std::make_unique<DecoderModel>(c, frozen);
      for (size_t i = 0; i < reference->parameters().infos().size(); ++i)
        if (reference->parameters().mapped(static_cast<int>(i))) {
          const Tensor& w = reference->parameters().var(static_cast<int>(i)).value();
          mapped_bytes += static_cast<int64_t>(w.bytes());
          mapped_peak[static_cast<size_t>(w.category())] +=
              static_cast<int64_t>(memory_counted_bytes(w.bytes()));
        }
    }
    // GRPO's generation: the caches of its sequences and their logits, counted as held through
    // the steps (the allocator's cache keeps their blocks once freed).
    DecoderModel::KvCache generation;
    Tensor generation_logits;
    if (o.generations > 0) {
      generation = model.new_kv_cache(o.generations);
      generation_logits =
          Tensor::empty(Shape{o.generations, c.vocab}, DType::F32, MemoryCategory::Workspace);
    }
    // The validation split's windows (evaluate reads only their count while measuring).
    const std::vector<int32_t> eval_tokens(
        static_cast<size_t>(std::max<int64_t>(0, o.eval_windows) * o.ctx + 1));
    // Steps repeat the same allocations; the block cache settles within a few, so the third is
    // what every later step holds. Where the run evaluates, a validation pass follows each step.
    const auto step = [&](int64_t n) {
      if (o.preference) {
        // The reference pass before the first step, as a validation pass computes.
        if (n == 1)
          sequence_log_probs(model, {}, {}, o.ctx, o.batch, 0, nullptr, o.batch, o.packed_targets);
        preference_step(trainer, model, n, {}, {}, 0, inputs, targets, o.packed_targets);
        if (o.eval_windows > 0)
          preference_validation_loss(model, {}, {}, o.ctx, o.batch, 0, nullptr, o.eval_windows,
                                     o.packed_targets);
        return;
      }
      if (o.packed) {
        finetune_step(trainer, model, n, {}, {}, 0, inputs, targets, o.packed_targets);
        if (o.eval_windows > 0)
          packed_validation_loss(model, {}, o.ctx, o.batch, 0, o.eval_windows, nullptr,
                                 o.packed_targets);
        return;
      }
      trainer.step({}, n);
      if (o.eval_windows > 0) trainer.evaluate(eval_tokens, o.eval_windows);
    };
    step(1);
    step(2);
    measure.reset_peaks();
    step(3);
    stats = measure.stats();
  }
  b.peak_bytes = stats.peak_bytes;
  b.step_peak_bytes = stats.peak_total_bytes;
  b.cache_headroom_bytes = std::max<int64_t>(0, stats.held_peak_bytes - stats.peak_total_bytes);
  b.corpus_bytes = o.corpus_tokens * 4;
  b.runtime_bytes = kRuntimeBytes + o.host_bytes;
  // Of a job's rank, what MPI holds outside the allocator: its libraries and shared-memory
  // segments, and the buffers it sums a bucket of gradients through (two buckets' worth).
  if (o.ranks > 1)
    b.runtime_bytes +=
        kMpiRuntimeBytes +
        2 * std::min(4 * TrainOptions{}.reduce_bucket,
                     stats.peak_bytes[static_cast<size_t>(MemoryCategory::Gradients)]);
  b.disk_bytes = disk_bytes;
  b.mapped_bytes = mapped_bytes;
  b.mapped_peak_bytes = mapped_peak;
  return b;
}

}  // namespace cputrain
