// Packing of bf16 values as K pairs, the operand layout of vdpbf16ps: one 32-bit element holds
// the bf16 values of k = 2p (low half) and k = 2p + 1 (high half). Shared by the AVX-512 BF16
// GEMM and attention; included by files compiled with AVX-512 BW flags only.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace cputrain::kernels::detail {
namespace {

inline uint32_t bf16_pair(uint16_t lo, uint16_t hi) {
  return static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
}

// Row `row` of n values (n may exceed 32; null: zeros) as 32 lanes of 16 bits, lanes at or past
// n zero. Plain loads where the row holds 32 values: masked loads that miss the cache are much
// slower.
inline __m512i read_bf16_row(const uint16_t* row, int64_t n) {
  if (row == nullptr) return _mm512_setzero_si512();
  if (n >= 32) return _mm512_loadu_si512(row);
  return _mm512_maskz_loadu_epi16(static_cast<__mmask32>((1u << n) - 1), row);
}

// The pairs (x0[c], x1[c]) of 32 lanes of 16 bits: c < 16 in *first, 16 <= c < 32 in *second.
inline __attribute__((always_inline)) void pairs_of(__m512i x0, __m512i x1, __m512i* first,
                                                    __m512i* second) {
  // unpacklo/hi work within 128-bit lanes; the permutes put columns back in order.
  const __m512i lo = _mm512_unpacklo_epi16(x0, x1), hi = _mm512_unpackhi_epi16(x0, x1);
  *first = _mm512_permutex2var_epi64(lo, _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0), hi);
  *second = _mm512_permutex2var_epi64(lo, _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4), hi);
}

// dst[c] = (row0[c], row1[c]) for c < lanes (<= 32) (row1 null: zeros), where the rows hold n
// values (n may exceed lanes); lanes at or past n are zero.
inline void interleave_pairs(uint32_t* dst, const uint16_t* row0, const uint16_t* row1, int64_t n,
                             int lanes) {
  __m512i first, second;
  pairs_of(read_bf16_row(row0, n), read_bf16_row(row1, n), &first, &second);
  const __mmask16 first_mask = lanes >= 16 ? 0xffff : static_cast<__mmask16>((1u << lanes) - 1);
  _mm512_mask_storeu_epi32(dst, first_mask, first);
  if (lanes > 16)
    _mm512_mask_storeu_epi32(dst + 16, static_cast<__mmask16>((1u << (lanes - 16)) - 1), second);
}

}  // namespace
}  // namespace cputrain::kernels::detail
