// SIGINT and SIGTERM as a request to stop, taken by a thread of their own, never by one computing.
#pragma once

#include <signal.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <thread>

namespace cputrain {

// The first stop signal of the current StopSignals scope (SIGINT or SIGTERM), or 0.
int stop_signal();

// Takes SIGINT and SIGTERM for its scope on a thread of its own, which calls `first` with the
// first of them (then stop_signal() returns it); both are blocked in every other thread (the
// caller's and OpenMP's team, and threads started later, which inherit the mask), so that no
// handler runs on a thread in the middle of a step. (With a handler, runs with the oneDNN GEMM
// interrupted on a loaded machine aborted now and then on a corrupted heap, found in a free
// inside oneDNN's sgemm: 7 in 195, and once in CI; with this, none in 300.) A second signal is
// logged and takes its default action. The default actions are back afterwards, however the
// scope is left.
class StopSignals {
 public:
  explicit StopSignals(std::function<void(int)> first);
  ~StopSignals();
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

 private:
  void mask_everywhere(int how) const;
  void watch() const;

  // Sent to the watching thread to end it; blocked, with the stop signals, for the scope.
  static constexpr int kQuit = SIGUSR2;

  std::function<void(int)> first_;
  sigset_t signals_;
  std::atomic<bool> quit_{false};
  std::thread watcher_;
};

// For tests that interrupt a run at a known point, whatever the machine's speed:
// CPUTRAIN_TEST_HOLD_STEP=N holds the training loop before step N, saying so on stderr, until a
// stop signal has arrived (then step N runs and the run stops after it); "N+" holds it for good,
// so that only a second signal ends the run, in the middle of step N; 0 holds the run while it
// prepares its data.
struct TestHold {
  int64_t step = -1;
  bool forever = false;
  bool reference = false;  // "reference": within DPO's reference pass, before its first batch
};
// The hold CPUTRAIN_TEST_HOLD_STEP asks for (step -1: none); a UserError if it is malformed.
TestHold test_hold();
// Says "CPUTRAIN_TEST_HOLD_STEP: holding before step N" (or "holding in WHERE") on stderr and
// waits as TestHold says.
void wait_for_stop_signal(int64_t step, bool forever, const char* where = nullptr);

}  // namespace cputrain
