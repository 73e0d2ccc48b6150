// Vectors of 16 floats, and a vectorised exp on them: a GCC vector type (one zmm) with AVX-512, a
// pair of 8-float ones (two ymm) with the operators of one with AVX2. The ISA comes from the
// flags of the file that includes this header, so everything here has internal linkage: each
// file gets its own copy, and code built for AVX-512 can never be picked by the linker for a file
// built for AVX2.
#pragma once

// Vectors are passed only between inline functions, so the ABI note GCC gives for them where
// AVX-512 is off does not apply.
#pragma GCC diagnostic ignored "-Wpsabi"

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace cputrain::kernels::vec {
namespace {

constexpr int kLanes = 16;

#if defined(__AVX512F__)
typedef float vf __attribute__((vector_size(64), may_alias));
typedef uint32_t vu __attribute__((vector_size(64), may_alias));
typedef float vf_unaligned __attribute__((vector_size(64), aligned(4), may_alias));

inline __attribute__((always_inline)) vf load(const float* p) {
  return *reinterpret_cast<const vf_unaligned*>(p);
}
inline __attribute__((always_inline)) void store(float* p, vf v) {
  *reinterpret_cast<vf_unaligned*>(p) = v;
}
// The bits of each lane, and the lanes of those bits.
inline __attribute__((always_inline)) vu bits_of(vf v) {
  return (vu)v;
}
inline __attribute__((always_inline)) vf from_bits(vu u) {
  return (vf)u;
}
// v as computed, its own rounding: GCC cannot fuse the product that gives v into a sum that
// takes it (an FMA). Where that fusing depends on how the code around it compiles (a sum in
// another basic block from the product is not fused), it would differ between the ISA builds.
inline __attribute__((always_inline)) vf unfused(vf v) {
  __asm__("" : "+v"(v));
  return v;
}
#else
// Two ymm: a pair of 8-lane vectors with the operators of a GCC vector. A 64-byte GCC vector
// does the same arithmetic, but GCC keeps one that spans two registers on the stack wherever it
// lives across a loop's iterations (narrow stores read back wide, which stalls), which makes the
// cross-entropy's and SwiGLU's loops 2-4 times slower and attention's products 20 times.
typedef float v8f __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef float v8f_unaligned __attribute__((vector_size(32), aligned(4), may_alias));

struct vf {
  v8f lo, hi;
  float operator[](int i) const { return i < 8 ? lo[i] : hi[i - 8]; }
  float& operator[](int i) { return reinterpret_cast<float*>(this)[i]; }
};
struct vu {
  v8u lo, hi;
};

#define CPUTRAIN_VEC16_OPS(V, S, op)                                   \
  inline __attribute__((always_inline)) V operator op(V a, V b) {      \
    return {a.lo op b.lo, a.hi op b.hi};                               \
  }                                                                    \
  inline __attribute__((always_inline)) V operator op(V a, S b) {      \
    return {a.lo op b, a.hi op b};                                     \
  }                                                                    \
  inline __attribute__((always_inline)) V operator op(S a, V b) {      \
    return {a op b.lo, a op b.hi};                                     \
  }                                                                    \
  inline __attribute__((always_inline)) V& operator op##=(V& a, V b) { \
    return a = a op b;                                                 \
  }                                                                    \
  inline __attribute__((always_inline)) V& operator op##=(V& a, S b) { \
    return a = a op b;                                                 \
  }
CPUTRAIN_VEC16_OPS(vf, float, +)
CPUTRAIN_VEC16_OPS(vf, float, -)
CPUTRAIN_VEC16_OPS(vf, float, *)
CPUTRAIN_VEC16_OPS(vf, float, /)
CPUTRAIN_VEC16_OPS(vu, uint32_t, +)
CPUTRAIN_VEC16_OPS(vu, uint32_t, &)
CPUTRAIN_VEC16_OPS(vu, uint32_t, |)
CPUTRAIN_VEC16_OPS(vu, uint32_t, >>)
CPUTRAIN_VEC16_OPS(vu, uint32_t, <<)
#undef CPUTRAIN_VEC16_OPS
inline __attribute__((always_inline)) vf operator-(vf a) {
  return {-a.lo, -a.hi};
}

inline __attribute__((always_inline)) vf load(const float* p) {
  return {*reinterpret_cast<const v8f_unaligned*>(p),
          *reinterpret_cast<const v8f_unaligned*>(p + 8)};
}
inline __attribute__((always_inline)) void store(float* p, vf v) {
  *reinterpret_cast<v8f_unaligned*>(p) = v.lo;
  *reinterpret_cast<v8f_unaligned*>(p + 8) = v.hi;
}
inline __attribute__((always_inline)) vu bits_of(vf v) {
  return {(v8u)v.lo, (v8u)v.hi};
}
inline __attribute__((always_inline)) vf from_bits(vu u) {
  return {(v8f)u.lo, (v8f)u.hi};
}
inline __attribute__((always_inline)) vf unfused(vf v) {
  __asm__("" : "+x"(v.lo), "+x"(v.hi));
  return v;
}
#endif
// Every lane a. A broadcast, where vf{} + a is an addition GCC must keep (it turns -0 into +0)
// before the broadcast, and in a product's inner loop takes the ports the multiply-adds need.
inline __attribute__((always_inline)) vf splat(float a) {
#if defined(__AVX512F__)
  return (vf)_mm512_set1_ps(a);
#else
  const v8f half = (v8f)_mm256_set1_ps(a);
  return vf{half, half};
#endif
}

