// The AMX BF16 peak: tdpbf16ps on two accumulator tiles from two source tiles held in tile
// registers, no memory traffic inside the loop. Two chains cover the instruction's latency: on
// a Xeon (family 6 model 207) one chain already ran at about 1000 flops per cycle, and more
// accumulators ran no faster (six were slower). Reached only where cpu_features() has amx_bf16.
#include <immintrin.h>

#include <cstdint>

#include "kernels/cpu/amx_tiles.h"
#include "kernels/cpu/peak.h"

namespace cputrain::kernels {

double tdpbf16_amx_loop(int64_t iterations) {
  load_full_tile_config();
  alignas(64) uint32_t pairs[16 * 16];
  for (uint32_t& p : pairs) p = 0x3a803a80u;  // (~1e-3, ~1e-3)
  _tile_loadd(6, pairs, 64);
  _tile_loadd(7, pairs, 64);
  _tile_zero(0);
  _tile_zero(1);
  // One tdpbf16ps is 16 x 16 x 32 multiply-adds and takes about 16 cycles where a vector
  // instruction takes one: iterations / 4 rounds of two keep the timing comparable.
  const int64_t rounds = iterations / 4 > 0 ? iterations / 4 : 1;
  for (int64_t r = 0; r < rounds; ++r) {
    _tile_dpbf16ps(0, 6, 7);
    _tile_dpbf16ps(1, 6, 7);
  }
  alignas(64) float out[16 * 16];
  _tile_stored(0, out, 64);
  volatile float sink = out[0];
  (void)sink;
  _tile_release();
  return static_cast<double>(rounds) * 2 * (16.0 * 16.0 * 32.0 * 2.0);
}

}  // namespace cputrain::kernels
