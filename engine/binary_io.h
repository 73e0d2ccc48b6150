// Little-endian binary files with a trailing FNV-1a checksum (the weights file, checkpoints):
// a writer that streams into an AtomicFileWriter while hashing, a reader that streams from a
// file with every short read reported as truncation, and a checksum check that streams.
#pragma once

#include <cstdint>
#include <fstream>
#include <string>

#include "engine/atomic_file.h"
#include "engine/hash.h"

namespace cputrain {

class HashingWriter {
 public:
  explicit HashingWriter(AtomicFileWriter& out) : out_(out) {}
  void bytes(const void* p, size_t n) {
    hash_ = fnv1a(p, n, hash_);
    out_.write(p, n);
  }
  template <typename T>
  void value(T v) { bytes(&v, sizeof(v)); }
  void string(const std::string& s) {
    value(static_cast<uint32_t>(s.size()));
    bytes(s.data(), s.size());
  }
  // Appends the hash of everything written so far.
  void checksum() { value(hash_); }

 private:
  AtomicFileWriter& out_;
  uint64_t hash_ = kFnvOffset;
};

// Errors are UserErrors "<path>: <what> (<kind> truncated / corrupt)".
class FileReader {
 public:
  // kind names the file in messages, e.g. "checkpoint".
  FileReader(const std::string& path, const std::string& kind);
  void bytes(void* p, size_t n);
  template <typename T>
  T value() {
    T v;
    bytes(&v, sizeof(v));
    return v;
  }
  std::string string(size_t limit);
  uint64_t size() const { return size_; }
  uint64_t pos() const { return pos_; }
  [[noreturn]] void corrupt(const std::string& what) const;

 private:
  std::string path_, kind_;
  std::ifstream in_;
  uint64_t size_ = 0, pos_ = 0;
};

// Whether the last 8 bytes of the file are the FNV-1a of the rest, read in 1 MiB pieces.
// A UserError for a file that cannot be read or is shorter than min_bytes.
bool checksum_matches(const std::string& path, const std::string& kind, uint64_t min_bytes);

}  // namespace cputrain
