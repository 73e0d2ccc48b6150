#include "kernels/swiglu.h"

#include "kernels/dispatch.h"
#include "kernels/swiglu_isa.h"

namespace cputrain::kernels {
namespace {

// The implementations, fastest first (kernels/dispatch.h).
using SwigluRow = KernelChoice<const SwigluKernels& (*)()>;
const SwigluRow kSwiglu[] = {
    {{"avx512", Isa::Avx512}, swiglu_kernels_avx512},
    {{"avx2", Isa::Avx2}, swiglu_kernels_avx2},
};

const SwigluRow& chosen() {
  static const SwigluRow& row = choose_kernel("swiglu", kSwiglu);
  return row;
}

const SwigluKernels& kernels() {
  static const SwigluKernels& k = chosen().entry();
  return k;
}

}  // namespace

std::string_view swiglu_kernel() {
  return chosen().row.name;
}

void swiglu_forward(float* out, const float* gate, const float* up, int64_t n) {
  kernels().forward(out, gate, up, n);
}

void swiglu_forward_bf16(uint16_t* out, uint16_t* gate16, uint16_t* up16, const float* gate,
                         const float* up, int64_t n) {
  kernels().forward_bf16(out, gate16, up16, gate, up, n);
}

void swiglu_backward(float* dgate, float* dup, const float* dout, const float* gate,
                     const float* up, int64_t n, bool accumulate) {
  kernels().backward(dgate, dup, dout, gate, up, n, accumulate);
}

void swiglu_backward(float* dgate, float* dup, const float* dout, const uint16_t* gate,
                     const uint16_t* up, int64_t n, bool accumulate) {
  kernels().backward_bf16(dgate, dup, dout, gate, up, n, accumulate);
}

void swiglu_backward_rounded(uint16_t* dgate, uint16_t* dup, const float* dout,
                             const uint16_t* gate, const uint16_t* up, int64_t n) {
  kernels().backward_rounded(dgate, dup, dout, gate, up, n);
}

}  // namespace cputrain::kernels
