#include "engine/memory.h"

#include <malloc.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <fstream>
#include <map>
#include <mutex>
#include <new>
#include <string>
#include <vector>

#include "kernels/workspace.h"

namespace cputrain {
namespace {

struct Counters {
  std::array<std::atomic<int64_t>, kMemoryCategoryCount> live{};
  std::array<std::atomic<int64_t>, kMemoryCategoryCount> peak{};
  std::atomic<int64_t> live_total{0};
  std::atomic<int64_t> peak_total{0};
  std::atomic<int64_t> held_peak{0};  // the most live + cached bytes
};

Counters& counters() {
  static Counters c;
  return c;
}

void raise_peak(std::atomic<int64_t>& peak, int64_t value) {
  int64_t seen = peak.load(std::memory_order_relaxed);
  while (value > seen && !peak.compare_exchange_weak(seen, value, std::memory_order_relaxed)) {
  }
}

// Reads "Key:   123 kB" from a /proc file, in bytes.
int64_t read_proc_kb(const char* path, const std::string& key) {
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    if (line.compare(0, key.size(), key) == 0 && line.size() > key.size() &&
        line[key.size()] == ':') {
      return std::strtoll(line.c_str() + key.size() + 1, nullptr, 10) * 1024;
    }
  }
  return 0;
}

// Freed blocks of 1 MiB and more, kept by size for the next allocation of the same size: a
// training step allocates the same sizes in the same order every time, so from the second step
// on its tensors reuse the pages of the previous one instead of mapping, faulting in and zeroing
// fresh ones. The cache holds no more than keeps live + cached within the peak of live bytes
// plus the largest block freed so far (the budget counts that block as the cache's headroom).
// Without the headroom, tensors of different sizes that peak at different moments evict one
// another every step: in mega the 128 MiB logits gradient, made when live is near its peak,
// evicted the backward's 8 and 24 MiB gradients, whose re-making evicted it in turn, and each
// step faulted in 272 MiB afresh (about 70000 page faults).
class BlockCache {
 public:
  static constexpr size_t kMinBytes = size_t{1} << 20;

  // A cached block of exactly `bytes`, or nullptr after making room for a new one of that size.
  void* take(size_t bytes, int64_t live, int64_t peak) {
    std::lock_guard lock(mutex_);
    auto it = blocks_.find(bytes);
    if (it != blocks_.end() && !it->second.empty()) {
      void* ptr = it->second.back();
      it->second.pop_back();
      cached_ -= static_cast<int64_t>(bytes);
      return ptr;
    }
    evict_until(std::max<int64_t>(0, peak + largest_ - live - static_cast<int64_t>(bytes)));
    ++fresh_;
    return nullptr;
  }

  // Keeps a freed block if live + cached stays within the peak plus the headroom, else frees it.
  void put(void* ptr, size_t bytes, int64_t live, int64_t peak) {
    std::lock_guard lock(mutex_);
    largest_ = std::max(largest_, static_cast<int64_t>(bytes));
    if (live + cached_ + static_cast<int64_t>(bytes) > peak + largest_) return std::free(ptr);
    blocks_[bytes].push_back(ptr);
    cached_ += static_cast<int64_t>(bytes);
  }

  int64_t fresh() {
    std::lock_guard lock(mutex_);
    return fresh_;
  }
  int64_t cached() {
    std::lock_guard lock(mutex_);
    return cached_;
  }
  int64_t largest() {
    std::lock_guard lock(mutex_);
    return largest_;
  }

  // Frees every kept block and forgets the largest block freed.
  void release() {
    std::lock_guard lock(mutex_);
    evict_until(0);
    largest_ = 0;
  }

 private:
  // Frees cached blocks, the largest first, until at most `limit` bytes stay cached.
  void evict_until(int64_t limit) {
    for (auto it = blocks_.rbegin(); cached_ > limit && it != blocks_.rend(); ++it) {
      while (cached_ > limit && !it->second.empty()) {
        std::free(it->second.back());
        it->second.pop_back();
        cached_ -= static_cast<int64_t>(it->first);
      }
    }
  }

  std::mutex mutex_;
  std::map<size_t, std::vector<void*>> blocks_;
  int64_t cached_ = 0;
  int64_t largest_ = 0;  // the largest block freed so far
  int64_t fresh_ = 0;    // allocations the cache did not serve
};

BlockCache& block_cache() {
  static BlockCache cache;
  return cache;
}

}  // namespace

