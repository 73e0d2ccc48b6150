#include "kernels/quant.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/bf16.h"
#include "kernels/gemm.h"

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
      const __m128i eight_bytes = _mm_srli_si128(nibbles[h], 8 * part);
      const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(eight_bytes));
      _mm256_storeu_ps(dst + 16 * h + 8 * part, _mm256_mul_ps(scale, _mm256_sub_ps(v, eight)));
    }
#else
  for (int i = 0; i < 16; ++i) dst[i] = d * static_cast<float>((q[i] & 0x0f) - 8);
  for (int i = 0; i < 16; ++i) dst[i + 16] = d * static_cast<float>((q[i] >> 4) - 8);
#endif
}

void q8_0(const uint8_t* src, float* dst) {
  const float d = half_at(src);
  const auto* q = reinterpret_cast<const int8_t*>(src + 2);
  for (int i = 0; i < 32; ++i) dst[i] = d * static_cast<float>(q[i]);
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

int64_t quant_block_values(QuantType type) {
  return type == QuantType::Q4_0 || type == QuantType::Q8_0 ? 32 : 256;
}

int64_t quant_block_bytes(QuantType type) {
  switch (type) {
    case QuantType::Q4_0:
      return 18;
    case QuantType::Q8_0:
      return 34;
    case QuantType::Q4_K:
      return 144;
    case QuantType::Q5_K:
      return 176;
    case QuantType::Q6_K:
      return 210;
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
    case QuantType::Q8_0:
      return each(q8_0);
    case QuantType::Q4_K:
      return each([](const uint8_t* b, float* d) { q45_k<false>(b, nullptr, b + 16, d); });
    case QuantType::Q5_K:
      return each([](const uint8_t* b, float* d) { q45_k<true>(b, b + 16, b + 48, d); });
    case QuantType::Q6_K:
      return each(q6_k);
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

namespace {

// product(n0, n, panel) over W's panels of rows n0 .. n0 + n, each dequantised into the calling
// thread's buffer: FP32 where T is float, bf16 where it is uint16_t.
template <typename T, typename Product>
void over_panels(const QuantMatrix& W, const char* fn, Product&& product) {
  check(W, fn);
  const int64_t rows = std::min(W.rows, quant_panel_rows(W.cols));
  T* panel = panel_buffer<T>(static_cast<size_t>(rows * W.cols));
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
