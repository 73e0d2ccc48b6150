// Replacing a file so that a reader sees either the old contents or the new, never a mix:
// write a temp file beside it, fsync, rename over the old one.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace cputrain {

// Streams a file into `path`.tmp; commit() flushes, fsyncs and renames it over `path`.
// Destroyed without a commit (an error, an exception on the way), it removes the temp file and
// `path` stays as it was. Errors are UserErrors naming the file, the system's reason, and that
// the previous file is unchanged.
class AtomicFileWriter {
 public:
  explicit AtomicFileWriter(const std::string& path);
  ~AtomicFileWriter();
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;

  void write(const void* data, size_t bytes);
  void commit();

 private:
  void flush();
  [[noreturn]] void fail(int err);

  std::string path_, tmp_;
  int fd_ = -1;
  std::vector<char> buffer_;
  size_t used_ = 0;
};

// For tests of failure handling: after `bytes` more bytes, every AtomicFileWriter write fails
// as on a full disk (ENOSPC). Negative: no limit (the default).
void set_atomic_write_limit_for_testing(int64_t bytes);

void write_file_atomic(const std::string& path, const void* data, size_t bytes);
inline void write_file_atomic(const std::string& path, const std::string& text) {
  write_file_atomic(path, text.data(), text.size());
}

}  // namespace cputrain
