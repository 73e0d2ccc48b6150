// Register-resident loops that measure this machine's peak FP32 FMA and BF16 dot-product rate:
// independent accumulator chains, enough to cover the instruction latency, no memory traffic.
#include <immintrin.h>

#include "benchmarks/peak.h"

namespace cputrain::bench {
namespace {

// Keeps the result alive so the loop is not optimised away.
void keep(__m512 v) {
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, v);
  volatile float sink = lanes[0];
  (void)sink;
}

}  // namespace

double fma_f32_loop(int64_t iterations) {
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_set1_ps(static_cast<float>(i) * 1e-3f);
  const __m512 x = _mm512_set1_ps(0.999f), y = _mm512_set1_ps(1e-4f);
  for (int64_t it = 0; it < iterations; ++it) {
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_fmadd_ps(acc[i], x, y);
  }
  __m512 sum = acc[0];
  for (int i = 1; i < 16; ++i) sum = _mm512_add_ps(sum, acc[i]);
  keep(sum);
  return static_cast<double>(iterations) * 16 * 16 * 2;  // flops
}

double dpbf16_loop(int64_t iterations) {
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  const __m512bh x = (__m512bh)_mm512_set1_epi32(0x3f803f80), y = (__m512bh)_mm512_set1_epi32(0x3a803a80);
  for (int64_t it = 0; it < iterations; ++it) {
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], x, y);
  }
  __m512 sum = acc[0];
  for (int i = 1; i < 16; ++i) sum = _mm512_add_ps(sum, acc[i]);
  keep(sum);
  return static_cast<double>(iterations) * 16 * 32 * 2;  // 32 products per instruction
}

}  // namespace cputrain::bench
