// The SwiGLU loops compiled for AVX-512: one zmm per vector.
#include "kernels/ops/swiglu_rows.h"

namespace cputrain::kernels {

const SwigluKernels& swiglu_kernels_avx512(Activation act) {
  return detail::kSwigluKernels[static_cast<int>(act)];
}

}  // namespace cputrain::kernels
