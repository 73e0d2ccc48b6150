// Products on bf16 pairs on AMX tiles: C (+)= A B with A rows of bf16 pairs (a tile is 16 rows x
// 16 pairs) and B pairs x columns (a tile is 16 pairs x 16 columns), the operand layouts of the
// vdpbf16ps products (bf16_dot_avx512.h), so that a caller packs the same on both paths. Reached
// only where cpu_features().amx_bf16 is set.
#pragma once

#include <cstdint>

namespace cputrain::kernels {

// Loads the tile configuration (amx_tiles.h) on the calling thread: once before the products
// of a parallel region's thread, after anything else that may have loaded its own.
void pairs_amx_configure();
// C[0:M, 0:N] (+)= A B with A (M x pairs, row stride lda) and B (pairs x N, row stride ldb) as
// bf16 pairs, M, N and pairs multiples of 16.
void pairs_product_amx(float* C, int64_t ldc, const uint32_t* A, int64_t lda, const uint32_t* B,
                       int64_t ldb, int64_t M, int64_t N, int64_t pairs, bool accumulate);

}  // namespace cputrain::kernels
