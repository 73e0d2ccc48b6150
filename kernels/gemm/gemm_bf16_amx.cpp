// BF16 GEMM on AMX: a 32 x 32 block of four 16 x 16 FP32 tiles, accumulated by tdpbf16ps from
// two A tiles (16 rows x 16 K pairs) and two B tiles (16 K pairs x 16 columns) per step.
// B panels are packed as K pairs exactly as for the AVX-512 BF16 kernel (the tile layout);
// A micro-panels are packed row by row ([r][p]) so a tile row is 16 consecutive pairs.
// Pairs left over after the last whole 16 are added with vdpbf16ps.
//
// Reached only where cpuid and the OS grant AMX; gemm.cpp checks it against the AVX-512 BF16
// path at first use.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels/cpu/amx_tiles.h"
#include "kernels/cpu/bf16.h"
#include "kernels/gemm/gemm_avx512_tile.h"
#include "kernels/gemm/gemm_bf16_packing.h"
#include "kernels/gemm/gemm_blocked.h"
#include "kernels/gemm/gemm_isa.h"

namespace cputrain::kernels {
namespace {

// Another library may configure the tiles its own way between our calls, so each thread
// loads our configuration once per call of gemm_bf16_amx.
std::atomic<uint64_t> call_generation{0};

void configure_tiles() {
  thread_local uint64_t configured = 0;
  const uint64_t generation = call_generation.load(std::memory_order_relaxed);
  if (configured == generation) return;
  load_full_tile_config();  // tiles 0-3 hold C, 4-5 A, 6-7 B
  configured = generation;
}

struct Bf16Amx {
  using In = uint16_t;
  using Packed = uint32_t;
  static constexpr int64_t KU = 2, MR = 32, NR = 32;
  static constexpr int64_t KC = 512;
  static constexpr TunedGemm kTuned = TunedGemm::Bf16Amx;  // MC and NC: gemm_tuning.h
  static constexpr bool kWholePanelsA = true;              // A is packed row by row

  // dst[r][p] = (op(A)[i0 + r][k0 + 2p], op(A)[i0 + r][k0 + 2p + 1]), kp = ceil(kc / 2) per row
  static void pack_a(uint32_t* dst, const uint16_t* A, int64_t lda, bool trans, int64_t i0,
                     int64_t m, int64_t k0, int64_t kc) {
    const int64_t kp = (kc + 1) / 2;
    if (!trans) {  // A stored (M, K): the pairs of a row are already consecutive
      for (int64_t r = 0; r < MR; ++r) {
        uint32_t* row = dst + r * kp;
        if (r >= m) {
          std::fill(row, row + kp, 0u);
          continue;
        }
        const uint16_t* src = A + (i0 + r) * lda + k0;
        std::memcpy(row, src, static_cast<size_t>(kc / 2) * sizeof(uint32_t));
        if (kc % 2) row[kp - 1] = detail::bf16_pair(src[kc - 1], 0);
      }
      return;
    }
    // A stored (K, M): interleave rows k and k + 1 into 16 pairs x 32 rows, then transpose.
    alignas(64) uint32_t block[16 * MR];
    for (int64_t p0 = 0; p0 < kp; p0 += 16) {
      const int np = static_cast<int>(std::min<int64_t>(16, kp - p0));
      for (int q = 0; q < np; ++q) {
        const int64_t p = p0 + q;
        const uint16_t* row = A + (k0 + 2 * p) * lda + i0;
        const uint16_t* next = 2 * p + 1 < kc ? row + lda : nullptr;
        detail::prefetch_rows_ahead(row, lda);
        detail::interleave_pairs(block + q * MR, row, next, m, MR);
      }
      for (int64_t half = 0; half < 2; ++half)
        detail::pack_transposed(dst + half * 16 * kp + p0, kp, np, block + half * 16, MR * 4, np,
                                16);
    }
  }

  // dst[p][c] = (op(B)[k0 + 2p][j0 + c], op(B)[k0 + 2p + 1][j0 + c]), as the AVX-512 BF16 kernel
  static void pack_b(uint32_t* dst, const uint16_t* B, int64_t ldb, bool trans, int64_t j0,
                     int64_t n, int64_t k0, int64_t kc) {
    detail::pack_b_pairs32(dst, B, ldb, trans, j0, n, k0, kc);
  }

