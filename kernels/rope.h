// Rotary position embedding (Su et al. 2021): for head dimension D (even) and pair j in
// [0, D/2), position p rotates a pair of the head's elements by angle p * theta^(-2j/D). The
// pair is (x[2j], x[2j+1]) (adjacent, llama.cpp's "normal" RoPE) or, with half_split,
// (x[j], x[j + D/2]) (llama.cpp's "neox" RoPE, Hugging Face's rotate_half).
#pragma once

#include <cstdint>

namespace cputrain::kernels {

// table (T, D/2, 2) receives (cos, sin) of the angle for positions 0..T-1, computed in double
// and rounded to float.
void rope_table(float* table, int64_t T, int64_t D, double theta);
// inp, out (B, T, H, D); out may equal inp. Position of row t is t (table row t).
void rope_forward(float* out, const float* inp, const float* table, int64_t B, int64_t T, int64_t H,
                  int64_t D, bool half_split);
// The same, rounded to bf16 (fp32_to_bf16 of what rope_forward writes).
void rope_forward_bf16(uint16_t* out, const float* inp, const float* table, int64_t B, int64_t T,
                       int64_t H, int64_t D, bool half_split);
// dinp (B, T, H, D) += the inverse rotation of dout (accumulate), or = it (not: dinp may hold
// garbage).
void rope_backward(float* dinp, const float* dout, const float* table, int64_t B, int64_t T,
                   int64_t H, int64_t D, bool half_split, bool accumulate);
// The inverse rotation of dout rounded to bf16 (fp32_to_bf16 of what rope_backward writes when
// it does not accumulate).
void rope_backward_bf16(uint16_t* dinp, const float* dout, const float* table, int64_t B, int64_t T,
                        int64_t H, int64_t D, bool half_split);

}  // namespace cputrain::kernels
