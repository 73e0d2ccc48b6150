// Gated DeltaNet's elementwise loops compiled for AVX-512: one zmm per vector.
#include "kernels/deltanet/deltanet_rows.h"

namespace cputrain::kernels {

const DeltanetKernels& deltanet_kernels_avx512() {
  return detail::kDeltanetKernels;
}

}  // namespace cputrain::kernels
