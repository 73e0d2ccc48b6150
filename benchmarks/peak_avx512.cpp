// Register-resident loops that measure this machine's peak FP32 FMA and BF16 dot-product rate:
// independent accumulator chains, enough to cover the instruction latency, no memory traffic.
#include <immintrin.h>

#include "benchmarks/peak.h"

namespace cputrain::bench {
namespace {

constexpr int kChains = 16;

// Runs `iterations` rounds of one `step` on each of kChains accumulators, keeps the result
// alive so nothing is optimised away, and returns the flops done.
template <typename Step>
inline __attribute__((always_inline)) double run_chains(int64_t iterations,
                                                        double flops_per_step, Step step) {
  __m512 acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t it = 0; it < iterations; ++it) {
#pragma GCC unroll 16
    for (int i = 0; i < kChains; ++i) acc[i] = step(acc[i]);
  }
  __m512 sum = acc[0];
  for (int i = 1; i < kChains; ++i) sum = _mm512_add_ps(sum, acc[i]);
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, sum);
  volatile float sink = lanes[0];
  (void)sink;
  return static_cast<double>(iterations) * kChains * flops_per_step;
}

}  // namespace

double fma_f32_loop(int64_t iterations) {
  const __m512 x = _mm512_set1_ps(0.999f), y = _mm512_set1_ps(1e-4f);
  return run_chains(iterations, 16 * 2, [&](__m512 acc) { return _mm512_fmadd_ps(acc, x, y); });
}

double dpbf16_loop(int64_t iterations) {
  const __m512bh x = (__m512bh)_mm512_set1_epi32(0x3f803f80);  // (1, 1)
  const __m512bh y = (__m512bh)_mm512_set1_epi32(0x3a803a80);  // (~1e-3, ~1e-3)
  // 32 products (16 lanes x 2) per instruction.
  return run_chains(iterations, 32 * 2, [&](__m512 acc) { return _mm512_dpbf16_ps(acc, x, y); });
}

}  // namespace cputrain::bench
