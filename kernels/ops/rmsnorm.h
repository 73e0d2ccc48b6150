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

// The residual sum into the next norm in one pass over the rows: sum = a + b (each row as
// vector_add writes it), then out and rstd as rmsnorm_forward(_bf16) gives them for sum, sum16
// (where not null) the rounding of sum.
void add_rmsnorm_forward(float* sum, float* out, float* rstd, const float* a, const float* b,
                         const float* weight, int64_t N, int64_t C, float eps, float offset = 0.0f);
void add_rmsnorm_forward_bf16(float* sum, uint16_t* out, uint16_t* sum16, float* rstd,
                              const float* a, const float* b, const float* weight, int64_t N,
                              int64_t C, float eps, float offset = 0.0f);
// Where one side of the sum takes its gradient (N, C): its bf16 rounding (`rounded`, the
// gradient's first and only contribution), else `grad`, added onto where `accumulate`; neither
// set: nothing.
struct SumGradient {
  float* grad = nullptr;
  uint16_t* rounded = nullptr;
  bool accumulate = false;
};
// The backward of both: the sum's gradient g = dsum (its other readers'; null: none) + the
// norm's d/dsum given dout, the bits of rmsnorm_backward accumulating onto dsum; g goes to
// each side (a's first, then b's: they may be one tensor), dweight (C) += d/dweight. sum FP32
// or its bf16 rounding, as rmsnorm_backward's inp.
void add_rmsnorm_backward(const SumGradient& da, const SumGradient& db, float* dweight,
                          const float* dsum, const float* dout, const float* sum,
                          const float* weight, const float* rstd, int64_t N, int64_t C,
                          float offset = 0.0f);
void add_rmsnorm_backward(const SumGradient& da, const SumGradient& db, float* dweight,
                          const float* dsum, const float* dout, const uint16_t* sum,
                          const float* weight, const float* rstd, int64_t N, int64_t C,
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
