// FP32 GEMM on AVX-512: 14 x 32 micro-kernel of vfmadd231ps with broadcast A, over panels
// packed by the blocked driver.
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "kernels/gemm/gemm_avx512_tile.h"
#include "kernels/gemm/gemm_blocked.h"
#include "kernels/gemm/gemm_isa.h"
#include "kernels/gemm/gemv_rows.h"

namespace cputrain::kernels {
namespace {

using detail::kTileCols;
using detail::kTileRows;

struct F32Avx512 {
  using In = float;
  using Packed = float;
  static constexpr int64_t KU = 1, MR = kTileRows, NR = kTileCols;
  static constexpr int64_t KC = 512;
  static constexpr TunedGemm kTuned = TunedGemm::F32Avx512;  // MC and NC: gemm_tuning.h

  // dst[k][r] = op(A)[i0 + r][k0 + k]
  static void pack_a(float* dst, const float* A, int64_t lda, bool trans, int64_t i0, int64_t m,
                     int64_t k0, int64_t kc) {
    if (trans) {  // A stored (K, M): each k is a contiguous run of m values
      const __mmask16 load = static_cast<__mmask16>((1u << std::min<int64_t>(m, MR)) - 1);
      const __mmask16 store = static_cast<__mmask16>((1u << MR) - 1);
      // Plain loads where the row holds 16 values: masked loads that miss the cache are much
      // slower.
      const bool whole = m >= 16;
      for (int64_t k = 0; k < kc; ++k) {
        const float* src = A + (k0 + k) * lda + i0;
        const __m512 v = whole ? _mm512_loadu_ps(src) : _mm512_maskz_loadu_ps(load, src);
        _mm512_mask_storeu_ps(dst + k * MR, store, v);
      }
      return;
    }
    detail::pack_transposed(dst, MR, MR, A + i0 * lda + k0, lda * 4,
                            static_cast<int>(std::min<int64_t>(m, MR)), kc);
  }

  // dst[k][c] = op(B)[k0 + k][j0 + c]
  static void pack_b(float* dst, const float* B, int64_t ldb, bool trans, int64_t j0, int64_t n,
                     int64_t k0, int64_t kc) {
    if (!trans) {  // B stored (K, N): each k is a contiguous run of n values
      const __mmask16 lo = detail::columns_mask(n, 0), hi = detail::columns_mask(n, 1);
      if (n >= NR) {
        for (int64_t k = 0; k < kc; ++k) {
          const float* src = B + (k0 + k) * ldb + j0;
          _mm512_store_ps(dst + k * NR, _mm512_loadu_ps(src));
          _mm512_store_ps(dst + k * NR + 16, _mm512_loadu_ps(src + 16));
        }
        return;
      }
      for (int64_t k = 0; k < kc; ++k) {
        const float* src = B + (k0 + k) * ldb + j0;
        _mm512_store_ps(dst + k * NR, _mm512_maskz_loadu_ps(lo, src));
        _mm512_store_ps(dst + k * NR + 16, _mm512_maskz_loadu_ps(hi, src + 16));
      }
      return;
    }
    // B stored (N, K): 16 x 16 blocks transposed through registers.
    for (int64_t half = 0; half < 2; ++half) {
      const int rows = static_cast<int>(std::clamp<int64_t>(n - 16 * half, 0, 16));
      detail::pack_transposed(dst + 16 * half, NR, 16, B + (j0 + 16 * half) * ldb + k0, ldb * 4,
                              rows, kc);
    }
  }

  // One K step of the tile's first R rows: row r += a[r] (b0, b1).
  template <int R>
  static inline __attribute__((always_inline)) void fma_step(detail::Tile& t, const float* a,
                                                             __m512 b0, __m512 b1) {
#pragma GCC unroll 14
    for (int r = 0; r < R; ++r) {
      const __m512 av = _mm512_set1_ps(a[r]);
      t.lo[r] = _mm512_fmadd_ps(av, b0, t.lo[r]);
      t.hi[r] = _mm512_fmadd_ps(av, b1, t.hi[r]);
    }
  }

  // The fused path's micro-kernel (gemm_fused.h): A stored (K, M) and B stored (K, N), row k
  // of each read at as + k * lda and bs + k * ldb where packed there and then, each fetched
  // into L1 kFusedAhead rows ahead and into L2 kFusedFar rows ahead: rows a stride apart, a page
  // or two each, are past what the hardware prefetcher follows, and a fetch into L1 from memory
  // holds one of L1's few miss buffers all the way, so the L2 fetch runs ahead of it. Rows of
  // the next A are fetched one a step, from the first.
  static constexpr bool kFusedPacking = true;
  static constexpr int64_t kFusedAhead = 16, kFusedFar = 64;
  // Taken up to rows = 4 x columns (a feed-forward up-projection's weight gradient); the LM head's
  // (32 x) stays on the blocked path, which is faster there.
  static bool fused_suits(int64_t M, int64_t N, int64_t) {
    return M <= 4 * N;
  }

