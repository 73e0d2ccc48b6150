// A command run as the ranks of a data-parallel job (`mpirun -np N cputrain train|finetune`):
// the ranks start together or not at all, rank 0 sends the others what they cannot know, and
// each step's figures of every rank reach rank 0, which alone writes the run directory.
#pragma once

#include <cstdint>
#include <exception>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <vector>

#include "engine/dist/communicator.h"

namespace cputrain {

class AdamW;
class ParameterSet;

// Ends this rank without a word: another rank has said why the job stops. The CLI exits with
// `code`.
struct QuietExit {
  int code = 1;
};

// Whether the job's ranks have started together (JobStart::ready) and not yet ended together:
// an error on one rank then leaves the others waiting in a collective, so the CLI ends the job.
bool job_running();
// The ranks ended together (every rank stops at the same step): an error on one is its own.
void job_ended();

// The ranks agree to start: each calls ready() when it can train, or failed() (in its catch
// block, before rethrowing) when it cannot; the first of those calls on each rank meets the
// others'. Where any rank failed, rank 0's error is the one reported: a rank whose failure
// rank 0 shares exits quietly, and rank 0 names the ranks that failed where it did not.
class JobStart {
 public:
  explicit JobStart(const Communicator& comm) : comm_(comm) {}
  // Throws QuietExit on a rank whose work others failed, a UserError on rank 0 naming the ranks
  // that failed where it did not.
  void ready();
  // This rank failed: returns true where its error is to be kept quiet (rank 0 reports one),
  // false where it is to be reported. Nothing to do (false) once the job has started.
  bool failed();

 private:
  // Sums this rank's (failed, rank 0 failed) with the others'.
  std::pair<int64_t, bool> meet(bool failed);
  const Communicator& comm_;
  bool met_ = false;
};

// `text` on every rank becomes rank 0's.
void broadcast_text(const Communicator& comm, std::string& text);
// Rank 0's `tokens` for the other ranks: the copy they receive (rank 0: empty).
std::vector<int32_t> share_tokens(const Communicator& comm, std::span<const int32_t> tokens);
// Rank 0's `value` on every rank.
int64_t share_value(const Communicator& comm, int64_t value);
// Every rank's trainable parameters (FP32 masters and bf16 copies) and optimizer state (m, v
// unless sharded, the step count) become rank 0's: a job starts from rank 0's init, model or
// resumed checkpoint.
void broadcast_training_state(const Communicator& comm, const ParameterSet& params,
                              AdamW& optimizer);

// What each rank made of a step, gathered on every rank.
struct RankStep {
  double ms = 0.0;           // the step's time on this rank
  double comm_ms = 0.0;      // of it, waiting for the gradients' sum after the backward pass
  double reducing_ms = 0.0;  // the sum's own time, most of it during the backward pass
  double gather_ms = 0.0;    // of it, gathering the updated weights
  int64_t rss_bytes = 0;     // resident now
  int64_t peak_rss = 0;      // peak resident
  int stop_signal = 0;       // a stop signal this rank received (0: none)
};
std::vector<RankStep> gather_step(const Communicator& comm, const RankStep& mine);
// metrics.jsonl's "ranks" of a step that moved `positions` over the job: each rank's time, time
// reducing, tokens/s (its share of the positions over its time) and memory.
nlohmann::json rank_records(const std::vector<RankStep>& ranks, int64_t positions);

}  // namespace cputrain
