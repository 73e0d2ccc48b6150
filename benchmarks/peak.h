// Peak arithmetic rate of this machine, measured with register-resident loops.
#pragma once

#include <cstdint>

namespace cputrain::bench {

// Each runs `iterations` rounds of 16 independent AVX-512 instructions and returns the flops
// done. Only call where the CPU has AVX-512 (and AVX512_BF16 for the second).
double fma_f32_loop(int64_t iterations);
double dpbf16_loop(int64_t iterations);

struct Peak {
  double f32_one_thread = 0, f32_all_threads = 0;    // GFLOP/s
  double bf16_one_thread = 0, bf16_all_threads = 0;  // GFLOP/s
};

// Best of several timed runs; zero for a rate this CPU cannot measure.
Peak measure_peak();

}  // namespace cputrain::bench
