#include "tools/finetune_command.h"

#include <omp.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "engine/atomic_file.h"
#include "engine/autograd.h"
#include "engine/checkpoint_file.h"
#include "engine/error.h"
#include "engine/hash.h"
#include "engine/memory.h"
#include "engine/offload.h"
#include "engine/profiler.h"
#include "engine/tokenizer.h"
#include "engine/trainer.h"
#include "engine/vocab_tokenizer.h"
#include "kernels/cpu_features.h"
#include "models/chat_template.h"
#include "models/finetune_data.h"
#include "models/gguf_model.h"
#include "models/hf_model.h"
#include "models/llama.h"
#include "models/lora.h"
#include "models/memory_budget.h"
#include "tools/budget_command.h"
#include "tools/flag_checks.h"
#include "tools/job.h"
#include "tools/model_source.h"
#include "tools/run_dir.h"

namespace cputrain {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

// Fisher-Yates on 64-bit draws of `seed`: the same order with any standard library.
template <class T>
void seeded_shuffle(std::vector<T>& v, uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (size_t r = v.size(); r > 1; --r) std::swap(v[r - 1], v[rng() % r]);
}

// The rows of a step, in an order shuffled anew each epoch (seed, epoch).
class RowOrder {
 public:
  RowOrder(size_t rows, uint64_t seed) : rows_(rows), seed_(seed) {}
  // The row at position `i` of the endless sequence of epochs.
  size_t at(int64_t i) {
    const auto epoch = static_cast<uint64_t>(i / static_cast<int64_t>(rows_));
    if (epoch != epoch_ || order_.empty()) {
      order_.resize(rows_);
      for (size_t r = 0; r < rows_; ++r) order_[r] = r;
      seeded_shuffle(order_, seed_ * 0x9E3779B97F4A7C15ull + epoch);
      epoch_ = epoch;
    }
    return order_[static_cast<size_t>(i % static_cast<int64_t>(rows_))];
  }

 private:
  size_t rows_;
  uint64_t seed_;
  uint64_t epoch_ = 0;
  std::vector<size_t> order_;
};

}  // namespace

