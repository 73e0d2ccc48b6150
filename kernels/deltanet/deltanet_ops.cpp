#include "kernels/deltanet/deltanet_ops.h"

#include <cmath>

#include "kernels/deltanet/deltanet_isa.h"

namespace cputrain::kernels {
namespace {

float sigmoid(float v) {
  return 1.0f / (1.0f + std::exp(-v));
}

// log(1 + e^v), exact where e^v overflows.
float softplus(float v) {
  return v > 20.0f ? v : std::log1p(std::exp(v));
}

void put(float* d, float v, bool accumulate) {
  *d = accumulate ? *d + v : v;
}

}  // namespace

void l2norm_forward(float* y, float* rnorm, const float* x, int64_t N, int64_t D, float eps) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < N; ++r) {
    const float* xr = x + r * D;
    double sum = 0;
    for (int64_t i = 0; i < D; ++i) sum += double(xr[i]) * xr[i];
    const float s = static_cast<float>(1.0 / std::sqrt(sum + eps));
    rnorm[r] = s;
    for (int64_t i = 0; i < D; ++i) y[r * D + i] = xr[i] * s;
  }
}

void l2norm_backward(float* dx, const float* dy, const float* y, const float* rnorm, int64_t N,
                     int64_t D, bool accumulate) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < N; ++r) {
    const float* yr = y + r * D;
    const float* dyr = dy + r * D;
    double dot = 0;
    for (int64_t i = 0; i < D; ++i) dot += double(dyr[i]) * yr[i];
    const auto d = static_cast<float>(dot);
    for (int64_t i = 0; i < D; ++i)
      put(dx + r * D + i, (dyr[i] - yr[i] * d) * rnorm[r], accumulate);
  }
}

void gated_rmsnorm_forward(float* y, float* rstd, const float* x, const float* z, const float* w,
                           int64_t N, int64_t D, float eps) {
  deltanet_kernels().gated_rmsnorm_forward(y, rstd, x, z, w, N, D, eps);
}

void gated_rmsnorm_backward(float* dx, float* dz, float* dw, const float* dy, const float* x,
                            const float* z, const float* w, const float* rstd, int64_t N, int64_t D,
                            bool accumulate) {
  deltanet_kernels().gated_rmsnorm_backward(dx, dz, dw, dy, x, z, w, rstd, N, D, accumulate);
}

void gated_rmsnorm_forward_reference(float* y, float* rstd, const float* x, const float* z,
                                     const float* w, int64_t N, int64_t D, float eps) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < N; ++r) {
    const float* xr = x + r * D;
    const float* zr = z + r * D;
    double sum = 0;
    for (int64_t i = 0; i < D; ++i) sum += double(xr[i]) * xr[i];
    const float s = static_cast<float>(1.0 / std::sqrt(sum / double(D) + eps));
    rstd[r] = s;
    for (int64_t i = 0; i < D; ++i) y[r * D + i] = xr[i] * s * w[i] * zr[i] * sigmoid(zr[i]);
  }
}

void gated_rmsnorm_backward_reference(float* dx, float* dz, float* dw, const float* dy,
                                      const float* x, const float* z, const float* w,
                                      const float* rstd, int64_t N, int64_t D, bool accumulate) {
  // Rows in parallel; dw's sums row by row after (one thread a column would stride).
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < N; ++r) {
    const float *xr = x + r * D, *zr = z + r * D, *dyr = dy + r * D;
    const float s = rstd[r];
    // n = x s w, y = n silu(z): dn = dy silu(z), dz = dy n silu'(z).
    double dot = 0;  // sum of dn_i w_i x_i
    for (int64_t i = 0; i < D; ++i) {
      const float sg = sigmoid(zr[i]);
      const float silu = zr[i] * sg;
      const float n = xr[i] * s * w[i];
      put(dz + r * D + i, dyr[i] * n * sg * (1.0f + zr[i] * (1.0f - sg)), accumulate);
      dot += double(dyr[i] * silu * w[i]) * xr[i];
    }
    const float c = static_cast<float>(dot) * s * s * s / static_cast<float>(D);
    for (int64_t i = 0; i < D; ++i) {
      const float silu = zr[i] * sigmoid(zr[i]);
      put(dx + r * D + i, dyr[i] * silu * w[i] * s - xr[i] * c, accumulate);
    }
  }
  for (int64_t r = 0; r < N; ++r) {
    const float *xr = x + r * D, *zr = z + r * D, *dyr = dy + r * D;
    for (int64_t i = 0; i < D; ++i) dw[i] += dyr[i] * xr[i] * rstd[r] * zr[i] * sigmoid(zr[i]);
  }
}

void deltanet_decay_forward(float* g, const float* a, const float* a_log, const float* dt_bias,
                            int64_t N, int64_t H) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < N; ++r)
    for (int64_t h = 0; h < H; ++h)
      g[r * H + h] = -std::exp(a_log[h]) * softplus(a[r * H + h] + dt_bias[h]);
}

void deltanet_decay_backward(float* da, float* da_log, float* ddt_bias, const float* dg,
                             const float* a, const float* a_log, const float* dt_bias, int64_t N,
                             int64_t H, bool accumulate) {
  for (int64_t r = 0; r < N; ++r)
    for (int64_t h = 0; h < H; ++h) {
      const float u = a[r * H + h] + dt_bias[h];
      const float e = std::exp(a_log[h]);
      const float d = dg[r * H + h];
      // d softplus(u) / du = sigmoid(u).
      const float du = -e * sigmoid(u) * d;
      if (da != nullptr) put(da + r * H + h, du, accumulate);
      if (ddt_bias != nullptr) ddt_bias[h] += du;
      if (da_log != nullptr) da_log[h] += -e * softplus(u) * d;
    }
}

void sigmoid_gate_forward(float* y, const float* x, const float* gate, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) y[i] = gate != nullptr ? x[i] * sigmoid(gate[i]) : sigmoid(x[i]);
}

void sigmoid_gate_backward(float* dx, float* dgate, const float* dy, const float* x,
                           const float* gate, int64_t n, bool accumulate) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    if (gate == nullptr) {
      const float s = sigmoid(x[i]);
      if (dx != nullptr) put(dx + i, dy[i] * s * (1.0f - s), accumulate);
      continue;
    }
    const float s = sigmoid(gate[i]);
    if (dx != nullptr) put(dx + i, dy[i] * s, accumulate);
    if (dgate != nullptr) put(dgate + i, dy[i] * x[i] * s * (1.0f - s), accumulate);
  }
}

}  // namespace cputrain::kernels
