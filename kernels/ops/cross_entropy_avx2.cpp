// The cross-entropy row loops compiled for the baseline ISA (AVX2): two ymm per vector.
#include "kernels/ops/cross_entropy_rows.h"

namespace cputrain::kernels {

const CrossEntropyKernels& cross_entropy_kernels_avx2() {
  return detail::kCrossEntropyKernels;
}

}  // namespace cputrain::kernels
