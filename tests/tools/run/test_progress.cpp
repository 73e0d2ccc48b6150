// The progress line's content and time left, and that the console sink draws it only on a
// terminal.
#include <gtest/gtest.h>
#include <spdlog/spdlog.h>

#include <memory>
#include <string>

#include "tools/run/progress.h"

namespace cputrain {
namespace {

TEST(Progress, DurationFormats) {
  EXPECT_EQ(format_duration(0.4), "0s");
  EXPECT_EQ(format_duration(45), "45s");
  EXPECT_EQ(format_duration(185), "3m05s");
  EXPECT_EQ(format_duration(2 * 3600 + 7 * 60 + 59), "2h07m");
  EXPECT_EQ(format_duration(-3), "0s");
}

TEST(Progress, LineShowsBarFractionAndTimeLeft) {
  // 25 of 100 steps in 50 s: 2 s a step, 75 steps left.
  const std::string line = progress_line(25, 100, 0, 50.0, "steps", "loss 2.000", 20);
  EXPECT_EQ(line, "[=====>              ]  25% 25/100 steps | loss 2.000 | 2m30s left");
  // Resumed at step 50: the rate counts only the steps done since.
  EXPECT_NE(progress_line(60, 100, 50, 10.0, "steps", "", 10).find("| 40s left"),
            std::string::npos);
  // Nothing done yet: no estimate; all done: a full bar.
  EXPECT_NE(progress_line(0, 10, 0, 0.0, "steps", "", 10).find("| - left"), std::string::npos);
  EXPECT_EQ(progress_line(10, 10, 0, 5.0, "steps", "", 4), "[====] 100% 10/10 steps | 0s left");
}

std::string log_through(bool terminal) {
  auto sink = std::make_shared<ProgressSink>(terminal);
  spdlog::logger logger("progress-test", sink);
  logger.set_pattern("%v");
  testing::internal::CaptureStdout();
  sink->set_status("[==> ] 50%");
  logger.info("a log line");
  sink->set_status("");
  return testing::internal::GetCapturedStdout();
}

TEST(Progress, StatusOnlyOnATerminal) {
  EXPECT_EQ(log_through(false), "a log line\n");
  const std::string tty = log_through(true);
  // The status is drawn, cleared for the log line, drawn again under it, and cleared at the end.
  EXPECT_EQ(tty, "\r\033[K[==> ] 50%\r\033[Ka log line\n[==> ] 50%\r\033[K");
}

}  // namespace
}  // namespace cputrain
