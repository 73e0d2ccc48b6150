// Peak arithmetic rate of this machine, measured with register-resident loops: the
// denominator of model FLOP utilisation (MFU) in training logs and of % of peak in benchmarks.
#pragma once

#include <cstdint>
#include <string_view>

namespace cputrain::kernels {

// The level measure_peak measures at: amx, avx512_bf16, avx512 or avx2 (kernels/cpu/dispatch.h).
std::string_view peak_kernel();

// Each runs `iterations` rounds of 16 independent vector instructions and returns the flops
// done. The AVX-512 ones only where the CPU has AVX-512 (and AVX512_BF16 for the second).
double fma_f32_avx2_loop(int64_t iterations);
double fma_f32_avx512_loop(int64_t iterations);
double dpbf16_avx512_loop(int64_t iterations);
// The same for AMX tdpbf16ps (iterations / 4 rounds of two), only where AMX is usable.
double tdpbf16_amx_loop(int64_t iterations);

struct Peak {
  double f32_one_thread = 0, f32_all_threads = 0;    // GFLOP/s
  double bf16_one_thread = 0, bf16_all_threads = 0;  // GFLOP/s, vdpbf16ps
  double amx_one_thread = 0, amx_all_threads = 0;    // GFLOP/s, AMX tdpbf16ps (0 without AMX)

  // The BF16 rate this machine's best BF16 path runs at: AMX where the CPU has it.
  double bf16_best_all_threads() const {
    return amx_all_threads > 0 ? amx_all_threads : bf16_all_threads;
  }
  const char* bf16_best_instruction() const {
    return amx_all_threads > 0 ? "AMX tdpbf16ps" : "vdpbf16ps";
  }
};

// Each rate the higher of a's and b's: a peak measured twice, at the start and the end of a
// benchmark run (on a shared machine, one of the two may fall in a slower spell).
Peak higher_peak(const Peak& a, const Peak& b);

// The best of `repetitions` timed runs of `iterations` rounds each, on 1 thread and on all
// threads, with the loops of peak_kernel(); zero for a rate that level has no instruction for
// (bf16 below avx512_bf16, AMX below amx). FP32 uses AVX-512 from avx512 up, else AVX2. With the
// defaults it takes a few seconds (benchmarks); training uses a short measurement.
Peak measure_peak(int64_t iterations = 20'000'000, int repetitions = 5);

}  // namespace cputrain::kernels
