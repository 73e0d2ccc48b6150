// The register tile shared by the AVX-512 micro-kernels: MR rows x 32 columns of FP32
// accumulators (two zmm per row), and its store into C with beta and edge masks. Included by
// files compiled with AVX-512 flags only.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <type_traits>

#include "kernels/cpu/vec16.h"

namespace cputrain::kernels::detail {
namespace {

constexpr int kTileRows = 14;  // 28 accumulators + 2 B vectors + 1 broadcast of 32 zmm
constexpr int kTileCols = 32;

struct Tile {
  __m512 lo[kTileRows];
  __m512 hi[kTileRows];
};

// out[j] lane i = in[i] lane j.
inline __attribute__((always_inline)) void transpose16x16(__m512 r[16]) {
  __m512 t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    u[4 * i + 0] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xee);
    u[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xee);
  }
  for (int q = 0; q < 4; ++q) {
    const __m512 v = _mm512_shuffle_f32x4(u[q], u[4 + q], 0x88);
    const __m512 w = _mm512_shuffle_f32x4(u[q], u[4 + q], 0xdd);
    const __m512 v2 = _mm512_shuffle_f32x4(u[8 + q], u[12 + q], 0x88);
    const __m512 w2 = _mm512_shuffle_f32x4(u[8 + q], u[12 + q], 0xdd);
    r[q] = _mm512_shuffle_f32x4(v, v2, 0x88);
    r[8 + q] = _mm512_shuffle_f32x4(v, v2, 0xdd);
    r[4 + q] = _mm512_shuffle_f32x4(w, w2, 0x88);
    r[12 + q] = _mm512_shuffle_f32x4(w, w2, 0xdd);
  }
}

// Packs `rows` (<= 16) rows of `count` 4-byte elements, row r starting at src + r * row_bytes,
// transposed: dst[k * dst_stride + r] for k < count and r < lanes (<= 16); lanes at or past
// `rows` are written as zero. Each row is fetched 128 bytes ahead of its loads: the rows are
// read side by side, more streams than the hardware prefetcher follows.
inline void pack_transposed(void* dst_v, int64_t dst_stride, int lanes, const void* src_v,
                            int64_t row_bytes, int rows, int64_t count) {
  auto* dst = static_cast<float*>(dst_v);
  const auto* src = static_cast<const char*>(src_v);
  const __mmask16 lane_mask = static_cast<__mmask16>((1u << lanes) - 1);
  __m512 r[16];
  for (int64_t k = 0; k < count; k += 16) {
    const int rem = static_cast<int>(count - k < 16 ? count - k : 16);
    const __mmask16 load_mask = static_cast<__mmask16>((1u << rem) - 1);
    for (int i = 0; i < 16; ++i) {
      const float* row = reinterpret_cast<const float*>(src + i * row_bytes) + k;
      if (i < rows) _mm_prefetch(reinterpret_cast<const char*>(row + 32), _MM_HINT_T0);
      // Plain loads for whole chunks: masked loads that miss the cache are much slower.
      r[i] = i >= rows   ? _mm512_setzero_ps()
             : rem == 16 ? _mm512_loadu_ps(row)
                         : _mm512_maskz_loadu_ps(load_mask, row);
    }
    transpose16x16(r);
    for (int kk = 0; kk < rem; ++kk)
      _mm512_mask_storeu_ps(dst + (k + kk) * dst_stride, lane_mask, r[kk]);
  }
}

// The lanes of vector v (columns 16 v .. 16 v + 15) of a 32-column row below column n.
inline __mmask16 columns_mask(int64_t n, int v) {
  const int64_t k = n - 16 * v;
  return k >= 16 ? 0xffff : k > 0 ? static_cast<__mmask16>((1u << k) - 1) : 0;
}

// Starts fetching the C tile, so that it has arrived when the K loop ends.
inline __attribute__((always_inline)) void prefetch_tile(const float* C, int64_t ldc, int m) {
  for (int r = 0; r < m; ++r) {
    _mm_prefetch(reinterpret_cast<const char*>(C + r * ldc), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(C + r * ldc + 16), _MM_HINT_T0);
  }
}

// row[0:n] = (lo, hi) + beta * row (beta 0 overwrites, never reading the row); n <= 32.
inline __attribute__((always_inline)) void store_row(float* row, __m512 lo, __m512 hi, float beta,
                                                     int n) {
  const __mmask16 mask_lo = columns_mask(n, 0), mask_hi = columns_mask(n, 1);
  if (beta != 0.0f) {
    // Plain loads for whole vectors: masked loads that miss L1 are much slower.
    const __m512 vbeta = _mm512_set1_ps(beta);
    const __m512 c_lo = n >= 16 ? _mm512_loadu_ps(row) : _mm512_maskz_loadu_ps(mask_lo, row);
    const __m512 c_hi =
        n >= 32 ? _mm512_loadu_ps(row + 16) : _mm512_maskz_loadu_ps(mask_hi, row + 16);
    lo = _mm512_fmadd_ps(vbeta, c_lo, lo);
    hi = _mm512_fmadd_ps(vbeta, c_hi, hi);
  }
  _mm512_mask_storeu_ps(row, mask_lo, lo);
  _mm512_mask_storeu_ps(row + 16, mask_hi, hi);
}

