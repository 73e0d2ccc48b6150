// Causal attention on bf16 q, k, v with vdpbf16ps (AVX-512 BF16): the tiled scheme of
// attention_tiled.h (64 queries x 64 keys, online softmax, probabilities recomputed from the
// saved log-sum-exp in the backward), with every product a dot product of bf16 pairs into FP32
// accumulators (vdpbf16ps, or AMX tiles over the same operands where the caller asks: amx).
// Scores, the softmax statistics, dP and all accumulations stay FP32, the exponentials taken in
// base 2 with a polynomial accurate to 2.7e-6 (exp2_lanes); the probabilities P, the
// output gradient dO and the score gradients dS are rounded to bf16 where they enter a product,
// and the output is written rounded to bf16.
// dQ = dS K and dK = dS^T Q take K and Q less their means over the sequence, m_K and m_Q:
// dK adds m_Q times the column sums of dS, kept exact in FP32, so that the rounding error of dS
// scales with the spread of the queries, not their size. Keys share a large common component,
// and a row of dS sums to zero, so dQ is a small difference of large terms: with dS K as it is,
// one rounding of dS made training measurably worse (cputrain parity, three seeds: +0.01 to
// +0.03 nats over FP32-widened attention). dQ = dS (K - m_K) alone: the row sums of dS are 0
// (sum_j P_ij (dP_ij - D_i) with D_i = sum_j P_ij dP_ij), and the sums as computed are not,
// D_i coming from the output rounded to bf16, so adding m_K times them added that error times
// the keys' mean (q and k sharing a component of sigma 12: dQ's relative error 0.10 with them,
// 8.1e-3 without, AttentionBf16.GradientsAccurateWhenKeysAndQueriesShareAComponent). With
// soft-capping dS has a factor 1 - tanh^2 that varies along the row, its rows do not sum to 0, and
// m_K times their sums is added.
//
// Grouped-query attention: H query heads, KVH key/value heads, query head h reading key/value
// head h / (H / KVH); q, out, dq, dout rows of H * D values, k, v, dk, dv rows of KVH * D.
//
// The operands, each packed once per head that owns it:
//   pairs along D    Q, K, dO rows as (T, Dp / 2) pairs: the left operand of S and dP;
//   K^T and V^T      per key tile, (Dp / 2, 64) pairs: the right operand of S and dP;
//   pairs along T    V, K, Q, dO as (T / 2, Dp): the right operand of P V, dS K, and of
//                    dK = dS^T Q and dV = P^T dO, whose left operands dS^T and P^T are read
//                    down the columns of dS and P as pairs along the queries;
//   Q^T and dO^T     (Dp, T / 2) pairs along T, on AMX only, whose tiles take rows: the left
//                    operand of dK^T = Q^T dS and dV^T = dO^T P there (the same sums).
// Where D is a multiple of 16 (no padding) and the products run on vdpbf16ps, Q's rows are read
// where they are stored, and K^T, V's pairs along T, the means and the centred rows are packed
// straight from the stored rows, without the copies as rows of pairs.
// Forward: one task per (batch, query head), which packs Q, and its key/value head's K^T and V
// unless the thread's previous task left them packed. Backward: one task per (batch, key/value
// head), which packs the key/value head's operands (K, K^T, V^T, m_K, K - m_K) once, then runs
// the group's query heads g in order, packing each one's (Q, dO, m_Q, Q - m_Q, their pairs
// along T and transposes); dk and dv receive the query heads' contributions in the order
// g = 0, 1, ... Within a task the order of every sum is fixed, so results do not depend on the
// thread count.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels/attention/attention_isa.h"
#include "kernels/cpu/bf16_dot_avx512.h"
#include "kernels/cpu/bf16_pairs_avx512.h"
#include "kernels/cpu/vec16.h"
#include "kernels/gemm/gemm_avx512_tile.h"

