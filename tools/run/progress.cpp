#include "tools/run/progress.h"

#include <spdlog/fmt/fmt.h>

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace cputrain {

void ProgressSink::set_status(const std::string& status) {
  std::lock_guard lock(mutex_);
  if (!terminal_) return;
  status_ = status;
  std::fputs("\r\033[K", stdout);
  std::fputs(status_.c_str(), stdout);
  std::fflush(stdout);
}

void ProgressSink::sink_it_(const spdlog::details::log_msg& msg) {
  spdlog::memory_buf_t formatted;
  formatter_->format(msg, formatted);
  // Warnings and errors go to stderr, the rest to stdout.
  std::FILE* stream = msg.level >= spdlog::level::warn ? stderr : stdout;
  if (terminal_ && !status_.empty()) {
    std::fputs("\r\033[K", stdout);
    std::fflush(stdout);
  }
  std::fwrite(formatted.data(), 1, formatted.size(), stream);
  std::fflush(stream);
  if (terminal_ && !status_.empty()) std::fputs(status_.c_str(), stdout);
  std::fflush(stdout);
}

void ProgressSink::flush_() {
  std::fflush(stdout);
}

std::string format_duration(double seconds) {
  const auto s = static_cast<int64_t>(std::max(0.0, std::round(seconds)));
  if (s < 60) return fmt::format("{}s", s);
  if (s < 3600) return fmt::format("{}m{:02}s", s / 60, s % 60);
  return fmt::format("{}h{:02}m", s / 3600, s % 3600 / 60);
}

std::string progress_line(int64_t done, int64_t total, int64_t done_at_start, double elapsed_s,
                          const std::string& unit, const std::string& extra, int width) {
  const double fraction = total > 0 ? std::clamp(static_cast<double>(done) / total, 0.0, 1.0) : 0.0;
  const int filled = static_cast<int>(fraction * width);
  std::string bar(static_cast<size_t>(width), ' ');
  std::fill(bar.begin(), bar.begin() + filled, '=');
  if (filled < width && done > 0) bar[static_cast<size_t>(filled)] = '>';
  std::string left = "-";
  const int64_t since = done - done_at_start;
  if (since > 0 && elapsed_s > 0.0)
    left =
        format_duration(elapsed_s / static_cast<double>(since) * static_cast<double>(total - done));
  return fmt::format("[{}] {:3.0f}% {}/{} {}{}{} | {} left", bar, 100.0 * fraction, done, total,
                     unit, extra.empty() ? "" : " | ", extra, left);
}

}  // namespace cputrain
