// Peak arithmetic rate of this machine, measured with register-resident loops: the
// denominator of model FLOP utilisation (MFU) in training logs and of % of peak in benchmarks.
#pragma once

#include <cstdint>

namespace cputrain::kernels {

// Each runs `iterations` rounds of 16 independent vector instructions and returns the flops
// done. The AVX-512 ones only where the CPU has AVX-512 (and AVX512_BF16 for the second).
double fma_f32_avx2_loop(int64_t iterations);
double fma_f32_avx512_loop(int64_t iterations);
double dpbf16_avx512_loop(int64_t iterations);

struct Peak {
  double f32_one_thread = 0, f32_all_threads = 0;    // GFLOP/s
  double bf16_one_thread = 0, bf16_all_threads = 0;  // GFLOP/s
};

// The best of `repetitions` timed runs of `iterations` rounds each, on 1 thread and on all
// threads; zero for a rate this CPU cannot reach with vector instructions (bf16 without
// AVX512_BF16). FP32 uses AVX-512 where the CPU has it, else AVX2. With the defaults it takes a
// few seconds (benchmarks); training uses a short measurement.
Peak measure_peak(int64_t iterations = 20'000'000, int repetitions = 5);

}  // namespace cputrain::kernels