namespace cputrain::kernels {
namespace {

constexpr int64_t kTile = kAttentionTile;
constexpr int64_t kTilePairs = 32;  // pairs along a tile's 64 positions

using detail::dp_product;
using detail::dp_product_pair_rows;

// A buffer of the calling thread, grown on demand and kept for the next call.
template <int Which>
uint32_t* thread_buffer(size_t words) {
  thread_local std::vector<uint32_t> buffer;
  if (buffer.size() < words) buffer.assign(words, 0u);
  return buffer.data();
}

// On a diagonal tile (the key tile from the query tile's first query), query r attends keys up
// to r: scores_product computes each 16 rows' scores only up to the block's last key (the
// columns past it, which the softmax masks, keep what they held), and probs_product adds only
// the pairs of keys up to it (the probabilities past it are 0). Elsewhere, the whole tile.
// C[0:rows, 0:64] = A B over `pairs`.
void scores_product(bool amx, bool diagonal, float* C, int64_t ldc, const uint32_t* A, int64_t lda,
                    const uint32_t* B, int64_t ldb, int64_t rows, int64_t pairs) {
  if (!diagonal) return dp_product(amx, C, ldc, A, lda, B, ldb, rows, kTile, pairs, false);
  for (int64_t r0 = 0; r0 < rows; r0 += 16)
    dp_product(amx, C + r0 * ldc, ldc, A + r0 * lda, lda, B, ldb, std::min<int64_t>(16, rows - r0),
               r0 + 16, pairs, false);
}
// C[0:rows, 0:N] += A B over a tile's 32 pairs of keys (AMX's: whole tiles of 16 pairs).
void probs_product(bool amx, bool diagonal, float* C, int64_t ldc, const uint32_t* A, int64_t lda,
                   const uint32_t* B, int64_t ldb, int64_t rows, int64_t N) {
  if (!diagonal) return dp_product(amx, C, ldc, A, lda, B, ldb, rows, N, kTilePairs, true);
  for (int64_t r0 = 0; r0 < rows; r0 += 16) {
    const int64_t pairs =
        amx ? std::min<int64_t>(kTilePairs, (r0 + 16 + 31) / 32 * 16) : r0 / 2 + 8;
    dp_product(amx, C + r0 * ldc, ldc, A + r0 * lda, lda, B, ldb, std::min<int64_t>(16, rows - r0),
               N, pairs, true);
  }
}

// rows 0..Tp of (Dp / 2) pairs: dst[t] = src row t (stride `stride`, D values), zero past D and
// past T.
void rows_as_pairs(uint32_t* dst, const uint16_t* src, int64_t stride, int64_t T, int64_t Tp,
                   int64_t D, int64_t Dp) {
  auto* out = reinterpret_cast<uint16_t*>(dst);
  for (int64_t t = 0; t < Tp; ++t) {
    uint16_t* o = out + t * Dp;
    if (t < T) std::memcpy(o, src + t * stride, sizeof(uint16_t) * static_cast<size_t>(D));
    std::fill(o + (t < T ? D : 0), o + Dp, uint16_t{0});
  }
}

// Pairs along T: dst[p][c] = (rows[2p][c], rows[2p + 1][c]) for p < Tp / 2, c < Dp, from rows
// of Dp bf16 values (zero past D and past T, as rows_as_pairs writes them).
void pairs_along_rows(uint32_t* dst, const uint32_t* rows, int64_t Tp, int64_t Dp) {
  const auto* in = reinterpret_cast<const uint16_t*>(rows);
  for (int64_t p = 0; p < Tp / 2; ++p)
    for (int64_t c = 0; c < Dp; c += 32) {
      const int n = static_cast<int>(std::min<int64_t>(32, Dp - c));
      detail::interleave_pairs(dst + p * Dp + c, in + 2 * p * Dp + c, in + (2 * p + 1) * Dp + c, n,
                               n);
    }
}

// dst (cols x rows) = the transpose of src (rows x cols) of 32-bit elements, rows a multiple
// of 16.
void transpose_words(uint32_t* dst, const uint32_t* src, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; r += 16)
    detail::pack_transposed(dst + r, rows, 16, src + r * cols, cols * 4, 16, cols);
}

// K^T pairs per key tile: dst + tile * (Dp / 2) * 64 holds (Dp / 2) x 64, from rows as pairs.
void key_tiles_transposed(uint32_t* dst, const uint32_t* rows, int64_t Tp, int64_t Dp) {
  const int64_t Dh = Dp / 2;
  for (int64_t j0 = 0; j0 < Tp; j0 += kTile)
    transpose_words(dst + j0 * Dh, rows + j0 * Dh, kTile, Dh);
}

// The same straight from T stored rows of Dp bf16 values, `stride` values apart (Dp even):
// keys at or past T zero.
void key_tiles_transposed_from(uint32_t* dst, const uint16_t* src, int64_t stride, int64_t T,
                               int64_t Tp, int64_t Dp) {
  const int64_t Dh = Dp / 2;
  for (int64_t j0 = 0; j0 < Tp; j0 += kTile)
    for (int64_t r = 0; r < kTile; r += 16) {
      const int rows = static_cast<int>(std::clamp<int64_t>(T - j0 - r, 0, 16));
      detail::pack_transposed(dst + j0 * Dh + r, kTile, 16, src + (j0 + r) * stride, stride * 2,
                              rows, Dh);
    }
}

// Pairs along T straight from T stored rows of Dp bf16 values, `stride` values apart: dst[p][c]
// = (src row 2p [c], src row 2p + 1 [c]) for p < Tp / 2, zero past T.
void pairs_along_rows_from(uint32_t* dst, const uint16_t* src, int64_t stride, int64_t T,
                           int64_t Tp, int64_t Dp) {
  for (int64_t p = 0; p < Tp / 2; ++p) {
    const uint16_t* r0 = 2 * p < T ? src + 2 * p * stride : nullptr;
    const uint16_t* r1 = 2 * p + 1 < T ? src + (2 * p + 1) * stride : nullptr;
    for (int64_t c = 0; c < Dp; c += 32) {
      const int n = static_cast<int>(std::min<int64_t>(32, Dp - c));
      detail::interleave_pairs(dst + p * Dp + c, r0 ? r0 + c : nullptr, r1 ? r1 + c : nullptr, n,
                               n);
    }
  }
}

using vec::vf;

constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2 = 0.693147180559945309f;

// 2^t in the lanes of `keep`, zero in the others, for t <= 2^-10 (the softmax's exponents, at
// most the rounding of the score's maximum above 0): within 2.7e-6 relative above t = -125,
// about 2.4e-38 below (a probability that no sum of at most 2^24 others can see). t = n + f with
// n the nearest integer (|f| <= 1/2), 2^f a polynomial of degree 4 fitted to the relative error
// on [-1/2, 1/2], 2^n added to its exponent bits. Five multiply-adds against vec::exp's eleven,
// on the vector units the tile's products need. NaN stays NaN.
inline __m512 exp2_lanes(__mmask16 keep, __m512 t) {
  const __m512 round = _mm512_set1_ps(12582912.0f);  // 1.5 * 2^23: the integer in the low bits
  t = _mm512_max_ps(_mm512_set1_ps(-125.0f), t);     // the second operand where NaN
  const __m512 r = _mm512_add_ps(t, round);
  const __m512 f = _mm512_sub_ps(t, _mm512_sub_ps(r, round));
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(0.009570376016199589f), f,
                             _mm512_set1_ps(0.055918723344802856f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24024745821952820f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.69312167167663574f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.99999928474426270f));
  // r's bits are 0x4B400000 + n, whose low 9 bits shifted up 23 are n's in the exponent field.
  return _mm512_castsi512_ps(_mm512_maskz_add_epi32(keep, _mm512_castps_si512(p),
                                                    _mm512_slli_epi32(_mm512_castps_si512(r), 23)));
}

// The mask of the 16 lanes from column c on that are below `valid`.
inline __mmask16 valid_lanes(int64_t c, int64_t valid) {
  const int64_t n = std::clamp<int64_t>(valid - c, 0, 16);
  return static_cast<__mmask16>((1u << n) - 1);
}

