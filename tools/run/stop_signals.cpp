#include "tools/run/stop_signals.h"

#include <pthread.h>
#include <spdlog/spdlog.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <string>
#include <string_view>

#include "engine/core/error.h"

namespace cputrain {
namespace {

std::atomic<int> g_stop_signal{0};

}  // namespace

int stop_signal() {
  return g_stop_signal.load();
}

StopSignals::StopSignals(std::function<void(int)> first) : first_(std::move(first)) {
  g_stop_signal = 0;
  sigemptyset(&signals_);
  sigaddset(&signals_, SIGINT);
  sigaddset(&signals_, SIGTERM);
  sigaddset(&signals_, kQuit);
  mask_everywhere(SIG_BLOCK);
  watcher_ = std::thread([this] { watch(); });
}

StopSignals::~StopSignals() {
  quit_ = true;
  pthread_kill(watcher_.native_handle(), kQuit);
  watcher_.join();
  mask_everywhere(SIG_UNBLOCK);
}

void StopSignals::mask_everywhere(int how) const {
  pthread_sigmask(how, &signals_, nullptr);
#pragma omp parallel
  pthread_sigmask(how, &signals_, nullptr);
}

void StopSignals::watch() const {
  // It sleeps until a signal comes: a thread waking at intervals takes a core from the compute
  // now and then, and on a machine whose threads all compute, a whole team waits for it.
  while (!quit_) {
    int sig = 0;
    if (sigwait(&signals_, &sig) != 0 || sig == kQuit) continue;
    if (g_stop_signal.load() == 0) {
      g_stop_signal = sig;
      first_(sig);
      continue;
    }
    if (auto log = spdlog::default_logger()) {
      log->warn("{} again: stopping at once, without a checkpoint of this step",
                sig == SIGINT ? "SIGINT" : "SIGTERM");
      log->flush();
    }
    std::signal(sig, SIG_DFL);
    pthread_sigmask(SIG_UNBLOCK, &signals_, nullptr);
    raise(sig);
  }
}

TestHold test_hold() {
  TestHold h;
  const char* env = std::getenv("CPUTRAIN_TEST_HOLD_STEP");
  if (env == nullptr || *env == '\0') return h;
  if (std::string_view(env) == "reference") {
    h.reference = true;
    return h;
  }
  char* end = nullptr;
  h.step = std::strtoll(env, &end, 10);
  h.forever = std::string_view(end) == "+";
  if (end == env || h.step < 0 || (*end != '\0' && !h.forever))
    throw UserError(std::string("CPUTRAIN_TEST_HOLD_STEP=") + env +
                    ": must be a step, a step and +, or reference");
  return h;
}

void wait_for_stop_signal(int64_t step, bool forever, const char* where) {
  if (where != nullptr)
    std::fprintf(stderr, "CPUTRAIN_TEST_HOLD_STEP: holding in %s\n", where);
  else
    std::fprintf(stderr, "CPUTRAIN_TEST_HOLD_STEP: holding before step %lld\n",
                 static_cast<long long>(step));
  std::fflush(stderr);
  while (forever || g_stop_signal.load() == 0)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

}  // namespace cputrain
