// BF16 GEMM on AVX-512 BF16: 14 x 32 micro-kernel of vdpbf16ps (each FP32 lane accumulates
// a[2p] b[2p] + a[2p+1] b[2p+1]), over panels packed as K pairs: one 32-bit element holds the
// bf16 values of k = 2p (low half) and 2p + 1 (high half).
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <type_traits>

#include "kernels/cpu/bf16_pairs_avx512.h"
#include "kernels/gemm/gemm_avx512_tile.h"
#include "kernels/gemm/gemm_bf16_packing.h"
#include "kernels/gemm/gemm_blocked.h"
#include "kernels/gemm/gemm_isa.h"

namespace cputrain::kernels {
namespace {

using detail::bf16_pair;
using detail::interleave_pairs;
using detail::kTileCols;
using detail::kTileRows;
using detail::pairs_of;
using detail::read_bf16_row;

struct Bf16Avx512 {
  using In = uint16_t;
  using Packed = uint32_t;
  static constexpr int64_t KU = 2, MR = kTileRows, NR = kTileCols;
  static constexpr int64_t KC = 512;
  static constexpr TunedGemm kTuned = TunedGemm::Bf16Avx512;  // MC and NC: gemm_tuning.h
  static constexpr int64_t kPrefetchRowsAliased = 8;

  // dst[p][r] = (op(A)[i0 + r][k0 + 2p], op(A)[i0 + r][k0 + 2p + 1])
  static void pack_a(uint32_t* dst, const uint16_t* A, int64_t lda, bool trans, int64_t i0,
                     int64_t m, int64_t k0, int64_t kc) {
    const int64_t kp = (kc + 1) / 2;
    if (trans) {  // A stored (K, M): interleave rows k and k + 1
      // Rows that alias in L1 fetched fewer rows on, so that they are not evicted again before
      // they are read.
      const int64_t ahead =
          detail::rows_alias_in_l1(lda * 2) ? kPrefetchRowsAliased : detail::kPrefetchRows;
      for (int64_t p = 0; p < kp; ++p) {
        const uint16_t* row = A + (k0 + 2 * p) * lda + i0;
        detail::prefetch_rows_ahead(row, lda, ahead);
        interleave_pairs(dst + p * MR, row, 2 * p + 1 < kc ? row + lda : nullptr, m, MR);
      }
      return;
    }
    // A stored (M, K): a pair is one 32-bit element of a row; transpose 16 x 16 blocks.
    const int64_t full = kc / 2;
    detail::pack_transposed(dst, MR, MR, A + i0 * lda + k0, lda * 2,
                            static_cast<int>(std::min<int64_t>(m, MR)), full);
    if (full < kp) {  // odd K: the last pair's second half is zero
      for (int64_t r = 0; r < MR; ++r)
        dst[full * MR + r] = r < m ? bf16_pair(A[(i0 + r) * lda + k0 + kc - 1], 0) : 0;
    }
  }

  static void pack_b(uint32_t* dst, const uint16_t* B, int64_t ldb, bool trans, int64_t j0,
                     int64_t n, int64_t k0, int64_t kc) {
    detail::pack_b_pairs32(dst, B, ldb, trans, j0, n, k0, kc);
  }

  // One K pair step of the tile's first R rows: row r += a[r] . (b0, b1), the dot products of
  // bf16 pairs.
  template <int R>
  static inline __attribute__((always_inline)) void pair_step(detail::Tile& t, const uint32_t* a,
                                                              __m512bh b0, __m512bh b1) {
#pragma GCC unroll 14
    for (int r = 0; r < R; ++r) {
      const __m512bh av = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[r]));
      t.lo[r] = _mm512_dpbf16_ps(t.lo[r], av, b0);
      t.hi[r] = _mm512_dpbf16_ps(t.hi[r], av, b1);
    }
  }