  template <bool PackA, bool PackB>
  static void micro_fused_t(int64_t kc, const float* as, int64_t lda, float* ap, const float* bs,
                            int64_t ldb, float* bp, float* C, int64_t ldc, float beta,
                            int64_t a_rows, int64_t b_cols, const float* next_a,
                            int64_t next_rows) {
    const int64_t kp = kc;  // KU = 1
    const int m = static_cast<int>(std::min<int64_t>(MR, a_rows));
    const int n = static_cast<int>(std::min<int64_t>(NR, b_cols));
    const __mmask16 a_load = static_cast<__mmask16>((1u << m) - 1);
    const __mmask16 a_store = static_cast<__mmask16>((1u << MR) - 1);
    const __mmask16 b_lo = detail::columns_mask(n, 0), b_hi = detail::columns_mask(n, 1);
    const auto steps = [=](detail::Tile & t, int64_t k0, int64_t k1, auto rows)
        __attribute__((always_inline)) {
      for (int64_t k = k0; k < k1; ++k) {
        if (k < next_rows) {
          const char* row = reinterpret_cast<const char*>(next_a + k * lda);
          _mm_prefetch(row, _MM_HINT_T1);
          _mm_prefetch(row + 4 * MR - 4, _MM_HINT_T1);
        }
        __m512 b0, b1;
        if constexpr (PackB) {
          const float* row = bs + k * ldb;
          const char* ahead = reinterpret_cast<const char*>(row + kFusedAhead * ldb);
          _mm_prefetch(ahead, _MM_HINT_T0);
          _mm_prefetch(ahead + 64, _MM_HINT_T0);
          _mm_prefetch(ahead + 124, _MM_HINT_T0);  // the third line of an unaligned row
          const char* far = reinterpret_cast<const char*>(row + kFusedFar * ldb);
          _mm_prefetch(far, _MM_HINT_T1);
          _mm_prefetch(far + 64, _MM_HINT_T1);
          _mm_prefetch(far + 124, _MM_HINT_T1);
          // Plain loads for whole rows: masked loads that miss the cache are much slower.
          b0 = n >= 16 ? _mm512_loadu_ps(row) : _mm512_maskz_loadu_ps(b_lo, row);
          b1 = n >= 32 ? _mm512_loadu_ps(row + 16) : _mm512_maskz_loadu_ps(b_hi, row + 16);
          _mm512_store_ps(bp + k * NR, b0);
          _mm512_store_ps(bp + k * NR + 16, b1);
        } else {
          b0 = _mm512_load_ps(bp + k * NR);
          b1 = _mm512_load_ps(bp + k * NR + 16);
        }
        const float* ak = ap + k * MR;
        if constexpr (PackA) {
          const float* row = as + k * lda;
          const char* ahead = reinterpret_cast<const char*>(row + kFusedAhead * lda);
          _mm_prefetch(ahead, _MM_HINT_T0);
          _mm_prefetch(ahead + 4 * MR - 4, _MM_HINT_T0);
          const char* far = reinterpret_cast<const char*>(row + kFusedFar * lda);
          _mm_prefetch(far, _MM_HINT_T1);
          _mm_prefetch(far + 4 * MR - 4, _MM_HINT_T1);
          _mm512_mask_storeu_ps(ap + k * MR, a_store, _mm512_maskz_loadu_ps(a_load, row));
          // Broadcast from the row just loaded, in L1, where the tile's rows are all in it (a
          // store just made to ap would hold the broadcasts up); else from ap.
          if (decltype(rows)::value <= m) ak = row;
        }
        fma_step<decltype(rows)::value>(t, ak, b0, b1);
      }
    };
    detail::micro_tile_blocks(kp, KC / KU, steps, C, ldc, beta, m, n);
  }

