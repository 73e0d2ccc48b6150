// Gated activations (Shazeer 2020): out = act(gate) * up, with act SiLU (SwiGLU: silu(x) =
// x / (1 + exp(-x))) or GELU with the tanh approximation (GeGLU: gelu(x) = x / 2 (1 + tanh(
// sqrt(2/pi) (x + 0.044715 x^3))), computed as x * sigmoid(2 sqrt(2/pi) (x + 0.044715 x^3)),
// the same function); and the activation alone (up null: out = act(gate), Phi-2's GELU MLP).
// SiluClamped is gpt-oss's: out = g sigmoid(1.702 g) (clamp(up, -7, 7) + 1) with g = min(gate,
// 7), no gradient through a clamp that bites (it always takes up).
#pragma once

#include <cstdint>
#include <string_view>

namespace cputrain::kernels {

enum class Activation { Silu, GeluTanh, SiluClamped };
std::string_view activation_name(Activation act);  // "silu", "gelu_tanh", "silu_clamped"
constexpr float kSiluClampedAlpha = 1.702f, kSiluClampedLimit = 7.0f;

// The implementation the functions below run: "avx512" or "avx2" (kernels/cpu/dispatch.h).
std::string_view swiglu_kernel();

// gate, up, out: n elements each; up may be null (act(gate) alone), here and below, and then
// dup is not written and may be null.
void swiglu_forward(float* out, const float* gate, const float* up, int64_t n,
                    Activation act = Activation::Silu);
// out = bf16(act(gate) * up), the rounding of what swiglu_forward writes; where gate16 and up16
// are not null, the roundings of gate and up go there in the same pass (fp32_to_bf16 of each).
void swiglu_forward_bf16(uint16_t* out, uint16_t* gate16, uint16_t* up16, const float* gate,
                         const float* up, int64_t n, Activation act = Activation::Silu);
// dgate += dout * up * act'(gate), dup += dout * act(gate) (accumulate); or = (not: dgate
// and dup may hold garbage, and must not overlap).
void swiglu_backward(float* dgate, float* dup, const float* dout, const float* gate,
                     const float* up, int64_t n, bool accumulate,
                     Activation act = Activation::Silu);
// The same from bf16 gate and up.
void swiglu_backward(float* dgate, float* dup, const float* dout, const uint16_t* gate,
                     const uint16_t* up, int64_t n, bool accumulate,
                     Activation act = Activation::Silu);
// From bf16 gate and up, dgate and dup written as the bf16 rounding (fp32_to_bf16) of what
// swiglu_backward writes when it does not accumulate.
void swiglu_backward_rounded(uint16_t* dgate, uint16_t* dup, const float* dout,
                             const uint16_t* gate, const uint16_t* up, int64_t n,
                             Activation act = Activation::Silu);

}  // namespace cputrain::kernels
