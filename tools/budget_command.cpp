#include "tools/budget_command.h"

#include <omp.h>
#include <spdlog/fmt/fmt.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "engine/core/error.h"
#include "engine/core/memory.h"
#include "engine/data/corpus.h"
#include "models/lora.h"
#include "models/memory_budget.h"
#include "tools/flag_checks.h"
#include "tools/model_source.h"

namespace cputrain {
namespace {

std::string dtype_string(DType d) {
  return d == DType::BF16 ? "bf16" : "fp32";
}

// The token cache's size before the corpus is tokenized: about one token per 3.5 bytes of
// text, 4 bytes each.
int64_t estimated_corpus_tokens(const std::string& corpus) {
  int64_t bytes = 0;
  for (const std::string& f : list_corpus_files(corpus)) {
    struct stat st {};
    if (::stat(f.c_str(), &st) == 0) bytes += st.st_size;
  }
  return static_cast<int64_t>(static_cast<double>(bytes) / 3.5);
}

// `cputrain budget --json`'s byte counts: each category's peak, the step peak, the rest of the
// total, what is available and whether it fits.
void add_budget_bytes(nlohmann::json& j, const MemoryBudget& b, int64_t available) {
  for (int i = 0; i < kMemoryCategoryCount; ++i)
    j[std::string(memory_category_name(static_cast<MemoryCategory>(i))) + "_bytes"] =
        b.peak_bytes[i];
  j["step_peak_bytes"] = b.step_peak_bytes;
  j["cache_headroom_bytes"] = b.cache_headroom_bytes;
  j["corpus_bytes"] = b.corpus_bytes;
  j["runtime_bytes"] = b.runtime_bytes;
  j["total_bytes"] = b.total_bytes();
  j["disk_bytes"] = b.disk_bytes;
  j["mapped_bytes"] = b.mapped_bytes;
  j["total_with_mapped_bytes"] = b.total_with_mapped_bytes();
  j["available_bytes"] = available;
  // The run starts where the total fits; the base's pages beside it, or it reads the base from
  // the disk every pass.
  j["fits"] = b.total_bytes() <= available;
  j["fits_with_mapped"] = b.total_with_mapped_bytes() <= available;
}

}  // namespace

void add_budget_flags(CLI::App& app, BudgetArgs& a) {
  TrainArgs& t = a.train;
  app.add_option("--preset", t.preset, "Model preset")->capture_default_str();
  app.add_option("--corpus", t.corpus, "Corpus, for the size of its token cache")
      ->capture_default_str();
  app.add_option("--batch", t.batch, "Sequences per micro-batch (default: the preset's)")
      ->check(positive_whole());
  app.add_option("--accum", t.accum, "Micro-batches per step (default: the preset's)")
      ->check(positive_whole());
  app.add_option("--ctx", t.ctx, "Tokens per sequence (default: the preset's)")
      ->check(positive_whole());
  add_model_flags(app, t);
  add_threads_flag(app, t.threads);
  app.add_option("--ranks", a.ranks,
                 "Each rank's budget in a data-parallel job of this many ranks (mpirun -np N), "
                 "AdamW's state sharded among them")
      ->capture_default_str()
      ->check(positive_whole());
  add_kernel_flags(app, t.kernels);
  add_dtype_flag(app, t.dtype);
  add_checkpoint_flag(app, t.checkpoint, {"none", "mlp", "layer"});
  add_memory_flags(app, t.mem_limit_gib, t.offload);
  app.add_flag("--json", a.json, "Print a JSON object of bytes per category and total_bytes");
  app.add_option("--model", a.model,
                 "A fine-tune of this GGUF file or Hugging Face folder (as cputrain finetune runs "
                 "it) instead of a preset");
  app.add_option("--lora-rank", a.lora_rank, "With --model: LoRA of this rank (0: every parameter)")
      ->check(non_negative());
  app.add_option("--lora-alpha", a.lora_alpha, "With --model: LoRA alpha (default: twice the rank)")
      ->check(positive());
  app.add_option("--lora-targets", a.lora_targets, "With --model: the projections with adapters")
      ->capture_default_str();
  app.add_option("--val-rows", a.val_rows,
                 "With --model: rows of validation examples evaluated between steps")
      ->check(non_negative());
  app.add_option("--method", a.method,
                 "With --model: sft, dpo or orpo (preference pairs), or grpo (completions "
                 "generated, --generations at once), as finetune --method")
      ->capture_default_str()
      ->check(CLI::IsMember({"sft", "dpo", "orpo", "grpo"}));
  app.add_option("--generations", a.generations,
                 "With --method grpo: completions of each prompt, generated together")
      ->capture_default_str()
      ->check(positive_whole());
}

namespace {

// `cputrain budget --model`: a fine-tune's budget, and the levers where it does not fit.
int fine_tune_budget(const BudgetArgs& a) {
  const TrainArgs& t = a.train;
  if (!t.preset.empty() && t.preset != TrainArgs().preset)
    throw UserError("--preset and --model: give one");
  const int64_t ctx = t.ctx > 0 ? t.ctx : 512;
  const ModelConfig model = load_model_config(a.model, "--model", ctx);
  select_kernels(t.kernels);
  std::string why;
  BudgetOptions o;
  o.dtype = choose_dtype(t.dtype, &why);
  o.batch = t.batch > 0 ? t.batch : 4;
  o.accum = t.accum > 0 ? t.accum : 4;
  o.ctx = std::min(ctx, model.ctx);
  o.checkpoint = *parse_checkpointing(t.checkpoint);
  o.threads = t.threads > 0 ? t.threads : omp_get_num_procs();
  o.packed = true;
  o.preference = a.method == "dpo" || a.method == "orpo";
  o.eval_windows = a.val_rows;
  if (a.method == "grpo") {
    // The generation's caches, and a pass without gradients over a micro-batch (the reference's
    // log-probabilities with --beta, or the generating policy's with --iterations).
    o.generations = a.generations;
    o.eval_windows = std::max(a.val_rows, o.batch);
  }
  o.ranks = a.ranks;
  if (a.lora_rank > 0) {
    o.lora.rank = a.lora_rank;
    o.lora.alpha = a.lora_alpha > 0.0 ? a.lora_alpha : 2.0 * static_cast<double>(a.lora_rank);
    o.lora.targets = parse_lora_targets(a.lora_targets, "--lora-targets");
    check_lora_targets(model, o.lora, "--lora-targets");
    check_lora_rank(model, o.lora, "--lora-rank");
  }
  // The model file's index and the tokenizer, as a fine-tune holds them.
  o.host_bytes = model_host_bytes(a.model, "--model");
  // A LoRA reads the base's quantised matrices (and in bf16 its BF16 ones) in place: apart
  // from what must fit.
  if (o.lora.active()) o.in_place = in_place_weights(a.model, "--model", model);
  const MemoryBudget b = memory_budget(model, o);
  const int64_t available = memory_limit_bytes(t.mem_limit_gib);
  const bool fits = b.total_bytes() <= available;
  if (a.json) {
    nlohmann::json j = {{"model", a.model},
                        {"dtype", dtype_string(o.dtype)},
                        {"lora_rank", o.lora.rank},
                        {"method", a.method},
                        {"generations", a.method == "grpo" ? a.generations : 0},
                        {"batch", o.batch},
                        {"accum", o.accum},
                        {"ctx", o.ctx},
                        {"checkpoint", checkpointing_name(o.checkpoint)},
                        {"parameters", parameter_count(model)}};
    add_budget_bytes(j, b, available);
    std::printf("%s\n", j.dump(2).c_str());
    return fits ? 0 : kDoesNotFit;
  }
  std::printf(
      "%s",
      fmt::format("memory budget: {} {} ({} parameters), {}, {}, {} x {} "
                  "packed rows of {} positions, checkpointing {}\n",
                  o.preference ? "preference tuning (" + a.method + ")"
                  : o.generations > 0
                      ? fmt::format("GRPO ({} completions generated together)", o.generations)
                      : std::string("fine-tuning"),
                  a.model, parameter_count(model),
                  o.lora.rank > 0 ? fmt::format("LoRA rank {}", o.lora.rank)
                                  : std::string("every parameter"),
                  dtype_string(o.dtype), o.batch, o.accum, o.ctx, checkpointing_words(o.checkpoint))
          .c_str());
  std::printf("%s", budget_table(b, available).c_str());
  // The levers not in use: each alone, with its total.
  std::string levers;
  const auto lever = [&](const std::string& what, BudgetOptions changed) {
    const int64_t total = memory_budget(model, changed).total_bytes();
    levers += fmt::format("  {:<38} {:>12}{}\n", what, format_bytes(total),
                          total <= available ? "  fits" : "");
  };
  for (const Checkpointing level : {Checkpointing::Mlp, Checkpointing::Layer}) {
    if (o.checkpoint >= level) continue;
    BudgetOptions c = o;
    c.checkpoint = level;
    lever("--checkpoint " + std::string(checkpointing_name(level)), c);
  }
  if (o.batch > 1) {
    BudgetOptions c = o;
    c.batch = o.batch / 2;
    c.accum = o.accum * 2;
    lever(fmt::format("--batch {} --accum {}", c.batch, c.accum), c);
  }
  if (o.ctx > 64) {
    BudgetOptions c = o;
    c.ctx = o.ctx / 2;
    lever(fmt::format("--ctx {}", c.ctx), c);
  }
  if (!levers.empty()) std::printf("levers:\n%s", levers.c_str());
  return fits ? 0 : kDoesNotFit;
}

}  // namespace

int run_budget(const BudgetArgs& a) {
  if (!a.model.empty()) return fine_tune_budget(a);
  if (a.lora_rank > 0 || a.val_rows > 0 || a.method != "sft")
    throw UserError("--lora-rank, --val-rows and --method: a fine-tune's, with --model");
  RunConfig config = resolve_run_config(a.train);
  select_kernels(a.train.kernels);
  std::string why;
  config.dtype = choose_dtype(a.train.dtype, &why);
  config.checkpoint = *parse_checkpointing(a.train.checkpoint);
  config.ranks = a.ranks;
  if (a.ranks > 1 && !config.offload.empty())
    throw UserError("--offload " + a.train.offload + ": a job of " + std::to_string(a.ranks) +
                    " ranks holds its state in RAM");
  const int64_t corpus_tokens = estimated_corpus_tokens(config.corpus);
  // Training evaluates between steps (--eval-windows, its default here).
  const int64_t eval_windows = a.train.eval_windows;
  const MemoryBudget b =
      memory_budget(config.model, budget_options(config, corpus_tokens, eval_windows));
  const int64_t available = memory_limit_bytes(a.train.mem_limit_gib);
  if (a.json) {
    nlohmann::json j = {{"preset", config.preset},
                        {"dtype", dtype_string(config.dtype)},
                        {"batch", config.train.batch},
                        {"accum", config.train.accum},
                        {"ctx", config.train.ctx},
                        {"checkpoint", checkpointing_name(config.checkpoint)},
                        {"offload", !config.offload.empty()},
                        {"ranks", config.ranks},
                        {"parameters", parameter_count(config.model)}};
    add_budget_bytes(j, b, available);
    std::printf("%s\n", j.dump(2).c_str());
    return b.total_bytes() <= available ? 0 : kDoesNotFit;
  }
  std::printf("%s", fmt::format("memory budget: preset {} ({} parameters), {}, {} x {} sequences "
                                "of {} tokens, checkpointing {}\n",
                                config.preset, parameter_count(config.model),
                                dtype_string(config.dtype), config.train.batch, config.train.accum,
                                config.train.ctx, checkpointing_words(config.checkpoint))
                        .c_str());
  std::printf("%s", budget_table(b, available).c_str());
  const std::string levers = budget_levers(config, corpus_tokens, eval_windows, available);
  if (!levers.empty()) std::printf("levers:\n%s", levers.c_str());
  return b.total_bytes() <= available ? 0 : kDoesNotFit;
}

}  // namespace cputrain
