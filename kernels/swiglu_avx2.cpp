// The SwiGLU loops compiled for the baseline ISA (AVX2): two ymm per vector.
#include "kernels/swiglu_rows.h"

namespace cputrain::kernels {

const SwigluKernels& swiglu_kernels_avx2() {
  return detail::kSwigluKernels;
}

}  // namespace cputrain::kernels
