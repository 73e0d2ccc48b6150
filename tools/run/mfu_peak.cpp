#include "tools/run/mfu_peak.h"

#include <algorithm>
#include <utility>

namespace cputrain {

MfuPeak::MfuPeak(double gflops, std::function<double()> measure)
    : gflops_(gflops), measure_(std::move(measure)) {}

bool MfuPeak::update(double model_gflops) {
  if (gflops_ <= 0 || model_gflops <= 0.9 * gflops_) return false;
  gflops_ = std::max(gflops_, measure_());
  return true;
}

std::optional<double> MfuPeak::mfu(double model_gflops) const {
  if (gflops_ <= 0 || model_gflops > gflops_) return std::nullopt;
  return model_gflops / gflops_;
}

}  // namespace cputrain
