// The tracking allocator's cache of freed blocks (engine/core/memory.cpp), written over what a
// block is: the allocator keeps pointers and frees the ones it drops; the memory budget's replay of
// a training step (models/memory_budget.cpp) runs the same policy on sizes alone, to count what the
// cache keeps beyond the peak of live bytes.
//
// Freed blocks of kMinBytes and more are kept by size for the next allocation of the same size:
// a training step allocates the same sizes in the same order every time, so from the second
// step on its tensors reuse the pages of the previous one instead of mapping, faulting in and
// zeroing fresh ones. The cache keeps no more than holds live + kept bytes within the peak of
// live bytes plus the largest block freed so far. Without that headroom, tensors of different
// sizes that peak at different moments evict one another every step: in mega the 128 MiB
// logits gradient, made when live is near its peak, evicted the backward's 8 and 24 MiB
// gradients, whose re-making evicted it in turn, and each step faulted in 272 MiB afresh (about
// 70000 page faults).
//
// Where blocks must go to make room, the ones kept longest go first: blocks a step no longer
// takes (left by start-up, by the first step's one-time tensors) then go before the step's own
// largest. Dropping the largest first, mega's step lost its 128 MiB logits gradient every other
// step (to make room near the peak for an 8 MiB block that the full cache had refused when it was
// freed), and with it the 32 and 24 MiB blocks made after it: 184 and 8 MiB faulted in on
// alternate steps, about 25000 page faults and 50-70 ms of the cross-entropy's pass a step. Kept
// longest first, none from the third step on, at the same live + kept peak; replays of the
// allocations of mini, a 0.5B LoRA fine-tune and a full one made none from the third step either
// way. Neither order is the better on every sequence (on random ones, after a first step of
// other sizes, each made fewer blocks afresh about as often as the other): this one is chosen on
// the recorded runs.
//
// Not thread-safe: the allocator holds a lock around it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <deque>
#include <map>

namespace cputrain {

template <class Block>
class BlockCache {
 public:
  static constexpr int64_t kMinBytes = int64_t{1} << 20;

  // A kept block of exactly `bytes` into *block (true), the one of that size kept last; else,
  // none being kept, room made for a new block of that size by dropping kept ones, the one kept
  // longest first (drop(block, bytes) for each), and false. live and peak: live bytes before the
  // allocation and their peak.
  template <class Drop>
  bool take(int64_t bytes, int64_t live, int64_t peak, Block* block, Drop drop) {
    auto it = by_size_.find(bytes);
    if (it != by_size_.end() && !it->second.empty()) {
      const auto kept = by_age_.find(it->second.back());
      *block = kept->second.block;
      by_age_.erase(kept);
      it->second.pop_back();
      cached_ -= bytes;
      return true;
    }
    drop_until(std::max<int64_t>(0, peak + largest_ - live - bytes), drop);
    ++fresh_;
    return false;
  }

  // Keeps a freed block where live (after the free) + kept bytes stay within the peak plus the
  // largest block freed so far (true); else false, and the caller frees it.
  bool put(Block block, int64_t bytes, int64_t live, int64_t peak) {
    largest_ = std::max(largest_, bytes);
    if (live + cached_ + bytes > peak + largest_) return false;
    by_age_.emplace(next_, Kept{block, bytes});
    by_size_[bytes].push_back(next_++);
    cached_ += bytes;
    return true;
  }

  // Drops every kept block and forgets the largest block freed.
  template <class Drop>
  void clear(Drop drop) {
    drop_until(0, drop);
    largest_ = 0;
  }

  int64_t cached() const { return cached_; }  // bytes kept
  int64_t fresh() const { return fresh_; }    // takes the cache did not serve

 private:
  struct Kept {
    Block block;
    int64_t bytes;
  };

  // Drops the blocks kept longest until no more than `limit` bytes are kept.
  template <class Drop>
  void drop_until(int64_t limit, Drop drop) {
    while (cached_ > limit && !by_age_.empty()) {
      const auto oldest = by_age_.begin();
      const Kept kept = oldest->second;
      // The oldest block of its size is the first of its size's list.
      by_size_[kept.bytes].pop_front();
      by_age_.erase(oldest);
      cached_ -= kept.bytes;
      drop(kept.block, kept.bytes);
    }
  }

  std::map<uint64_t, Kept> by_age_;                  // by the order kept: oldest first
  std::map<int64_t, std::deque<uint64_t>> by_size_;  // each size's keys, oldest first
  uint64_t next_ = 0;                                // the key of the next block kept
  int64_t cached_ = 0;
  int64_t largest_ = 0;
  int64_t fresh_ = 0;
};

}  // namespace cputrain
