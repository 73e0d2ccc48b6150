#include "kernels/cpu/workspace.h"

#include <atomic>
#include <cstdlib>
#include <new>

namespace cputrain::kernels {
namespace {

void* aligned_allocate(size_t bytes) {
  void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}

void aligned_free(void* ptr, size_t) {
  std::free(ptr);
}

std::atomic<WorkspaceAllocate> allocate_fn{aligned_allocate};
std::atomic<WorkspaceFree> free_fn{aligned_free};

}  // namespace

void set_workspace_allocator(WorkspaceAllocator allocator) {
  allocate_fn.store(allocator.allocate);
  free_fn.store(allocator.free);
}

WorkspaceAllocator workspace_allocator() {
  return {allocate_fn.load(), free_fn.load()};
}

}  // namespace cputrain::kernels
