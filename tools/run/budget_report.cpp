#include "tools/run/budget_report.h"

#include <spdlog/fmt/fmt.h>

#include <string_view>
#include <vector>

#include "engine/core/memory.h"

namespace cputrain {
namespace {

const char* category_label(MemoryCategory c) {
  switch (c) {
    case MemoryCategory::Weights:
      return "weights (FP32 master)";
    case MemoryCategory::Bf16Weights:
      return "bf16 weight copies";
    case MemoryCategory::Gradients:
      return "gradients (FP32)";
    case MemoryCategory::OptimizerState:
      return "AdamW m and v";
    case MemoryCategory::Activations:
      return "activations (peak)";
    case MemoryCategory::Workspace:
      return "workspace (peak)";
  }
  return "";
}

std::string fit_verdict(const MemoryBudget& b, int64_t available) {
  if (b.total_bytes() > available) return "DOES NOT FIT";
  if (b.total_with_mapped_bytes() <= available) return "fits";
  // The fine-tune runs: it reads each block of the base ahead of its compute (MEMORY.md).
  return "fits, with the base read from the disk every pass (its pages do not fit beside it)";
}

}  // namespace

std::string format_bytes(int64_t bytes) {
  const double b = static_cast<double>(bytes);
  if (b >= 1024.0 * 1024.0 * 1024.0)
    return fmt::format("{:.2f} GiB", b / (1024.0 * 1024.0 * 1024.0));
  return fmt::format("{:.1f} MiB", b / (1024.0 * 1024.0));
}

BudgetOptions budget_options(const RunConfig& c, int64_t corpus_tokens, int64_t eval_windows) {
  BudgetOptions o;
  o.dtype = c.dtype;
  o.batch = c.train.batch;
  o.ctx = c.train.ctx;
  o.accum = c.train.accum;
  o.checkpoint = c.checkpoint;
  o.threads = c.threads;
  o.corpus_tokens = corpus_tokens;
  o.eval_windows = eval_windows;
  o.offload = !c.offload.empty();
  o.ranks = c.ranks;
  return o;
}

std::string budget_table(const MemoryBudget& b, int64_t available) {
  std::string t;
  const auto row = [&t](std::string_view what, int64_t bytes, std::string_view sign = "") {
    t += fmt::format("  {:<38} {:>12}\n", what, std::string(sign) + format_bytes(bytes));
  };
  // A base read in place is the model file's pages, not the process's memory: its own row,
  // apart from the category its weights are counted in.
  for (int i = 0; i < kMemoryCategoryCount; ++i) {
    const auto c = static_cast<MemoryCategory>(i);
    const int64_t own = b.peak_bytes[i] - b.mapped_peak_bytes[i];
    if (own <= 0) continue;
    row(c == MemoryCategory::OptimizerState && b.disk_bytes > 0 ? "AdamW staging (--offload)"
                                                                : category_label(c),
        own);
    if (b.per_layer_table_bytes > 0 && !b.per_layer_table_mapped && c == b.per_layer_table_category)
      row("  of which the per-layer embeddings", b.per_layer_table_bytes);
  }
  row("step peak (all of the above at once)", b.step_peak_bytes - b.mapped_bytes);
  row("kept for the next step (block cache)", b.cache_headroom_bytes);
  row("token cache (memory-mapped)", b.corpus_bytes);
  row("runtime (code, libraries, tokenizer)", b.runtime_bytes);
  row(b.mapped_bytes > 0 ? "total (the process's own memory)" : "total", b.total_bytes());
  if (b.mapped_bytes > 0) {
    row("base read in place (the file's pages)", b.mapped_bytes, "+");
    if (b.per_layer_table_bytes > 0 && b.per_layer_table_mapped)
      row("  of which the per-layer embeddings", b.per_layer_table_bytes);
    row("total with the base's pages", b.total_with_mapped_bytes());
  }
  if (b.disk_bytes > 0) row("on disk (--offload: masters, m and v)", b.disk_bytes);
  if (available > 0)
    t += fmt::format("  {:<38} {:>12}  -> {}\n", "available (MemAvailable or --mem-limit)",
                     format_bytes(available), fit_verdict(b, available));
  return t;
}

std::string budget_levers(const RunConfig& c, int64_t corpus_tokens, int64_t eval_windows,
                          int64_t available) {
  struct Lever {
    std::string what;
    RunConfig config;
  };
  std::vector<Lever> levers;
  if (c.dtype != DType::BF16) {
    RunConfig r = c;
    r.dtype = DType::BF16;
    levers.push_back({"--dtype bf16", r});
  }
  for (const Checkpointing level : {Checkpointing::Mlp, Checkpointing::Layer}) {
    if (c.checkpoint >= level) continue;
    RunConfig r = c;
    r.checkpoint = level;
    levers.push_back({"--checkpoint " + std::string(checkpointing_name(level)), r});
  }
  if (c.train.batch > 1) {
    RunConfig r = c;
    r.train.batch = c.train.batch / 2;
    r.train.accum = c.train.accum * 2;
    levers.push_back(
        {fmt::format("--batch {} --accum {} (same tokens per step)", r.train.batch, r.train.accum),
         r});
  }
  if (c.offload.empty() && c.ranks == 1) {  // a job of several ranks holds its state in RAM
    RunConfig r = c;
    r.offload = "DIR";
    levers.push_back({"--offload DIR", r});
  }
  if (c.train.ctx > 1) {
    RunConfig r = c;
    r.train.ctx = c.train.ctx / 2;
    r.model.ctx = r.train.ctx;
    levers.push_back({fmt::format("--ctx {}", r.train.ctx), r});
  }
  std::string t;
  for (const Lever& l : levers) {
    const MemoryBudget b =
        memory_budget(l.config.model, budget_options(l.config, corpus_tokens, eval_windows));
    t += fmt::format(
        "  {:<48} total {:>12}{}\n", l.what, format_bytes(b.total_bytes()),
        available > 0 ? (b.total_bytes() <= available ? "  fits" : "  does not fit") : "");
  }
  return t;
}

}  // namespace cputrain
