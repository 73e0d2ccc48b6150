// The memory budget of training a DecoderModel: bytes per memory category (engine/core/memory.h)
// from the configuration and the run's options, without allocating anything. It is measured from
// the real code: the model and trainer are built and three training steps (each followed by the
// validation pass training makes between steps) run while measuring (engine/core/memory.h), where
// every tensor records its size and category but gets no storage and no kernel runs. So what
// an op saves for backward, the gradients of activations, transient conversions, GEMM buffers
// and the block cache are counted as the allocator counts them in training, op by op, with no
// copy of the model's allocations kept here.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <string>

#include "engine/core/memory.h"
#include "engine/core/tensor.h"
#include "engine/train/parameters.h"
#include "models/lora.h"
#include "models/model_config.h"

namespace cputrain {

struct BudgetOptions {
  DType dtype = DType::F32;
  int64_t batch = 1;  // sequences per micro-batch
  int64_t ctx = 1;    // tokens per sequence
  int64_t accum = 1;  // micro-batches per step: gradients accumulate in place, so no extra memory
  Checkpointing checkpoint = Checkpointing::None;
  int threads = 1;
  int64_t corpus_tokens = 0;  // both splits of the token cache
  // Validation windows (of ctx tokens) per evaluation between steps (Trainer::evaluate, in
  // micro-batches of batch windows); 0: the run evaluates none.
  int64_t eval_windows = 0;
  // Which parameters train, by name (ModelOptions::trainable); all where unset, or with
  // adapters the adapters alone.
  std::function<bool(const std::string& name)> trainable;
  // Adapters on the projections (ModelOptions::lora).
  LoraConfig lora;
  // A fine-tune's steps (finetune_step: packed rows, the caller's batch buffers) and validation
  // (packed_validation_loss over eval_windows rows), instead of a corpus's windows.
  bool packed = false;
  // With packed: rows of preference pairs (preference_step, DPO's and ORPO's loss), validated as
  // preference_validation_loss and, before the first step, DPO's reference pass over them
  // (counted for ORPO too: a pass without gradients holds less than the step after it).
  bool preference = false;
  // GRPO (--method grpo): the sequences generated together, whose caches (KV rows of ctx each,
  // DeltaNet states) and logits are held beside the steps' memory (0: no generation).
  int64_t generations = 0;
  // And a full fine-tune's reference (--beta): a frozen copy of the base, its matrices read in
  // place where `reference_in_place` says (the model file's types), counted in mapped_bytes.
  bool reference_copy = false;
  std::function<InPlaceWeight(const ParameterInfo&)> reference_in_place;
  // Of packed rows, the most positions with a target that a micro-batch of `batch` rows holds
  // (the LM head runs on those alone); 0: every position.
  int64_t packed_targets = 0;
  // --offload: the FP32 masters the bf16 copies stand for, and AdamW's m and v, in state files
  // (ParameterSet::set_offload); RAM holds the optimizer's staging chunks instead.
  bool offload = false;
  // The ranks of a data-parallel job (`mpirun -np N`): the budget is one rank's, with AdamW's
  // state sharded (ZeRO-1) and the gradients' receiving buffer (engine/dist/gradient_reducer.h).
  int ranks = 1;
  // The frozen weights read in place from the model file (ModelOptions::in_place; the data is not
  // read): measured at the file's size, and counted in mapped_bytes.
  std::function<InPlaceWeight(const ParameterInfo&)> in_place;
  // What the process holds on the heap beside the model and its steps: a model file's index and
  // the tokenizer (tens of MB for a 150k-token BPE vocabulary; LoadedModel::host_bytes), a
  // fine-tune's examples and packed rows. Part of runtime_bytes.
  int64_t host_bytes = 0;
};

struct MemoryBudget {
  // The most each category holds during a step (or a validation pass between steps).
  std::array<int64_t, kMemoryCategoryCount> peak_bytes{};
  // The most all categories hold at one moment (not more than the sum of their peaks: the
  // activations peak at the end of the forward pass, the workspace during the backward pass).
  int64_t step_peak_bytes = 0;
  // Freed tensors the allocator's block cache keeps beyond the step peak (at most the largest
  // tensor a step frees; engine/core/memory.cpp), in the third step measured.
  int64_t cache_headroom_bytes = 0;
  // The token cache, memory-mapped: resident as training touches it, reported apart.
  int64_t corpus_bytes = 0;
  // The process before any tensor: code, libraries, thread stacks, allocator overhead and of a
  // job's rank MPI's (estimates: kRuntimeBytes, kMpiRuntimeBytes), and the heap the caller
  // measured (BudgetOptions::host_bytes: a model file's index, the tokenizer, the examples).
  int64_t runtime_bytes = 0;
  // On disk, not in RAM: the state files of --offload (their pages pass through the page cache,
  // which the kernel gives back under pressure and does not count as the process's).
  int64_t disk_bytes = 0;
  // Of the weights above, those read in place from the model file (BudgetOptions::in_place), at
  // the file's size (bf16 or quantised): the file's pages, resident as the steps read them and
  // dropped and read again under pressure, so apart from the total a memory limit covers.
  int64_t mapped_bytes = 0;
  // Of each category's peak, the part read in place (mapped_bytes, by the category the weights
  // are counted in).
  std::array<int64_t, kMemoryCategoryCount> mapped_peak_bytes{};
  // Per-layer embeddings' table (Gemma 4 E2B's, larger than the rest of the model): its bytes,
  // the category its weights are counted in, and whether it is read in place (among
  // mapped_bytes); 0 bytes: none.
  int64_t per_layer_table_bytes = 0;
  MemoryCategory per_layer_table_category = MemoryCategory::Weights;
  bool per_layer_table_mapped = false;
  // What the process holds, anonymous memory: the total a memory limit covers.
  int64_t total_bytes() const {
    return step_peak_bytes + cache_headroom_bytes + corpus_bytes + runtime_bytes - mapped_bytes;
  }
  // With the base's pages, which every step reads: what must be resident for the steps to read
  // the base from memory rather than from the disk.
  int64_t total_with_mapped_bytes() const { return total_bytes() + mapped_bytes; }
};

// What a training process holds besides its tensors and the token cache, as measured on
// Debian 12 builds: about 15-19 MiB resident before the model is built (libraries, the
// tokenizer), about 22 MiB once the OpenMP team and the GEMM libraries have run.
inline constexpr int64_t kRuntimeBytes = 24ll << 20;
// Besides, a rank of a data-parallel job holds Open MPI's libraries and shared-memory segments
// (Debian 12's Open MPI 4.1, ranks on one machine: 7-14 MiB) and, while it sums a bucket of
// gradients (engine/dist/gradient_reducer.h), two buckets' worth of MPI's own buffers.
inline constexpr int64_t kMpiRuntimeBytes = 10ll << 20;

// The budget on the GEMM backend selected now (its packing and widening buffers count) and with
// options.threads OpenMP threads (their buffers depend on it). Not while measuring already.
MemoryBudget memory_budget(const ModelConfig& config, const BudgetOptions& options);

}  // namespace cputrain
