#include "tools/run/session.h"

#include <spdlog/sinks/null_sink.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>

#include "engine/dist/communicator.h"
#include "tools/run/train_stages.h"

namespace cputrain {

RunSession::RunSession(const RunDirectory& dir, bool lead, const char* preparing)
    : what_(preparing) {
  // On a terminal a progress line with the time left stays under the log. (Not under an MPI
  // launcher, whose pseudo-terminal is a terminal to the ranks wherever mpirun's output goes.)
  io_.console = std::make_shared<ProgressSink>(::isatty(::fileno(stdout)) == 1 &&
                                               Communicator::launched_ranks() == 1);
  if (!lead) {
    io_.log = std::make_shared<spdlog::logger>("cputrain-rank",
                                               std::make_shared<spdlog::sinks::null_sink_mt>());
    // A rank's stop signal reaches rank 0 with its step's figures.
    signals_ = std::make_unique<StopSignals>([](int) {});
    return;
  }
  io_.log = open_run_log(dir.path, io_.console);
  for (const std::string& path : dir.stale)
    io_.log->info("removed {}, left by a process that stopped while writing it", path);
  signals_ = std::make_unique<StopSignals>([this, &dir](int sig) {
    const char* name = sig == SIGINT ? "SIGINT" : "SIGTERM";
    if (preparing_) {
      io_.log->warn("{} while {}: stopped at once, before any step of this command", name,
                    what_.load());
      io_.log->flush();
      dir.discard_if_unused();
      std::_Exit(128 + sig);
    }
    io_.log->warn("{}: the run stops after this step, with a checkpoint (again to stop at once)",
                  name);
  });
}

RunSession::~RunSession() {
  signals_.reset();
  io_.console->set_status("");
}

}  // namespace cputrain
