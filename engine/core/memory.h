// Memory accounting: every tensor allocation is tagged with what it is for, and live and peak
// bytes are kept per category. Next to it, the process view from /proc.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace cputrain {

enum class MemoryCategory : int {
  Weights,         // FP32 master weights
  Bf16Weights,     // bf16 copies of the weight matrices
  Gradients,       // FP32 parameter gradients
  OptimizerState,  // AdamW m and v
  Activations,     // op outputs and what ops save for backward
  Workspace,       // transient buffers: activation gradients, scratch, logits
};
inline constexpr int kMemoryCategoryCount = 6;
std::string_view memory_category_name(MemoryCategory category);

struct MemoryStats {
  std::array<int64_t, kMemoryCategoryCount> live_bytes{};
  std::array<int64_t, kMemoryCategoryCount> peak_bytes{};
  int64_t live_total_bytes = 0;
  int64_t peak_total_bytes = 0;
  // The most live bytes plus blocks kept by the cache: what the process holds for tensors.
  int64_t held_peak_bytes = 0;
  // Allocations of 1 MiB and more the block cache did not serve: fresh pages, faulted in and
  // zeroed by the kernel on first touch. A training step after the first makes none.
  int64_t fresh_blocks = 0;
};

// 64-byte aligned and counted as whole 64-byte lines (at least one) under `category` until
// memory_free. Throws std::bad_alloc. Freed blocks of 1 MiB and more are kept for reuse by an
// allocation of the same size (engine/core/block_cache.h).
void* memory_allocate(size_t bytes, MemoryCategory category);
// What an allocation (or a mapped tensor counted) of `bytes` is counted as: whole 64-byte lines,
// at least one.
size_t memory_counted_bytes(size_t bytes);
void memory_free(void* ptr, size_t bytes, MemoryCategory category);
// Counts (or, with count false, stops counting) `bytes` under `category` that live in memory the
// allocator did not give: a model file's tensors mapped in place. They are resident once read,
// as any other weights are.
void memory_count_mapped(size_t bytes, MemoryCategory category, bool count);
MemoryStats memory_stats();
// Sets every peak to the current live figure.
void memory_reset_peaks();
// Frees the blocks kept for reuse, and forgets the largest block freed so far.
void memory_release_cached();

// Measuring: while a MeasureScope is alive, memory_allocate gives no storage (it returns null)
// and counts the allocation in the scope's own ledger instead of the process's, with the same
// categories, peaks and block-cache policy; memory_free of null counts the free there. The code
// that runs meanwhile (a training step, for the memory budget) runs its kernels only where
// measuring() is false, so it makes exactly the allocations it makes for real, in the same
// order, without touching memory. One scope at a time, on one thread.
bool measuring();
class MeasureScope {
 public:
  MeasureScope();
  ~MeasureScope();
  MeasureScope(const MeasureScope&) = delete;
  MeasureScope& operator=(const MeasureScope&) = delete;
  MemoryStats stats() const;
  void reset_peaks();

  struct State;

 private:
  std::unique_ptr<State> state_;
};
// While measuring, what a long-lived scratch buffer of a kernel's does where the kernel would
// ask it for `bytes` (the GEMM's buffers, kernels/gemm/gemm_plan.h's five): each slot keeps the
// largest size asked so far; a larger one frees the block it holds and allocates the new size.
// Each thread has its own slots (`thread`: 0 the thread that runs the step, 1... OpenMP's other
// threads, where products run one a thread).
inline constexpr int kMeasureBuffers = 5;
void measure_buffer(int slot, size_t bytes, MemoryCategory category, int thread = 0);

// Resident set size and its high-water mark (VmRSS, VmHWM of /proc/self/status).
struct ProcessMemory {
  int64_t rss_bytes = 0;
  int64_t peak_rss_bytes = 0;
  // The resident set's two parts: anonymous memory (the heap, tensors, stacks), and pages of
  // mapped files (code, libraries, a model file read in place), which the kernel can drop and
  // read again.
  int64_t rss_anon_bytes = 0;
  int64_t rss_file_bytes = 0;
};
ProcessMemory process_memory();
// Bytes the C heap holds in use (glibc's mallinfo2: its blocks in use and its mapped ones, of
// the main arena, freed blocks in the thread's cache among them).
int64_t heap_in_use_bytes();

// What glibc's malloc takes for a block of `bytes`: its header, rounded to 16, at least 32.
constexpr int64_t heap_chunk_bytes(int64_t bytes) {
  return bytes <= 0 ? 0 : std::max<int64_t>(32, (bytes + 8 + 15) / 16 * 16);
}
// The heap behind a std::string (none within its 15 inline characters) and a std::vector.
inline int64_t heap_bytes_of(const std::string& s) {
  return s.capacity() > 15 ? heap_chunk_bytes(static_cast<int64_t>(s.capacity()) + 1) : 0;
}
template <class T>
int64_t heap_bytes_of(const std::vector<T>& v) {
  return heap_chunk_bytes(static_cast<int64_t>(v.capacity() * sizeof(T)));
}
// Returns freed heap memory to the system (malloc_trim) and restarts the peak RSS from the
// current RSS (/proc/self/clear_refs), so a later peak measures what follows, not set-up work
// such as tokenizer training. Returns false where the kernel does not allow it.
bool process_memory_reset_peak();
// MemAvailable of /proc/meminfo (0 if unreadable).
int64_t available_memory_bytes();

}  // namespace cputrain
