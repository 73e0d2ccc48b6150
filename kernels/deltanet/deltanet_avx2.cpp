// Gated DeltaNet's elementwise loops compiled for the baseline ISA (AVX2): two ymm per vector.
#include "kernels/deltanet/deltanet_rows.h"

namespace cputrain::kernels {

const DeltanetKernels& deltanet_kernels_avx2() {
  return detail::kDeltanetKernels;
}

}  // namespace cputrain::kernels