  // The fused path's micro-kernel (gemm_fused.h): A stored (K, M) and B stored (K, N), the
  // pair of rows 2p, 2p + 1 of each read from as and bs where packed there and then (B's pairs
  // used straight from the registers; A's stored kAAhead pairs before their broadcasts read
  // them back, which a store just made would hold up), each fetched into L1 kFusedAhead pairs
  // ahead and into L2 kFusedFar pairs ahead: rows a stride apart, a page or two each, are past
  // what the hardware prefetcher follows.
  static constexpr bool kFusedPacking = true;
  static constexpr int64_t kFusedAhead = 8, kAAhead = 16, kFusedFar = 32;
  // The values of a stored row of A that fused_pack_a reads (a whole vector from the micro-panel's
  // first column, read_bf16_row), all of which are fetched ahead: the line of the panel's MR
  // values alone leaves the next one unfetched where the vector reaches into it, and the packing
  // then waits on memory (docs/tuning-log.md).
  static constexpr int64_t kAReadWidth = 32;
  // A packed once for all threads where a thread's B block overflows L2 (gemm_fused.h). Not on
  // FP32, whose packing of A is a copy, cheaper than sharing it.
  static constexpr bool kFusedSharedA = true;
  // Packing A's pairs inside the products costs shuffles the FP32 path has not, and every thread
  // reads all of A there, so the fused path takes the shapes it measured ahead on against the
  // blocked path: up to 6 times as many rows as columns (a layer's weight gradients), and small
  // products, where the blocked path's barrier per K block is a large part of the time. An LM
  // head's (rows 16 or 32 times the columns) stays on the blocked path, faster there
  // (docs/tuning-log.md).
  static bool fused_suits(int64_t M, int64_t N, int64_t K) {
    return M <= 6 * N || 2.0 * static_cast<double>(M) * static_cast<double>(N) * K < 5e8;
  }

  // Fetches the first `count` values of rows `row` and `row + ld` (their first and last lines).
  template <int Hint>
  static inline __attribute__((always_inline)) void prefetch_pair(const uint16_t* row, int64_t ld,
                                                                  int64_t count) {
    for (const uint16_t* r : {row, row + ld}) {
      _mm_prefetch(reinterpret_cast<const char*>(r), static_cast<decltype(_MM_HINT_T0)>(Hint));
      _mm_prefetch(reinterpret_cast<const char*>(r + count - 1),
                   static_cast<decltype(_MM_HINT_T0)>(Hint));
    }
  }

  // ap[q] = the pairs of A's rows 2q and 2q + 1 (the second zero past kc).
  static inline __attribute__((always_inline)) void fused_pack_a(const uint16_t* as, int64_t lda,
                                                                 uint32_t* ap, int64_t q,
                                                                 int64_t kc, int64_t a_rows) {
    const uint16_t* row = as + 2 * q * lda;
    __m512i first, second;
    pairs_of(read_bf16_row(row, a_rows),
             read_bf16_row(2 * q + 1 < kc ? row + lda : nullptr, a_rows), &first, &second);
    _mm512_mask_storeu_epi32(ap + q * MR, static_cast<__mmask16>((1u << MR) - 1), first);
  }

