#include "kernels/swiglu.h"

#include <algorithm>

#include "kernels/vec16.h"

namespace cputrain::kernels {
namespace {

using vec::kLanes;
using vec::vf;

// Calls f(i, lanes) for the blocks of kLanes values of [0, n), the last one possibly shorter,
// in parallel where n is large.
template <class F>
void for_blocks(int64_t n, F f) {
  const int64_t blocks = (n + kLanes - 1) / kLanes;
#pragma omp parallel for schedule(static) if (n > 16384)
  for (int64_t b = 0; b < blocks; ++b)
    f(b * kLanes, static_cast<int>(std::min<int64_t>(kLanes, n - b * kLanes)));
}

inline vf load(const float* p, int lanes) {
  return lanes == kLanes ? vec::load(p) : vec::load_partial(p, lanes, 0.0f);
}
inline void store(float* p, vf v, int lanes) {
  if (lanes == kLanes)
    vec::store(p, v);
  else
    vec::store_partial(p, v, lanes);
}

}  // namespace

void swiglu_forward(float* out, const float* gate, const float* up, int64_t n) {
  for_blocks(n, [&](int64_t i, int lanes) {
    const vf g = load(gate + i, lanes);
    store(out + i, g / (1.0f + vec::exp(-g)) * load(up + i, lanes), lanes);
  });
}

void swiglu_backward(float* dgate, float* dup, const float* dout, const float* gate,
                     const float* up, int64_t n) {
  for_blocks(n, [&](int64_t i, int lanes) {
    const vf g = load(gate + i, lanes), u = load(up + i, lanes), d = load(dout + i, lanes);
    const vf sig = 1.0f / (1.0f + vec::exp(-g));
    // d silu / dg = sig * (1 + g * (1 - sig))
    store(dgate + i, load(dgate + i, lanes) + d * u * sig * (1.0f + g * (1.0f - sig)), lanes);
    store(dup + i, load(dup + i, lanes) + d * (g * sig), lanes);
  });
}

}  // namespace cputrain::kernels
