// The allocator's cache of freed blocks (engine/core/block_cache.h) on blocks that are numbers:
// which block a take returns, what a put refuses, which blocks go to make room, and a step
// repeated after a different first one.
#include <gtest/gtest.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "engine/core/block_cache.h"

namespace cputrain {
namespace {

constexpr int64_t kMiB = BlockCache<int>::kMinBytes;

// An allocator over the cache as engine/core/memory.cpp runs it: live bytes and their peak,
// blocks numbered as they are made, the ones the cache drops or refuses recorded.
struct Allocator {
  BlockCache<int> cache;
  int64_t live = 0, peak = 0, held_peak = 0;
  int made = 0;                                  // blocks made afresh
  std::vector<std::pair<int, int64_t>> dropped;  // (block, bytes) in the order dropped
  int allocate(int64_t bytes) {
    int block = 0;
    if (!cache.take(bytes, live, peak, &block,
                    [this](int b, int64_t n) { dropped.emplace_back(b, n); }))
      block = ++made;
    live += bytes;
    peak = std::max(peak, live);
    held_peak = std::max(held_peak, live + cache.cached());
    return block;
  }
  void free(int block, int64_t bytes) {
    live -= bytes;
    if (!cache.put(block, bytes, live, peak)) dropped.emplace_back(block, bytes);
    held_peak = std::max(held_peak, live + cache.cached());
  }
  // Makes blocks of `mib` MiB in turn, then frees them in the order of `freed` (indices into
  // mib); the blocks' numbers.
  std::vector<int> make_then_free(const std::vector<int64_t>& mib,
                                  const std::vector<size_t>& freed) {
    std::vector<int> blocks;
    for (const int64_t m : mib) blocks.push_back(allocate(m * kMiB));
    for (const size_t i : freed) free(blocks[i], mib[i] * kMiB);
    return blocks;
  }
};

TEST(BlockCache, TakesTheBlockKeptLastOfItsSize) {
  Allocator a;
  const int first = a.allocate(4 * kMiB), second = a.allocate(4 * kMiB);
  const int other = a.allocate(2 * kMiB);
  a.free(first, 4 * kMiB);
  a.free(second, 4 * kMiB);
  a.free(other, 2 * kMiB);
  EXPECT_EQ(a.cache.cached(), 10 * kMiB);
  EXPECT_EQ(a.allocate(4 * kMiB), second);
  EXPECT_EQ(a.allocate(4 * kMiB), first);
  EXPECT_EQ(a.made, 3);
  EXPECT_EQ(a.allocate(3 * kMiB), 4) << "no block of 3 MiB kept: made afresh";
  EXPECT_EQ(a.cache.fresh(), 4);
}

TEST(BlockCache, KeepsWithinThePeakPlusTheLargestBlock) {
  Allocator a;
  const int x = a.allocate(6 * kMiB), y = a.allocate(2 * kMiB);  // peak 8 MiB
  a.free(x, 6 * kMiB);                                           // 2 live + 6 kept
  a.free(y, 2 * kMiB);                                           // 0 live + 8 kept
  const int z = a.allocate(3 * kMiB);  // room made: 3 live + kept within 8 + 6
  EXPECT_LE(a.live + a.cache.cached(), a.peak + 6 * kMiB);
  EXPECT_TRUE(a.dropped.empty());
  const int w = a.allocate(5 * kMiB);  // 8 live: the 6 kept dropped to stay within 14
  EXPECT_EQ(a.dropped, (std::vector<std::pair<int, int64_t>>{{x, 6 * kMiB}}));
  a.free(z, 3 * kMiB);
  a.free(w, 5 * kMiB);
  EXPECT_LE(a.held_peak, a.peak + 6 * kMiB);
  EXPECT_GE(a.cache.cached(), 8 * kMiB);
}

TEST(BlockCache, DropsTheBlockKeptLongestFirst) {
  Allocator a;
  // Kept: 2, 8 and 4 MiB in that order; the peak 14, the largest 8.
  const std::vector<int> kept = a.make_then_free({2, 8, 4}, {0, 1, 2});
  const int b2 = kept[0], b8 = kept[1];
  // 16 MiB of a size not kept: kept bytes brought within 14 + 8 - 16 = 6 MiB.
  a.allocate(16 * kMiB);
  // Kept longest first: the 2 and then the 8, not the 8 alone (the largest).
  EXPECT_EQ(a.dropped, (std::vector<std::pair<int, int64_t>>{{b2, 2 * kMiB}, {b8, 8 * kMiB}}));
  EXPECT_EQ(a.cache.cached(), 4 * kMiB);
}

// A step repeated after a first one of other sizes (start-up, the first step's one-time
// tensors): what the first left kept is dropped before the step's own blocks, and from the third
// step on the step takes every block from the cache. Dropping the largest first, the step's 8
// and 6 MiB blocks pushed each other out on every step instead, two made afresh each time.
TEST(BlockCache, ARepeatedStepSettlesAfterADifferentFirstOne) {
  Allocator a;
  a.make_then_free({4, 4, 2}, {2, 1, 0});
  std::vector<int> made_by_step;
  for (int step = 0; step < 8; ++step) {
    const int before = a.made;
    const int t0 = a.allocate(8 * kMiB);
    a.free(t0, 8 * kMiB);
    const int t2 = a.allocate(6 * kMiB), t1 = a.allocate(4 * kMiB);
    a.free(t1, 4 * kMiB);
    a.free(t2, 6 * kMiB);
    made_by_step.push_back(a.made - before);
    EXPECT_LE(a.held_peak, a.peak + 8 * kMiB) << "step " << step;
  }
  EXPECT_EQ(made_by_step, (std::vector<int>{2, 0, 0, 0, 0, 0, 0, 0}));
}

}  // namespace
}  // namespace cputrain
