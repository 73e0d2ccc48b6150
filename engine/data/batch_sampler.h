// Windows of a token stream for training and evaluation.
#pragma once

#include <cstdint>
#include <span>

namespace cputrain {

// Rows [first_row, first_row + rows) of the training batch of step `step`: row r is the window
// of ctx tokens starting at a position drawn from a hash of (seed, step, r), so a row does not
// depend on how rows are grouped into micro-batches, on threads, or on earlier steps.
// inputs and targets are (rows, ctx); targets are the inputs shifted by one token.
// Requires tokens.size() > ctx.
void sample_windows(std::span<const int32_t> tokens, int64_t ctx, uint64_t seed, uint64_t step,
                    int64_t first_row, int64_t rows, int32_t* inputs, int32_t* targets);

// Evaluation reads the stream as consecutive non-overlapping windows: window w starts at
// w * ctx. This many fit (each needs ctx + 1 tokens).
int64_t eval_window_count(std::span<const int32_t> tokens, int64_t ctx);
void eval_windows(std::span<const int32_t> tokens, int64_t ctx, int64_t first, int64_t rows,
                  int32_t* inputs, int32_t* targets);

}  // namespace cputrain
