// Register-resident loops that measure this machine's peak FP32 FMA and BF16 dot-product rate:
// independent accumulator chains, enough to cover the instruction latency, no memory traffic.
#include <immintrin.h>

#include "kernels/cpu/peak.h"
#include "kernels/cpu/peak_chains.h"

namespace cputrain::kernels {

double fma_f32_avx512_loop(int64_t iterations) {
  const __m512 x = _mm512_set1_ps(0.999f), y = _mm512_set1_ps(1e-4f);
  return run_chains<__m512>(iterations, 16 * 2,
                            [&](__m512 acc) { return _mm512_fmadd_ps(acc, x, y); });
}

double dpbf16_avx512_loop(int64_t iterations) {
  const __m512bh x = (__m512bh)_mm512_set1_epi32(0x3f803f80);  // (1, 1)
  const __m512bh y = (__m512bh)_mm512_set1_epi32(0x3a803a80);  // (~1e-3, ~1e-3)
  // 32 products (16 lanes x 2) per instruction.
  return run_chains<__m512>(iterations, 32 * 2,
                            [&](__m512 acc) { return _mm512_dpbf16_ps(acc, x, y); });
}

}  // namespace cputrain::kernels