// The first n (< kLanes) values at p, the other lanes `fill`.
inline __attribute__((always_inline)) vf load_partial(const float* p, int n, float fill) {
  vf v = splat(fill);
  std::memcpy(&v, p, sizeof(float) * static_cast<size_t>(n));
  return v;
}
inline __attribute__((always_inline)) void store_partial(float* p, vf v, int n) {
  std::memcpy(p, &v, sizeof(float) * static_cast<size_t>(n));
}
// The m (<= kLanes) values at p, zeros after them; and their store.
inline __attribute__((always_inline)) vf load_n(const float* p, int m) {
  return m == kLanes ? load(p) : load_partial(p, m, 0.0f);
}
inline __attribute__((always_inline)) void store_n(float* p, vf v, int m) {
  if (m == kLanes)
    store(p, v);
  else
    store_partial(p, v, m);
}

// f(i, m) for the runs of kLanes values of an array of n (from i, m of them: the last run
// partial), split over threads where n is large. Each thread calls its own copy of f, so what f
// holds stays in registers (vector stores, which may alias anything, would else reload it).
template <class F>
void for_each_run(int64_t n, F f) {
  const int64_t runs = (n + kLanes - 1) / kLanes;
#pragma omp parallel for schedule(static) if (n > 16384) firstprivate(f)
  for (int64_t r = 0; r < runs; ++r)
    f(r * kLanes, static_cast<int>(n - r * kLanes < kLanes ? n - r * kLanes : kLanes));
}

// The first n (<= kLanes) bf16 values at p, widened; the other lanes 0.
inline vf load_bf16(const uint16_t* p, int n) {
  typedef uint16_t vh __attribute__((vector_size(32), may_alias));
  vh h{};
  std::memcpy(&h, p, sizeof(uint16_t) * static_cast<size_t>(n));
#if defined(__AVX512F__)
  return (vf)(__builtin_convertvector(h, vu) << 16);
#else
  const __m256i x = (__m256i)h;
  return {(v8f)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(x)), 16),
          (v8f)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(x, 1)), 16)};
#endif
}

// The first n (<= kLanes) lanes of v rounded to bf16 at p, as fp32_to_bf16 rounds (to
// nearest even; a NaN stays a quiet NaN).
inline void store_bf16(uint16_t* p, vf v, int n) {
  typedef uint16_t vh __attribute__((vector_size(32), may_alias));
#if defined(__AVX512F__)
  const vu bits = (vu)v;
  const vu rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const vu quiet = (bits >> 16) | 0x0040u;
  const vh h = __builtin_convertvector((bits & 0x7fffffffu) > 0x7f800000u ? quiet : rounded, vh);
#else
  // The same in AVX2 intrinsics, a register at a time.
  const __m256i in[2] = {(__m256i)v.lo, (__m256i)v.hi};
  __m256i half[2];
  for (int k = 0; k < 2; ++k) {
    const __m256i bits = in[k];
    const __m256i high = _mm256_srli_epi32(bits, 16);
    const __m256i rounded =
        _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)),
                                           _mm256_and_si256(high, _mm256_set1_epi32(1))),
                          16);
    const __m256i quiet = _mm256_or_si256(high, _mm256_set1_epi32(0x0040));
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    half[k] = _mm256_blendv_epi8(rounded, quiet, nan);
  }
  // Both halves hold values below 2^16, so the saturating pack keeps them; it interleaves the
  // halves' 128-bit lanes, which the permutation puts back in order.
  const vh h = (vh)_mm256_permute4x64_epi64(_mm256_packus_epi32(half[0], half[1]), 0xD8);
#endif
  if (n == kLanes)
    std::memcpy(p, &h, sizeof(h));
  else
    std::memcpy(p, &h, sizeof(uint16_t) * static_cast<size_t>(n));
}

