// What a run holds from the moment its directory is open: rank 0's log (the console, with the
// progress line on a terminal, and <run>/train.log) and the stop signals. While the run prepares
// (reads its model and data, trains its tokenizer), a stop signal ends the process at once: nothing
// of the run exists yet to save, and a directory the run created is removed. Once it is prepared,
// a stop signal stops the loop after its step, with a checkpoint (run_loop).
#pragma once

#include <atomic>
#include <memory>
#include <string>

#include "tools/run/loop.h"
#include "tools/run/run_dir.h"
#include "tools/run/stop_signals.h"

namespace cputrain {

class RunSession {
 public:
  // Rank 0 (`lead`) logs to the console and the run's train.log; the other ranks of a job hold a
  // log that writes nothing. `preparing` says what a signal interrupts ("preparing the data").
  RunSession(const RunDirectory& dir, bool lead, const char* preparing);
  // The progress line is gone before the last words, whatever way the run ends.
  ~RunSession();
  RunSession(const RunSession&) = delete;
  RunSession& operator=(const RunSession&) = delete;

  const LoopIo& io() const { return io_; }
  spdlog::logger& log() const { return *io_.log; }
  ProgressSink& console() const { return *io_.console; }
  // From now on a stop signal stops the loop after its step.
  void prepared() { preparing_ = false; }
  // Until prepared() again, a stop signal ends the process at once: a pass before the first step
  // (DPO's reference), which saves nothing a step would need. `what` names it.
  void preparing(const char* what) {
    what_ = what;
    preparing_ = true;
  }

 private:
  LoopIo io_;
  std::atomic<bool> preparing_{true};
  std::atomic<const char*> what_;
  std::unique_ptr<StopSignals> signals_;
};

}  // namespace cputrain