void add_finetune_flags(CLI::App& app, FinetuneArgs& a) {
  app.add_option("--model", a.model,
                 "The model to fine-tune: a GGUF file, a Hugging Face folder or a cputrain run")
      ->required();
  app.add_option("--data", a.data,
                 "JSON Lines of examples: {text}, {prompt, completion}, Alpaca's {instruction, "
                 "input, output} or chat {messages}")
      ->required();
  app.add_option("--val", a.val, "JSON Lines held out for validation");
  app.add_option("--val-fraction", a.val_fraction,
                 "Hold out this fraction of --data for validation (without --val)")
      ->check(CLI::Range(0.0, 0.5));
  app.add_option("--out", a.out, "The run directory (created; it must not hold a run)")->required();
  app.add_option("--lora-rank", a.lora_rank, "LoRA rank")
      ->capture_default_str()
      ->check(positive_whole());
  app.add_option("--lora-alpha", a.lora_alpha,
                 "LoRA alpha; the update is scaled alpha / rank "
                 "(default: twice the rank)")
      ->check(positive());
  app.add_option("--lora-targets", a.lora_targets,
                 "Projections that get adapters: q,k,v,o,gate,up,down or all")
      ->capture_default_str();
  app.add_option("--lora-dropout", a.lora_dropout,
                 "Dropout on the adapters' input in training (PEFT's lora_dropout)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 0.9));
  app.add_flag("--full", a.full, "Train every parameter instead of adapters");
  app.add_option("--epochs", a.epochs, "Passes over the data (without --steps)")
      ->capture_default_str()
      ->check(positive());
  app.add_option("--steps", a.steps, "Optimizer steps (default: from --epochs)")
      ->check(positive_whole());
  app.add_option("--batch", a.batch, "Packed rows per micro-batch")
      ->capture_default_str()
      ->check(positive_whole());
  app.add_option("--accum", a.accum, "Micro-batches per optimizer step")
      ->capture_default_str()
      ->check(positive_whole());
  app.add_option("--ctx", a.ctx,
                 "Positions per row; longer examples are cut (at most the "
                 "model's context)")
      ->capture_default_str()
      ->check(positive_whole());
  app.add_option("--lr", a.lr, "Peak learning rate (cosine to zero after warm-up)")
      ->capture_default_str()
      ->check(positive());
  app.add_option("--warmup", a.warmup, "Warm-up, as a fraction of the steps")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--weight-decay", a.weight_decay, "AdamW weight decay on matrices")
      ->capture_default_str()
      ->check(non_negative());
  app.add_option("--dtype", a.dtype, "auto, bf16 or fp32 (auto: bf16 where the CPU has it)")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "bf16", "fp32"}));
  app.add_option("--checkpoint", a.checkpoint, "Gradient checkpointing: none or layer")
      ->capture_default_str()
      ->check(CLI::IsMember({"none", "layer"}));
  app.add_option("--eval-every", a.eval_every,
                 "Validation loss every N steps (always before the first and after the last)")
      ->check(non_negative());
  app.add_option("--save-every", a.save_every,
                 "A checkpoint (adapters and AdamW's state) every N steps, and at the end")
      ->check(non_negative());
  app.add_flag("--resume", a.resume,
               "Continue the fine-tune in --out from its newest checkpoint, bit for bit as if it "
               "had not stopped (give the same flags)");
  app.add_option("--chat-template", a.chat_template,
                 "chatml, llama3, llama2, mistral or zephyr (default: the model's, recognised)");
  app.add_flag("--train-on-prompt", a.train_on_prompt,
               "The loss on every token, not only on completions and replies");
  app.add_option("--seed", a.seed, "Seed of the adapters' initialisation and the row order")
      ->capture_default_str();
  app.add_option("--threads", a.threads, "OpenMP threads (default: all cores)")
      ->check(threads_limit());
  app.add_option("--mem-limit", a.mem_limit_gib,
                 "GiB the fine-tune (each rank of a job) may use (default: the available memory, "
                 "shared among a job's ranks on this machine); a base read in place from its "
                 "file is apart: its pages are the page cache's")
      ->check(positive());
  app.add_option("--rank-timeout", a.rank_timeout,
                 "Of a job of several ranks (mpirun): seconds a rank waits for the others in a "
                 "step before it ends the job, saying so (0: forever)")
      ->capture_default_str()
      ->check(non_negative());
  app.add_option("--offload", a.offload,
                 "Keep the trained FP32 masters (bf16) and AdamW's m and v in files in this "
                 "folder, streamed through RAM in the optimizer step (for --full)");
  app.add_flag("--profile", a.profile,
               "Time every op over the steps after the first and print the table at the end");
  add_kernel_flags(app, a.kernels);
}

namespace {
int finetune(const FinetuneArgs& a, const Communicator& comm, JobStart& start);
}  // namespace

int run_finetune(const FinetuneArgs& a) {
  // Of a data-parallel job every rank reads the model and the data; rank 0 alone prints and
  // writes the run directory.
  const Communicator& comm = Communicator::world();
  if (comm.rank() > 0 && std::freopen("/dev/null", "w", stdout) == nullptr)
    throw UserError("/dev/null: cannot open for writing");
  JobStart start(comm);
  try {
    return finetune(a, comm, start);
  } catch (...) {
    if (start.failed()) throw QuietExit{1};
    throw;
  }
}

