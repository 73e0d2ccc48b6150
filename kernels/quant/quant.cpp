#include "kernels/quant/quant.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/cpu/bf16.h"
#include "kernels/gemm/gemm.h"
#include "kernels/gemm/gemm_plan.h"

namespace cputrain::kernels {

namespace {

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return half_to_fp32(h);
}

// Q4_K's and Q5_K's six-bit scale and minimum of sub-block j (0..7) from their 12 packed bytes.
inline void k_scale_min(int j, const uint8_t* q, int* scale, int* min) {
  if (j < 4) {
    *scale = q[j] & 63;
    *min = q[j + 4] & 63;
  } else {
    *scale = (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4);
    *min = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

void q4_0(const uint8_t* src, float* dst) {
  const float d = half_at(src);
  const uint8_t* q = src + 2;
#ifdef __AVX2__
  // The 16 bytes' low nibbles (values 0-15) and high ones (16-31), less 8, times d: the scalar
  // arithmetic, 8 lanes at a time.
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  const __m128i mask = _mm_set1_epi8(0x0f);
  const __m128i nibbles[2] = {_mm_and_si128(bytes, mask),
                              _mm_and_si128(_mm_srli_epi16(bytes, 4), mask)};
  const __m256 scale = _mm256_set1_ps(d), eight = _mm256_set1_ps(8.0f);
  for (int h = 0; h < 2; ++h)
    for (int part = 0; part < 2; ++part) {
      // The upper 8 bytes moved down (a shift by a constant, as the instruction takes).
      const __m128i eight_bytes =
          part == 0 ? nibbles[h] : _mm_unpackhi_epi64(nibbles[h], nibbles[h]);
      const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(eight_bytes));
      _mm256_storeu_ps(dst + 16 * h + 8 * part, _mm256_mul_ps(scale, _mm256_sub_ps(v, eight)));
    }
#else
  for (int i = 0; i < 16; ++i) dst[i] = d * static_cast<float>((q[i] & 0x0f) - 8);
  for (int i = 0; i < 16; ++i) dst[i + 16] = d * static_cast<float>((q[i] >> 4) - 8);
#endif
}

// E2M1's values by code (bit 3 the sign; -0 read as 0); the magnitudes are the first eight.
constexpr float kE2m1[16] = {0.0f, 0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                             0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

void mxfp4(const uint8_t* src, float* dst) {
  // 2^(e - 127) from its bits: e in the exponent field, or for e = 0 the subnormal 2^-127 (bit
  // 22); e = 255 is infinity, as 2^128 is.
  const uint32_t bits = src[0] == 0 ? 0x00400000u : static_cast<uint32_t>(src[0]) << 23;
  float d;
  std::memcpy(&d, &bits, 4);
  const uint8_t* q = src + 1;
#ifdef __AVX2__
  // Each code's value from the table: its low three bits index the magnitudes (the first eight
  // entries) and the negated ones (the last eight), bit 3 choosing between them; times d.
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  const __m128i mask = _mm_set1_epi8(0x0f);
  const __m128i nibbles[2] = {_mm_and_si128(bytes, mask),
                              _mm_and_si128(_mm_srli_epi16(bytes, 4), mask)};
  const __m256 positive = _mm256_loadu_ps(kE2m1), negative = _mm256_loadu_ps(kE2m1 + 8);
  const __m256 scale = _mm256_set1_ps(d);
  for (int h = 0; h < 2; ++h)
    for (int part = 0; part < 2; ++part) {
      const __m128i eight_bytes =
          part == 0 ? nibbles[h] : _mm_unpackhi_epi64(nibbles[h], nibbles[h]);
      const __m256i code = _mm256_cvtepu8_epi32(eight_bytes);
      const __m256 v = _mm256_blendv_ps(_mm256_permutevar8x32_ps(positive, code),
                                        _mm256_permutevar8x32_ps(negative, code),
                                        _mm256_castsi256_ps(_mm256_slli_epi32(code, 28)));
      _mm256_storeu_ps(dst + 16 * h + 8 * part, _mm256_mul_ps(scale, v));
    }
#else
  for (int i = 0; i < 16; ++i) {
    dst[i] = d * kE2m1[q[i] & 15];
    dst[i + 16] = d * kE2m1[q[i] >> 4];
  }
#endif
}

void quantize_mxfp4(const float* x, uint8_t* b) {
  float largest = 0.0f;
  for (int i = 0; i < 32; ++i) largest = std::max(largest, std::abs(x[i]));
  // The smallest e with 6 * 2^(e - 127) >= largest (e in 0 .. 254): from largest's binary
  // exponent, then a step either way where the factor 6 decides.
  int p = 0;
  std::frexp(largest / 6.0f, &p);  // largest / 6 in [2^(p-1), 2^p)
  int e = largest > 0.0f ? std::clamp(p + 127, 0, 254) : 0;
  while (e > 0 && 6.0f * std::ldexp(1.0f, e - 1 - 127) >= largest) --e;
  while (e < 254 && 6.0f * std::ldexp(1.0f, e - 127) < largest) ++e;
  b[0] = static_cast<uint8_t>(e);
  const float d = std::ldexp(1.0f, e - 127);
  uint8_t codes[32];
  for (int i = 0; i < 32; ++i) {
    const float m = std::abs(x[i]) / d;
    int best = 0;
    for (int c = 1; c < 8; ++c) {
      const float err = std::abs(kE2m1[c] - m), was = std::abs(kE2m1[best] - m);
      if (err < was || (err == was && c % 2 == 0)) best = c;
    }
    codes[i] = static_cast<uint8_t>(best | (x[i] < 0.0f && best != 0 ? 8 : 0));
  }
  for (int i = 0; i < 16; ++i) b[1 + i] = static_cast<uint8_t>(codes[i] | (codes[i + 16] << 4));
}

void q8_0(const uint8_t* src, float* dst) {
  const float d = half_at(src);
  const auto* q = reinterpret_cast<const int8_t*>(src + 2);
  for (int i = 0; i < 32; ++i) dst[i] = d * static_cast<float>(q[i]);
}

// Q5_0, and Offset, Q5_1 (its f16 m after d): levels of five bits, the fifth of value i bit i of
// the four bytes after the scales, the low four as Q4_0's nibbles.
template <bool Offset>
void q5(const uint8_t* src, float* dst) {
  const float d = half_at(src), m = Offset ? half_at(src + 2) : 0.0f;
  const uint8_t* h = src + (Offset ? 4 : 2);
  const uint32_t fifth = static_cast<uint32_t>(h[0]) | (static_cast<uint32_t>(h[1]) << 8) |
                         (static_cast<uint32_t>(h[2]) << 16) | (static_cast<uint32_t>(h[3]) << 24);
  const uint8_t* q = h + 4;
  for (int i = 0; i < 16; ++i) {
    const int lo = (q[i] & 15) | static_cast<int>(((fifth >> i) & 1) << 4);
    const int hi = (q[i] >> 4) | static_cast<int>(((fifth >> (i + 16)) & 1) << 4);
    if constexpr (Offset) {
      dst[i] = d * static_cast<float>(lo) + m;
      dst[i + 16] = d * static_cast<float>(hi) + m;
    } else {
      dst[i] = d * static_cast<float>(lo - 16);
      dst[i + 16] = d * static_cast<float>(hi - 16);
    }
  }
}

// Q4_K, and Five, Q5_K (`high` its 32 bytes of fifth bits).
template <bool Five>
void q45_k(const uint8_t* src, const uint8_t* high, const uint8_t* q, float* dst) {
  const float d = half_at(src), dmin = half_at(src + 2);
  const uint8_t* scales = src + 4;
  for (int j = 0; j < 8; j += 2, q += 32, dst += 64) {
    int s0, m0, s1, m1;
    k_scale_min(j, scales, &s0, &m0);
    k_scale_min(j + 1, scales, &s1, &m1);
    const float d0 = d * static_cast<float>(s0), o0 = dmin * static_cast<float>(m0);
    const float d1 = d * static_cast<float>(s1), o1 = dmin * static_cast<float>(m1);
    for (int l = 0; l < 32; ++l) {
      const int h0 = Five ? ((high[l] >> j) & 1) << 4 : 0;
      const int h1 = Five ? ((high[l] >> (j + 1)) & 1) << 4 : 0;
      dst[l] = d0 * static_cast<float>((q[l] & 0x0f) | h0) - o0;
      dst[l + 32] = d1 * static_cast<float>((q[l] >> 4) | h1) - o1;
    }
  }
}

void q6_k(const uint8_t* src, float* dst) {
  const uint8_t* ql = src;
  const uint8_t* qh = src + 128;
  const auto* sc = reinterpret_cast<const int8_t*>(src + 192);
  const float d = half_at(src + 208);
  // Each half of 128 values takes 64 low-nibble bytes and 32 high-bit bytes.
  for (int half = 0; half < 2; ++half, ql += 64, qh += 32, sc += 8, dst += 128) {
    for (int is = 0; is < 2; ++is) {  // values l of each quarter take scale is = l / 16
      const int s1 = sc[is], s2 = sc[is + 2], s3 = sc[is + 4], s4 = sc[is + 6];
      for (int l = 16 * is; l < 16 * is + 16; ++l) {
        const int q1 = ((ql[l] & 0x0f) | (((qh[l] >> 0) & 3) << 4)) - 32;
        const int q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) - 32;
        const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
        const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
        dst[l] = d * static_cast<float>(s1 * q1);
        dst[l + 32] = d * static_cast<float>(s2 * q2);
        dst[l + 64] = d * static_cast<float>(s3 * q3);
        dst[l + 96] = d * static_cast<float>(s4 * q4);
      }
    }
  }
}

// Buffer Which of the calling thread, grown on demand and kept for the next call.
template <typename T, int Which = 0>
T* panel_buffer(size_t n) {
  thread_local std::vector<T> buffer;
  if (buffer.size() < n) buffer.resize(n);
  return buffer.data();
}

void check(const QuantMatrix& w, const char* fn) {
  if (w.cols <= 0 || w.cols % quant_block_values(w.type) != 0 || w.rows <= 0)
    throw std::invalid_argument(std::string(fn) +
                                ": a quantised matrix's rows are whole blocks, and it has rows");
}

}  // namespace

float half_to_fp32(uint16_t h) {
#ifdef __F16C__
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h >> 15) << 31;
  const uint32_t exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
  uint32_t bits;
  if (exponent == 0) {  // zero or subnormal: mantissa x 2^-24, exact in FP32
    const float v = static_cast<float>(mantissa) * 0x1p-24f;
    std::memcpy(&bits, &v, 4);
    bits |= sign;
  } else if (exponent == 31) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

uint16_t fp32_to_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000;
  const uint32_t abs = x & 0x7fffffff;
  if (abs >= 0x7f800000)
    return static_cast<uint16_t>(sign | 0x7c00 | (abs > 0x7f800000 ? 0x200 : 0));
  if (abs >= 0x477ff000) return static_cast<uint16_t>(sign | 0x7c00);  // rounds above 65504
  if (abs < 0x38800000) {  // a subnormal half (or zero): round abs / 2^-24 to an integer
    float v;
    std::memcpy(&v, &abs, 4);
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(std::ldexp(v, 24))));
  }
  // Normal: rebias the exponent, round the 13 dropped mantissa bits to nearest even.
  const uint32_t rounded = abs + 0xfff + ((abs >> 13) & 1);
  return static_cast<uint16_t>(sign | ((rounded - 0x38000000) >> 13));
}

