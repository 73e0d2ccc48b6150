// exp(x) in single precision written so that loops over it vectorise (no libm call): range
// reduction x = n ln2 + r with |r| <= ln2 / 2 and the Taylor polynomial of degree 7 (truncation
// error below 1e-8 relative), then 2^n put into the exponent bits. Within 2 ulp of exp for
// -87.3 <= x <= 88.3. Below that the result is about 1e-38 instead of smaller (callers that
// need an exact 0 set it themselves); above, exp(88.3). NaN gives NaN.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>

namespace cputrain::kernels {

inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.3f), 88.3f);
  const float shifter = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float n = (x * 1.44269504088896341f + shifter) - shifter;
  float r = std::fma(n, -0.693145751953125f, x);  // ln2 in two parts, the first exact in n
  r = std::fma(n, -1.428606765330187e-06f, r);
  float p = 1.0f / 5040.0f;
  p = std::fma(p, r, 1.0f / 720.0f);
  p = std::fma(p, r, 1.0f / 120.0f);
  p = std::fma(p, r, 1.0f / 24.0f);
  p = std::fma(p, r, 1.0f / 6.0f);
  p = std::fma(p, r, 0.5f);
  p = std::fma(p, r, 1.0f);
  p = std::fma(p, r, 1.0f);
  const int32_t bits = (static_cast<int32_t>(x == x ? n : 0.0f) + 127) << 23;
  const float y = p * std::bit_cast<float>(bits);
  return x == x ? y : x;
}

}  // namespace cputrain::kernels