// log(x) per lane for 1 <= x < 2^24, within 1e-6 absolute: x = 2^e m with m in
// [sqrt(1/2), sqrt(2)), log m = 2 atanh(s) with s = (m - 1) / (m + 1), |s| < 0.172, the odd
// series to s^9 (the next term under 3e-10).
inline __m512 log_lanes(__m512 x) {
  __m512 e = _mm512_getexp_ps(x);
  __m512 m = _mm512_getmant_ps(x, _MM_MANT_NORM_1_2, _MM_MANT_SIGN_zero);
  const __mmask16 high = _mm512_cmp_ps_mask(m, _mm512_set1_ps(1.41421356f), _CMP_GT_OQ);
  m = _mm512_mask_mul_ps(m, high, m, _mm512_set1_ps(0.5f));
  e = _mm512_mask_add_ps(e, high, e, _mm512_set1_ps(1.0f));
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 s = _mm512_div_ps(_mm512_sub_ps(m, one), _mm512_add_ps(m, one));
  const __m512 s2 = _mm512_mul_ps(s, s);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(2.0f / 9.0f), s2, _mm512_set1_ps(2.0f / 7.0f));
  p = _mm512_fmadd_ps(p, s2, _mm512_set1_ps(2.0f / 5.0f));
  p = _mm512_fmadd_ps(p, s2, _mm512_set1_ps(2.0f / 3.0f));
  p = _mm512_fmadd_ps(p, s2, _mm512_set1_ps(2.0f));
  return _mm512_fmadd_ps(e, _mm512_set1_ps(kLn2), _mm512_mul_ps(p, s));
}

// Lane r = the largest of the 16 lanes of x[r], r < 16: four rounds, each taking the larger of
// two halves of each vector's lanes and packing two vectors' halves into one.
inline __m512 row_maxima(const __m512 x[16]) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // 128-bit lanes 0, 1: row 2i; 2, 3: row 2i + 1
    a[i] = _mm512_max_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // 128-bit lane L: row 4i + L
    b[i] = _mm512_max_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // 128-bit lane L, values 0, 1: row 8i + L; 2, 3: row 8i + 4 + L
    c[i] = _mm512_max_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
  // 128-bit lane L, value v: row L + 4 v.
  const __m512 z =
      _mm512_max_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
  return _mm512_permutexvar_ps(
      _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0), z);
}

// Rounds 64 floats to bf16 into 32 pairs.
inline void round_row(uint32_t* dst, const __m512 x[4]) {
  _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(x[1], x[0]));
  _mm512_storeu_si512(dst + 16, (__m512i)_mm512_cvtne2ps_pbh(x[3], x[2]));
}

// The 16 pairs (a[c], b[c]) from the 32 bf16 values of cvtne2ps(b, a): a's in the low half.
inline __m512i pairs_of_halves(__m512i rounded) {
  // Lane 2i takes a's value i, lane 2i + 1 b's.
  const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24,
                                         8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(order, rounded);
}

// The 16 pairs (a[c], b[c]) of 16 floats a and b rounded to bf16.
inline __m512i rounded_pairs(__m512 a, __m512 b) {
  return pairs_of_halves((__m512i)_mm512_cvtne2ps_pbh(b, a));
}

// Rounds two rows of 64 floats, a and b, to bf16 pairs along the rows: dst[c] = (a[c], b[c]).
inline void interleave_rows(uint32_t* dst, const __m512 a[4], const __m512 b[4]) {
  for (int v = 0; v < 4; ++v) _mm512_storeu_si512(dst + 16 * v, rounded_pairs(a[v], b[v]));
}

// dst[c * row + d] = (accumulate ? dst[c * row + d] : 0) + src[c * Dp + d] for c < cols, d < D.
void add_rows(float* dst, int64_t row, const float* src, int64_t cols, int64_t D, int64_t Dp,
              bool accumulate) {
  for (int64_t c = 0; c < cols; ++c)
    for (int64_t d = 0; d < D; d += 16) {
      const __mmask16 lanes = valid_lanes(d, D);
      float* out = dst + c * row + d;
      const __m512 base = accumulate ? _mm512_maskz_loadu_ps(lanes, out) : _mm512_setzero_ps();
      _mm512_mask_storeu_ps(out, lanes, _mm512_add_ps(base, _mm512_loadu_ps(src + c * Dp + d)));
    }
}

// dst[c * row + d] = (accumulate ? dst[c * row + d] : 0) + src[d * kTile + c] for c < cols,
// d < D: src (Dp x kTile) transposed through scratch (kTile x Dp).
void add_transposed(float* dst, int64_t row, const float* src, float* scratch, int64_t cols,
                    int64_t D, int64_t Dp, bool accumulate) {
  transpose_words(reinterpret_cast<uint32_t*>(scratch), reinterpret_cast<const uint32_t*>(src), Dp,
                  kTile);
  add_rows(dst, row, scratch, cols, D, Dp, accumulate);
}

// 16 bf16 values as floats.
inline __m512 widen16(__m256i x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
}

// The mean over rows 0..T of the bf16 rows (Dp values each, zero past D, `stride` values
// apart): mean[0:Dp], in one pass over the rows, each lane's sum added in row order.
void column_means(float* mean, const uint16_t* in, int64_t stride, int64_t T, int64_t Dp) {
  for (int64_t d = 0; d < Dp; d += 16) _mm512_storeu_ps(mean + d, _mm512_setzero_ps());
  for (int64_t t = 0; t < T; ++t)
    for (int64_t d = 0; d < Dp; d += 16)
      _mm512_storeu_ps(
          mean + d,
          _mm512_add_ps(
              _mm512_loadu_ps(mean + d),
              widen16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + t * stride + d)))));
  for (int64_t d = 0; d < Dp; d += 16)
    _mm512_storeu_ps(mean + d, _mm512_mul_ps(_mm512_loadu_ps(mean + d),
                                             _mm512_set1_ps(1.0f / static_cast<float>(T))));
}

// Pairs along T of the centred rows: dst[p][c] = (bf16(in row 2p [c] - mean[c]), bf16(in row
// 2p + 1 [c] - mean[c])) for p < Tp / 2, c < Dp, zero for rows at or past T. Rows of Dp bf16
// values, `stride` values apart.
void centered_pairs_along_rows(uint32_t* dst, const uint16_t* in, int64_t stride, const float* mean,
                               int64_t T, int64_t Tp, int64_t Dp) {
  const auto centered = [&](int64_t t, int64_t d) {
    if (t >= T) return _mm512_setzero_ps();
    const __m512 x =
        widen16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + t * stride + d)));
    return _mm512_sub_ps(x, _mm512_loadu_ps(mean + d));
  };
  for (int64_t p = 0; p < Tp / 2; ++p)
    for (int64_t d = 0; d < Dp; d += 16)
      _mm512_storeu_si512(dst + p * Dp + d,
                          rounded_pairs(centered(2 * p, d), centered(2 * p + 1, d)));
}