namespace {

// Squared error of n values x ~ s q - m, each q the nearest level in [0, top]; with the sums of
// the least squares for those levels.
struct GridFit {
  double err = 0.0, sq = 0.0, sqq = 0.0, sx = 0.0, sxq = 0.0;
};
GridFit grid_fit(const float* x, int n, int top, float s, float m) {
  GridFit f;
  for (int i = 0; i < n; ++i) {
    const float q = std::clamp(std::nearbyint((x[i] + m) / s), 0.0f, static_cast<float>(top));
    const double e = static_cast<double>(s) * q - m - x[i];
    f.err += e * e;
    f.sq += q, f.sqq += static_cast<double>(q) * q;
    f.sx += x[i], f.sxq += static_cast<double>(x[i]) * q;
  }
  return f;
}

// x ~ scale * q - min over n values, q integers in [0, top], scale >= 0, min >= 0 (the K-quants'
// sub-block with a minimum). Candidates: the values' range spread over k of the levels, for k
// from top down to two thirds of it, the lowest value at each level it can take (so values that
// lie on such a grid, as a quantised file's do, are fitted exactly); from the best, alternately
// the levels each value rounds to and the least-squares scale and minimum for those levels.
void fit_scale_min(const float* x, int n, int top, float* scale, float* min) {
  float lo = x[0], hi = x[0];
  for (int i = 1; i < n; ++i) lo = std::min(lo, x[i]), hi = std::max(hi, x[i]);
  *scale = 0.0f;
  *min = std::max(0.0f, -lo);
  if (hi <= lo) {  // one value: a scale alone, or a minimum alone
    if (lo > 0.0f) *scale = lo / static_cast<float>(top), *min = 0.0f;
    return;
  }
  double best = 1e300;
  const auto consider = [&](float s, float m) {
    if (!(s > 0.0f) || m < 0.0f) return;
    const GridFit f = grid_fit(x, n, top, s, m);
    if (f.err < best) best = f.err, *scale = s, *min = m;
  };
  consider(hi / static_cast<float>(top), 0.0f);  // no minimum
  for (int k = top; 3 * k >= 2 * top; --k) {
    const float s = (hi - lo) / static_cast<float>(k);
    for (int a = 0; a + k <= top; ++a) consider(s, static_cast<float>(a) * s - lo);
  }
  for (int iteration = 0; iteration < 4 && best > 0.0; ++iteration) {
    const GridFit f = grid_fit(x, n, top, *scale, *min);
    // min(sum (s q - m - x)^2) over s and m: s (sqq) - m (sq) = sxq, s (sq) - m n = sx.
    const double det = f.sqq * n - f.sq * f.sq;
    if (det <= 0.0) break;
    double ns = (f.sxq * n - f.sq * f.sx) / det, nm = (ns * f.sq - f.sx) / n;
    if (nm < 0.0) {  // the minimum at its bound: the scale alone
      nm = 0.0;
      ns = f.sqq > 0.0 ? f.sxq / f.sqq : 0.0;
    }
    const double before = best;
    consider(static_cast<float>(ns), static_cast<float>(nm));
    if (best >= before) break;
  }
}

// A block's f16 scale for sub-block scales up to `largest` stored in `levels` steps: d written at
// p, its value returned (0 where largest is 0).
float block_scale(float largest, float levels, uint8_t* p) {
  const uint16_t h = fp32_to_half(largest / levels);
  std::memcpy(p, &h, 2);
  return half_to_fp32(h);
}

// The nearest level to v of a grid of `step` (offset by `min`) with levels lo .. hi; lo where the
// step is 0.
inline float level(float v, float step, float min, float lo, float hi) {
  return step != 0.0f ? std::clamp(std::nearbyint((v + min) / step), lo, hi) : lo;
}

// Squared error of n values on that grid.
double grid_error(const float* x, int n, float step, float min, float lo, float hi) {
  double e = 0.0;
  for (int i = 0; i < n; ++i) {
    const double d = static_cast<double>(step) * level(x[i], step, min, lo, hi) - min - x[i];
    e += d * d;
  }
  return e;
}

// A sub-block's scale as an integer multiple of the block's d, within [lo, hi]: of the multiples
// next to `scale` / d, the one whose grid fits the values best (a 6- or 8-bit scale rounded
// alone can leave the largest value far outside its grid).
template <typename Error>
int scale_multiple(float scale, float d, int lo, int hi, Error&& error) {
  if (d == 0.0f) return 0;
  const int r = static_cast<int>(std::nearbyint(scale / d));
  int best = std::clamp(r, lo, hi);
  double best_error = error(best);
  for (const int c : {r - 1, r + 1}) {
    if (c < lo || c > hi) continue;
    const double e = error(c);
    if (e < best_error) best = c, best_error = e;
  }
  return best;
}

void quantize_q4_k(const float* x, uint8_t* b) {
  float scales[8], mins[8];
  for (int j = 0; j < 8; ++j) fit_scale_min(x + 32 * j, 32, 15, scales + j, mins + j);
  const float d = block_scale(*std::max_element(scales, scales + 8), 63.0f, b);
  const float dmin = block_scale(*std::max_element(mins, mins + 8), 63.0f, b + 2);
  uint8_t sc[8], mn[8];
  for (int j = 0; j < 8; ++j) {
    const float* v = x + 32 * j;
    // The minimum's multiple for the rounded scale, then the scale's for that minimum.
    const int m0 =
        dmin > 0.0f ? std::clamp(static_cast<int>(std::nearbyint(mins[j] / dmin)), 0, 63) : 0;
    const int s = scale_multiple(scales[j], d, 0, 63, [&](int c) {
      return grid_error(v, 32, d * static_cast<float>(c), dmin * static_cast<float>(m0), 0.0f,
                        15.0f);
    });
    const int m = scale_multiple(mins[j], dmin, 0, 63, [&](int c) {
      return grid_error(v, 32, d * static_cast<float>(s), dmin * static_cast<float>(c), 0.0f,
                        15.0f);
    });
    sc[j] = static_cast<uint8_t>(s);
    mn[j] = static_cast<uint8_t>(m);
  }
  // Sub-blocks 0-3: six bits each in bytes 0-3 (scales) and 4-7 (minimums); 4-7: their low four
  // bits in bytes 8-11 (scale low, minimum high), their top two over bytes 0-3 and 4-7.
  uint8_t* s = b + 4;
  for (int j = 0; j < 4; ++j) {
    s[j] = static_cast<uint8_t>(sc[j] | ((sc[j + 4] >> 4) << 6));
    s[j + 4] = static_cast<uint8_t>(mn[j] | ((mn[j + 4] >> 4) << 6));
    s[j + 8] = static_cast<uint8_t>((sc[j + 4] & 15) | ((mn[j + 4] & 15) << 4));
  }
  uint8_t q[256];
  for (int j = 0; j < 8; ++j) {
    const float step = d * sc[j], min = dmin * mn[j];
    for (int l = 0; l < 32; ++l)
      q[32 * j + l] = static_cast<uint8_t>(level(x[32 * j + l], step, min, 0.0f, 15.0f));
  }
  // Each 64 values: 32 bytes, the first 32 values' levels low, the next 32's high.
  for (int g = 0; g < 4; ++g)
    for (int l = 0; l < 32; ++l)
      b[16 + 32 * g + l] = static_cast<uint8_t>(q[64 * g + l] | (q[64 * g + 32 + l] << 4));
}

// The step of a grid of levels lo .. hi (lo = -hi - 1) that fits n values best among those that
// take the value of largest magnitude to a level from 3/4 of hi + 1 to hi + 1 away from 0; with
// `half`, each candidate rounded to an f16 first (a scale the block stores as it is).
float signed_step(const float* x, int n, float hi, bool half) {
  float top = 0.0f;
  for (int l = 0; l < n; ++l)
    if (std::abs(x[l]) > std::abs(top)) top = x[l];
  float step = 0.0f;
  double best = 1e300;
  const int reach = static_cast<int>(hi) + 1;
  for (int level = 3 * reach / 4; level <= reach && top != 0.0f; ++level)
    for (const float signed_level : {-static_cast<float>(level), static_cast<float>(level)}) {
      if (signed_level > hi) continue;
      float s = top / signed_level;
      if (half) s = half_to_fp32(fp32_to_half(s));
      if (s == 0.0f) continue;
      const double e = grid_error(x, n, s, 0.0f, -hi - 1.0f, hi);
      if (e < best) best = e, step = s;
    }
  return step;
}

void quantize_q6_k(const float* x, uint8_t* b) {
  // Sub-blocks of 16, levels -32 .. 31 of a signed scale (signed_step: values on such a grid, as
  // a quantised file's are, fitted exactly).
  float scales[16];
  float largest = 0.0f;
  for (int j = 0; j < 16; ++j) {
    scales[j] = signed_step(x + 16 * j, 16, 31.0f, false);
    largest = std::max(largest, std::abs(scales[j]));
  }
  // The block's d: the largest scale over 127 or 128 steps, of either sign (the int8 scales reach
  // -128 but only 127), whichever fits the block best.
  const auto sub_scale = [&](float d, int j) {
    const float* v = x + 16 * j;
    return scale_multiple(scales[j], d, -128, 127, [&](int c) {
      const float step = d * static_cast<float>(c);
      return step != 0.0f ? grid_error(v, 16, step, 0.0f, -32.0f, 31.0f)
                          : grid_error(v, 16, 1.0f, 0.0f, 0.0f, 0.0f);
    });
  };
  float d = 0.0f;
  double best = 1e300;
  for (const float steps : {127.0f, 128.0f, -127.0f, -128.0f}) {
    const float candidate = half_to_fp32(fp32_to_half(largest / steps));
    double e = 0.0;
    for (int j = 0; j < 16; ++j) {
      const float step = candidate * static_cast<float>(sub_scale(candidate, j));
      e += step != 0.0f ? grid_error(x + 16 * j, 16, step, 0.0f, -32.0f, 31.0f)
                        : grid_error(x + 16 * j, 16, 1.0f, 0.0f, 0.0f, 0.0f);
    }
    if (e < best) best = e, d = candidate;
  }
  const uint16_t dh = fp32_to_half(d);
  std::memcpy(b + 208, &dh, 2);
  uint8_t q[256];
  for (int j = 0; j < 16; ++j) {
    const float* v = x + 16 * j;
    const int sc = sub_scale(d, j);
    b[192 + j] = static_cast<uint8_t>(static_cast<int8_t>(sc));
    const float step = d * static_cast<float>(sc);
    for (int l = 0; l < 16; ++l)
      q[16 * j + l] =
          static_cast<uint8_t>(32 + (step != 0.0f ? level(v[l], step, 0.0f, -32.0f, 31.0f) : 0.0f));
  }
  // Halves of 128: value l + 32 s (s = 0..3) has its low four bits in byte l + 32 (s % 2) of the
  // half's 64 (low nibble for s < 2, high for s >= 2), its top two at bits 2s of byte l of the
  // half's 32.
  for (int h = 0; h < 2; ++h) {
    uint8_t* ql = b + 64 * h;
    uint8_t* qh = b + 128 + 32 * h;
    const uint8_t* v = q + 128 * h;
    for (int l = 0; l < 32; ++l) {
      ql[l] = static_cast<uint8_t>((v[l] & 15) | ((v[l + 64] & 15) << 4));
      ql[l + 32] = static_cast<uint8_t>((v[l + 32] & 15) | ((v[l + 96] & 15) << 4));
      qh[l] = static_cast<uint8_t>((v[l] >> 4) | ((v[l + 32] >> 4) << 2) | ((v[l + 64] >> 4) << 4) |
                                   ((v[l + 96] >> 4) << 6));
    }
  }
}

void quantize_q5_0(const float* x, uint8_t* b) {
  const float d = signed_step(x, 32, 15.0f, true);
  const uint16_t h = fp32_to_half(d);
  std::memcpy(b, &h, 2);
  uint8_t q[32];
  for (int i = 0; i < 32; ++i)
    q[i] = static_cast<uint8_t>(16.0f + (d != 0.0f ? level(x[i], d, 0.0f, -16.0f, 15.0f) : 0.0f));
  uint32_t fifth = 0;
  for (int i = 0; i < 32; ++i) fifth |= static_cast<uint32_t>(q[i] >> 4) << i;
  for (int k = 0; k < 4; ++k) b[2 + k] = static_cast<uint8_t>(fifth >> (8 * k));
  for (int i = 0; i < 16; ++i)
    b[6 + i] = static_cast<uint8_t>((q[i] & 15) | ((q[i + 16] & 15) << 4));
}

}  // namespace

