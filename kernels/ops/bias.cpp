#include "kernels/ops/bias.h"

#include "kernels/cpu/bf16.h"

namespace cputrain::kernels {
namespace {

inline float widen(float x) {
  return x;
}
inline float widen(uint16_t x) {
  return bf16_to_fp32(x);
}

// Columns in blocks of 64 per task; within a column the rows are summed in order.
template <class T>
void column_sums(float* db, const T* dy, int64_t M, int64_t N, bool accumulate) {
  constexpr int64_t kBlock = 64;
#pragma omp parallel for schedule(static) if (M * N > 65536)
  for (int64_t n0 = 0; n0 < N; n0 += kBlock) {
    const int64_t n1 = n0 + kBlock < N ? n0 + kBlock : N;
    float sum[kBlock];
    for (int64_t n = n0; n < n1; ++n) sum[n - n0] = accumulate ? db[n] : 0.0f;
    for (int64_t m = 0; m < M; ++m) {
      const T* row = dy + m * N;
#pragma omp simd
      for (int64_t n = n0; n < n1; ++n) sum[n - n0] += widen(row[n]);
    }
    for (int64_t n = n0; n < n1; ++n) db[n] = sum[n - n0];
  }
}

}  // namespace

void bias_add(float* y, const float* b, int64_t M, int64_t N) {
#pragma omp parallel for schedule(static) if (M * N > 65536)
  for (int64_t m = 0; m < M; ++m) {
    float* row = y + m * N;
#pragma omp simd
    for (int64_t n = 0; n < N; ++n) row[n] += b[n];
  }
}

void bias_add_rounded(uint16_t* y, const float* x, const float* b, int64_t M, int64_t N) {
#pragma omp parallel for schedule(static) if (M * N > 65536)
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) y[m * N + n] = fp32_to_bf16(x[m * N + n] + b[n]);
}

void bias_backward(float* db, const float* dy, int64_t M, int64_t N, bool accumulate) {
  column_sums(db, dy, M, N, accumulate);
}

void bias_backward(float* db, const uint16_t* dy, int64_t M, int64_t N, bool accumulate) {
  column_sums(db, dy, M, N, accumulate);
}

}  // namespace cputrain::kernels
