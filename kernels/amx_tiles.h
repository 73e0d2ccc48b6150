// The AMX tile configuration shared by the AMX GEMM and the AMX peak loop: palette 1, all eight
// tiles 16 rows x 64 bytes (16 FP32 or 16 bf16 pairs per row). Included by files compiled with
// -mamx-tile.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace cputrain::kernels {

struct alignas(64) AmxTileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
static_assert(sizeof(AmxTileConfig) == 64);

// Loads the 8 x (16 x 64 bytes) configuration on the calling thread.
inline void load_full_tile_config() {
  AmxTileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = 16;
  }
  // GCC 12 does not count ldtilecfg as reading its operand and may drop the stores above
  // (seen at -O2: only the palette byte was written, so every later tile instruction faulted).
  __asm__ volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}

}  // namespace cputrain::kernels