void quantize_blocks(QuantType type, const float* src, int64_t blocks, uint8_t* dst) {
  const int64_t bytes = quant_block_bytes(type), values = quant_block_values(type);
  if (type != QuantType::Q4_K && type != QuantType::Q6_K && type != QuantType::Q5_0 &&
      type != QuantType::MXFP4)
    throw std::invalid_argument("quantize_blocks: Q4_K, Q6_K, Q5_0 and MXFP4 only");
#pragma omp parallel for schedule(static) if (blocks >= 64)
  for (int64_t i = 0; i < blocks; ++i) {
    if (type == QuantType::Q4_K)
      quantize_q4_k(src + values * i, dst + bytes * i);
    else if (type == QuantType::Q6_K)
      quantize_q6_k(src + values * i, dst + bytes * i);
    else if (type == QuantType::MXFP4)
      quantize_mxfp4(src + values * i, dst + bytes * i);
    else
      quantize_q5_0(src + values * i, dst + bytes * i);
  }
}

int64_t quant_block_values(QuantType type) {
  return type == QuantType::Q4_K || type == QuantType::Q5_K || type == QuantType::Q6_K ? 256 : 32;
}

int64_t quant_block_bytes(QuantType type) {
  switch (type) {
    case QuantType::Q4_0:
      return 18;
    case QuantType::Q5_0:
      return 22;
    case QuantType::Q5_1:
      return 24;
    case QuantType::Q8_0:
      return 34;
    case QuantType::Q4_K:
      return 144;
    case QuantType::Q5_K:
      return 176;
    case QuantType::Q6_K:
      return 210;
    case QuantType::MXFP4:
      return 17;
  }
  return 0;
}