  template <bool PackA, bool PackB>
  static void micro_fused_t(int64_t kc, const uint16_t* as, int64_t lda, uint32_t* ap,
                            const uint16_t* bs, int64_t ldb, uint32_t* bp, float* C, int64_t ldc,
                            float beta, int64_t a_rows, int64_t b_cols, const uint16_t* next_a,
                            int64_t next_rows) {
    const int64_t kp = (kc + 1) / 2;
    const int m = static_cast<int>(std::min<int64_t>(MR, a_rows));
    const int n = static_cast<int>(std::min<int64_t>(NR, b_cols));
    if constexpr (PackA)
      for (int64_t q = 0; q < std::min(kAAhead, kp); ++q) fused_pack_a(as, lda, ap, q, kc, a_rows);
    const auto steps = [=](detail::Tile & t, int64_t p0, int64_t p1, auto rows)
        __attribute__((always_inline)) {
      for (int64_t p = p0; p < p1; ++p) {
        if (2 * p < next_rows) prefetch_pair<_MM_HINT_T1>(next_a + 2 * p * lda, lda, kAReadWidth);
        __m512bh b0, b1;
        if constexpr (PackB) {
          const uint16_t* row = bs + 2 * p * ldb;
          prefetch_pair<_MM_HINT_T0>(row + 2 * kFusedAhead * ldb, ldb, NR);
          prefetch_pair<_MM_HINT_T1>(row + 2 * kFusedFar * ldb, ldb, NR);
          __m512i first, second;
          pairs_of(read_bf16_row(row, b_cols),
                   read_bf16_row(2 * p + 1 < kc ? row + ldb : nullptr, b_cols), &first, &second);
          _mm512_store_si512(bp + p * NR, first);
          _mm512_store_si512(bp + p * NR + 16, second);
          b0 = (__m512bh)first;
          b1 = (__m512bh)second;
        } else {
          b0 = (__m512bh)_mm512_load_si512(bp + p * NR);
          b1 = (__m512bh)_mm512_load_si512(bp + p * NR + 16);
        }
        if constexpr (PackA) {
          if (p + kAAhead < kp) fused_pack_a(as, lda, ap, p + kAAhead, kc, a_rows);
          prefetch_pair<_MM_HINT_T0>(as + 2 * (p + kFusedAhead) * lda, lda, kAReadWidth);
          prefetch_pair<_MM_HINT_T1>(as + 2 * (p + kFusedFar) * lda, lda, kAReadWidth);
        }
        pair_step<decltype(rows)::value>(t, ap + p * MR, b0, b1);
      }
    };
    detail::micro_tile_blocks(kp, KC / KU, steps, C, ldc, beta, m, n);
  }

  // C FP32 (+ beta C) or, for the rounded product, bf16.
  template <class CT>
  static void micro(int64_t kp, const uint32_t* a, const uint32_t* b, CT* C, int64_t ldc,
                    float beta, int m, int n) {
    const auto steps = [ a, b ](detail::Tile & t, int64_t p0, int64_t p1, auto rows)
        __attribute__((always_inline)) {
      for (int64_t p = p0; p < p1; ++p) {
        pair_step<decltype(rows)::value>(t, a + p * MR, (__m512bh)_mm512_load_si512(b + p * NR),
                                         (__m512bh)_mm512_load_si512(b + p * NR + 16));
      }
    };
    detail::micro_tile(kp, steps, C, ldc, beta, m, n);
  }
};

// Products of few columns, C (M x N, N <= kSkinnyCols) = A op(B) + beta C with A stored (M, K):
// a LoRA adapter's u = X A' and g = dY B (N its rank). On the blocked path such a product packs
// all of A, each value of which then serves N columns only, and fills half a 32-column tile or
// less: its time went on A's packing and stores. Here op(B), a few KiB, is packed once as the
// blocked path's B panel of 32 columns (pack_b: pairs by column, zero past N), and each thread's
// rows of A are read where they are stored, 8 rows at a time, one pair of each broadcast against
// the packed B. The sums are the blocked path's: per K block of KC, from zero, pair by pair in
// order, then added to C (beta on the first block) as its micro-kernel stores them, so the bits are
// the same.
constexpr int64_t kSkinnyCols = Bf16Avx512::NR;  // one B panel
constexpr int64_t kSkinnyRows = 8;

bool takes_skinny(Transpose ta, int64_t M, int64_t N, int64_t K) {
  return ta == Transpose::No && M >= 2 && N >= 1 && N <= kSkinnyCols && K > 0 &&
         gemm_skinny_enabled();
}

