// The delta rule's chunk products on bf16 (deltanet_isa.h, product_bf16): the FP32 operands
// rounded to bf16 pairs along the inner dimension, A as rows of pairs and B as pairs x columns
// (the layouts of bf16_dot_avx512.h and pairs_amx.h), multiplied on vdpbf16ps or, in the amx
// table, in whole tiles of 16 rows on AMX. The elementwise entries are the AVX-512 table's.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels/cpu/bf16_dot_avx512.h"
#include "kernels/cpu/pairs_amx.h"
#include "kernels/deltanet/deltanet_isa.h"

namespace cputrain::kernels {
namespace {

// 16 floats from x, those at or past `count` (which may be <= 0) zero.
inline __m512 load_upto(const float* x, int64_t count) {
  if (x == nullptr || count <= 0) return _mm512_setzero_ps();
  if (count >= 16) return _mm512_loadu_ps(x);
  return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << count) - 1), x);
}

inline __mmask16 first_lanes(int64_t count) {
  return count >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << count) - 1);
}

// dst[p] = (x[2p], x[2p + 1]) rounded to bf16, for p < pairs; values at or past n zero.
void round_pairs(uint32_t* dst, const float* x, int64_t n, int64_t pairs) {
  for (int64_t p0 = 0; p0 < pairs; p0 += 16) {
    const int64_t i = 2 * p0;
    const __m512 lo = load_upto(i < n ? x + i : nullptr, n - i);
    const __m512 hi = load_upto(i + 16 < n ? x + i + 16 : nullptr, n - i - 16);
    // cvtne2ps's low half is its second operand's values, in order: 16 pairs.
    _mm512_mask_storeu_epi32(dst + p0, first_lanes(pairs - p0),
                             (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
}

// dst[c] = (r0[c], r1[c]) rounded to bf16 for c < width (a row null: zeros); c at or past n zero.
void interleave(uint32_t* dst, const float* r0, const float* r1, int64_t n, int64_t width) {
  // Lane 2i takes the first row's value i (the low half of cvtne2ps's result), lane 2i + 1 the
  // second's.
  const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24,
                                         8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int64_t c0 = 0; c0 < width; c0 += 16) {
    const bool inside = c0 < n;
    const __m512 a = load_upto(inside && r0 != nullptr ? r0 + c0 : nullptr, n - c0);
    const __m512 b = load_upto(inside && r1 != nullptr ? r1 + c0 : nullptr, n - c0);
    _mm512_mask_storeu_epi32(dst + c0, first_lanes(width - c0),
                             _mm512_permutexvar_epi16(order, (__m512i)_mm512_cvtne2ps_pbh(b, a)));
  }
}

template <class V>
void grow(std::vector<V>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
}

template <bool Amx>
void product_bf16(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda,
                  const float* B, int64_t ldb, float beta, float* C, int64_t ldc, PairsScratch& s) {
  if (M <= 0 || N <= 0) return;
  // AMX takes pairs in whole tiles of 16; the zero pairs past K add nothing.
  const int64_t pairs = Amx ? (K + 31) / 32 * 16 : (K + 1) / 2;
  const int64_t Np = (N + 15) / 16 * 16;
  grow(s.a, M * pairs);
  grow(s.b, pairs * Np);
  grow(s.c, M * Np);
  grow(s.row, std::max(M, pairs) + 16);
  uint32_t *a = s.a.data(), *b = s.b.data(), *row = s.row.data();
  // A as M rows of pairs along K.
  if (!ta) {
    for (int64_t r = 0; r < M; ++r) round_pairs(a + r * pairs, A + r * lda, K, pairs);
  } else {
    // op(A)[r][k] = A[k lda + r]: rows 2p and 2p + 1 interleaved give column p.
    for (int64_t p = 0; p < pairs; ++p) {
      const float* r0 = 2 * p < K ? A + 2 * p * lda : nullptr;
      const float* r1 = 2 * p + 1 < K ? A + (2 * p + 1) * lda : nullptr;
      interleave(row, r0, r1, M, M);
      for (int64_t r = 0; r < M; ++r) a[r * pairs + p] = row[r];
    }
  }
  // B as pairs x Np.
  if (!tb) {
    for (int64_t p = 0; p < pairs; ++p) {
      const float* r0 = 2 * p < K ? B + 2 * p * ldb : nullptr;
      const float* r1 = 2 * p + 1 < K ? B + (2 * p + 1) * ldb : nullptr;
      interleave(b + p * Np, r0, r1, N, Np);
    }
  } else {
    // op(B)[k][c] = B[c ldb + k]: row c's pairs along K give column c.
    for (int64_t c = 0; c < Np; ++c) {
      if (c < N)
        round_pairs(row, B + c * ldb, K, pairs);
      else
        std::fill_n(row, pairs, 0u);
      for (int64_t p = 0; p < pairs; ++p) b[p * Np + c] = row[p];
    }
  }
  float* c = s.c.data();
  if (Amx) pairs_amx_configure();
  detail::dp_product(Amx, c, Np, a, pairs, b, Np, M, Np, pairs, false);
  for (int64_t i = 0; i < M; ++i) {
    float* out = C + i * ldc;
    for (int64_t j = 0; j < N; j += 16) {
      const __mmask16 lanes = first_lanes(N - j);
      __m512 x = _mm512_loadu_ps(c + i * Np + j);
      if (beta != 0)
        x = _mm512_fmadd_ps(_mm512_set1_ps(beta), _mm512_maskz_loadu_ps(lanes, out + j), x);
      _mm512_mask_storeu_ps(out + j, lanes, x);
    }
  }
}

DeltanetKernels with_products(void (*product)(bool, bool, int64_t, int64_t, int64_t, const float*,
                                              int64_t, const float*, int64_t, float, float*,
                                              int64_t, PairsScratch&)) {
  DeltanetKernels k = deltanet_kernels_avx512();
  k.product_bf16 = product;
  return k;
}

}  // namespace

const DeltanetKernels& deltanet_kernels_avx512_bf16() {
  static const DeltanetKernels k = with_products(product_bf16<false>);
  return k;
}

const DeltanetKernels& deltanet_kernels_amx() {
  static const DeltanetKernels k = with_products(product_bf16<true>);
  return k;
}

}  // namespace cputrain::kernels