namespace {

int finetune(const FinetuneArgs& a, const Communicator& comm, JobStart& start) {
  omp_set_num_threads(a.threads > 0 ? a.threads : omp_get_num_procs());
  select_kernels(a.kernels);
  if (!a.val.empty() && a.val_fraction > 0.0) throw UserError("--val and --val-fraction: give one");
  if (a.full &&
      (a.lora_alpha > 0.0 || a.lora_targets != "q,k,v,o,gate,up,down" || a.lora_dropout > 0.0))
    throw UserError(
        "--full trains every parameter: no --lora-alpha, --lora-targets or --lora-dropout");
  const bool bf16 = a.dtype == "bf16" || (a.dtype == "auto" && kernels::cpu_features().avx512_bf16);
  ModelOptions options;
  options.compute_dtype = bf16 ? DType::BF16 : DType::F32;
  if (!a.full) {
    options.lora.rank = a.lora_rank;
    options.lora.alpha = a.lora_alpha > 0.0 ? a.lora_alpha : 2.0 * static_cast<double>(a.lora_rank);
    options.lora.targets = parse_lora_targets(a.lora_targets, "--lora-targets");
    options.lora.dropout = a.lora_dropout;
  }
  if (!a.offload.empty()) {
    options.offload = true;
    options.offload_dir = std::make_shared<OffloadDir>(a.offload);
  }

  const bool lead = comm.rank() == 0;
  if (comm.size() > 1 && options.offload)
    throw UserError("--offload " + a.offload + ": a data-parallel job of " +
                    std::to_string(comm.size()) + " ranks holds its state in RAM");
  RunDirectory dir =
      lead ? open_run_directory(a.out, a.resume ? RunDirUse::Resume : RunDirUse::NewRun)
           : RunDirectory{};
  try {
    const auto load_start = std::chrono::steady_clock::now();
    LoadedModel m = load_model_to_train(a.model, "--model", a.ctx, options);
    LlamaModel& model = *m.model;
    if (!a.full) model.init_adapters(a.seed);
    model.set_checkpointing(a.checkpoint == "layer");
    const int64_t ctx = std::min(a.ctx, m.config.ctx);
    const Tokenizer& tokenizer = *m.tokenizer;
    std::printf(
        "model: %s, %.2f s\n", m.source.c_str(),
        std::chrono::duration<double>(std::chrono::steady_clock::now() - load_start).count());
    int64_t trained = 0, total = 0;
    for (const ParameterInfo& p : model.parameters().infos()) {
      total += p.shape.numel();
      if (p.trainable) trained += p.shape.numel();
    }
    if (a.full)
      std::printf("training: every parameter (%lld), %s\n", static_cast<long long>(trained),
                  bf16 ? "bf16" : "fp32");
    else
      std::printf(
          "training: LoRA rank %lld, alpha %g on %s: %lld parameters (%.2f%% of %lld), "
          "the base frozen%s, %s\n",
          static_cast<long long>(options.lora.rank), options.lora.alpha,
          lora_targets_text(options.lora.targets).c_str(), static_cast<long long>(trained),
          100.0 * static_cast<double>(trained) / static_cast<double>(total),
          static_cast<long long>(total), bf16 ? " in bf16" : "", bf16 ? "bf16" : "fp32");

    // The chat template: --chat-template, else the model's, where it is a known family.
    FinetuneDataOptions data_options;
    data_options.train_on_prompt = a.train_on_prompt;
    data_options.max_tokens = ctx + 1;
    const Vocabulary* vocabulary =
        tokenizer.vocabulary() ? &tokenizer.vocabulary()->vocabulary() : nullptr;
    const std::string eos = vocabulary && vocabulary->eos >= 0
                                ? vocabulary->tokens[static_cast<size_t>(vocabulary->eos)]
                                : std::string("</s>");
    if (!a.chat_template.empty()) {
      data_options.chat = chat_template_named(a.chat_template, "--chat-template", eos);
      std::printf("chat template: %s (--chat-template)\n", a.chat_template.c_str());
    } else if (vocabulary && !vocabulary->chat_template.empty()) {
      data_options.chat = detect_chat_template(vocabulary->chat_template, eos);
      if (data_options.chat)
        std::printf("chat template: %s (the model's)\n",
                    std::string(chat_family_name(data_options.chat->family)).c_str());
      else
        std::printf(
            "chat template: the model's is none cputrain recognises (%s); "
            "--chat-template names one\n",
            chat_family_names().c_str());
    } else {
      std::printf("chat template: none (the model has none; --chat-template names one)\n");
    }

    FinetuneData data = read_finetune_jsonl(a.data, tokenizer, data_options);
    std::vector<FinetuneExample> val;
    if (!a.val.empty()) {
      val = read_finetune_jsonl(a.val, tokenizer, data_options).examples;
    } else if (a.val_fraction > 0.0) {
      // A seeded choice of examples, taken out of the training set.
      std::vector<FinetuneExample>& all = data.examples;
      seeded_shuffle(all, a.seed + 17);
      const auto n = static_cast<size_t>(
          std::max(1.0, std::round(a.val_fraction * static_cast<double>(all.size()))));
      if (n >= all.size())
        throw UserError("--val-fraction " + std::to_string(a.val_fraction) + ": " +
                        std::to_string(all.size()) + " examples leave none to train on");
      val.assign(all.end() - static_cast<std::ptrdiff_t>(n), all.end());
      all.resize(all.size() - n);
    }
    std::printf("data: %zu examples (", data.examples.size() + (a.val.empty() ? val.size() : 0));
    bool first = true;
    for (int s = 0; s < kExampleShapes; ++s) {
      if (data.shapes[static_cast<size_t>(s)] == 0) continue;
      std::printf("%s%lld %s", first ? "" : ", ",
                  static_cast<long long>(data.shapes[static_cast<size_t>(s)]),
                  example_shape_name(static_cast<ExampleShape>(s)));
      first = false;
    }
    std::printf(
        "), %lld tokens, %lld of them targets; %lld cut to %lld tokens, %lld dropped "
        "with no target left\n",
        static_cast<long long>(data.tokens), static_cast<long long>(data.targets),
        static_cast<long long>(data.truncated), static_cast<long long>(ctx + 1),
        static_cast<long long>(data.dropped));
    if (data.truncated > 0)
      std::fprintf(stderr, "warning: %lld examples are longer than --ctx %lld and were cut\n",
                   static_cast<long long>(data.truncated), static_cast<long long>(ctx));

    const std::vector<PackedRow> rows = pack_examples(data.examples, ctx);
    int64_t used = 0;
    for (const PackedRow& r : rows) used += r.positions;
    const int64_t per_step = a.batch * a.accum * comm.size();
    const int64_t steps =
        a.steps > 0
            ? a.steps
            : std::max<int64_t>(
                  1, static_cast<int64_t>(std::ceil(a.epochs * static_cast<double>(rows.size()) /
                                                    static_cast<double>(per_step))));
    std::printf(
        "packed: %zu rows of %lld positions, %.1f%% filled; %lld steps of %lld rows "
        "(%.2f epochs); validation: %zu examples\n",
        rows.size(), static_cast<long long>(ctx),
        100.0 * static_cast<double>(used) / static_cast<double>(rows.size() * ctx),
        static_cast<long long>(steps), static_cast<long long>(per_step),
        static_cast<double>(steps * per_step) / static_cast<double>(rows.size()), val.size());

    // The memory budget of this fine-tune, measured from the code that runs it; refused where it
    // does not fit.
    BudgetOptions bo;
    bo.dtype = options.compute_dtype;
    bo.batch = a.batch;
    bo.ctx = ctx;
    bo.accum = a.accum;
    bo.checkpoint = a.checkpoint == "layer";
    bo.threads = omp_get_max_threads();
    bo.lora = options.lora;
    bo.packed = true;
    bo.offload = options.offload;
    bo.ranks = comm.size();
    bo.eval_windows = val.empty() ? 0 : static_cast<int64_t>(pack_examples(val, ctx).size());
    MemoryBudget budget = memory_budget(m.config, bo);
    // A base read in place is the model file's pages: resident as the steps read them, dropped
    // and read again under pressure, so the limit covers the rest.
    for (size_t i = 0; i < model.parameters().infos().size(); ++i)
      if (model.parameters().mapped(static_cast<int>(i)))
        budget.mapped_bytes += model.parameters().infos()[i].shape.numel() * 2;
    const int64_t mapped_bytes = budget.mapped_bytes;
    const int64_t budget_bytes = budget.total_bytes();
    const int64_t available =
        a.mem_limit_gib > 0.0 ? static_cast<int64_t>(a.mem_limit_gib * 1024.0 * 1024.0 * 1024.0)
                              : available_memory_bytes() / Communicator::launched_local_ranks() +
                                    process_memory().rss_bytes;
    std::printf(
        "memory budget: %s (weights %s, adapters' gradients and AdamW %s, activations %s, "
        "workspace %s); %s available%s\n",
        format_bytes(budget_bytes).c_str(),
        format_bytes(budget.peak_bytes[static_cast<int>(MemoryCategory::Weights)] +
                     budget.peak_bytes[static_cast<int>(MemoryCategory::Bf16Weights)] -
                     mapped_bytes)
            .c_str(),
        format_bytes(budget.peak_bytes[static_cast<int>(MemoryCategory::Gradients)] +
                     budget.peak_bytes[static_cast<int>(MemoryCategory::OptimizerState)])
            .c_str(),
        format_bytes(budget.peak_bytes[static_cast<int>(MemoryCategory::Activations)]).c_str(),
        format_bytes(budget.peak_bytes[static_cast<int>(MemoryCategory::Workspace)]).c_str(),
        format_bytes(available).c_str(),
        mapped_bytes > 0 ? ("; besides it, " + format_bytes(mapped_bytes) +
                            " of base weights read in place from the model file (page cache)")
                               .c_str()
                         : "");
    if (budget.disk_bytes > 0)
      std::printf("offloaded to %s: %s on disk (masters, AdamW's m and v)\n", a.offload.c_str(),
                  format_bytes(budget.disk_bytes).c_str());
    if (available > 0 && budget_bytes > available)
      throw UserError("the fine-tune needs " + format_bytes(budget_bytes) + " and " +
                      format_bytes(available) +
                      " is available: lower --batch (raising --accum keeps the step), lower --ctx" +
                      (bo.checkpoint ? "" : ", give --checkpoint layer") +
                      (a.full ? "" : ", or lower --lora-rank"));
    // A base that does not fit beside the budget is read from the disk every pass: its blocks
    // are read ahead of the compute.
    if (mapped_bytes > 0 && available > 0 && budget_bytes + mapped_bytes > available) {
      model.set_read_ahead(true);
      std::printf("the base does not fit beside the budget in %s: each block is read ahead\n",
                  format_bytes(available).c_str());
    }

    TrainOptions train;
    train.batch = a.batch;
    train.accum = a.accum;
    train.ctx = ctx;
    train.seed = a.seed;
    train.lr.peak = a.lr;
    train.lr.total_steps = steps;
    train.lr.warmup_steps = static_cast<int64_t>(std::round(a.warmup * static_cast<double>(steps)));
    train.lr.min_ratio = 0.0;
    train.adamw.weight_decay = static_cast<float>(a.weight_decay);
    train.comm = &comm;
    Trainer trainer(
        model.parameters(),
        [&model](const Tensor& in, const Tensor& tg) { return model.loss(in, tg); }, train);
    // The batch buffers, after the trainer, as the memory budget makes them.
    const Tensor inputs = Tensor::empty(Shape{a.batch, ctx}, DType::I32, MemoryCategory::Workspace);
    const Tensor targets =
        Tensor::empty(Shape{a.batch, ctx}, DType::I32, MemoryCategory::Workspace);

    json config = {{"model", fs::absolute(a.model).string()},
                   {"data", fs::absolute(a.data).string()},
                   {"val", a.val.empty() ? "" : fs::absolute(a.val).string()},
                   {"val_fraction", a.val_fraction},
                   {"full", a.full},
                   {"lora_rank", a.full ? 0 : options.lora.rank},
                   {"lora_alpha", a.full ? 0.0 : options.lora.alpha},
                   {"lora_targets", a.full ? "" : lora_targets_text(options.lora.targets)},
                   {"lora_dropout", a.full ? 0.0 : a.lora_dropout},
                   {"steps", steps},
                   {"batch", a.batch},
                   {"accum", a.accum},
                   {"ctx", ctx},
                   {"lr", a.lr},
                   {"warmup_steps", train.lr.warmup_steps},
                   {"weight_decay", a.weight_decay},
                   {"dtype", bf16 ? "bf16" : "fp32"},
                   {"checkpoint", a.checkpoint},
                   {"chat_template", data_options.chat
                                         ? std::string(chat_family_name(data_options.chat->family))
                                         : std::string()},
                   {"train_on_prompt", a.train_on_prompt},
                   {"seed", a.seed}};
    // A job's batch is each rank's: the ranks are part of the run.
    if (comm.size() > 1) config["ranks"] = comm.size();
    // The data's fingerprint: every example's tokens and targets, training and validation.
    uint64_t data_fingerprint = kFnvOffset;
    for (const auto* set : {&data.examples, &val})
      for (const FinetuneExample& e : *set) {
        data_fingerprint =
            fnv1a(e.tokens.data(), e.tokens.size() * sizeof(int32_t), data_fingerprint);
        data_fingerprint = fnv1a(e.target.data(), e.target.size(), data_fingerprint);
      }
    const std::string config_text = config.dump(2) + "\n";
    int64_t first_step = 1;
    std::string resume_from;  // the checkpoint rank 0 resumes from
    if (a.resume && lead) {
      // The same configuration, the newest checkpoint, the same data: then every later step is
      // the one the run would have made.
      std::ifstream in(a.out + "/config.json");
      std::stringstream stored;
      stored << in.rdbuf();
      int stored_ranks = 1;
      try {
        stored_ranks = json::parse(stored.str()).value("ranks", 1);
      } catch (const json::exception&) {
        // a damaged config.json: refused below as another fine-tune's
      }
      if (stored_ranks != comm.size())
        throw UserError("--resume " + a.out + ": the fine-tune runs as " +
                        std::to_string(stored_ranks) + " rank" + (stored_ranks == 1 ? "" : "s") +
                        " (its batch is each rank's), and this job has " +
                        std::to_string(comm.size()) + ": resume it with mpirun -np " +
                        std::to_string(stored_ranks));
      if (stored.str() != config_text)
        throw UserError("--resume " + a.out +
                        ": its config.json is another fine-tune's; give the "
                        "flags it was started with");
      const auto all = list_checkpoints(a.out);
      if (all.empty())
        throw UserError("--resume " + a.out + ": no checkpoint in " + checkpoint_dir(a.out));
      resume_from = all.back().second;
      const CheckpointInfo info = read_checkpoint_info(resume_from);
      if (info.data_fingerprint != data_fingerprint)
        throw UserError(all.back().second + ": trained on other data than " + a.data);
      first_step = info.step + 1;
      std::printf("resumed from %s (step %lld of %lld)\n", all.back().second.c_str(),
                  static_cast<long long>(info.step), static_cast<long long>(steps));
      // metrics.jsonl keeps what the checkpoint had reached.
      std::ifstream old(a.out + "/metrics.jsonl");
      std::string kept;
      for (std::string line; std::getline(old, line);)
        if (json::parse(line).value("step", int64_t{0}) <= info.step) kept += line + "\n";
      write_file_atomic(a.out + "/metrics.jsonl", kept);
    } else if (lead) {
      write_file_atomic(a.out + "/config.json", config_text);
      write_file_atomic(a.out + "/metrics.jsonl", "");
    }
    std::ofstream metrics;
    if (lead) metrics.open(a.out + "/metrics.jsonl", std::ios::app);
    // Every rank starts from rank 0's adapters (or weights) and, resumed, its optimizer state
    // (sharded: each rank takes its shard as rank 0 reads the file).
    if (comm.size() > 1) {
      start.ready();
      comm.set_timeout(a.rank_timeout);
      first_step = share_value(comm, first_step);
    }
    const bool sharded = !trainer.optimizer().shards().empty();
    if (!resume_from.empty())
      load_checkpoint(resume_from, model.parameters(), &trainer.optimizer());
    else if (first_step > 1 && sharded)
      share_checkpoint_state(model.parameters(), trainer.optimizer(), false);
    if (comm.size() > 1) {
      broadcast_training_state(comm, model.parameters(), trainer.optimizer());
      std::printf("data parallel: %d ranks, each of %lld x %lld rows a step\n", comm.size(),
                  static_cast<long long>(a.batch), static_cast<long long>(a.accum));
    }
    const auto save = [&](int64_t step) {
      std::error_code ec;
      fs::create_directories(checkpoint_dir(a.out), ec);
      if (ec) throw UserError(checkpoint_dir(a.out) + ": cannot create (" + ec.message() + ")");
      CheckpointInfo info;
      info.step = step;
      info.adamw_step = trainer.optimizer().step_count();
      info.data_fingerprint = data_fingerprint;
      info.config_json = config_text;
      save_checkpoint(checkpoint_path(a.out, step), model.parameters(), trainer.optimizer(), info);
      std::printf("step %lld | saved %s\n", static_cast<long long>(step),
                  checkpoint_path(a.out, step).c_str());
    };

    const int32_t pad = tokenizer.eos_id();
    // Every rank validates its share of the batches.
    const auto validate = [&](int64_t step) {
      if (val.empty()) return;
      const auto start = std::chrono::steady_clock::now();
      const double loss = packed_validation_loss(model, val, ctx, a.batch, pad, 0, &comm);
      std::printf("step %lld | validation loss %.4f (%.1f s)\n", static_cast<long long>(step), loss,
                  std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
      if (lead) metrics << json{{"step", step}, {"val_loss", loss}}.dump() << "\n" << std::flush;
    };
    if (first_step == 1) validate(0);

    RowOrder order(rows.size(), a.seed);
    const auto run_start = std::chrono::steady_clock::now();
    int64_t profiled_steps = 0;
    double profiled_seconds = 0.0;
    for (int64_t step = first_step; step <= steps; ++step) {
      profiler::set_enabled(a.profile && (step > 1 || steps == 1));
      std::vector<const PackedRow*> step_rows;
      for (int64_t i = 0; i < per_step; ++i)
        step_rows.push_back(&rows[order.at((step - 1) * per_step + i)]);
      const StepResult r =
          finetune_step(trainer, model, step, step_rows, data.examples, pad, inputs, targets);
      const int64_t targets_in_step = count_targets(step_rows, data.examples);
      if (profiler::enabled()) {
        ++profiled_steps;
        profiled_seconds += r.ms / 1000.0;
      }
      profiler::set_enabled(false);
      const double elapsed =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - run_start).count();
      // With the base read in place, the budget stands for the anonymous part of the RSS; the
      // mapped files' pages (the base, the code) are shown beside it.
      const ProcessMemory mem = process_memory();
      const int64_t resident = mapped_bytes > 0 ? mem.rss_anon_bytes : mem.rss_bytes;
      // Every rank's step (the job stops together on a bad one, as rank 0 decides alike).
      const std::vector<RankStep> ranks = gather_step(
          comm, {r.ms, r.comm_ms, r.reducing_ms, r.gather_ms, resident, mem.peak_rss_bytes, 0});
      int64_t largest = 0;
      for (const RankStep& rs : ranks) largest = std::max(largest, rs.rss_bytes);
      std::printf(
          "step %lld/%lld | loss %.4f | lr %.2e | grad norm %.3f | %.0f tokens/s | "
          "RSS %s (budget %s)%s%s\n",
          static_cast<long long>(step), static_cast<long long>(steps), r.loss, r.lr, r.grad_norm,
          r.tokens_per_s, format_bytes(largest).c_str(), format_bytes(budget_bytes).c_str(),
          mapped_bytes > 0
              ? (" + " + format_bytes(mem.rss_file_bytes) + " of mapped files (base, code)").c_str()
              : "",
          comm.size() > 1
              ? (" | the largest of " + std::to_string(comm.size()) + " ranks; " +
                 "summing gradients " + std::to_string(static_cast<int64_t>(r.reducing_ms)) +
                 " ms, " + std::to_string(static_cast<int64_t>(r.comm_ms)) +
                 " of it after the backward pass; gathering weights " +
                 std::to_string(static_cast<int64_t>(r.gather_ms)) + " ms")
                    .c_str()
              : "");
      std::fflush(stdout);
      json record{{"step", step},
                  {"loss", r.loss},
                  {"lr", r.lr},
                  {"grad_norm", r.grad_norm},
                  {"targets", targets_in_step},
                  {"tokens_per_s", r.tokens_per_s},
                  {"rss_bytes", mem.rss_bytes},
                  {"rss_anon_bytes", mem.rss_anon_bytes},
                  {"rss_file_bytes", mem.rss_file_bytes},
                  {"budget_bytes", budget_bytes},
                  {"mapped_bytes", mapped_bytes},
                  {"elapsed_s", elapsed}};
      if (comm.size() > 1)
        record["ranks"] = rank_records(ranks, a.batch * a.accum * ctx * comm.size());
      if (lead) metrics << record.dump() << "\n" << std::flush;
      if (a.eval_every > 0 && step % a.eval_every == 0 && step < steps) validate(step);
      if ((a.save_every > 0 && step % a.save_every == 0) || step == steps) {
        if (lead)
          save(step);
        else if (sharded)
          share_checkpoint_state(model.parameters(), trainer.optimizer(), true);
      }
    }
    validate(steps);
    job_ended();
    if (!lead) return 0;
    if (a.profile)
      for (const std::string& line :
           profiler::report(profiler::entries(), profiled_steps, profiled_seconds))
        std::printf("%s\n", line.c_str());

    // The result: the adapter as llama.cpp loads it, or the whole model.
    const std::string name = fs::path(a.model).filename().string();
    if (a.full) {
      GgufExport e;
      e.type = GgmlType::F32;
      e.name = name + " fine-tuned";
      write_gguf(a.out + "/model.gguf", m.config, model.parameters(), tokenizer.to_vocabulary(), e);
      std::printf("wrote %s/model.gguf\n", a.out.c_str());
    } else {
      write_lora_gguf(a.out + "/adapter.gguf", m.config, model.parameters(), options.lora.alpha,
                      name + " LoRA");
      write_peft_adapter(a.out + "/peft", m.config, model.parameters(), options.lora,
                         fs::absolute(a.model).string());
      // llama.cpp takes the base as a GGUF file: a run's is written by export.
      const bool gguf_base = !fs::is_directory(a.model);
      const std::string base = gguf_base ? a.model : "BASE.gguf";
      std::printf(
          "wrote %s/adapter.gguf (llama.cpp: --model %s --lora %s/adapter.gguf%s) and "
          "%s/peft (PEFT's adapter_config.json and adapter_model.safetensors)\n",
          a.out.c_str(), base.c_str(), a.out.c_str(),
          gguf_base ? ""
                    : (", BASE.gguf from cputrain export --model " + a.model + " --out BASE.gguf")
                          .c_str(),
          a.out.c_str());
    }
  } catch (...) {
    dir.discard_if_unused();
    throw;
  }
  return 0;
}

}  // namespace

}  // namespace cputrain
