#include "engine/memory.h"

#include <malloc.h>

#include <atomic>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <new>
#include <string>

#include "engine/block_cache.h"
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

// The cache of freed blocks (engine/block_cache.h) and its lock.
struct SharedCache {
  std::mutex mutex;
  BlockCache<void*> cache;
};

SharedCache& block_cache() {
  static SharedCache c;
  return c;
}

void free_block(void* ptr, int64_t) {
  std::free(ptr);
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
  const auto n = static_cast<int64_t>(rounded);
  SharedCache& bc = block_cache();
  std::lock_guard lock(bc.mutex);
  void* ptr = nullptr;
  if (n < BlockCache<void*>::kMinBytes ||
      !bc.cache.take(n, c.live_total.load(std::memory_order_relaxed),
                     c.peak_total.load(std::memory_order_relaxed), &ptr, free_block))
    ptr = std::aligned_alloc(64, rounded);
  if (ptr == nullptr) throw std::bad_alloc();
  const int i = static_cast<int>(category);
  raise_peak(c.peak[i], c.live[i].fetch_add(n, std::memory_order_relaxed) + n);
  raise_peak(c.peak_total, c.live_total.fetch_add(n, std::memory_order_relaxed) + n);
  raise_peak(c.held_peak, c.live_total.load(std::memory_order_relaxed) + bc.cache.cached());
  return ptr;
}

void memory_free(void* ptr, size_t bytes, MemoryCategory category) {
  if (ptr == nullptr) return;
  Counters& c = counters();
  const size_t rounded = allocated_size(bytes);
  const auto n = static_cast<int64_t>(rounded);
  c.live[static_cast<int>(category)].fetch_sub(n, std::memory_order_relaxed);
  const int64_t live = c.live_total.fetch_sub(n, std::memory_order_relaxed) - n;
  SharedCache& bc = block_cache();
  std::lock_guard lock(bc.mutex);
  if (n < BlockCache<void*>::kMinBytes ||
      !bc.cache.put(ptr, n, live, c.peak_total.load(std::memory_order_relaxed)))
    std::free(ptr);
  raise_peak(c.held_peak, live + bc.cache.cached());
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
  s.held_peak_bytes = c.held_peak.load(std::memory_order_relaxed);
  SharedCache& bc = block_cache();
  std::lock_guard lock(bc.mutex);
  s.fresh_blocks = bc.cache.fresh();
  return s;
}

void memory_reset_peaks() {
  Counters& c = counters();
  for (int i = 0; i < kMemoryCategoryCount; ++i) c.peak[i].store(c.live[i].load());
  c.peak_total.store(c.live_total.load());
  SharedCache& bc = block_cache();
  std::lock_guard lock(bc.mutex);
  c.held_peak.store(c.live_total.load() + bc.cache.cached());
}

ProcessMemory process_memory() {
  return {read_proc_kb("/proc/self/status", "VmRSS"), read_proc_kb("/proc/self/status", "VmHWM")};
}

void memory_release_cached() {
  SharedCache& bc = block_cache();
  std::lock_guard lock(bc.mutex);
  bc.cache.clear(free_block);
}

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