// The output gradient as the products take it, from its FP32 rows (`stride` values apart, D
// values each): rows[t] its rounding to bf16 (Dp values, zero past D and past T), pairs[p] the
// pairs (rows[2p][c], rows[2p + 1][c]) along T, and Di[t] = rows[t] . out row t (bf16, `stride`
// values apart) for t < T, the sum over d in lanes of 16 and then across them.
void output_gradient_rows(uint32_t* rows, uint32_t* pairs, float* Di, const float* dout,
                          const uint16_t* out, int64_t stride, int64_t T, int64_t Tp, int64_t D,
                          int64_t Dp) {
  auto* r16 = reinterpret_cast<uint16_t*>(rows);
  for (int64_t p = 0; p < Tp / 2; ++p) {
    __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t d = 0; d < Dp; d += 16) {
      const __mmask16 lanes = valid_lanes(d, D);
      __m512 x[2];
      for (int i = 0; i < 2; ++i) {
        const int64_t t = 2 * p + i;
        x[i] = _mm512_maskz_loadu_ps(t < T ? lanes : 0, dout + t * stride + d);
      }
      const __m512i b = (__m512i)_mm512_cvtne2ps_pbh(x[1], x[0]);
      const __m256i g[2] = {_mm512_castsi512_si256(b), _mm512_extracti64x4_epi64(b, 1)};
      _mm512_storeu_si512(pairs + p * Dp + d, pairs_of_halves(b));
      for (int i = 0; i < 2; ++i) {
        const int64_t t = 2 * p + i;
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(r16 + t * Dp + d), g[i]);
        if (t < T)
          acc[i] = _mm512_fmadd_ps(widen16(g[i]),
                                   widen16(_mm256_maskz_loadu_epi16(lanes, out + t * stride + d)),
                                   acc[i]);
      }
    }
    for (int i = 0; i < 2; ++i)
      if (2 * p + i < T) Di[2 * p + i] = _mm512_reduce_add_ps(acc[i]);
  }
}

// One head's shapes: rows of H * D values (queries) and KVH * D (keys and values), query heads
// per key/value head, D padded to Dp (a multiple of 16, Dh pairs), T to Tp (whole tiles).
struct Head {
  Head(int64_t T, int64_t H, int64_t KVH, int64_t D, const AttentionOptions& o, bool amx)
      : amx(amx),
        scale(attention_score_scale(o, D)),
        cap(o.softcap),
        window(o.window),
        sinks(o.sinks),
        row(H * D),
        kv_row(KVH * D),
        group(H / KVH),
        Dp((D + 15) / 16 * 16),
        Dh(Dp / 2),
        Tp((T + kTile - 1) / kTile * kTile),
        in_place(D == Dp && !amx) {}
  bool amx;  // products on AMX tiles
  float scale;
  float cap;           // soft-capping's cap, 0 for none
  int64_t window;      // the sliding window, 0 for none
  const float* sinks;  // each query head's sink logit (H), null for none
  int64_t row, kv_row, group, Dp, Dh, Tp;
  // Q, K and V read where they are stored, not copied as padded rows of pairs: where a row is D
  // whole pairs and the products run on vdpbf16ps (AMX keeps the copies).
  bool in_place;
};

// The lanes of a row of scores, query i against the key tile from j0 (cols keys): the keys up to
// the query, within the sequence and, Windowed, after i - window.
template <bool Windowed>
struct RowLanes {
  RowLanes(int64_t i, int64_t j0, int64_t cols, int64_t window)
      : valid(std::min(cols, i - j0 + 1)), first(Windowed ? i - window + 1 - j0 : 0) {}
  // The 16 lanes from column c on.
  __mmask16 operator()(int64_t c) const {
    const __mmask16 upto = valid_lanes(c, valid);
    return Windowed ? upto & static_cast<__mmask16>(~valid_lanes(c, first)) : upto;
  }
  int64_t valid, first;
};
// Every lane: a tile wholly below the diagonal and within the sequence (and the window).
struct AllLanes {
  AllLanes(int64_t, int64_t, int64_t, int64_t) {}
  __mmask16 operator()(int64_t) const { return 0xFFFF; }
};
// Whether every lane of the tile of queries i0.. (rows) and keys j0.. (cols) is attended: the
// whole key tile up to the first query and, Windowed, the window reaching its first key from the
// last query.
template <bool Windowed>
bool every_lane(int64_t i0, int64_t j0, int64_t rows, int64_t cols, int64_t window) {
  return cols == kTile && j0 + kTile - 1 <= i0 && (!Windowed || i0 + rows - window <= j0);
}

// cap * tanh(x / cap), and tanh(x / cap) in t.
inline __m512 soft_cap(__m512 x, float cap, __m512* t) {
  *t = (__m512)vec::tanh((vf)_mm512_mul_ps(x, _mm512_set1_ps(1.0f / cap)));
  return _mm512_mul_ps(*t, _mm512_set1_ps(cap));
}

// Consecutive pieces of the calling thread's buffer Which, of `size` words: the sizes are
// counted by hand, so taking more than that stops the program instead of overrunning.
template <int Which>
struct Carve {
  explicit Carve(int64_t size)
      : next(thread_buffer<Which>(static_cast<size_t>(size))), left(size) {}
  uint32_t* words(int64_t n) {
    if (n > left) {
      std::fprintf(stderr, "attention_bf16_avx512: buffer %d carved past its size\n", Which);
      std::abort();
    }
    left -= n;
    return std::exchange(next, next + n);
  }
  float* floats(int64_t n) { return reinterpret_cast<float*>(words(n)); }
  uint32_t* next;
  int64_t left;
};

