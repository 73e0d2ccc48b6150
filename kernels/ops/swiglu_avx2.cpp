// The SwiGLU loops compiled for the baseline ISA (AVX2): two ymm per vector.
#include "kernels/ops/swiglu_rows.h"

namespace cputrain::kernels {

const SwigluKernels& swiglu_kernels_avx2(Activation act) {
  return detail::kSwigluKernels[static_cast<int>(act)];
}

}  // namespace cputrain::kernels
