// The memory budget of a run as it is reported: the table of what each category holds with the
// total and whether it fits, the levers not in use with what each would give, and byte counts as
// they are shown. What `cputrain budget` prints, and what a run prints before it starts or when it
// refuses to.
#pragma once

#include <cstdint>
#include <string>

#include "models/memory_budget.h"
#include "tools/run/run_config.h"

namespace cputrain {

// eval_windows: validation windows per evaluation between steps (0: the run evaluates none).
BudgetOptions budget_options(const RunConfig& config, int64_t corpus_tokens, int64_t eval_windows);
// The per-category table with the total, and whether it fits in `available` bytes.
std::string budget_table(const MemoryBudget& budget, int64_t available);
// One line per lever not in use yet (bf16, per-layer checkpointing, half the batch with twice
// the accumulation, half the context) with the total it would give and whether that fits.
std::string budget_levers(const RunConfig& config, int64_t corpus_tokens, int64_t eval_windows,
                          int64_t available);
// "1.23 GiB"
std::string format_bytes(int64_t bytes);

}  // namespace cputrain
