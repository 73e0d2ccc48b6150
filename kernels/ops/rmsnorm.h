// The norms of a block. RMSNorm (Zhang & Sennrich 2019): out = inp / sqrt(mean(inp^2) + eps) *
// (weight + offset), the offset 0, or 1 where the weights are held as Gemma's Hugging Face files
// hold them (scaling by 1 + w). LayerNorm (Ba et al. 2016) with a bias: out = (inp - mean) /
// sqrt(var + eps) * weight + bias, var the mean of (inp - mean)^2.
#pragma once

#include <cstdint>

namespace cputrain::kernels {

// inp, out (N, C); weight (C); rstd (N) receives 1 / sqrt(mean(inp^2) + eps) for backward.
void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int64_t N,
                     int64_t C, float eps, float offset = 0.0f);
// The same with out rounded to bf16 (fp32_to_bf16 of what rmsnorm_forward writes); where inp16
// is not null, the rounding of inp goes there in the same pass.
void rmsnorm_forward_bf16(uint16_t* out, uint16_t* inp16, float* rstd, const float* inp,
                          const float* weight, int64_t N, int64_t C, float eps,
                          float offset = 0.0f);
// dinp (N, C) += d/dinp (accumulate; or = d/dinp, dinp may hold garbage), dweight (C) +=
// d/dweight, given dout (N, C) and the saved rstd.
void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp,
                      const float* weight, const float* rstd, int64_t N, int64_t C, bool accumulate,
                      float offset = 0.0f);
// The same from a bf16 inp.
void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const uint16_t* inp,
                      const float* weight, const float* rstd, int64_t N, int64_t C, bool accumulate,
                      float offset = 0.0f);

// inp, out (N, C); weight, bias (C); mean and rstd (N) receive each row's mean and
// 1 / sqrt(var + eps) for backward.
void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                       const float* bias, int64_t N, int64_t C, float eps);
// The same with out rounded to bf16; where inp16 is not null, the rounding of inp goes there.
void layernorm_forward_bf16(uint16_t* out, uint16_t* inp16, float* mean, float* rstd,
                            const float* inp, const float* weight, const float* bias, int64_t N,
                            int64_t C, float eps);
// dinp (N, C) += d/dinp (accumulate; or =), dweight and dbias (C) += theirs, given dout and the
// saved mean and rstd; inp FP32 or bf16.
void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                        const float* inp, const float* weight, const float* mean, const float* rstd,
                        int64_t N, int64_t C, bool accumulate);
void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                        const uint16_t* inp, const float* weight, const float* mean,
                        const float* rstd, int64_t N, int64_t C, bool accumulate);

}  // namespace cputrain::kernels
