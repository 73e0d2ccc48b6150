// The bf16 attention (attention_bf16_avx512.cpp) with its products on AMX tiles
// (kernels/cpu/pairs_amx.h). Reached only where cpu_features().amx_bf16 is set.
#include "kernels/attention/attention_isa.h"

namespace cputrain::kernels {

// The bf16 attention with its products on AMX tiles; FP32 attention as on AVX-512.
const AttentionKernels& attention_kernels_amx() {
  static const AttentionKernels k{attention_forward_avx512, attention_backward_avx512,
                                  attention_forward_bf16_on<true>,
                                  attention_backward_bf16_on<true>};
  return k;
}

}  // namespace cputrain::kernels
