#include "engine/data/batch_sampler.h"

#include <algorithm>
#include <stdexcept>

#include "engine/core/hash.h"

namespace cputrain {
namespace {

void copy_window(std::span<const int32_t> tokens, int64_t start, int64_t ctx, int32_t* inputs,
                 int32_t* targets) {
  std::copy_n(tokens.data() + start, ctx, inputs);
  std::copy_n(tokens.data() + start + 1, ctx, targets);
}

}  // namespace

void sample_windows(std::span<const int32_t> tokens, int64_t ctx, uint64_t seed, uint64_t step,
                    int64_t first_row, int64_t rows, int32_t* inputs, int32_t* targets) {
  const int64_t n = static_cast<int64_t>(tokens.size());
  if (n <= ctx) throw std::invalid_argument("sample_windows: fewer than ctx + 1 tokens");
  const uint64_t starts = static_cast<uint64_t>(n - ctx);
  for (int64_t i = 0; i < rows; ++i) {
    const uint64_t r = static_cast<uint64_t>(first_row + i);
    const uint64_t h = splitmix64(splitmix64(splitmix64(seed) ^ step) ^ r);
    copy_window(tokens, static_cast<int64_t>(h % starts), ctx, inputs + i * ctx, targets + i * ctx);
  }
}

int64_t eval_window_count(std::span<const int32_t> tokens, int64_t ctx) {
  const int64_t n = static_cast<int64_t>(tokens.size());
  return n > ctx ? (n - 1) / ctx : 0;
}

void eval_windows(std::span<const int32_t> tokens, int64_t ctx, int64_t first, int64_t rows,
                  int32_t* inputs, int32_t* targets) {
  if (first + rows > eval_window_count(tokens, ctx))
    throw std::invalid_argument("eval_windows: window out of range");
  for (int64_t i = 0; i < rows; ++i)
    copy_window(tokens, (first + i) * ctx, ctx, inputs + i * ctx, targets + i * ctx);
}

}  // namespace cputrain
