#include "engine/io/binary_io.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "engine/core/error.h"

namespace cputrain {

FileReader::FileReader(const std::string& path, const std::string& kind)
    : path_(path), kind_(kind), in_(path, std::ios::binary) {
  if (!in_) throw UserError(path + ": cannot open " + kind);
  in_.seekg(0, std::ios::end);
  size_ = static_cast<uint64_t>(in_.tellg());
  in_.seekg(0, std::ios::beg);
}

void FileReader::bytes(void* p, size_t n) {
  if (n > size_ - pos_) corrupt("truncated " + kind_);
  in_.read(static_cast<char*>(p), static_cast<std::streamsize>(n));
  if (!in_) corrupt("read error in " + kind_);
  pos_ += n;
}

std::string FileReader::string(size_t limit) {
  const auto n = value<uint32_t>();
  if (n > limit) corrupt("corrupt " + kind_ + " (a string of " + std::to_string(n) + " bytes)");
  std::string s(n, '\0');
  bytes(s.data(), n);
  return s;
}

std::string FileReader::preamble(const char* magic, uint32_t version, uint64_t max_json) {
  char seen[8];
  if (size_ < sizeof(seen) + 4 + 8 + 8) corrupt("not a cputrain " + kind_ + " (too short)");
  bytes(seen, sizeof(seen));
  if (std::memcmp(seen, magic, sizeof(seen)) != 0) corrupt("not a cputrain " + kind_);
  const auto v = value<uint32_t>();
  if (v != version)
    corrupt(kind_ + " version " + std::to_string(v) + ", expected " + std::to_string(version));
  if (!checksum_matches(path_, kind_, 0))
    corrupt("checksum mismatch (the " + kind_ + " is corrupt or truncated)");
  const auto n = value<uint64_t>();
  if (n > max_json) corrupt("corrupt " + kind_ + " (a header of " + std::to_string(n) + " bytes)");
  std::string json(n, '\0');
  bytes(json.data(), n);
  return json;
}

void FileReader::corrupt(const std::string& what) const {
  throw UserError(path_ + ": " + what);
}

bool checksum_matches(const std::string& path, const std::string& kind, uint64_t min_bytes) {
  FileReader r(path, kind);
  if (r.size() < std::max<uint64_t>(min_bytes, 8))
    r.corrupt("too short for a " + kind + " (" + std::to_string(r.size()) + " bytes)");
  std::vector<char> piece(1 << 20);
  uint64_t h = kFnvOffset, left = r.size() - 8;
  while (left > 0) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(left, piece.size()));
    r.bytes(piece.data(), n);
    h = fnv1a(piece.data(), n, h);
    left -= n;
  }
  return r.value<uint64_t>() == h;
}

}  // namespace cputrain
