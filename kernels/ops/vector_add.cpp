#include "kernels/ops/vector_add.h"

#include <algorithm>
#include <vector>

namespace cputrain::kernels {

void vector_add(float* out, const float* a, const float* b, int64_t n) {
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

void vector_accumulate(float* dst, const float* src, int64_t n) {
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) dst[i] += src[i];
}

void vector_scale(float* dst, const float* src, float s, int64_t n) {
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) dst[i] = s * src[i];
}

void vector_copy(float* dst, const float* src, int64_t n) {
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i];
}

double vector_sum_squares(const float* x, int64_t n) {
  // Fixed blocks summed in order: the result does not depend on the thread count.
  constexpr int64_t kBlock = 8192;
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  std::vector<double> partial(static_cast<size_t>(blocks));
#pragma omp parallel for schedule(static) if (blocks > 8)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t i0 = blk * kBlock, i1 = std::min(n, i0 + kBlock);
    double lanes[8] = {};
    int64_t i = i0;
    for (; i + 8 <= i1; i += 8)
      for (int l = 0; l < 8; ++l) lanes[l] += static_cast<double>(x[i + l]) * x[i + l];
    for (; i < i1; ++i) lanes[0] += static_cast<double>(x[i]) * x[i];
    double s = 0.0;
    for (double v : lanes) s += v;
    partial[static_cast<size_t>(blk)] = s;
  }
  double total = 0.0;
  for (double p : partial) total += p;
  return total;
}

}  // namespace cputrain::kernels
