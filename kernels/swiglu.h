// SwiGLU gating (Shazeer 2020): out = silu(gate) * up, silu(x) = x / (1 + exp(-x)).
#pragma once

#include <cstdint>
#include <string_view>

namespace cputrain::kernels {

// The implementation the functions below run: "avx512" or "avx2" (kernels/dispatch.h).
std::string_view swiglu_kernel();

// gate, up, out: n elements each.
void swiglu_forward(float* out, const float* gate, const float* up, int64_t n);
// out = bf16(silu(gate) * up), the rounding of what swiglu_forward writes; where gate16 and up16
// are not null, the roundings of gate and up go there in the same pass (fp32_to_bf16 of each).
void swiglu_forward_bf16(uint16_t* out, uint16_t* gate16, uint16_t* up16, const float* gate,
                         const float* up, int64_t n);
// dgate += dout * up * silu'(gate), dup += dout * silu(gate) (accumulate); or = (not: dgate
// and dup may hold garbage, and must not overlap).
void swiglu_backward(float* dgate, float* dup, const float* dout, const float* gate,
                     const float* up, int64_t n, bool accumulate);
// The same from bf16 gate and up.
void swiglu_backward(float* dgate, float* dup, const float* dout, const uint16_t* gate,
                     const uint16_t* up, int64_t n, bool accumulate);
// From bf16 gate and up, dgate and dup written as the bf16 rounding (fp32_to_bf16) of what
// swiglu_backward writes when it does not accumulate.
void swiglu_backward_rounded(uint16_t* dgate, uint16_t* dup, const float* dout,
                             const uint16_t* gate, const uint16_t* up, int64_t n);

}  // namespace cputrain::kernels