// The forward and backward, with the scores soft-capped (Capped) and windowed (Windowed) or
// not: each combination its own loops.
template <bool Capped, bool Windowed>
void forward_tiles(uint16_t* out, float* lse, const uint16_t* q, const uint16_t* k,
                   const uint16_t* v, int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t D,
                   const Head& hd) {
  const float scale = hd.scale;
  const float coef = Capped ? kLog2e : scale * kLog2e;  // a score before it, in log2 units
  const int64_t row = hd.row, kv_row = hd.kv_row, group = hd.group;
  const int64_t Dp = hd.Dp, Dh = hd.Dh, Tp = hd.Tp;
  const bool in_place = hd.in_place;
  const int64_t q_ld = in_place ? row / 2 : Dh;
#pragma omp parallel
  {
    // Whole head, each Tp * Dh words: Q (query head), K, V (its key/value head) as rows of pairs
    // (not in place), K^T per key tile, V as pairs along T; per query tile the scores, the
    // output, P as bf16 and the row statistics.
    Carve<0> head((in_place ? 2 : 5) * Tp * Dh);
    const auto copy = [&] { return in_place ? nullptr : head.words(Tp * Dh); };
    uint32_t *Qr = copy(), *Kr = copy(), *Vr = copy();
    uint32_t *Kt = head.words(Tp * Dh), *Vi = head.words(Tp * Dh);
    Carve<1> tile(kTile * kTile + kTile * Dp + kTile * kTilePairs + 18 * kTile);
    float *S = tile.floats(kTile * kTile), *O = tile.floats(kTile * Dp);
    uint32_t* Pb = tile.words(kTile * kTilePairs);
    // m per row; l per row as 16 partial sums, added up once the row's last tile is done.
    float *m = tile.floats(kTile), *l = tile.floats(16 * kTile), *l_row = tile.floats(kTile);
    int64_t packed = -1;  // b * KVH + the key/value head whose Kr, Kt, Vr, Vi are packed
    if (hd.amx) pairs_amx_configure();
#pragma omp for schedule(dynamic, 1)
    for (int64_t bh = 0; bh < B * H; ++bh) {
      const int64_t b = bh / H, h = bh % H, bkv = b * KVH + h / group;
      const int64_t off = b * T * row + h * D;
      const int64_t kv_off = b * T * kv_row + h / group * D;
      // Q read where it is stored where its rows are whole pairs (no padding); K and V packed
      // from there.
      const uint32_t* Qs = in_place ? reinterpret_cast<const uint32_t*>(q + off) : Qr;
      if (!in_place) rows_as_pairs(Qr, q + off, row, T, Tp, D, Dp);
      if (bkv != packed) {
        if (in_place) {
          key_tiles_transposed_from(Kt, k + kv_off, kv_row, T, Tp, Dp);
          pairs_along_rows_from(Vi, v + kv_off, kv_row, T, Tp, Dp);
        } else {
          rows_as_pairs(Kr, k + kv_off, kv_row, T, Tp, D, Dp);
          key_tiles_transposed(Kt, Kr, Tp, Dp);
          rows_as_pairs(Vr, v + kv_off, kv_row, T, Tp, D, Dp);
          pairs_along_rows(Vi, Vr, Tp, Dp);
        }
        packed = bkv;
      }
      for (int64_t i0 = 0; i0 < T; i0 += kTile) {
        const int64_t rows = std::min(kTile, T - i0);
        std::fill(O, O + rows * Dp, 0.0f);
        std::fill(m, m + rows, -std::numeric_limits<float>::infinity());
        std::fill(l, l + 16 * rows, 0.0f);
        for (int64_t j0 = window_first_key_tile(i0, hd.window); j0 <= i0; j0 += kTile) {
          const int64_t cols = std::min(kTile, T - j0);
          scores_product(hd.amx, j0 == i0, S, kTile, Qs + i0 * q_ld, q_ld, Kt + j0 * Dh, kTile,
                         rows, Dh);
          // Rows 16 at a time: each row's maximum over its lanes, the 16 reduced together
          // (row_maxima), the statistics m and the factors alpha of the 16 as vectors, then each
          // row's exponentials. The statistics m are in units of log2: m = max_c y_c * coef, with
          // y the score before its scale (or after soft-capping) and coef what turns y into log2
          // units, so that p = 2^(y coef - m) is one multiply-add and exp2_lanes.
          auto row_group = [&]<bool Full>(int64_t r0, int64_t n, std::bool_constant<Full>) {
            using Lanes = std::conditional_t<Full, AllLanes, RowLanes<Windowed>>;
            const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
            __m512 mx[16];
#pragma GCC unroll 16
            for (int q = 0; q < 16; ++q) {
              mx[q] = minus_inf;
              if (q >= n) continue;
              const int64_t r = r0 + q;
              const Lanes lanes(i0 + r, j0, cols, hd.window);
              for (int v4 = 0; v4 < 4; ++v4) {
                __m512 x = _mm512_loadu_ps(S + r * kTile + 16 * v4);
                if (Capped) {
                  __m512 t;
                  x = soft_cap(_mm512_mul_ps(x, _mm512_set1_ps(scale)), hd.cap, &t);
                  _mm512_storeu_ps(S + r * kTile + 16 * v4, x);
                }
                mx[q] = _mm512_mask_max_ps(mx[q], lanes(16 * v4), mx[q], x);
              }
            }
            // Rounding is monotonic, so the maximum of y times coef is that of each y times coef.
            // m = -inf on a row's first tile: alpha ~ 0, and O and l are still 0. Where the
            // maximum stays (most rows after the first few key tiles, and a row whose window
            // starts past this tile) alpha is exactly 1.
            const __mmask16 group = valid_lanes(0, n);
            const __m512 m_old = _mm512_mask_loadu_ps(minus_inf, group, m + r0);
            const __m512 m_new =
                _mm512_max_ps(m_old, _mm512_mul_ps(row_maxima(mx), _mm512_set1_ps(coef)));
            const __mmask16 rescale = _mm512_mask_cmp_ps_mask(group, m_new, m_old, _CMP_NEQ_UQ);
            float alpha[16];
            _mm512_storeu_ps(alpha, exp2_lanes(0xFFFF, _mm512_sub_ps(m_old, m_new)));
            _mm512_mask_storeu_ps(m + r0, group, m_new);
#pragma GCC unroll 2
            for (int q = 0; q < n; ++q) {
              const int64_t r = r0 + q;
              const Lanes lanes(i0 + r, j0, cols, hd.window);
              const bool rescaled = (rescale >> q) & 1;
              const __m512 shift = _mm512_set1_ps(m[r]);
              __m512 x[4];
              __m512 sum = _mm512_setzero_ps();
              for (int v4 = 0; v4 < 4; ++v4) {
                x[v4] = exp2_lanes(lanes(16 * v4),
                                   _mm512_fmsub_ps(_mm512_loadu_ps(S + r * kTile + 16 * v4),
                                                   _mm512_set1_ps(coef), shift));
                sum = _mm512_add_ps(sum, x[v4]);
              }
              float* lr = l + 16 * r;
              _mm512_storeu_ps(
                  lr, rescaled ? _mm512_fmadd_ps(_mm512_loadu_ps(lr), _mm512_set1_ps(alpha[q]), sum)
                               : _mm512_add_ps(_mm512_loadu_ps(lr), sum));
              round_row(Pb + r * kTilePairs, x);
              float* o = O + r * Dp;
              if (rescaled)
                for (int64_t d = 0; d < Dp; d += 16)
                  _mm512_storeu_ps(o + d,
                                   _mm512_mul_ps(_mm512_loadu_ps(o + d), _mm512_set1_ps(alpha[q])));
            }
          };
          const bool full = every_lane<Windowed>(i0, j0, rows, cols, hd.window);
          auto rows_of = [&]<bool Full>(std::bool_constant<Full> f) {
            for (int64_t r = 0; r < rows; r += 16) row_group(r, std::min<int64_t>(16, rows - r), f);
          };
          full ? rows_of(std::true_type{}) : rows_of(std::false_type{});
          probs_product(hd.amx, j0 == i0, O, Dp, Pb, kTilePairs, Vi + j0 / 2 * Dp, Dp, rows, Dp);
        }
        for (int64_t r = 0; r < rows; ++r)
          l_row[r] = _mm512_reduce_add_ps(_mm512_loadu_ps(l + 16 * r));
        // The sink joins the sum as one more key, of value zero (m in units of log2).
        if (hd.sinks)
          for (int64_t r = 0; r < rows; ++r) {
            const float sink = hd.sinks[h] * kLog2e, top = std::max(m[r], sink);
            const float a = std::exp2(m[r] - top);
            l_row[r] = l_row[r] * a + std::exp2(sink - top);
            m[r] = top;
            for (int64_t d = 0; d < Dp; ++d) O[r * Dp + d] *= a;
          }
        for (int64_t r = 0; r < rows; ++r) {
          uint16_t* dst = out + off + (i0 + r) * row;
          const __m512 inv = _mm512_set1_ps(1.0f / l_row[r]);
          for (int64_t d = 0; d < D; d += 16)
            _mm256_mask_storeu_epi16(
                dst + d, valid_lanes(d, D),
                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(O + r * Dp + d), inv)));
        }
        // lse = m ln 2 + log l, 16 rows at a time.
        for (int64_t r0 = 0; r0 < rows; r0 += 16) {
          const __mmask16 lanes = valid_lanes(r0, rows);
          const __m512 lr = _mm512_mask_loadu_ps(_mm512_set1_ps(1.0f), lanes, l_row + r0);
          _mm512_mask_storeu_ps(lse + bh * T + i0 + r0, lanes,
                                _mm512_fmadd_ps(_mm512_maskz_loadu_ps(lanes, m + r0),
                                                _mm512_set1_ps(kLn2), log_lanes(lr)));
        }
      }
    }
  }
}

