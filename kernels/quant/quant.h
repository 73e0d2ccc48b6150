// ggml's block-quantised weight formats (as GGUF files hold them), dequantised, and the two
// products of a linear layer whose weight W stays quantised: each takes W a panel of rows at a
// time, dequantised into a buffer of the calling thread, and multiplies it with the dispatched
// GEMM (gemm_f32, or gemm_bf16 on bf16 activations), so W is never widened whole.
//
// Formats (values per block, bytes per block):
//   Q4_0 (32, 18)   f16 d; 16 bytes: low nibbles values 0-15, high 16-31; d * (q - 8)
//   Q5_0 (32, 22)   f16 d; 4 bytes of fifth bits (value i: bit i); 16 bytes of nibbles as Q4_0's;
//                   d * (q - 16)
//   Q5_1 (32, 24)   f16 d, f16 m; then Q5_0's; d * q + m
//   Q8_0 (32, 34)   f16 d; 32 int8; d * q
//   Q4_K (256, 144) f16 d, f16 dmin, 12 bytes of eight 6-bit scales and minimums, 128 bytes of
//                   nibbles (each 64 values: 32 low nibbles, then their high ones);
//                   d * scale * q - dmin * min per sub-block of 32
//   Q5_K (256, 176) Q4_K's, with 32 bytes of fifth bits after the scales (sub-block j: bit j)
//   Q6_K (256, 210) 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales (per 16
//                   values), f16 d; d * scale * (q - 32)
//   MXFP4 (32, 17)  OCP's microscaling FP4 (gpt-oss's experts): an E8M0 exponent byte e, then 16
//                   bytes of 4-bit E2M1 codes (low nibbles values 0-15, high 16-31; bit 3 the
//                   sign, magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6); code * 2^(e - 127)
#pragma once

#include <cstddef>
#include <cstdint>

namespace cputrain::kernels {

enum class QuantType : uint8_t { Q4_0, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, MXFP4 };

// An IEEE half (the formats' scales, F16 tensors) as FP32, exactly (F16C where the build has it);
// FP32 rounded to the nearest half (even on ties; beyond 65504 infinity).
float half_to_fp32(uint16_t h);
uint16_t fp32_to_half(float f);

int64_t quant_block_values(QuantType type);  // 32 or 256
int64_t quant_block_bytes(QuantType type);

// dst[0 .. blocks * values) = the values of `blocks` consecutive blocks from src.
void dequantize_blocks(QuantType type, const uint8_t* src, int64_t blocks, float* dst);

// dst = `blocks` blocks of Q4_K, Q6_K, Q5_0 or MXFP4 holding src[0 .. blocks * values), for
// cputrain export's q4_k (MXFP4: the smallest exponent whose largest code, 6, covers the block's
// largest magnitude, each value the nearest code, ties to the even code) (Q4_K_M's mix, with
// llama.cpp's Q5_0 where rows are not whole blocks of 256). Each (sub-)block's scale (and Q4_K's
// minimum) is the candidate whose grid fits its values best: their range over each number of levels
// from all of them down to two thirds (Q6_K, Q5_0: the value of largest magnitude at each level
// from 3/4 of the largest), then least squares over the levels they round to (Q4_K); the K-quants'
// sub-block scales are then the multiples of the block's f16 scale(s) next to them that fit best.
// Values on a grid of the format whose scales span their bits (a quantised file's) come back as
// they were.
void quantize_blocks(QuantType type, const float* src, int64_t blocks, uint8_t* dst);

// A (rows, cols) matrix stored row by row, each row cols / block values blocks.
struct QuantMatrix {
  QuantType type;
  const uint8_t* data;
  int64_t rows, cols;
  int64_t row_bytes() const { return cols / quant_block_values(type) * quant_block_bytes(type); }
};

// dst (n, cols) = rows r0 .. r0 + n of w, as FP32 or rounded to bf16 (nearest even).
void dequantize_rows(const QuantMatrix& w, int64_t r0, int64_t n, float* dst);
void dequantize_rows_bf16(const QuantMatrix& w, int64_t r0, int64_t n, uint16_t* dst);

// The rows of W dequantised at a time: panels of 2^21 values (a multiple of 16 rows).
int64_t quant_panel_rows(int64_t cols);
// Bytes of the panel the products of a (rows, cols) W dequantise into, FP32 or bf16: the calling
// thread's GEMM buffer kGemmQuantPanel (kernels/gemm/gemm.h), kept from call to call. The panel's
// product then takes the GEMM's own buffers for its sizes (M, panel rows, cols).
size_t quant_panel_bytes(bool bf16, int64_t rows, int64_t cols);

// Forward, Y (M, N) = X (M, K) W^T + beta Y, W (N, K) quantised: the columns of Y panel by panel,
// each the dispatched GEMM over the whole K, so each element is what gemm_f32 (gemm_bf16) gives
// on the dequantised W. The bf16 form takes bf16 X and multiplies by W's bf16 rounding.
// With M at most kQuantRowsM (decoding a token), each row of W is decoded once, by the thread
// that takes it, and dotted with every row of X (summed in FP32, in another order than the
// GEMM's), with no panel.
void gemm_quant_forward(int64_t M, const float* X, int64_t ldx, const QuantMatrix& W, float beta,
                        float* Y, int64_t ldy);
constexpr int64_t kQuantRowsM = 4;
void gemm_quant_forward_bf16(int64_t M, const uint16_t* X, int64_t ldx, const QuantMatrix& W,
                             float beta, float* Y, int64_t ldy);
// Input gradient, dX (M, K) = dY (M, N) W + beta dX: the panels' products summed in order of
// the panels (the sum over N in that grouping, within FP32 rounding of the whole product).
void gemm_quant_backward_input(int64_t M, const float* dY, int64_t lddy, const QuantMatrix& W,
                               float beta, float* dX, int64_t lddx);
void gemm_quant_backward_input_bf16(int64_t M, const uint16_t* dY, int64_t lddy,
                                    const QuantMatrix& W, float beta, float* dX, int64_t lddx);

}  // namespace cputrain::kernels
