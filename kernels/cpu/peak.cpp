#include "kernels/cpu/peak.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>

#include "kernels/cpu/dispatch.h"
#include "kernels/cpu/peak_chains.h"

namespace cputrain::kernels {

double fma_f32_avx2_loop(int64_t iterations) {
  const __m256 x = _mm256_set1_ps(0.999f), y = _mm256_set1_ps(1e-4f);
  return run_chains<__m256>(iterations, 8 * 2,
                            [&](__m256 acc) { return _mm256_fmadd_ps(acc, x, y); });
}

namespace {

// The loops each level measures: FP32 FMA, vdpbf16ps, AMX tdpbf16ps (null: none at that level).
struct PeakLoops {
  double (*f32)(int64_t);
  double (*bf16)(int64_t);
  double (*amx)(int64_t);
};
// The implementations, fastest first (kernels/cpu/dispatch.h).
using PeakRow = KernelChoice<PeakLoops>;
const PeakRow kPeak[] = {
    {{"amx", Isa::Amx}, {fma_f32_avx512_loop, dpbf16_avx512_loop, tdpbf16_amx_loop}},
    {{"avx512_bf16", Isa::Avx512Bf16}, {fma_f32_avx512_loop, dpbf16_avx512_loop, nullptr}},
    {{"avx512", Isa::Avx512}, {fma_f32_avx512_loop, nullptr, nullptr}},
    {{"avx2", Isa::Avx2}, {fma_f32_avx2_loop, nullptr, nullptr}},
};

const PeakRow& chosen() {
  static const PeakRow& row = choose_kernel("peak", kPeak);
  return row;
}

// The best of several runs: interference from elsewhere only ever lowers a peak.
template <typename Loop>
double best_rate(Loop loop, int threads, int64_t iterations, int repetitions) {
  double best = 0.0;
  for (int rep = 0; rep < repetitions; ++rep) {
    const auto start = std::chrono::steady_clock::now();
    double flops = 0;
#pragma omp parallel num_threads(threads) reduction(+ : flops)
    flops += loop(iterations);
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    best = std::max(best, flops / s / 1e9);
  }
  return best;
}

}  // namespace

Peak higher_peak(const Peak& a, const Peak& b) {
  Peak p;
  p.f32_one_thread = std::max(a.f32_one_thread, b.f32_one_thread);
  p.f32_all_threads = std::max(a.f32_all_threads, b.f32_all_threads);
  p.bf16_one_thread = std::max(a.bf16_one_thread, b.bf16_one_thread);
  p.bf16_all_threads = std::max(a.bf16_all_threads, b.bf16_all_threads);
  p.amx_one_thread = std::max(a.amx_one_thread, b.amx_one_thread);
  p.amx_all_threads = std::max(a.amx_all_threads, b.amx_all_threads);
  return p;
}

std::string_view peak_kernel() {
  return chosen().row.name;
}

Peak measure_peak(int64_t iterations, int repetitions) {
  Peak p;
  const PeakLoops& loops = chosen().entry;
  const int all = omp_get_max_threads();
  p.f32_one_thread = best_rate(loops.f32, 1, iterations, repetitions);
  p.f32_all_threads = best_rate(loops.f32, all, iterations, repetitions);
  if (loops.bf16 != nullptr) {
    p.bf16_one_thread = best_rate(loops.bf16, 1, iterations, repetitions);
    p.bf16_all_threads = best_rate(loops.bf16, all, iterations, repetitions);
  }
  if (loops.amx != nullptr) {
    p.amx_one_thread = best_rate(loops.amx, 1, iterations, repetitions);
    p.amx_all_threads = best_rate(loops.amx, all, iterations, repetitions);
  }
  return p;
}

}  // namespace cputrain::kernels
