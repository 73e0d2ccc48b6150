#include "engine/train/lr_schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace cputrain {

double learning_rate(const LrSchedule& s, int64_t step) {
  if (s.warmup_steps > 0 && step <= s.warmup_steps)
    return s.peak * static_cast<double>(step) / static_cast<double>(s.warmup_steps);
  if (s.beyond_ratio >= 0.0 && step > s.total_steps) return s.peak * s.beyond_ratio;
  const double min_lr = s.peak * s.min_ratio;
  const int64_t decay_steps = s.total_steps - s.warmup_steps;
  if (decay_steps <= 0) return s.peak;
  const double progress = std::clamp(
      static_cast<double>(step - s.warmup_steps) / static_cast<double>(decay_steps), 0.0, 1.0);
  return min_lr + (s.peak - min_lr) * 0.5 * (1.0 + std::cos(std::numbers::pi * progress));
}

}  // namespace cputrain