  // The direct path (gemm_direct.h), for weight gradients with up to 4x as many rows as columns
  // (direct_suits): A and B both read where they are stored, (K, M) and (K, N), by a
  // micro-kernel of its own, 8 rows x 48 columns (24 accumulators; a K step broadcasts 8 values
  // of A's row, within one cache line, and loads 3 of B's), each row fetched into L1
  // kDirectNear rows ahead and into L2 kDirectFar rows ahead, on every read. Row blocks of 8
  // micro-panels. The 8 x 48 tile reads one cache line of A's row a step, where a 14 x 32 tile's
  // spans two as often as not. docs/tuning-log.md has the measurements behind these choices.
  static constexpr bool kDirect = true;
  static constexpr int64_t kDirectMR = 8, kDirectNR = 48;
  static constexpr int64_t kDirectRowPanels = 8, kDirectNear = 6, kDirectFar = 48;
  // C's rows are fetched into L2 256 K steps before a tile's end: C is read and written once per
  // K block, and a mega product's is several MiB.
  static constexpr int64_t kDirectCL2Steps = 256;
  // Columns in groups of 6 micro-panels (288: B's rows of a group 576 KiB at KC, within L2).
  static constexpr int64_t kDirectGroupPanels = 6;
  // Up to 4x as many rows as columns, where it is ahead of the fused path; the LM head's
  // weight gradient (32 x) stays on the blocked path.
  static bool direct_suits(int64_t M, int64_t N, int64_t) {
    return M <= 4 * N;
  }

  // C's R rows of V vectors fetched into the cache level of Hint (_MM_HINT_T0 or _T1), with the
  // line a row's last vector reaches where C's rows do not start lines.
  template <int Hint, int R, int V>
  static void fetch_c_rows(const float* C, int64_t ldc) {
    for (int r = 0; r < R; ++r) {
      const char* row = reinterpret_cast<const char*>(C + r * ldc);
      for (int v = 0; v < V; ++v)
        _mm_prefetch(row + 64 * v, static_cast<decltype(_MM_HINT_T0)>(Hint));
      _mm_prefetch(row + 64 * V - 4, static_cast<decltype(_MM_HINT_T0)>(Hint));
    }
  }

  // R rows and V vectors of 16 columns (n > 16 (V - 1)).
  template <int R, int V>
  static void micro_direct_t(int64_t kc, const float* a, int64_t lda, const float* b, int64_t ldb,
                             float* C, int64_t ldc, float beta, int n) {
    __m512 acc[R][V];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_ps();
    __mmask16 mask[V];
    for (int v = 0; v < V; ++v) mask[v] = detail::columns_mask(n, v);
    const bool whole = n >= 16 * V;
    const auto steps = [&](int64_t k0, int64_t k1) __attribute__((always_inline)) {
      for (int64_t k = k0; k < k1; ++k) {
        const float* brow = b + k * ldb;
        const float* arow = a + k * lda;
        const char* b_near = reinterpret_cast<const char*>(brow + kDirectNear * ldb);
        for (int v = 0; v < V; ++v) _mm_prefetch(b_near + 64 * v, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(arow + kDirectNear * lda), _MM_HINT_T0);
        const char* b_far = reinterpret_cast<const char*>(brow + kDirectFar * ldb);
        for (int v = 0; v < V; ++v) _mm_prefetch(b_far + 64 * v, _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(arow + kDirectFar * lda), _MM_HINT_T1);
        // Plain loads for whole rows: masked loads that miss the cache are much slower.
        __m512 bv[V];
        for (int v = 0; v < V; ++v)
          bv[v] = whole ? _mm512_loadu_ps(brow + 16 * v)
                        : _mm512_maskz_loadu_ps(mask[v], brow + 16 * v);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const __m512 av = _mm512_set1_ps(arow[r]);
          for (int v = 0; v < V; ++v) acc[r][v] = _mm512_fmadd_ps(av, bv[v], acc[r][v]);
        }
      }
    };
    // C's rows fetched into L2 kDirectCL2Steps steps before the end, and into L1
    // kPrefetchCSteps before it, as in micro_tile.
    const int64_t early = std::max<int64_t>(0, kc - kDirectCL2Steps);
    const int64_t late = std::max<int64_t>(0, kc - detail::kPrefetchCSteps);
    steps(0, early);
    fetch_c_rows<_MM_HINT_T1, R, V>(C, ldc);
    steps(early, late);
    fetch_c_rows<_MM_HINT_T0, R, V>(C, ldc);
    steps(late, kc);
    const __m512 vbeta = _mm512_set1_ps(beta);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      float* row = C + r * ldc;
      for (int v = 0; v < V; ++v) {
        __m512 x = acc[r][v];
        if (beta != 0.0f) {  // beta 0 overwrites, never reading C
          const __m512 c =
              whole ? _mm512_loadu_ps(row + 16 * v) : _mm512_maskz_loadu_ps(mask[v], row + 16 * v);
          x = _mm512_fmadd_ps(vbeta, c, x);
        }
        _mm512_mask_storeu_ps(row + 16 * v, mask[v], x);
      }
    }
  }

