// `cputrain budget`: the analytic memory budget of a training run (models/memory_budget.h) as
// a table, whether it fits in this machine's available memory, and what each lever would give.
// The same report is what `cputrain train` prints when it refuses to start.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>

#include "models/memory_budget.h"
#include "tools/run/budget_report.h"
#include "tools/run/run_config.h"
#include "tools/train_command.h"

namespace cputrain {

struct BudgetArgs {
  TrainArgs
      train;  // preset, shape overrides, batch, accum, ctx, dtype, checkpoint, threads, corpus
  bool json = false;
  // A fine-tune of a model file (--model): LoRA of --lora-rank (0: --full, every parameter),
  // packed rows of --ctx (default 512), --batch 4 x --accum 4, as `cputrain finetune` runs it.
  std::string model;
  int64_t lora_rank = 0;
  double lora_alpha = 0.0;
  std::string lora_targets = "q,k,v,o,gate,up,down";
  int64_t val_rows = 0;        // validation rows of --ctx evaluated between steps
  int ranks = 1;               // each rank's budget in a job of this many (mpirun -np N)
  std::string method = "sft";  // or dpo, orpo: preference pairs; grpo (finetune --method)
  int64_t generations = 8;     // grpo: the sequences generated together
};

void add_budget_flags(CLI::App& app, BudgetArgs& args);
// The exit status of `cputrain budget` when the budget does not fit the memory (0 when it does).
inline constexpr int kDoesNotFit = 3;
// Prints the budget; returns 0, or kDoesNotFit.
int run_budget(const BudgetArgs& args);

}  // namespace cputrain
