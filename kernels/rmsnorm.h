// RMSNorm (Zhang & Sennrich 2019): out = inp / sqrt(mean(inp^2) + eps) * weight.
#pragma once

#include <cstdint>

namespace cputrain::kernels {

// inp, out (N, C); weight (C); rstd (N) receives 1 / sqrt(mean(inp^2) + eps) for backward.
void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int64_t N,
                     int64_t C, float eps);
// The same with out rounded to bf16 (fp32_to_bf16 of what rmsnorm_forward writes); where inp16
// is not null, the rounding of inp goes there in the same pass.
void rmsnorm_forward_bf16(uint16_t* out, uint16_t* inp16, float* rstd, const float* inp,
                          const float* weight, int64_t N, int64_t C, float eps);
// dinp (N, C) += d/dinp (accumulate; or = d/dinp, dinp may hold garbage), dweight (C) +=
// d/dweight, given dout (N, C) and the saved rstd.
void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp,
                      const float* weight, const float* rstd, int64_t N, int64_t C,
                      bool accumulate);
// The same from a bf16 inp.
void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const uint16_t* inp,
                      const float* weight, const float* rstd, int64_t N, int64_t C,
                      bool accumulate);

}  // namespace cputrain::kernels
