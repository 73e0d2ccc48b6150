// A status line under the log on a terminal: a bar, the fraction done, a rate and the time
// left, redrawn in place. Log lines written through ProgressSink (warnings and errors to stderr,
// the rest to stdout) clear it first and redraw it after, so the two never mix. When stdout is
// not a terminal the status line is never drawn.
#pragma once

#include <spdlog/sinks/base_sink.h>

#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>

namespace cputrain {

class ProgressSink : public spdlog::sinks::base_sink<std::mutex> {
 public:
  // `terminal`: whether stdout is a terminal (isatty), decided by the caller.
  explicit ProgressSink(bool terminal) : terminal_(terminal) {}

  bool terminal() const { return terminal_; }
  // Replaces the status line (empty: removes it).
  void set_status(const std::string& status);

 protected:
  void sink_it_(const spdlog::details::log_msg& msg) override;
  void flush_() override;

 private:
  bool terminal_;
  std::string status_;
};

// "[=========>          ] 45% 450/1000 steps | 4.2k tok/s | 1m20s left" for `width` bar
// characters, from what is done and the seconds elapsed since `done_at_start` was done.
std::string progress_line(int64_t done, int64_t total, int64_t done_at_start, double elapsed_s,
                          const std::string& unit, const std::string& extra, int width = 30);

// Seconds since construction or the last restart.
class Stopwatch {
 public:
  Stopwatch() : start_(std::chrono::steady_clock::now()) {}
  void restart() { start_ = std::chrono::steady_clock::now(); }
  double seconds() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }

 private:
  std::chrono::steady_clock::time_point start_;
};

// Seconds as "45s", "3m05s" or "2h07m".
std::string format_duration(double seconds);

}  // namespace cputrain
