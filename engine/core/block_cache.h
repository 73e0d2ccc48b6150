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
// Not thread-safe: the allocator holds a lock around it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <vector>

namespace cputrain {

template <class Block>
class BlockCache {
 public:
  static constexpr int64_t kMinBytes = int64_t{1} << 20;

  // A kept block of exactly `bytes` into *block (true); else, none being kept, room made for a
  // new block of that size by dropping kept ones, the largest first (drop(block, bytes) for
  // each), and false. live and peak: live bytes before the allocation and their peak.
  template <class Drop>
  bool take(int64_t bytes, int64_t live, int64_t peak, Block* block, Drop drop) {
    auto it = blocks_.find(bytes);
    if (it != blocks_.end() && !it->second.empty()) {
      *block = it->second.back();
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
    blocks_[bytes].push_back(block);
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
  template <class Drop>
  void drop_until(int64_t limit, Drop drop) {
    for (auto it = blocks_.rbegin(); cached_ > limit && it != blocks_.rend(); ++it) {
      while (cached_ > limit && !it->second.empty()) {
        drop(it->second.back(), it->first);
        it->second.pop_back();
        cached_ -= it->first;
      }
    }
  }

  std::map<int64_t, std::vector<Block>> blocks_;
  int64_t cached_ = 0;
  int64_t largest_ = 0;
  int64_t fresh_ = 0;
};

}  // namespace cputrain
