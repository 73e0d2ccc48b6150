#include "kernels/ops/embedding.h"

#include <algorithm>
#include <cstring>

#include "kernels/cpu/bf16.h"

namespace cputrain::kernels {

void embedding_forward(float* out, const int32_t* tokens, const float* table, int64_t N, int64_t C,
                       float scale) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < N; ++i) {
    const float* row = table + static_cast<int64_t>(tokens[i]) * C;
    if (scale == 1.0f)
      std::memcpy(out + i * C, row, static_cast<size_t>(C) * sizeof(float));
    else
      for (int64_t c = 0; c < C; ++c) out[i * C + c] = row[c] * scale;
  }
}

void embedding_forward_bf16(float* out, const int32_t* tokens, const uint16_t* table, int64_t N,
                            int64_t C, float scale) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < N; ++i) {
    bf16_to_fp32_array(out + i * C, table + static_cast<int64_t>(tokens[i]) * C, C);
    if (scale != 1.0f)
      for (int64_t c = 0; c < C; ++c) out[i * C + c] *= scale;
  }
}

void embedding_backward(float* dtable, const float* dout, const int32_t* tokens, int64_t N,
                        int64_t C, float scale) {
  // Each thread owns a range of columns and walks the rows in order, so repeated tokens sum in
  // the same order whatever the thread count.
  constexpr int64_t kColumnBlock = 64;
  const int64_t blocks = (C + kColumnBlock - 1) / kColumnBlock;
#pragma omp parallel for schedule(static)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t c0 = blk * kColumnBlock, c1 = std::min(C, c0 + kColumnBlock);
    for (int64_t i = 0; i < N; ++i) {
      float* dst = dtable + static_cast<int64_t>(tokens[i]) * C;
      const float* src = dout + i * C;
      if (scale == 1.0f)
        for (int64_t c = c0; c < c1; ++c) dst[c] += src[c];
      else
        for (int64_t c = c0; c < c1; ++c) dst[c] += scale * src[c];
    }
  }
}

}  // namespace cputrain::kernels
