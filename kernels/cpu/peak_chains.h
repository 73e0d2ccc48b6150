// The loop behind the peak measurements (kernels/cpu/peak.h): independent accumulator chains,
// enough to cover the instruction latency, no memory traffic. Included by files compiled for
// the vector type's ISA.
#pragma once

#include <cstdint>
#include <cstring>

namespace cputrain::kernels {
namespace {

constexpr int kChains = 16;

// Runs `iterations` rounds of one `step` on each of kChains accumulators of type V (zeroed),
// keeps the result alive so nothing is optimised away, and returns the flops done.
template <typename V, typename Step>
inline __attribute__((always_inline)) double run_chains(int64_t iterations, double flops_per_step,
                                                        Step step) {
  V acc[kChains];
  for (int i = 0; i < kChains; ++i) std::memset(&acc[i], 0, sizeof(V));
  for (int64_t it = 0; it < iterations; ++it) {
#pragma GCC unroll 16
    for (int i = 0; i < kChains; ++i) acc[i] = step(acc[i]);
  }
  float lanes[sizeof(V) / sizeof(float)];
  float total = 0.0f;
  for (int i = 0; i < kChains; ++i) {
    std::memcpy(lanes, &acc[i], sizeof(V));
    total += lanes[0];
  }
  volatile float sink = total;
  (void)sink;
  return static_cast<double>(iterations) * kChains * flops_per_step;
}

}  // namespace
}  // namespace cputrain::kernels
