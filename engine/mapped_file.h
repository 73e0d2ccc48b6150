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

}  // namespace cputrain