template <bool Capped, bool Windowed>
void backward_tiles(float* dq, float* dk, float* dv, const float* dout, const uint16_t* q,
                    const uint16_t* k, const uint16_t* v, const uint16_t* out, const float* lse,
                    int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t D, bool accumulate,
                    const Head& hd) {
  const float scale = hd.scale;
  const int64_t row = hd.row, kv_row = hd.kv_row, group = hd.group;
  const int64_t Dp = hd.Dp, Dh = hd.Dh, Tp = hd.Tp;
  const bool in_place = hd.in_place;
#pragma omp parallel
  {
    // Each Tp * Dh words. Whole key/value head: K, V as rows of pairs (not in place); K^T and V^T
    // per key tile; K less its mean as pairs along T. Whole query head: Q (not in place), dO as
    // rows of pairs; Q less its mean and dO as pairs along T; on AMX, (Q less its mean)^T and
    // dO^T.
    Carve<0> head((11 - (in_place ? 3 : 0) - (hd.amx ? 0 : 2)) * Tp * Dh);
    const auto copy = [&] { return in_place ? nullptr : head.words(Tp * Dh); };
    const auto on_amx = [&] { return hd.amx ? head.words(Tp * Dh) : nullptr; };
    uint32_t *Kr = copy(), *Vr = copy(), *Qr = copy(), *QT = on_amx(), *GT = on_amx();
    uint32_t *Kt = head.words(Tp * Dh), *Vt = head.words(Tp * Dh), *Ki = head.words(Tp * Dh);
    uint32_t *Gr = head.words(Tp * Dh), *Qi = head.words(Tp * Dh), *Gi = head.words(Tp * Dh);
    // dQ, D_i and, with soft-capping, the row sums of dS of the query head (16 partial sums a
    // row, added up once the row's last tile is done); the means of K and Q; per key tile dK^T and
    // dV^T (dK and dV where not on AMX), and on AMX the scratch of their transposes; per tile
    // pair P, dP, P as bf16 pairs along T, dS as bf16 rows and pairs along T.
    Carve<1> tile(Tp * Dp + 17 * Tp + 2 * Dp + (hd.amx ? 3 : 2) * Dp * kTile + 2 * kTile * kTile +
                  3 * kTile * kTilePairs);
    float *dQ = tile.floats(Tp * Dp), *Di = tile.floats(Tp), *row_sum = tile.floats(16 * Tp);
    float *k_mean = tile.floats(Dp), *q_mean = tile.floats(Dp);
    float *dKT = tile.floats(Dp * kTile), *dVT = tile.floats(Dp * kTile);
    float* scratch = hd.amx ? tile.floats(Dp * kTile) : nullptr;
    float *P = tile.floats(kTile * kTile), *dP = tile.floats(kTile * kTile);
    uint32_t* Pi = tile.words(kTile * kTilePairs);
    uint32_t *dSb = tile.words(kTile * kTilePairs), *dSi = tile.words(kTile * kTilePairs);
    if (hd.amx) pairs_amx_configure();
#pragma omp for schedule(dynamic, 1)
    for (int64_t bkv = 0; bkv < B * KVH; ++bkv) {
      const int64_t b = bkv / KVH, kh = bkv % KVH;
      const int64_t kv_off = b * T * kv_row + kh * D;
      // K and V packed straight from where they are stored where a row is D whole pairs, else
      // from a padded copy (Ks, ks_ld).
      const uint16_t* Ks = k + kv_off;
      int64_t ks_ld = kv_row;
      if (in_place) {
        key_tiles_transposed_from(Kt, k + kv_off, kv_row, T, Tp, Dp);
        key_tiles_transposed_from(Vt, v + kv_off, kv_row, T, Tp, Dp);
      } else {
        rows_as_pairs(Kr, k + kv_off, kv_row, T, Tp, D, Dp);
        rows_as_pairs(Vr, v + kv_off, kv_row, T, Tp, D, Dp);
        key_tiles_transposed(Kt, Kr, Tp, Dp);
        key_tiles_transposed(Vt, Vr, Tp, Dp);
        Ks = reinterpret_cast<const uint16_t*>(Kr);
        ks_ld = Dp;
      }
      // dQ = dS K and dK = dS^T Q take K and Q less their means m: dS K = dS (K - m) + (dS 1) m,
      // the second term 0 but with soft-capping (the file's head), and dS^T Q likewise with the
      // column sums of dS exact in FP32. Where keys (queries) share a large component, the
      // rounding error of dS then scales with their spread, not their size.
      column_means(k_mean, Ks, ks_ld, T, Dp);
      centered_pairs_along_rows(Ki, Ks, ks_ld, k_mean, T, Tp, Dp);
      for (int64_t g = 0; g < group; ++g) {
        const int64_t h = kh * group + g, bh = b * H + h;
        const int64_t off = b * T * row + h * D;
        const float* lse_bh = lse + bh * T;
        // dk and dv: the group's first query head writes them (or adds, with accumulate), the
        // others add to that.
        const bool add = accumulate || g > 0;
        // Q read where it is stored, as K, or from a padded copy.
        const uint16_t* Qs = q + off;
        int64_t qs_ld = row;
        if (!in_place) {
          rows_as_pairs(Qr, q + off, row, T, Tp, D, Dp);
          Qs = reinterpret_cast<const uint16_t*>(Qr);
          qs_ld = Dp;
        }
        // dO rounded, as rows and as pairs along T, and D_i = sum_j P_ij dP_ij = dO_i . out_i
        // from the bf16 dO the products see.
        output_gradient_rows(Gr, Gi, Di, dout + off, out + off, row, T, Tp, D, Dp);
        column_means(q_mean, Qs, qs_ld, T, Dp);
        centered_pairs_along_rows(Qi, Qs, qs_ld, q_mean, T, Tp, Dp);
        if (hd.amx) {  // dK^T and dV^T on AMX tiles take Q^T and dO^T as rows
          transpose_words(QT, Qi, Tp / 2, Dp);
          transpose_words(GT, Gi, Tp / 2, Dp);
        }
        std::fill(dQ, dQ + Tp * Dp, 0.0f);
        if (Capped) std::fill(row_sum, row_sum + 16 * Tp, 0.0f);
        for (int64_t j0 = 0; j0 < T; j0 += kTile) {
          const int64_t cols = std::min(kTile, T - j0);
          std::fill(dKT, dKT + Dp * kTile, 0.0f);
          std::fill(dVT, dVT + Dp * kTile, 0.0f);
          __m512 cs[4];
          for (int v4 = 0; v4 < 4; ++v4) cs[v4] = _mm512_setzero_ps();
          for (int64_t i0 = j0; i0 < window_query_end(j0, cols, T, hd.window); i0 += kTile) {
            const int64_t rows = std::min(kTile, T - i0);
            const bool diagonal = i0 == j0;
            scores_product(hd.amx, diagonal, P, kTile,
                           reinterpret_cast<const uint32_t*>(Qs + i0 * qs_ld), qs_ld / 2,
                           Kt + j0 * Dh, kTile, rows, Dh);
            scores_product(hd.amx, diagonal, dP, kTile, Gr + i0 * Dh, Dh, Vt + j0 * Dh, kTile, rows,
                           Dh);
            // Rows two at a time: each row's dS rounded as a row of pairs along the keys, and the
            // two rows' P and dS as pairs along the queries (one row of Pi and of dSi).
            auto rows_of = [&]<bool Full>(std::bool_constant<Full>) {
              using Lanes = std::conditional_t<Full, AllLanes, RowLanes<Windowed>>;
              auto one_row = [&](int64_t r, __m512* p, __m512* ds) {
                const Lanes lanes(i0 + r, j0, cols, hd.window);
                const __m512 shift = _mm512_set1_ps(lse_bh[i0 + r] * kLog2e);
                const __m512 di = _mm512_set1_ps(Di[i0 + r]);
                const __m512 di_scaled = _mm512_set1_ps(Di[i0 + r] * scale);
                for (int v4 = 0; v4 < 4; ++v4) {
                  const __m512 x = _mm512_loadu_ps(P + r * kTile + 16 * v4);
                  // The score's scale, and through cap * tanh(s / cap) 1 - tanh^2, in dS.
                  __m512 dscale = _mm512_set1_ps(scale);
                  __m512 s;  // the score less lse, in log2 units
                  if (Capped) {
                    __m512 t;
                    s = _mm512_fmsub_ps(soft_cap(_mm512_mul_ps(x, dscale), hd.cap, &t),
                                        _mm512_set1_ps(kLog2e), shift);
                    dscale = _mm512_mul_ps(dscale, _mm512_fnmadd_ps(t, t, _mm512_set1_ps(1.0f)));
                  } else {
                    s = _mm512_fmsub_ps(x, _mm512_set1_ps(scale * kLog2e), shift);
                  }
                  p[v4] = exp2_lanes(lanes(16 * v4), s);
                  // Zero past the keys the query attends, whatever dP holds there.
                  const __m512 dp = _mm512_loadu_ps(dP + r * kTile + 16 * v4);
                  ds[v4] = Capped
                               ? _mm512_maskz_mul_ps(lanes(16 * v4), _mm512_mul_ps(p[v4], dscale),
                                                     _mm512_sub_ps(dp, di))
                               : _mm512_maskz_mul_ps(lanes(16 * v4), p[v4],
                                                     _mm512_fmsub_ps(dp, dscale, di_scaled));
                  cs[v4] = _mm512_add_ps(cs[v4], ds[v4]);
                }
                if (Capped) {
                  float* rs = row_sum + 16 * (i0 + r);
                  _mm512_storeu_ps(rs, _mm512_add_ps(_mm512_loadu_ps(rs),
                                                     _mm512_add_ps(_mm512_add_ps(ds[0], ds[1]),
                                                                   _mm512_add_ps(ds[2], ds[3]))));
                }
                round_row(dSb + r * kTilePairs, ds);
              };
              for (int64_t r = 0; r < rows; r += 2) {
                __m512 p[2][4], ds[2][4];
                one_row(r, p[0], ds[0]);
                if (r + 1 < rows) {
                  one_row(r + 1, p[1], ds[1]);
                } else {
                  for (int v4 = 0; v4 < 4; ++v4) p[1][v4] = ds[1][v4] = _mm512_setzero_ps();
                }
                interleave_rows(Pi + r / 2 * kTile, p[0], p[1]);
                interleave_rows(dSi + r / 2 * kTile, ds[0], ds[1]);
              }
            };
            const bool full = every_lane<Windowed>(i0, j0, rows, cols, hd.window);
            full ? rows_of(std::true_type{}) : rows_of(std::false_type{});
            std::fill(dSb + rows * kTilePairs, dSb + kTile * kTilePairs, 0u);
            for (uint32_t* rounded : {Pi, dSi})
              std::fill(rounded + (rows + 1) / 2 * kTile, rounded + kTilePairs * kTile, 0u);
            // dV += P^T dO, dK += dS^T (Q - m_Q) (on AMX: dV^T += dO^T P, dK^T += (Q - m_Q)^T dS,
            // the same sums), dQ += dS (K - m_K) (the scale is in dS).
            if (hd.amx) {
              dp_product(true, dVT, kTile, GT + i0 / 2, Tp / 2, Pi, kTile, Dp, kTile, kTilePairs,
                         true);
              dp_product(true, dKT, kTile, QT + i0 / 2, Tp / 2, dSi, kTile, Dp, kTile, kTilePairs,
                         true);
            } else {
              dp_product_pair_rows(dVT, Dp, Pi, kTile, Gi + i0 / 2 * Dp, Dp, kTile, Dp, kTilePairs);
              dp_product_pair_rows(dKT, Dp, dSi, kTile, Qi + i0 / 2 * Dp, Dp, kTile, Dp,
                                   kTilePairs);
            }
            probs_product(hd.amx, diagonal, dQ + i0 * Dp, Dp, dSb, kTilePairs, Ki + j0 / 2 * Dp, Dp,
                          rows, Dp);
          }
          // dK += (column sums of dS) m_Q^T, with this query head's m_Q
          if (hd.amx) {
            for (int64_t d = 0; d < Dp; ++d) {
              const __m512 m = _mm512_set1_ps(q_mean[d]);
              for (int v4 = 0; v4 < 4; ++v4) {
                float* o = dKT + d * kTile + 16 * v4;
                _mm512_storeu_ps(o, _mm512_fmadd_ps(m, cs[v4], _mm512_loadu_ps(o)));
              }
            }
            add_transposed(dk + kv_off + j0 * kv_row, kv_row, dKT, scratch, cols, D, Dp, add);
            add_transposed(dv + kv_off + j0 * kv_row, kv_row, dVT, scratch, cols, D, Dp, add);
          } else {
            alignas(64) float col_sums[kTile];
            for (int v4 = 0; v4 < 4; ++v4) _mm512_store_ps(col_sums + 16 * v4, cs[v4]);
            for (int64_t c = 0; c < cols; ++c) {
              const __m512 sum = _mm512_set1_ps(col_sums[c]);
              for (int64_t d = 0; d < Dp; d += 16) {
                float* o = dKT + c * Dp + d;
                _mm512_storeu_ps(
                    o, _mm512_fmadd_ps(_mm512_loadu_ps(q_mean + d), sum, _mm512_loadu_ps(o)));
              }
            }
            add_rows(dk + kv_off + j0 * kv_row, kv_row, dKT, cols, D, Dp, add);
            add_rows(dv + kv_off + j0 * kv_row, kv_row, dVT, cols, D, Dp, add);
          }
        }
        for (int64_t i = 0; i < T; ++i) {
          float* gq = dq + off + i * row;
          // A row of dS sums to D_i times the sink's probability exp(sink - lse_i) (0 without a
          // sink): taken so, exact, not from the rounded dS.
          const float sum_i = Capped     ? _mm512_reduce_add_ps(_mm512_loadu_ps(row_sum + 16 * i))
                              : hd.sinks ? Di[i] * std::exp(hd.sinks[h] - lse_bh[i]) * scale
                                         : 0.0f;
          for (int64_t d = 0; d < D; ++d)
            gq[d] = (accumulate ? gq[d] : 0.0f) + (dQ[i * Dp + d] + sum_i * k_mean[d]);
        }
      }
    }
  }
}

