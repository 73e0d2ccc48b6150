// Little-endian binary files with a trailing FNV-1a checksum (the weights file, checkpoints):
// a writer that streams into an AtomicFileWriter while hashing, a reader that streams from a
// file with every short read reported as truncation, and a checksum check that streams.
#pragma once

#include <cstdint>
#include <fstream>
#include <string>

#include "engine/core/hash.h"
#include "engine/io/atomic_file.h"

namespace cputrain {

class HashingWriter {
 public:
  explicit HashingWriter(AtomicFileWriter& out) : out_(out) {}
  void bytes(const void* p, size_t n) {
    hash_ = fnv1a(p, n, hash_);
    out_.write(p, n);
  }
  template <typename T>
  void value(T v) {
    bytes(&v, sizeof(v));
  }
  void string(const std::string& s) {
    value(static_cast<uint32_t>(s.size()));
    bytes(s.data(), s.size());
  }
  // The start both file formats share: magic (8 bytes) | u32 version | u64 JSON bytes | JSON.
  void preamble(const char* magic, uint32_t version, const std::string& json) {
    bytes(magic, 8);
    value(version);
    value(static_cast<uint64_t>(json.size()));
    bytes(json.data(), json.size());
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
  // Reads the preamble HashingWriter::preamble wrote and returns its JSON: first the magic and
  // version (so a foreign file is named as such), then the trailing checksum over the whole
  // file (a second pass), then the JSON, of at most max_json bytes.
  std::string preamble(const char* magic, uint32_t version, uint64_t max_json);
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