  // C[0:m, 0:n] = the product over kc K rows + beta C (m <= kDirectMR, n <= kDirectNR).
  static void micro_direct(int64_t kc, const float* a, int64_t lda, const float* b, int64_t ldb,
                           float* C, int64_t ldc, float beta, int m, int n) {
    // Only the vectors the columns need (a last micro-panel of 32 columns, as at N = 512, would
    // otherwise spend a third of its FMAs on zeros).
    const auto vectors = [&](auto r, auto v) {
      constexpr int R = decltype(r)::value, V = decltype(v)::value;
      micro_direct_t<R, V>(kc, a, lda, b, ldb, C, ldc, beta, n);
    };
    const auto rows = [&](auto r) {
      if (n > 32) return vectors(r, std::integral_constant<int, 3>{});
      if (n > 16) return vectors(r, std::integral_constant<int, 2>{});
      vectors(r, std::integral_constant<int, 1>{});
    };
    static_assert(kDirectMR == 8, "the cases below cover 1 to 8 rows");
    switch (m) {
      case 1:
        return rows(std::integral_constant<int, 1>{});
      case 2:
        return rows(std::integral_constant<int, 2>{});
      case 3:
        return rows(std::integral_constant<int, 3>{});
      case 4:
        return rows(std::integral_constant<int, 4>{});
      case 5:
        return rows(std::integral_constant<int, 5>{});
      case 6:
        return rows(std::integral_constant<int, 6>{});
      case 7:
        return rows(std::integral_constant<int, 7>{});
      default:
        return rows(std::integral_constant<int, 8>{});
    }
  }

  static void micro(int64_t kp, const float* a, const float* b, float* C, int64_t ldc, float beta,
                    int m, int n) {
    const auto steps = [ a, b ](detail::Tile & t, int64_t k0, int64_t k1, auto rows)
        __attribute__((always_inline)) {
      for (int64_t k = k0; k < k1; ++k) {
        fma_step<decltype(rows)::value>(t, a + k * MR, _mm512_load_ps(b + k * NR),
                                        _mm512_load_ps(b + k * NR + 16));
      }
    };
    detail::micro_tile(kp, steps, C, ldc, beta, m, n);
  }
};

// bf16 values to FP32: each value's 16 bits above 16 zero bits (exact).
inline __attribute__((always_inline)) __m512 widen16(__m256i v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
inline __attribute__((always_inline)) __m256i load_bf16(const uint16_t* p, int n) {
  return n >= 16 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                 : _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1), p);
}

// pack_transposed over bf16 rows: `rows` (<= 16) rows of `count` bf16 values, row r at
// src + r * ld, widened and transposed to dst[k * dst_stride + r] (lanes at or past rows zero).
inline void pack_transposed_bf16(float* dst, int64_t dst_stride, int lanes, const uint16_t* src,
                                 int64_t ld, int rows, int64_t count) {
  const __mmask16 lane_mask = static_cast<__mmask16>((1u << lanes) - 1);
  __m512 r[16];
  for (int64_t k = 0; k < count; k += 16) {
    const int rem = static_cast<int>(count - k < 16 ? count - k : 16);
    for (int i = 0; i < 16; ++i) {
      const uint16_t* row = src + i * ld + k;
      if (i < rows) _mm_prefetch(reinterpret_cast<const char*>(row + 64), _MM_HINT_T0);
      r[i] = i >= rows ? _mm512_setzero_ps() : widen16(load_bf16(row, rem));
    }
    detail::transpose16x16(r);
    for (int kk = 0; kk < rem; ++kk)
      _mm512_mask_storeu_ps(dst + (k + kk) * dst_stride, lane_mask, r[kk]);
  }
}

// bf16 operands on a CPU whose bf16 instructions are absent or slower than its FMA: the FP32
// kernel's blocked path over panels widened to FP32 as they are packed (each product of two bf16
// values is exact in FP32, so this is bf16 inputs with FP32 accumulation, in the FP32 kernel's
// order), instead of widening whole operands in memory first.
struct WidenedBf16Avx512 {
  using In = uint16_t;
  using Packed = float;
  static constexpr int64_t KU = 1, MR = kTileRows, NR = kTileCols;
  static constexpr int64_t KC = F32Avx512::KC;
  static constexpr TunedGemm kTuned = TunedGemm::F32Avx512;