  // C FP32 (+ beta C) or, for the rounded product (beta 0), bf16.
  template <class CT>
  static void micro(int64_t kp, const uint32_t* a, const uint32_t* b, CT* C, int64_t ldc,
                    float beta, int m, int n) {
    constexpr bool fp32_c = std::is_same_v<CT, float>;
    configure_tiles();
    // A whole 32 x 32 FP32 block with beta 0 or 1 and whole tiles along K: C goes through the
    // tiles. The B micro-panel streams from L2 while A stays in L1: B is prefetched.
    if (fp32_c && m == MR && n == NR && kp % 16 == 0 && (beta == 0.0f || beta == 1.0f))
      return tile_product<2, 2, true>(reinterpret_cast<float*>(C), ldc, a, kp, b, NR, kp,
                                      beta == 1.0f);
    // Otherwise through a block of FP32 on the stack, pairs past the last whole 16 on vdpbf16ps,
    // rounded to bf16 there for a bf16 C.
    alignas(64) float acc[MR * NR];
    const int64_t whole = kp / 16 * 16;
    tile_product<2, 2, true>(acc, NR, a, kp, b, NR, whole, false);
    for (int r = 0; r < m; ++r) {
      __m512 lo = _mm512_load_ps(acc + r * NR), hi = _mm512_load_ps(acc + r * NR + 16);
      for (int64_t p = whole; p < kp; ++p) {
        const __m512bh av = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[r * kp + p]));
        lo = _mm512_dpbf16_ps(lo, av, (__m512bh)_mm512_load_si512(b + p * NR));
        hi = _mm512_dpbf16_ps(hi, av, (__m512bh)_mm512_load_si512(b + p * NR + 16));
      }
      if constexpr (fp32_c)
        detail::store_row(C + r * ldc, lo, hi, beta, n);
      else
        detail::store_row_bf16(C + r * ldc, lo, hi, n);
    }
  }
};

}  // namespace

void gemm_bf16_amx(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K, const uint16_t* A,
                   int64_t lda, const uint16_t* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  // One row (decoding) streams the matrix once with vdpbf16ps: tiles would only add packing.
  if (M == 1 && ta == Transpose::No && tb == Transpose::Yes && K > 0)
    return gemv_bf16_avx512(N, K, A, B, ldb, beta, C);
  call_generation.fetch_add(1, std::memory_order_relaxed);
  detail::gemm_blocked<Bf16Amx>(ta, tb, M, N, K, A, lda, B, ldb, beta, C, ldc);
}

void gemm_bf16_rounded_amx(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K,
                           const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb,
                           uint16_t* C, int64_t ldc) {
  call_generation.fetch_add(1, std::memory_order_relaxed);
  detail::gemm_blocked<Bf16Amx>(ta, tb, M, N, K, A, lda, B, ldb, 0.0f, C, ldc);
}

int64_t gemm_bf16_amx_block_k() {
  return Bf16Amx::KC;
}

std::array<int64_t, 2> gemm_bf16_amx_pack_floats(Transpose ta, Transpose tb, int64_t M, int64_t N,
                                                 int64_t K) {
  return detail::blocked_pack_floats<Bf16Amx>(ta, tb, M, N, K);
}

bool gemm_bf16_amx_self_test() {
  const int64_t shapes[][3] = {{37, 45, 70}, {64, 64, 64}, {100, 33, 257}, {1, 1, 1}};
  uint32_t state = 12345;
  auto next = [&state] {
    state = state * 1664525u + 1013904223u;
    return static_cast<float>(state >> 8) / static_cast<float>(1u << 24) - 0.5f;
  };
  for (const auto& s : shapes) {
    const int64_t M = s[0], N = s[1], K = s[2];
    for (int t = 0; t < 8; ++t) {
      const Transpose ta = t & 1 ? Transpose::Yes : Transpose::No;
      const Transpose tb = t & 2 ? Transpose::Yes : Transpose::No;
      const float beta = t & 4 ? 1.0f : 0.0f;
      std::vector<uint16_t> a(M * K), b(K * N);
      for (auto& x : a) x = fp32_to_bf16(next());
      for (auto& x : b) x = fp32_to_bf16(next());
      std::vector<float> c0(M * N);
      for (auto& x : c0) x = next();
      std::vector<float> want = c0, got = c0;
      const int64_t lda = ta == Transpose::No ? K : M, ldb = tb == Transpose::No ? N : K;
      gemm_bf16_avx512(ta, tb, M, N, K, a.data(), lda, b.data(), ldb, beta, want.data(), N);
      gemm_bf16_amx(ta, tb, M, N, K, a.data(), lda, b.data(), ldb, beta, got.data(), N);
      for (size_t i = 0; i < want.size(); ++i)
        if (!(std::abs(got[i] - want[i]) <= 1e-4f * (1.0f + std::abs(want[i])))) {
          std::fprintf(stderr,
                       "cputrain: warning: the AMX GEMM disagrees with AVX-512 on %ldx%ldx%ld "
                       "(ta %d, tb %d, beta %g); AMX is not used\n",
                       static_cast<long>(M), static_cast<long>(N), static_cast<long>(K),
                       ta == Transpose::Yes, tb == Transpose::Yes, static_cast<double>(beta));
          return false;
        }
    }
  }
  return true;
}

}  // namespace cputrain::kernels
