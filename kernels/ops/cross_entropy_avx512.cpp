// The cross-entropy row loops compiled for AVX-512: one zmm per vector.
#include "kernels/ops/cross_entropy_rows.h"

namespace cputrain::kernels {

const CrossEntropyKernels& cross_entropy_kernels_avx512() {
  return detail::kCrossEntropyKernels;
}

}  // namespace cputrain::kernels
