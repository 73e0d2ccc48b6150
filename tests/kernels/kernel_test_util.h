// Helpers shared by the kernel tests: random data and a double-precision numerical gradient.
#pragma once

#include <omp.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <vector>

#include "kernels/quant/quant.h"

namespace cputrain::kernels::test {

// Random blocks of a quantised format whose f16 scales are between 2^-7 and 2^-1 (either sign
// for d of Q4_0, Q5_0, Q8_0, Q6_K and d, m of Q5_1; positive d, dmin for the K-quants with
// minimums).
inline std::vector<uint8_t> random_quant_blocks(QuantType t, int64_t blocks, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> data(static_cast<size_t>(blocks * quant_block_bytes(t)));
  for (uint8_t& byte : data) byte = static_cast<uint8_t>(rng());
  const auto half = [&](uint8_t* p, bool sign) {
    const uint32_t h = (sign ? (rng() & 1) << 15 : 0) | ((8 + rng() % 7) << 10) | (rng() & 1023);
    p[0] = static_cast<uint8_t>(h);
    p[1] = static_cast<uint8_t>(h >> 8);
  };
  for (int64_t b = 0; b < blocks; ++b) {
    uint8_t* p = data.data() + b * quant_block_bytes(t);
    if (t == QuantType::Q6_K) {
      half(p + 208, true);
    } else if (t == QuantType::Q4_K || t == QuantType::Q5_K) {
      half(p, false);
      half(p + 2, false);
    } else if (t == QuantType::MXFP4) {
      // Exponents from 2^-8 to 2^5 (1, 2^-127 and 2^128 apart, in the decoder test).
      p[0] = static_cast<uint8_t>(119 + rng() % 14);
    } else if (t == QuantType::Q5_1) {
      half(p, true);
      half(p + 2, true);
    } else {
      half(p, true);
    }
  }
  return data;
}

inline std::vector<float> random_floats(size_t n, uint32_t seed, float lo = -1.0f,
                                        float hi = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

inline std::vector<double> to_double(const std::vector<float>& v) {
  return std::vector<double>(v.begin(), v.end());
}

// Central differences of a scalar function of x, in double.
inline std::vector<double> numerical_gradient(
    const std::function<double(const std::vector<double>&)>& f, std::vector<double> x,
    double h = 1e-6) {
  std::vector<double> g(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double keep = x[i];
    x[i] = keep + h;
    const double up = f(x);
    x[i] = keep - h;
    const double down = f(x);
    x[i] = keep;
    g[i] = (up - down) / (2 * h);
  }
  return g;
}

// A gradient plus `base`, to compare with an accumulating kernel's output that started from base.
inline std::vector<double> plus(const std::vector<double>& g, const std::vector<float>& base) {
  std::vector<double> out(g.size());
  for (size_t i = 0; i < g.size(); ++i) out[i] = g[i] + base[i];
  return out;
}

// max |got - want| relative to max(1, max |want|).
inline double max_error(const std::vector<float>& got, const std::vector<double>& want) {
  double err = 0.0, scale = 1.0;
  for (size_t i = 0; i < want.size(); ++i) {
    err = std::max(err, std::abs(got[i] - want[i]));
    scale = std::max(scale, std::abs(want[i]));
  }
  return err / scale;
}

// Sets the OpenMP thread count for a scope.
class ThreadCount {
 public:
  explicit ThreadCount(int n) : saved_(omp_get_max_threads()) { omp_set_num_threads(n); }
  ~ThreadCount() { omp_set_num_threads(saved_); }
  ThreadCount(const ThreadCount&) = delete;
  ThreadCount& operator=(const ThreadCount&) = delete;

 private:
  int saved_;
};

}  // namespace cputrain::kernels::test
