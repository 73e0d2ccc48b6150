#include "engine/core/memory.h"

#include <malloc.h>
#include <sys/mman.h>

#include <atomic>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/core/block_cache.h"
#include "kernels/cpu/dispatch.h"
#include "kernels/cpu/workspace.h"

namespace cputrain {
namespace {

// Live and peak bytes per category and in all, and the cache of freed blocks
// (engine/core/block_cache.h) with its lock: the process's ledger over real blocks, a measuring
// ledger (MeasureScope) over sizes alone.
template <class Block>
struct Ledger {
  std::array<std::atomic<int64_t>, kMemoryCategoryCount> live{};
  std::array<std::atomic<int64_t>, kMemoryCategoryCount> peak{};
  std::atomic<int64_t> live_total{0};
  std::atomic<int64_t> peak_total{0};
  std::atomic<int64_t> held_peak{0};  // the most live + cached bytes
  std::mutex mutex;
  BlockCache<Block> cache;
};

void raise_peak(std::atomic<int64_t>& peak, int64_t value) {
  int64_t seen = peak.load(std::memory_order_relaxed);
  while (value > seen && !peak.compare_exchange_weak(seen, value, std::memory_order_relaxed)) {
  }
}

// A block of n bytes kept by the cache into *block (true); else, none being kept, room made in
// the cache for a new one (false). Counts nothing.
template <class Block, class Drop>
bool ledger_take(Ledger<Block>& l, int64_t n, Block* block, Drop drop) {
  return n >= BlockCache<Block>::kMinBytes &&
         l.cache.take(n, l.live_total.load(std::memory_order_relaxed),
                      l.peak_total.load(std::memory_order_relaxed), block, drop);
}

// Counts an allocation of n bytes (whole lines) under `category`.
template <class Block>
void ledger_count(Ledger<Block>& l, int64_t n, MemoryCategory category) {
  const int i = static_cast<int>(category);
  raise_peak(l.peak[i], l.live[i].fetch_add(n, std::memory_order_relaxed) + n);
  raise_peak(l.peak_total, l.live_total.fetch_add(n, std::memory_order_relaxed) + n);
  raise_peak(l.held_peak, l.live_total.load(std::memory_order_relaxed) + l.cache.cached());
}

// Counts the free of n bytes; true where the cache keeps the block.
template <class Block>
bool ledger_free(Ledger<Block>& l, Block block, int64_t n, MemoryCategory category) {
  l.live[static_cast<int>(category)].fetch_sub(n, std::memory_order_relaxed);
  const int64_t live = l.live_total.fetch_sub(n, std::memory_order_relaxed) - n;
  const bool kept = n >= BlockCache<Block>::kMinBytes &&
                    l.cache.put(block, n, live, l.peak_total.load(std::memory_order_relaxed));
  raise_peak(l.held_peak, live + l.cache.cached());
  return kept;
}

template <class Block>
MemoryStats ledger_stats(Ledger<Block>& l) {
  MemoryStats s;
  for (int i = 0; i < kMemoryCategoryCount; ++i) {
    s.live_bytes[i] = l.live[i].load(std::memory_order_relaxed);
    s.peak_bytes[i] = l.peak[i].load(std::memory_order_relaxed);
  }
  s.live_total_bytes = l.live_total.load(std::memory_order_relaxed);
  s.peak_total_bytes = l.peak_total.load(std::memory_order_relaxed);
  s.held_peak_bytes = l.held_peak.load(std::memory_order_relaxed);
  std::lock_guard lock(l.mutex);
  s.fresh_blocks = l.cache.fresh();
  return s;
}

template <class Block>
void ledger_reset_peaks(Ledger<Block>& l) {
  for (int i = 0; i < kMemoryCategoryCount; ++i) l.peak[i].store(l.live[i].load());
  l.peak_total.store(l.live_total.load());
  std::lock_guard lock(l.mutex);
  l.held_peak.store(l.live_total.load() + l.cache.cached());
}

Ledger<void*>& process_ledger() {
  static Ledger<void*> l;
  return l;
}

// The ledger of the MeasureScope alive, or null. A kept block of a measured run is nothing but
// its size.
using MeasureLedger = Ledger<char>;
std::atomic<MeasureLedger*> measure_ledger{nullptr};

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

// Blocks of 1 MiB and more are mapped and unmapped here on their own, so a block that leaves the
// cache returns its pages at once and the resident set follows live + cached tensors, whatever
// malloc's thresholds.
constexpr size_t kMappedBlockBytes = size_t{1} << 20;

void* allocate_block(size_t bytes) {
  if (bytes < kMappedBlockBytes) return std::aligned_alloc(64, bytes);
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  return p == MAP_FAILED ? nullptr : p;
}

void free_block(void* ptr, int64_t bytes) {
  if (static_cast<size_t>(bytes) < kMappedBlockBytes)
    std::free(ptr);
  else
    ::munmap(ptr, static_cast<size_t>(bytes));
}

}  // namespace

std::string_view memory_category_name(MemoryCategory category) {
  switch (category) {
    case MemoryCategory::Weights:
      return "weights";
    case MemoryCategory::Bf16Weights:
      return "bf16_weights";
    case MemoryCategory::Gradients:
      return "gradients";
    case MemoryCategory::OptimizerState:
      return "optimizer_state";
    case MemoryCategory::Activations:
      return "activations";
    case MemoryCategory::Workspace:
      return "workspace";
  }
  return "unknown";
}

size_t memory_counted_bytes(size_t bytes) {
  return bytes == 0 ? 64 : (bytes + 63) / 64 * 64;
}

void* memory_allocate(size_t bytes, MemoryCategory category) {
  const size_t rounded = memory_counted_bytes(bytes);
  const auto n = static_cast<int64_t>(rounded);
  if (MeasureLedger* m = measure_ledger.load(std::memory_order_relaxed)) {
    std::lock_guard lock(m->mutex);
    char block;
    ledger_take(*m, n, &block, [](char, int64_t) {});
    ledger_count(*m, n, category);
    return nullptr;
  }
  Ledger<void*>& l = process_ledger();
  std::lock_guard lock(l.mutex);
  void* ptr = nullptr;
  if (!ledger_take(l, n, &ptr, free_block)) ptr = allocate_block(rounded);
  if (ptr == nullptr) throw std::bad_alloc();
  ledger_count(l, n, category);
  return ptr;
}

void memory_free(void* ptr, size_t bytes, MemoryCategory category) {
  const auto n = static_cast<int64_t>(memory_counted_bytes(bytes));
  if (ptr == nullptr) {  // a measured allocation (or none)
    if (MeasureLedger* m = measure_ledger.load(std::memory_order_relaxed)) {
      std::lock_guard lock(m->mutex);
      ledger_free(*m, char{}, n, category);
    }
    return;
  }
  Ledger<void*>& l = process_ledger();
  std::lock_guard lock(l.mutex);
  if (!ledger_free(l, ptr, n, category)) free_block(ptr, n);
}

void memory_count_mapped(size_t bytes, MemoryCategory category, bool count) {
  const auto n = static_cast<int64_t>(memory_counted_bytes(bytes));
  Ledger<void*>& l = process_ledger();
  std::lock_guard lock(l.mutex);
  if (count) {
    ledger_count(l, n, category);
  } else {
    l.live[static_cast<int>(category)].fetch_sub(n, std::memory_order_relaxed);
    l.live_total.fetch_sub(n, std::memory_order_relaxed);
  }
}

MemoryStats memory_stats() {
  return ledger_stats(process_ledger());
}

void memory_reset_peaks() {
  ledger_reset_peaks(process_ledger());
}

bool measuring() {
  return measure_ledger.load(std::memory_order_relaxed) != nullptr;
}

struct MeasureScope::State {
  MeasureLedger ledger;
  struct Slots {
    std::array<int64_t, kMeasureBuffers> bytes{};  // bytes held in each buffer slot
    std::array<MemoryCategory, kMeasureBuffers> categories{};
  };
  std::vector<Slots> threads = std::vector<Slots>(1);  // each thread's slots
};

namespace {
std::atomic<MeasureScope::State*> measure_state{nullptr};
}  // namespace

void measure_buffer(int slot, size_t bytes, MemoryCategory category, int thread) {
  MeasureScope::State* m = measure_state.load(std::memory_order_relaxed);
  if (m == nullptr || slot < 0 || slot >= kMeasureBuffers || thread < 0)
    throw std::logic_error("measure_buffer: a slot of a live MeasureScope");
  if (static_cast<size_t>(thread) >= m->threads.size())
    m->threads.resize(static_cast<size_t>(thread) + 1);
  MeasureScope::State::Slots& slots = m->threads[static_cast<size_t>(thread)];
  const auto n = static_cast<int64_t>(memory_counted_bytes(bytes));
  int64_t& held = slots.bytes[slot];
  if (held >= n) return;
  if (held > 0) memory_free(nullptr, static_cast<size_t>(held), slots.categories[slot]);
  memory_allocate(static_cast<size_t>(n), category);
  held = n;
  slots.categories[slot] = category;
}

MeasureScope::MeasureScope() : state_(std::make_unique<State>()) {
  // The kernels' one-time set-up computes for real (the GEMM's choice of backend runs its
  // self-test): before measuring, not inside.
  kernels::kernel_choices();
  MeasureLedger* expected = nullptr;
  if (!measure_ledger.compare_exchange_strong(expected, &state_->ledger))
    throw std::logic_error("MeasureScope: one is already alive");
  measure_state.store(state_.get());
}

MeasureScope::~MeasureScope() {
  measure_state.store(nullptr);
  measure_ledger.store(nullptr);
}

MemoryStats MeasureScope::stats() const {
  return ledger_stats(state_->ledger);
}

void MeasureScope::reset_peaks() {
  ledger_reset_peaks(state_->ledger);
}

int64_t heap_in_use_bytes() {
  const struct mallinfo2 m = mallinfo2();
  return static_cast<int64_t>(m.uordblks + m.hblkhd);
}

ProcessMemory process_memory() {
  const char* status = "/proc/self/status";
  return {read_proc_kb(status, "VmRSS"), read_proc_kb(status, "VmHWM"),
          read_proc_kb(status, "RssAnon"),
          read_proc_kb(status, "RssFile") + read_proc_kb(status, "RssShmem")};
}

void memory_release_cached() {
  Ledger<void*>& l = process_ledger();
  std::lock_guard lock(l.mutex);
  l.cache.clear(free_block);
}

bool process_memory_reset_peak() {
  memory_release_cached();
  ::malloc_trim(0);
  std::ofstream out("/proc/self/clear_refs");
  return static_cast<bool>(out << "5" << std::flush);
}

int64_t available_memory_bytes() {
  return read_proc_kb("/proc/meminfo", "MemAvailable");
}

namespace {

// glibc raises its trim threshold to twice the largest mapped block freed so far (up to 64 MiB)
// and its mapping threshold to that block's size, so a heap can keep tens of MiB freed at its
// top that no budget counts, more in one run than another. Fixed thresholds keep it near what is
// live: the heap's free top returned past 128 KiB, and blocks from 256 KiB mapped apart, the
// smaller ones reused from the heap with their pages resident (from 1 MiB this ledger maps its
// own and keeps them). Blocks of 256 KiB to 1 MiB left in the heap leave it holding free pages
// between blocks in use: some 0.1 GiB through each step of a Gemma 4 E2B fine-tune (its
// per-layer inputs, 512 KiB a layer), which no budget counts. Below 256 KiB they stay: mapping
// every block from 64 KiB costs the tiny preset's 17 ms step 2-4 ms in page faults. Set
// before the program's own allocations; thresholds set in the environment are left to hold.
const bool heap_thresholds_fixed = [] {
  if (std::getenv("MALLOC_TRIM_THRESHOLD_") != nullptr ||
      std::getenv("MALLOC_MMAP_THRESHOLD_") != nullptr)
    return false;
  ::mallopt(M_TRIM_THRESHOLD, 128 << 10);
  ::mallopt(M_MMAP_THRESHOLD, 256 << 10);
  return true;
}();

// Kernel scratch (GEMM packing buffers) is counted as workspace like any other allocation.
const bool kernel_workspace_accounted = [] {
  kernels::set_workspace_allocator(
      {[](size_t bytes) { return memory_allocate(bytes, MemoryCategory::Workspace); },
       [](void* ptr, size_t bytes) { memory_free(ptr, bytes, MemoryCategory::Workspace); }});
  return true;
}();

}  // namespace

}  // namespace cputrain