// Rows i0..i0 + R of C over the pairs p0..p1 of one K block, NV vectors of 16 columns.
template <int R, int NV>
inline __attribute__((always_inline)) void skinny_block(float* C, int64_t ldc, const uint16_t* A,
                                                        int64_t lda, const uint32_t* bp, int64_t p0,
                                                        int64_t p1, int64_t K, float beta,
                                                        __mmask16 last_mask) {
  __m512 acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  // A pair whose second value is past K is taken with a zero there, as the packing writes it.
  const int64_t whole = std::min(p1, K / 2);
  const auto step = [&](int64_t p, const auto& pair_of) __attribute__((always_inline)) {
    __m512bh b[NV];
    for (int v = 0; v < NV; ++v) b[v] = (__m512bh)_mm512_load_si512(bp + p * kSkinnyCols + 16 * v);
    for (int r = 0; r < R; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair_of(r)));
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], a, b[v]);
    }
  };
  for (int64_t p = p0; p < whole; ++p)
    step(
        p, [&](int r) __attribute__((always_inline)) {
          uint32_t pair;  // rows of any stride: the pair where it is stored
          std::memcpy(&pair, A + r * lda + 2 * p, sizeof pair);
          return pair;
        });
  if (whole < p1)  // odd K: the last value and a zero
    step(whole, [&](int r) { return uint32_t{A[r * lda + K - 1]}; });
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) {
      const __mmask16 mask = v == NV - 1 ? last_mask : static_cast<__mmask16>(0xffff);
      float* c = C + r * ldc + 16 * v;
      __m512 out = acc[r][v];
      if (beta != 0.0f)
        out = _mm512_fmadd_ps(_mm512_set1_ps(beta), _mm512_maskz_loadu_ps(mask, c), out);
      _mm512_mask_storeu_ps(c, mask, out);
    }
}

template <int NV>
void skinny_rows(float* C, int64_t ldc, const uint16_t* A, int64_t lda, const uint32_t* bp,
                 int64_t M, int64_t N, int64_t K, float beta, int threads) {
  const int64_t kp = (K + 1) / 2, block_pairs = Bf16Avx512::KC / 2;
  const auto last_mask = static_cast<__mmask16>((1u << (N - 16 * (NV - 1))) - 1u);
  const int64_t blocks = (M + kSkinnyRows - 1) / kSkinnyRows;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t i0 = blk * kSkinnyRows;
    const int64_t rows = std::min(kSkinnyRows, M - i0);
    for (int64_t p0 = 0; p0 < kp; p0 += block_pairs) {
      const int64_t p1 = std::min(kp, p0 + block_pairs);
      const float beta_block = p0 == 0 ? beta : 1.0f;
      float* c = C + i0 * ldc;
      const uint16_t* a = A + i0 * lda;
      int64_t r = 0;
      for (; r + 8 <= rows; r += 8)
        skinny_block<8, NV>(c + r * ldc, ldc, a + r * lda, lda, bp, p0, p1, K, beta_block,
                            last_mask);
      for (; r < rows; ++r)
        skinny_block<1, NV>(c + r * ldc, ldc, a + r * lda, lda, bp, p0, p1, K, beta_block,
                            last_mask);
    }
  }
}

void gemm_skinny(Transpose tb, int64_t M, int64_t N, int64_t K, const uint16_t* A, int64_t lda,
                 const uint16_t* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  auto* bp = reinterpret_cast<uint32_t*>(
      detail::gemm_pack_buffer(static_cast<size_t>((K + 1) / 2 * kSkinnyCols), 0));
  Bf16Avx512::pack_b(bp, B, ldb, tb == Transpose::Yes, 0, N, 0, K);
  const int threads = detail::blocked_threads(M, N, K);
  if (N > 16) return skinny_rows<2>(C, ldc, A, lda, bp, M, N, K, beta, threads);
  skinny_rows<1>(C, ldc, A, lda, bp, M, N, K, beta, threads);
}

}  // namespace

void gemm_bf16_avx512(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K,
                      const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb, float beta,
                      float* C, int64_t ldc) {
  if (M == 1 && ta == Transpose::No && tb == Transpose::Yes && K > 0)
    return gemv_bf16_avx512(N, K, A, B, ldb, beta, C);
  if (takes_skinny(ta, M, N, K)) return gemm_skinny(tb, M, N, K, A, lda, B, ldb, beta, C, ldc);
  detail::gemm_blocked<Bf16Avx512>(ta, tb, M, N, K, A, lda, B, ldb, beta, C, ldc);
}