void dequantize_blocks(QuantType type, const uint8_t* src, int64_t blocks, float* dst) {
  const int64_t values = quant_block_values(type), bytes = quant_block_bytes(type);
  // One loop per format, the format chosen once.
  const auto each = [&](auto block) {
    for (int64_t b = 0; b < blocks; ++b) block(src + b * bytes, dst + b * values);
  };
  switch (type) {
    case QuantType::Q4_0:
      return each(q4_0);
    case QuantType::Q5_0:
      return each(q5<false>);
    case QuantType::Q5_1:
      return each(q5<true>);
    case QuantType::Q8_0:
      return each(q8_0);
    case QuantType::Q4_K:
      return each([](const uint8_t* b, float* d) { q45_k<false>(b, nullptr, b + 16, d); });
    case QuantType::Q5_K:
      return each([](const uint8_t* b, float* d) { q45_k<true>(b, b + 16, b + 48, d); });
    case QuantType::Q6_K:
      return each(q6_k);
    case QuantType::MXFP4:
      return each(mxfp4);
  }
}

void dequantize_rows(const QuantMatrix& w, int64_t r0, int64_t n, float* dst) {
  const int64_t blocks = w.cols / quant_block_values(w.type);
#pragma omp parallel for schedule(static) if (n * w.cols >= (1 << 16))
  for (int64_t r = 0; r < n; ++r)
    dequantize_blocks(w.type, w.data + (r0 + r) * w.row_bytes(), blocks, dst + r * w.cols);
}

