// A regular file mapped read-only for the object's lifetime (model files read in place).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace cputrain {

class MappedFile {
 public:
  // A UserError naming `path` where it cannot be opened, is not a regular file, or cannot be
  // mapped.
  explicit MappedFile(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const std::string& path() const { return path_; }
  const uint8_t* data() const { return static_cast<const uint8_t*>(map_); }
  size_t size() const { return size_; }

 private:
  std::string path_;
  void* map_ = nullptr;
  size_t size_ = 0;
};

// Marks the pages of a file mapping that hold [data, data + bytes) as the first to give back
// when memory runs short (MADV_COLD): they stay in memory and mapped while there is room. For
// weights read in passes, released once a pass is done with them, so that the page cache keeps
// what is read ahead rather than what was read last.
void release_mapped(const void* data, size_t bytes);

// Brings the pages of a read-only file mapping that hold [data, data + bytes) into memory and
// maps them (MADV_POPULATE_READ; on kernels before 5.14, MADV_WILLNEED starts their reading),
// so that what reads them next does not wait on the disk. Blocks until they are in: run it on a
// thread of its own to read ahead. Failure is harmless (the pages are then read when touched)
// and not reported.
void populate_mapped(const void* data, size_t bytes);

}  // namespace cputrain