// Whether gemm_bf16_low_rank_avx512 adds a rank-r update inside an M x N x K product: on the
// blocked path with A not transposed (never the fused or direct path, which are for a transposed
// A), r within one K block.
bool takes_low_rank(Transpose ta, int64_t M, int64_t N, int64_t K, int64_t r) {
  return ta == Transpose::No && M >= 2 && N >= 1 && K > 0 && !takes_skinny(ta, M, N, K) && r >= 1 &&
         r <= Bf16Avx512::KC && gemm_low_rank_enabled();
}

void gemm_bf16_low_rank_avx512(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K,
                               const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb,
                               float beta, float* C, int64_t ldc, const LowRankUpdate& update) {
  if (!takes_low_rank(ta, M, N, K, update.r))
    throw std::logic_error("gemm_bf16_low_rank_avx512: a product that does not take the update");
  detail::gemm_blocked<Bf16Avx512>(ta, tb, M, N, K, A, lda, B, ldb, beta, C, ldc, &update);
}

bool gemm_bf16_avx512_takes_low_rank(Transpose ta, Transpose, int64_t M, int64_t N, int64_t K,
                                     int64_t r) {
  return takes_low_rank(ta, M, N, K, r);
}

int64_t gemm_bf16_avx512_low_rank_floats(int64_t M, int64_t N, int64_t r) {
  return detail::low_rank_pack_floats<Bf16Avx512>(M, N, r);
}

// Whether gemm_bf16_kept_avx512 keeps op(B): where gemm_bf16_avx512 runs the blocked path with A
// not transposed (not one row, not the skinny path), and gemm_kept_b_enabled().
bool keeps_b(Transpose tb, int64_t M, int64_t N, int64_t K) {
  return M > 0 && N > 0 && K > 0 && !(M == 1 && tb == Transpose::Yes) &&
         !takes_skinny(Transpose::No, M, N, K) && gemm_kept_b_enabled();
}

void gemm_bf16_kept_avx512(Transpose tb, int64_t M, int64_t N, int64_t K, const uint16_t* A,
                           int64_t lda, const uint16_t* B, int64_t ldb, float beta, float* C,
                           int64_t ldc, KeptB& kept) {
  if (!keeps_b(tb, M, N, K))
    throw std::logic_error("gemm_bf16_kept_avx512: a product that does not keep B");
  detail::gemm_blocked<Bf16Avx512>(Transpose::No, tb, M, N, K, A, lda, B, ldb, beta, C, ldc,
                                   nullptr, &kept);
}

bool gemm_bf16_avx512_keeps_b(Transpose tb, int64_t M, int64_t N, int64_t K) {
  return keeps_b(tb, M, N, K);
}

int64_t gemm_bf16_avx512_kept_b_floats(int64_t N, int64_t K) {
  return detail::kept_b_floats<Bf16Avx512>(N, K);
}

void gemm_bf16_rounded_avx512(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K,
                              const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb,
                              uint16_t* C, int64_t ldc) {
  detail::gemm_blocked<Bf16Avx512>(ta, tb, M, N, K, A, lda, B, ldb, 0.0f, C, ldc);
}

int64_t gemm_bf16_avx512_block_k() {
  return Bf16Avx512::KC;
}

std::array<int64_t, 2> gemm_bf16_avx512_pack_floats(Transpose ta, Transpose tb, int64_t M,
                                                    int64_t N, int64_t K) {
  if (takes_skinny(ta, M, N, K)) return {(K + 1) / 2 * kSkinnyCols, 0};
  return detail::blocked_pack_floats<Bf16Avx512>(ta, tb, M, N, K);
}

bool gemm_bf16_avx512_takes_skinny(Transpose ta, Transpose, int64_t M, int64_t N, int64_t K) {
  return takes_skinny(ta, M, N, K);
}

bool gemm_bf16_avx512_takes_fused(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K) {
  return detail::takes_fused_path<Bf16Avx512>(ta, tb, M, N, K);
}

}  // namespace cputrain::kernels