void dequantize_rows_bf16(const QuantMatrix& w, int64_t r0, int64_t n, uint16_t* dst) {
  const int64_t blocks = w.cols / quant_block_values(w.type);
#pragma omp parallel if (n * w.cols >= (1 << 16))
  {
    float* row = panel_buffer<float, 1>(static_cast<size_t>(w.cols));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < n; ++r) {
      dequantize_blocks(w.type, w.data + (r0 + r) * w.row_bytes(), blocks, row);
      uint16_t* out = dst + r * w.cols;
      for (int64_t c = 0; c < w.cols; ++c) out[c] = fp32_to_bf16(row[c]);
    }
  }
}

int64_t quant_panel_rows(int64_t cols) {
  return std::max<int64_t>(16, (int64_t{1} << 21) / std::max<int64_t>(cols, 1) / 16 * 16);
}

size_t quant_panel_bytes(bool bf16, int64_t rows, int64_t cols) {
  const int64_t n = std::min(rows, quant_panel_rows(cols)) * cols;
  return static_cast<size_t>((n * (bf16 ? 2 : 4) + 3) / 4 * 4);
}

namespace {

// product(n0, n, panel) over W's panels of rows n0 .. n0 + n, each dequantised into the calling
// thread's buffer: FP32 where T is float, bf16 where it is uint16_t.
template <typename T, typename Product>
void over_panels(const QuantMatrix& W, const char* fn, Product&& product) {
  check(W, fn);
  const int64_t rows = std::min(W.rows, quant_panel_rows(W.cols));
  T* panel = reinterpret_cast<T*>(detail::gemm_pack_buffer(
      quant_panel_bytes(std::is_same_v<T, uint16_t>, W.rows, W.cols) / sizeof(float),
      kGemmQuantPanel));
  for (int64_t n0 = 0; n0 < W.rows; n0 += rows) {
    const int64_t n = std::min(rows, W.rows - n0);
    if constexpr (std::is_same_v<T, float>)
      dequantize_rows(W, n0, n, panel);
    else
      dequantize_rows_bf16(W, n0, n, panel);
    product(n0, n, panel);
  }
}

// Y = X W^T + beta Y row by row of W, for a few rows of X: each row of W decoded once, by the
// thread that takes it (rounded to bf16 where X is bf16, as the GEMM multiplies it), and dotted
// with every row of X in FP32.
template <typename T>
void rows_product(int64_t M, const T* X, int64_t ldx, const QuantMatrix& W, float beta, float* Y,
                  int64_t ldy) {
  check(W, "gemm_quant_forward");
  const int64_t K = W.cols, blocks = K / quant_block_values(W.type);
  constexpr bool kBf16 = std::is_same_v<T, uint16_t>;
  // X's rows as FP32, once, read by every thread.
  float* x = panel_buffer<float, 2>(static_cast<size_t>(M * K));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) {
      if constexpr (kBf16)
        x[m * K + k] = bf16_to_fp32(X[m * ldx + k]);
      else
        x[m * K + k] = X[m * ldx + k];
    }
#pragma omp parallel
  {
    float* row = panel_buffer<float, 1>(static_cast<size_t>(K));
#pragma omp for schedule(static)
    for (int64_t n = 0; n < W.rows; ++n) {
      dequantize_blocks(W.type, W.data + n * W.row_bytes(), blocks, row);
      if constexpr (kBf16)
        for (int64_t k = 0; k < K; ++k) row[k] = bf16_to_fp32(fp32_to_bf16(row[k]));
      for (int64_t m = 0; m < M; ++m) {
        const float* xm = x + m * K;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t k = 0; k < K; ++k) sum += xm[k] * row[k];
        float& y = Y[m * ldy + n];
        y = beta == 0.0f ? sum : beta * y + sum;
      }
    }
  }
}

}  // namespace