// Runs f.template operator()<Capped, Windowed>() for the head's options.
template <typename F>
void with_options(const Head& hd, F&& f) {
  if (hd.cap > 0.0f)
    hd.window > 0 ? f.template operator()<true, true>() : f.template operator()<true, false>();
  else
    hd.window > 0 ? f.template operator()<false, true>() : f.template operator()<false, false>();
}

}  // namespace

void attention_forward_bf16_avx512(uint16_t* out, float* lse, const uint16_t* q, const uint16_t* k,
                                   const uint16_t* v, int64_t B, int64_t T, int64_t H, int64_t KVH,
                                   int64_t D, const AttentionOptions& options, bool amx) {
  const Head hd(T, H, KVH, D, options, amx);
  with_options(hd, [&]<bool Capped, bool Windowed>() {
    forward_tiles<Capped, Windowed>(out, lse, q, k, v, B, T, H, KVH, D, hd);
  });
}

void attention_backward_bf16_avx512(float* dq, float* dk, float* dv, const float* dout,
                                    const uint16_t* q, const uint16_t* k, const uint16_t* v,
                                    const uint16_t* out, const float* lse, int64_t B, int64_t T,
                                    int64_t H, int64_t KVH, int64_t D, bool accumulate,
                                    const AttentionOptions& options, bool amx) {
  const Head hd(T, H, KVH, D, options, amx);
  with_options(hd, [&]<bool Capped, bool Windowed>() {
    backward_tiles<Capped, Windowed>(dq, dk, dv, dout, q, k, v, out, lse, B, T, H, KVH, D,
                                     accumulate, hd);
  });
}

const AttentionKernels& attention_kernels_avx512_bf16() {
  static const AttentionKernels k{attention_forward_avx512, attention_backward_avx512,
                                  attention_forward_bf16_on<false>,
                                  attention_backward_bf16_on<false>};
  return k;
}

}  // namespace cputrain::kernels