std::string_view memory_category_name(MemoryCategory category) {
  switch (category) {
    case MemoryCategory::Weights: return "weights";
    case MemoryCategory::Bf16Weights: return "bf16_weights";
    case MemoryCategory::Gradients: return "gradients";
    case MemoryCategory::OptimizerState: return "optimizer_state";
    case MemoryCategory::Activations: return "activations";
    case MemoryCategory::Workspace: return "workspace";
  }
  return "unknown";
}

// What an allocation of `bytes` takes: whole 64-byte lines, at least one. Counted as such.
static size_t allocated_size(size_t bytes) { return bytes == 0 ? 64 : (bytes + 63) / 64 * 64; }

void* memory_allocate(size_t bytes, MemoryCategory category) {
  const size_t rounded = allocated_size(bytes);
  Counters& c = counters();
  void* ptr = rounded >= BlockCache::kMinBytes
                  ? block_cache().take(rounded, c.live_total.load(std::memory_order_relaxed),
                                       c.peak_total.load(std::memory_order_relaxed))
                  : nullptr;
  if (ptr == nullptr) ptr = std::aligned_alloc(64, rounded);
  if (ptr == nullptr) throw std::bad_alloc();
  const int i = static_cast<int>(category);
  const auto n = static_cast<int64_t>(rounded);
  raise_peak(c.peak[i], c.live[i].fetch_add(n, std::memory_order_relaxed) + n);
  raise_peak(c.peak_total, c.live_total.fetch_add(n, std::memory_order_relaxed) + n);
  raise_peak(c.held_peak, c.live_total.load(std::memory_order_relaxed) + block_cache().cached());
  return ptr;
}

void memory_free(void* ptr, size_t bytes, MemoryCategory category) {
  if (ptr == nullptr) return;
  Counters& c = counters();
  const size_t rounded = allocated_size(bytes);
  const auto n = static_cast<int64_t>(rounded);
  c.live[static_cast<int>(category)].fetch_sub(n, std::memory_order_relaxed);
  const int64_t live = c.live_total.fetch_sub(n, std::memory_order_relaxed) - n;
  if (rounded >= BlockCache::kMinBytes) {
    block_cache().put(ptr, rounded, live, c.peak_total.load(std::memory_order_relaxed));
    raise_peak(c.held_peak, live + block_cache().cached());
  } else {
    std::free(ptr);
  }
}

MemoryStats memory_stats() {
  Counters& c = counters();
  MemoryStats s;
  for (int i = 0; i < kMemoryCategoryCount; ++i) {
    s.live_bytes[i] = c.live[i].load(std::memory_order_relaxed);
    s.peak_bytes[i] = c.peak[i].load(std::memory_order_relaxed);
  }
  s.live_total_bytes = c.live_total.load(std::memory_order_relaxed);
  s.peak_total_bytes = c.peak_total.load(std::memory_order_relaxed);
  s.fresh_blocks = block_cache().fresh();
  s.held_peak_bytes = c.held_peak.load(std::memory_order_relaxed);
  s.largest_freed_block_bytes = block_cache().largest();
  return s;
}

void memory_reset_peaks() {
  Counters& c = counters();
  for (int i = 0; i < kMemoryCategoryCount; ++i) c.peak[i].store(c.live[i].load());
  c.peak_total.store(c.live_total.load());
  c.held_peak.store(c.live_total.load() + block_cache().cached());
}

ProcessMemory process_memory() {
  return {read_proc_kb("/proc/self/status", "VmRSS"), read_proc_kb("/proc/self/status", "VmHWM")};
}

void memory_release_cached() { block_cache().release(); }

bool process_memory_reset_peak() {
  memory_release_cached();
  ::malloc_trim(0);
  std::ofstream out("/proc/self/clear_refs");
  return static_cast<bool>(out << "5" << std::flush);
}

int64_t available_memory_bytes() { return read_proc_kb("/proc/meminfo", "MemAvailable"); }

namespace {

// Kernel scratch (GEMM packing buffers) is counted as workspace like any other allocation.
// Tensors of 1 MiB and more are mapped and unmapped on their own, so a block that leaves the
// cache returns its pages at once and the resident set follows live + cached tensors. (glibc's
// default threshold rises after the first large free, after which freed tensors would stay in
// the heap as residue.)
const bool large_allocations_mapped = [] { return ::mallopt(M_MMAP_THRESHOLD, 1 << 20) == 1; }();

const bool kernel_workspace_accounted = [] {
  kernels::set_workspace_allocator(
      {[](size_t bytes) { return memory_allocate(bytes, MemoryCategory::Workspace); },
       [](void* ptr, size_t bytes) { memory_free(ptr, bytes, MemoryCategory::Workspace); }});
  return true;
}();

}  // namespace

}  // namespace cputrain