// row[0:n] = the bf16 roundings of (lo, hi) (vec::store_bf16, as fp32_to_bf16 rounds); n <= 32.
inline __attribute__((always_inline)) void store_row_bf16(uint16_t* row, __m512 lo, __m512 hi,
                                                          int n) {
  vec::store_bf16(row, (vec::vf)lo, n < 16 ? n : 16);
  if (n > 16) vec::store_bf16(row + 16, (vec::vf)hi, n - 16);
}

// C[0:m, 0:n] = tile + beta * C.
inline __attribute__((always_inline)) void store_tile(const Tile& t, float* C, int64_t ldc,
                                                      float beta, int m, int n) {
#pragma GCC unroll 14
  for (int r = 0; r < kTileRows; ++r) {
    if (r >= m) break;
    store_row(C + r * ldc, t.lo[r], t.hi[r], beta, n);
  }
}

// C[0:m, 0:n] = the tile rounded to bf16 (no beta: a rounded C is never accumulated into).
inline __attribute__((always_inline)) void store_tile(const Tile& t, uint16_t* C, int64_t ldc,
                                                      float, int m, int n) {
#pragma GCC unroll 14
  for (int r = 0; r < kTileRows; ++r) {
    if (r >= m) break;
    store_row_bf16(C + r * ldc, t.lo[r], t.hi[r], n);
  }
}

// K steps before the end of a micro-kernel's loop at which it fetches an FP32 C tile: late
// enough that the lines are not evicted again by the A and B panels streaming through L1,
// early enough to arrive from L2 or L3 in time.
constexpr int64_t kPrefetchCSteps = 32;

// f(std::integral_constant<int, R>) for R, the rows a tile of m rows (1 <= m <= kTileRows)
// computes: m rounded up to even. A tile's last rows cost their own rows, not a whole tile's
// (M = 512 ends in 8 rows).
template <class F>
inline __attribute__((always_inline)) void with_rows(int m, F f) {
  static_assert(kTileRows == 14, "with_rows covers the even row counts up to 14");
  switch ((m + 1) / 2) {
    case 1:
      return f(std::integral_constant<int, 2>{});
    case 2:
      return f(std::integral_constant<int, 4>{});
    case 3:
      return f(std::integral_constant<int, 6>{});
    case 4:
      return f(std::integral_constant<int, 8>{});
    case 5:
      return f(std::integral_constant<int, 10>{});
    case 6:
      return f(std::integral_constant<int, 12>{});
    default:
      return f(std::integral_constant<int, kTileRows>{});
  }
}

// The frame of the AVX-512 micro-kernels: C[0:m, 0:n] = the sum over K steps 0..kp + beta C,
// where steps(t, k0, k1, rows) adds the products of steps k0..k1 to the first `rows` rows of
// the tile t (a std::integral_constant, m or m + 1).
template <class CT, class Steps>
inline __attribute__((always_inline)) void micro_tile(int64_t kp, Steps steps, CT* C, int64_t ldc,
                                                      float beta, int m, int n) {
  with_rows(m, [&](auto rows) {
    constexpr int R = decltype(rows)::value;
    Tile t;
#pragma GCC unroll 14
    for (int r = 0; r < R; ++r) t.lo[r] = t.hi[r] = _mm512_setzero_ps();
    const int64_t late = kp > kPrefetchCSteps ? kp - kPrefetchCSteps : 0;
    steps(t, 0, late, rows);
    if constexpr (std::is_same_v<CT, float>) prefetch_tile(C, ldc, m);
    steps(t, late, kp, rows);
    store_tile(t, C, ldc, beta, m, n);
  });
}

// micro_tile over K steps 0..kp in blocks of `block` steps, the tile stored into C after each
// (beta on the first only): the bits of one product per block, with the tile in L1 between
// them.
template <class Steps>
inline __attribute__((always_inline)) void micro_tile_blocks(int64_t kp, int64_t block, Steps steps,
                                                             float* C, int64_t ldc, float beta,
                                                             int m, int n) {
  for (int64_t k0 = 0; k0 < kp; k0 += block) {
    const auto part = [&](Tile & t, int64_t k1, int64_t k2, auto rows)
        __attribute__((always_inline)) {
      steps(t, k0 + k1, k0 + k2, rows);
    };
    micro_tile(kp - k0 < block ? kp - k0 : block, part, C, ldc, k0 == 0 ? beta : 1.0f, m, n);
  }
}

}  // namespace
}  // namespace cputrain::kernels::detail
