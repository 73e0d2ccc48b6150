#include "kernels/ops/swiglu.h"

#include "kernels/cpu/dispatch.h"
#include "kernels/ops/swiglu_isa.h"

namespace cputrain::kernels {
namespace {

// The implementations, fastest first (kernels/cpu/dispatch.h).
using SwigluRow = KernelChoice<const SwigluKernels& (*)(Activation)>;
const SwigluRow kSwiglu[] = {
    {{"avx512", Isa::Avx512}, swiglu_kernels_avx512},
    {{"avx2", Isa::Avx2}, swiglu_kernels_avx2},
};

const SwigluRow& chosen() {
  static const SwigluRow& row = choose_kernel("swiglu", kSwiglu);
  return row;
}

const SwigluKernels& kernels(Activation act) {
  static const SwigluKernels& silu = chosen().entry(Activation::Silu);
  static const SwigluKernels& gelu = chosen().entry(Activation::GeluTanh);
  static const SwigluKernels& clamped = chosen().entry(Activation::SiluClamped);
  return act == Activation::Silu ? silu : act == Activation::GeluTanh ? gelu : clamped;
}

}  // namespace

std::string_view activation_name(Activation act) {
  return act == Activation::Silu       ? "silu"
         : act == Activation::GeluTanh ? "gelu_tanh"
                                       : "silu_clamped";
}

std::string_view swiglu_kernel() {
  return chosen().row.name;
}

void swiglu_forward(float* out, const float* gate, const float* up, int64_t n, Activation act) {
  kernels(act).forward(out, gate, up, n);
}

void swiglu_forward_bf16(uint16_t* out, uint16_t* gate16, uint16_t* up16, const float* gate,
                         const float* up, int64_t n, Activation act) {
  kernels(act).forward_bf16(out, gate16, up16, gate, up, n);
}

void swiglu_backward(float* dgate, float* dup, const float* dout, const float* gate,
                     const float* up, int64_t n, bool accumulate, Activation act) {
  kernels(act).backward(dgate, dup, dout, gate, up, n, accumulate);
}

void swiglu_backward(float* dgate, float* dup, const float* dout, const uint16_t* gate,
                     const uint16_t* up, int64_t n, bool accumulate, Activation act) {
  kernels(act).backward_bf16(dgate, dup, dout, gate, up, n, accumulate);
}

void swiglu_backward_rounded(uint16_t* dgate, uint16_t* dup, const float* dout,
                             const uint16_t* gate, const uint16_t* up, int64_t n, Activation act) {
  kernels(act).backward_rounded(dgate, dup, dout, gate, up, n);
}

}  // namespace cputrain::kernels
