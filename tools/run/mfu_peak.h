// The peak a training run's MFU is taken over: measured at start-up in about 0.1 s, which on a
// shared machine can run while something holds a core (seen: exactly half the peak). Where a
// step then runs at over 90% of it, the peak is measured again, longer, and the best kept; a
// step still above it has no MFU.
#pragma once

#include <functional>
#include <optional>

namespace cputrain {

class MfuPeak {
 public:
  // `gflops`: the start-up measurement (0: none, and no MFU); `measure`: a longer measurement.
  MfuPeak(double gflops, std::function<double()> measure);

  // After a step that ran at `model_gflops`: measures again where the step ran at over 90% of
  // the peak; returns whether it did.
  bool update(double model_gflops);
  // model_gflops over the peak, or nothing where there is no peak or the step ran above it.
  std::optional<double> mfu(double model_gflops) const;
  double gflops() const { return gflops_; }

 private:
  double gflops_;
  std::function<double()> measure_;
};

}  // namespace cputrain