void gemm_quant_forward(int64_t M, const float* X, int64_t ldx, const QuantMatrix& W, float beta,
                        float* Y, int64_t ldy) {
  if (M <= kQuantRowsM) return rows_product(M, X, ldx, W, beta, Y, ldy);
  over_panels<float>(W, "gemm_quant_forward", [&](int64_t n0, int64_t n, const float* panel) {
    gemm_f32(Transpose::No, Transpose::Yes, M, n, W.cols, X, ldx, panel, W.cols, beta, Y + n0, ldy);
  });
}

void gemm_quant_forward_bf16(int64_t M, const uint16_t* X, int64_t ldx, const QuantMatrix& W,
                             float beta, float* Y, int64_t ldy) {
  if (M <= kQuantRowsM) return rows_product(M, X, ldx, W, beta, Y, ldy);
  over_panels<uint16_t>(W, "gemm_quant_forward_bf16",
                        [&](int64_t n0, int64_t n, const uint16_t* panel) {
                          gemm_bf16(Transpose::No, Transpose::Yes, M, n, W.cols, X, ldx, panel,
                                    W.cols, beta, Y + n0, ldy);
                        });
}

void gemm_quant_backward_input(int64_t M, const float* dY, int64_t lddy, const QuantMatrix& W,
                               float beta, float* dX, int64_t lddx) {
  over_panels<float>(W, "gemm_quant_backward_input",
                     [&](int64_t n0, int64_t n, const float* panel) {
                       gemm_f32(Transpose::No, Transpose::No, M, W.cols, n, dY + n0, lddy, panel,
                                W.cols, n0 == 0 ? beta : 1.0f, dX, lddx);
                     });
}

void gemm_quant_backward_input_bf16(int64_t M, const uint16_t* dY, int64_t lddy,
                                    const QuantMatrix& W, float beta, float* dX, int64_t lddx) {
  over_panels<uint16_t>(W, "gemm_quant_backward_input_bf16",
                        [&](int64_t n0, int64_t n, const uint16_t* panel) {
                          gemm_bf16(Transpose::No, Transpose::No, M, W.cols, n, dY + n0, lddy,
                                    panel, W.cols, n0 == 0 ? beta : 1.0f, dX, lddx);
                        });
}

}  // namespace cputrain::kernels