// max_of(a, b) = a > b ? a : b and min_of(a, b) = a < b ? a : b per lane, b where either is NaN
// (the x86 max and min instructions). Selections go through them and select_less: GCC lowers a
// ?: on a 64-byte vector lane by lane where it spans two registers, and AVX2's pair has none.
#if defined(__AVX512F__)
inline __attribute__((always_inline)) vf max_of(vf a, vf b) {
  return (vf)_mm512_max_ps((__m512)a, (__m512)b);
}
inline __attribute__((always_inline)) vf min_of(vf a, vf b) {
  return (vf)_mm512_min_ps((__m512)a, (__m512)b);
}
#else
inline __attribute__((always_inline)) vf max_of(vf a, vf b) {
  return {(v8f)_mm256_max_ps((__m256)a.lo, (__m256)b.lo),
          (v8f)_mm256_max_ps((__m256)a.hi, (__m256)b.hi)};
}
inline __attribute__((always_inline)) vf min_of(vf a, vf b) {
  return {(v8f)_mm256_min_ps((__m256)a.lo, (__m256)b.lo),
          (v8f)_mm256_min_ps((__m256)a.hi, (__m256)b.hi)};
}
#endif

// The square root per lane (IEEE, correctly rounded).
#if defined(__AVX512F__)
inline __attribute__((always_inline)) vf sqrt(vf a) {
  return (vf)_mm512_sqrt_ps((__m512)a);
}
#else
inline __attribute__((always_inline)) vf sqrt(vf a) {
  return {(v8f)_mm256_sqrt_ps((__m256)a.lo), (v8f)_mm256_sqrt_ps((__m256)a.hi)};
}
#endif

// a < b ? x : y per lane (y where either is NaN), a blend rather than GCC's ?: (above).
#if defined(__AVX512F__)
inline __attribute__((always_inline)) vf select_less(vf a, vf b, vf x, vf y) {
  const __mmask16 m = _mm512_cmp_ps_mask((__m512)a, (__m512)b, _CMP_LT_OQ);
  return (vf)_mm512_mask_blend_ps(m, (__m512)y, (__m512)x);
}
#else
inline __attribute__((always_inline)) vf select_less(vf a, vf b, vf x, vf y) {
  const auto half = [](v8f p, v8f q, v8f s, v8f t) {
    return (v8f)_mm256_blendv_ps((__m256)t, (__m256)s,
                                 _mm256_cmp_ps((__m256)p, (__m256)q, _CMP_LT_OQ));
  };
  return {half(a.lo, b.lo, x.lo, y.lo), half(a.hi, b.hi, x.hi, y.hi)};
}
#endif

// a < b ? b : a per lane (a where either is NaN).
inline __attribute__((always_inline)) vf max(vf a, vf b) {
  return max_of(b, a);
}

inline float hsum(vf v) {
  float s = 0.0f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}
inline float hmax(vf v) {
  float m = v[0];
  for (int i = 1; i < kLanes; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

// exp(x) per lane, within 2 ulp for -87.3 <= x <= 88.3: range reduction x = n ln2 + r with
// |r| <= ln2 / 2 and the Taylor polynomial of degree 7 (truncation error below 1e-8
// relative), then 2^n put into the exponent bits. Below -87.3 the result is about 1e-38
// instead of smaller (callers that need an exact 0 set it themselves); above 88.3 it is
// exp(88.3); NaN gives NaN.
inline __attribute__((always_inline)) vf exp(vf x) {
  const vf lo = splat(-87.3f), hi = splat(88.3f);
  x = max_of(lo, x);  // x < lo ? lo : x: NaN compares false and stays NaN
  x = min_of(hi, x);  // x > hi ? hi : x
  // Adding 1.5 * 2^23 rounds x / ln2 to the integer n, which lands in the low mantissa bits of
  // t (read back below without a float-to-int conversion).
  const vf t = x * 1.44269504088896341f + 12582912.0f;
  const vf n = t - 12582912.0f;
  vf r = x - n * 0.693145751953125f;  // ln2 in two parts, the first exact in n
  r = r - n * 1.428606765330187e-06f;
  vf p = splat(1.0f / 5040.0f);
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  // 2^n: the exponent field n + 127, from t's bits 0x4B400000 + n.
  const vu scale = (bits_of(t) + (127u - 0x4B400000u)) << 23u;
  return p * from_bits(scale);
}

inline float exp(float x) {
  return exp(splat(x))[0];
}

// tanh(x) per lane, within a few ulp: the odd Taylor polynomial to x^9 below |x| = 0.25 (the next
// term under 3e-9), (1 - e) / (1 + e) with e = exp(-2|x|) above, with x's sign.
inline __attribute__((always_inline)) vf tanh(vf x) {
  const vf a = from_bits(bits_of(x) & 0x7FFFFFFFu);  // |x|
  const vf e = exp(-2.0f * a);
  const vf big = (1.0f - e) / (1.0f + e);
  const vf x2 = x * x;
  vf small = splat(62.0f / 2835.0f);
  small = small * x2 - 17.0f / 315.0f;
  small = small * x2 + 2.0f / 15.0f;
  small = small * x2 - 1.0f / 3.0f;
  small = small * x2 + 1.0f;
  small = small * a;
  const vf mag = select_less(a, splat(0.25f), small, big);
  return from_bits((bits_of(x) & 0x80000000u) | bits_of(mag));
}

}  // namespace
}  // namespace cputrain::kernels::vec
