// Learning rate: linear warm-up to the peak, then cosine decay to min_ratio * peak.
#pragma once

#include <cstdint>

namespace cputrain {

struct LrSchedule {
  double peak = 3e-4;
  int64_t warmup_steps = 0;
  int64_t total_steps = 1;
  double min_ratio = 0.1;
  // The rate of the steps past total_steps, a run extended beyond the schedule it began with, as
  // a fraction of the peak (negative: min_ratio's, where the decay ended).
  double beyond_ratio = -1.0;
};

// Rate for 1-based step `step`: peak * step / warmup during warm-up; afterwards
// min + (peak - min) * (1 + cos(pi * progress)) / 2, progress running from 0 after warm-up to 1
// at total_steps (and held at min beyond it, or at beyond_ratio * peak where that is set).
double learning_rate(const LrSchedule& schedule, int64_t step);

}  // namespace cputrain
