// The AMX tile configuration shared by the AMX GEMM, the attention's AMX products and the AMX
// peak loop (palette 1, all eight tiles 16 rows x 64 bytes: 16 FP32 or 16 bf16 pairs per row),
// and the tile product the first two use. Included by files compiled with -mamx-tile and
// -mamx-bf16.
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

// C (+)= A B on MT x NT tiles of 16 x 16 FP32 (C in tiles 0, 1 for the first 16 rows, 2, 3 for
// the next), over `pairs` bf16 pairs, a multiple of 16: A rows of pairs, row stride lda words
// (tiles 4, 5); B pairs x columns, row stride ldb words (tiles 6, 7); C row stride ldc floats.
// accumulate loads C into the tiles, else they start at zero. With PrefetchB, each K step starts
// fetching into L1 the B rows two steps ahead (for a B that streams from L2; past its end they
// are whatever follows, which a prefetch may touch). The configuration of load_full_tile_config
// must be loaded on this thread.
template <int MT, int NT, bool PrefetchB>
inline __attribute__((always_inline)) void tile_product(float* C, int64_t ldc, const uint32_t* A,
                                                        int64_t lda, const uint32_t* B, int64_t ldb,
                                                        int64_t pairs, bool accumulate) {
  static_assert(MT >= 1 && MT <= 2 && NT >= 1 && NT <= 2);
  const int64_t cs = ldc * 4, as = lda * 4, bs = ldb * 4;
  if (accumulate) {
    _tile_loadd(0, C, cs);
    if (NT > 1) _tile_loadd(1, C + 16, cs);
    if (MT > 1) _tile_loadd(2, C + 16 * ldc, cs);
    if (MT > 1 && NT > 1) _tile_loadd(3, C + 16 * ldc + 16, cs);
  } else {
    _tile_zero(0);
    if (NT > 1) _tile_zero(1);
    if (MT > 1) _tile_zero(2);
    if (MT > 1 && NT > 1) _tile_zero(3);
  }
  for (int64_t p = 0; p < pairs; p += 16) {
    if (PrefetchB) {
      for (int64_t row = p + 32; row < p + 48; ++row)
        for (int line = 0; line < NT; ++line)
          _mm_prefetch(reinterpret_cast<const char*>(B + row * ldb) + 64 * line, _MM_HINT_T0);
    }
    _tile_loadd(4, A + p, as);
    _tile_loadd(6, B + p * ldb, bs);
    if (NT > 1) _tile_loadd(7, B + p * ldb + 16, bs);
    _tile_dpbf16ps(0, 4, 6);
    if (NT > 1) _tile_dpbf16ps(1, 4, 7);
    if (MT > 1) {
      _tile_loadd(5, A + 16 * lda + p, as);
      _tile_dpbf16ps(2, 5, 6);
      if (NT > 1) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, C, cs);
  if (NT > 1) _tile_stored(1, C + 16, cs);
  if (MT > 1) _tile_stored(2, C + 16 * ldc, cs);
  if (MT > 1 && NT > 1) _tile_stored(3, C + 16 * ldc + 16, cs);
}

}  // namespace cputrain::kernels
