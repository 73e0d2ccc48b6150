// Helpers shared by the kernel tests: random data and a double-precision numerical gradient.
#pragma once

#include <omp.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <vector>

namespace cputrain::kernels::test {

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
