// Where kernels get their long-lived scratch memory (GEMM packing buffers). kernels/ knows
// nothing above it, so the engine installs its accounted allocator here at start-up; until then
// (and in programs without the engine) plain 64-byte aligned allocation is used.
#pragma once

#include <cstddef>

namespace cputrain::kernels {

using WorkspaceAllocate = void* (*)(size_t bytes);  // 64-byte aligned; throws
using WorkspaceFree = void (*)(void* ptr, size_t bytes);

struct WorkspaceAllocator {
  WorkspaceAllocate allocate;
  WorkspaceFree free;
};

void set_workspace_allocator(WorkspaceAllocator allocator);
WorkspaceAllocator workspace_allocator();

}  // namespace cputrain::kernels
