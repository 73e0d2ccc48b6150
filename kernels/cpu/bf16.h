// fp32 <-> bf16 conversion. bf16 is the upper half of an IEEE float: 1 sign, 8 exponent and
// 7 mantissa bits, stored as uint16_t.
#pragma once

#include <cstdint>
#include <cstring>

namespace cputrain::kernels {

// Round to nearest, ties to even; a NaN stays a (quiet) NaN; infinities and signed zeros are
// kept; denormals round like any other value.
inline uint16_t fp32_to_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  const uint32_t rounding_bias = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding_bias) >> 16);
}

inline float bf16_to_fp32(uint16_t x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

void fp32_to_bf16_array(uint16_t* out, const float* in, int64_t n);
void bf16_to_fp32_array(float* out, const uint16_t* in, int64_t n);

}  // namespace cputrain::kernels
