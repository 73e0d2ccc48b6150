// Rotary position embedding (Su et al. 2021): for R rotated dimensions of a head (even; R = D,
// the head dimension, unless partial) and pair j in [0, R/2), position p rotates a pair of the
// head's elements by angle p * theta^(-2j/R). The pair is (x[2j], x[2j+1]) (adjacent,
// llama.cpp's "normal" RoPE) or, with half_split, (x[j], x[j + R/2]) (llama.cpp's "neox" RoPE,
// Hugging Face's rotate_half); elements R .. D-1 pass unrotated (partial rotary, Phi-4-mini).
#pragma once

#include <cstdint>

namespace cputrain::kernels {

// table (T, R/2, 2) receives (cos, sin) of the angle for positions 0..T-1, computed in double,
// times attn_factor, rounded to float (D below is R). With `freq_factors` (D/2 values,
// llama.cpp's rope_freqs), pair j's frequency theta^(-2j/D) is divided by freq_factors[j] (RoPE
// scaling such as Llama 3's or Phi-3's longrope, whose attn_factor also scales the rotation).
void rope_table(float* table, int64_t T, int64_t D, double theta,
                const float* freq_factors = nullptr, double attn_factor = 1.0);
// inp, out (B, T, H, D); out may equal inp. Position of row t is t (table row t). R: the
// rotated dimensions (0: all D).
void rope_forward(float* out, const float* inp, const float* table, int64_t B, int64_t T, int64_t H,
                  int64_t D, bool half_split, int64_t R = 0);
// The same, rounded to bf16 (fp32_to_bf16 of what rope_forward writes).
void rope_forward_bf16(uint16_t* out, const float* inp, const float* table, int64_t B, int64_t T,
                       int64_t H, int64_t D, bool half_split, int64_t R = 0);
// dinp (B, T, H, D) += the inverse rotation of dout (accumulate), or = it (not: dinp may hold
// garbage).
void rope_backward(float* dinp, const float* dout, const float* table, int64_t B, int64_t T,
                   int64_t H, int64_t D, bool half_split, bool accumulate, int64_t R = 0);
// The inverse rotation of dout rounded to bf16 (fp32_to_bf16 of what rope_backward writes when
// it does not accumulate).
void rope_backward_bf16(uint16_t* dinp, const float* dout, const float* table, int64_t B, int64_t T,
                        int64_t H, int64_t D, bool half_split, int64_t R = 0);

}  // namespace cputrain::kernels
