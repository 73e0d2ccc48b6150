// Windows of a token stream for training and evaluation, and the order of a fine-tune's packed
// rows.
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <utility>
#include <vector>

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

// Fisher-Yates on 64-bit draws of `seed`: the same order with any standard library.
template <class T>
void seeded_shuffle(std::vector<T>& v, uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (size_t r = v.size(); r > 1; --r) std::swap(v[r - 1], v[rng() % r]);
}

// Packed rows of a fine-tune, in an order shuffled anew each epoch (seed, epoch).
class RowOrder {
 public:
  RowOrder(size_t rows, uint64_t seed) : rows_(rows), seed_(seed) {}
  // The row at position `i` of the endless sequence of epochs.
  size_t at(int64_t i) {
    const auto epoch = static_cast<uint64_t>(i / static_cast<int64_t>(rows_));
    if (epoch != epoch_ || order_.empty()) {
      order_.resize(rows_);
      for (size_t r = 0; r < rows_; ++r) order_[r] = r;
      seeded_shuffle(order_, seed_ * 0x9E3779B97F4A7C15ull + epoch);
      epoch_ = epoch;
    }
    return order_[static_cast<size_t>(i % static_cast<int64_t>(rows_))];
  }

 private:
  size_t rows_;
  uint64_t seed_;
  uint64_t epoch_ = 0;
  std::vector<size_t> order_;
};

}  // namespace cputrain