  static void pack_a(float* dst, const uint16_t* A, int64_t lda, bool trans, int64_t i0, int64_t m,
                     int64_t k0, int64_t kc) {
    const int rows = static_cast<int>(std::min<int64_t>(m, MR));
    if (trans) {  // A stored (K, M)
      const __mmask16 store = static_cast<__mmask16>((1u << MR) - 1);
      for (int64_t k = 0; k < kc; ++k)
        _mm512_mask_storeu_ps(dst + k * MR, store,
                              widen16(load_bf16(A + (k0 + k) * lda + i0, rows)));
      return;
    }
    pack_transposed_bf16(dst, MR, MR, A + i0 * lda + k0, lda, rows, kc);
  }

  static void pack_b(float* dst, const uint16_t* B, int64_t ldb, bool trans, int64_t j0, int64_t n,
                     int64_t k0, int64_t kc) {
    if (!trans) {  // B stored (K, N)
      const int lo = static_cast<int>(std::clamp<int64_t>(n, 0, 16));
      const int hi = static_cast<int>(std::clamp<int64_t>(n - 16, 0, 16));
      for (int64_t k = 0; k < kc; ++k) {
        const uint16_t* src = B + (k0 + k) * ldb + j0;
        _mm512_store_ps(dst + k * NR, widen16(load_bf16(src, lo)));
        _mm512_store_ps(dst + k * NR + 16,
                        hi > 0 ? widen16(load_bf16(src + 16, hi)) : _mm512_setzero_ps());
      }
      return;
    }
    for (int64_t half = 0; half < 2; ++half) {  // B stored (N, K)
      const int rows = static_cast<int>(std::clamp<int64_t>(n - 16 * half, 0, 16));
      pack_transposed_bf16(dst + 16 * half, NR, 16, B + (j0 + 16 * half) * ldb + k0, ldb, rows, kc);
    }
  }

  static void micro(int64_t kp, const float* a, const float* b, float* C, int64_t ldc, float beta,
                    int m, int n) {
    F32Avx512::micro(kp, a, b, C, ldc, beta, m, n);
  }
};

}  // namespace

void gemm_bf16_widened_avx512(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K,
                              const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb,
                              float beta, float* C, int64_t ldc) {
  detail::gemm_blocked<WidenedBf16Avx512>(ta, tb, M, N, K, A, lda, B, ldb, beta, C, ldc);
}

std::array<int64_t, 2> gemm_bf16_widened_avx512_pack_floats(Transpose ta, Transpose tb, int64_t M,
                                                            int64_t N, int64_t K) {
  return detail::blocked_pack_floats<WidenedBf16Avx512>(ta, tb, M, N, K);
}

void gemm_f32_avx512(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K, const float* A,
                     int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  // One row (decoding) streams the matrix once: packing it would only add memory traffic.
  if (M == 1 && ta == Transpose::No && tb == Transpose::Yes && K > 0)
    return gemv_f32_avx512(N, K, A, B, ldb, beta, C);
  detail::gemm_blocked<F32Avx512>(ta, tb, M, N, K, A, lda, B, ldb, beta, C, ldc);
}

namespace {

struct F32Ops {
  using T = float;
  static constexpr int64_t kStep = 16;
  static __m512 step(__m512 acc, const T* x, const T* w) {
    return _mm512_fmadd_ps(_mm512_loadu_ps(x), _mm512_loadu_ps(w), acc);
  }
  static __m512 tail(__m512 acc, const T* x, const T* w, int64_t n) {
    const auto mask = static_cast<__mmask16>((1u << n) - 1);
    return _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, x), _mm512_maskz_loadu_ps(mask, w), acc);
  }
};

}  // namespace

void gemv_f32_avx512(int64_t N, int64_t K, const float* x, const float* W, int64_t ldw, float beta,
                     float* y) {
  detail::gemv_rows<F32Ops>(N, K, x, W, ldw, beta, y);
}

std::array<int64_t, 2> gemm_f32_avx512_pack_floats(Transpose ta, Transpose tb, int64_t M, int64_t N,
                                                   int64_t K) {
  return detail::blocked_pack_floats<F32Avx512>(ta, tb, M, N, K);
}

bool gemm_f32_avx512_takes_fused(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K) {
  return detail::takes_fused_path<F32Avx512>(ta, tb, M, N, K);
}

bool gemm_f32_avx512_takes_direct(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K) {
  return detail::takes_direct_path<F32Avx512>(ta, tb, M, N, K);
}

bool gemm_f32_avx512_takes_direct(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K,
                                  const float* A, int64_t lda, const float* B, int64_t ldb) {
  return detail::takes_direct_path<F32Avx512>(ta, tb, M, N, K, lda, ldb,
                                              detail::operands_start_lines(A, lda, B, ldb));
}

}  // namespace cputrain::kernels
