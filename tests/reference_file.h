// Reader for the CTRF reference-tensor files that tests/models/make_llama_reference.py writes:
// magic "CTRF", u32 version 1, u32 record count; per record u32 name length, name, u32 dtype
// (0 f32, 1 i32), u32 ndim, ndim x u64 dims, then the data, all little-endian.
#pragma once

#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace cputrain::test {

struct ReferenceTensor {
  std::string name;
  int dtype = 0;  // 0 f32, 1 i32
  std::vector<int64_t> shape;
  std::vector<float> f32;
  std::vector<int32_t> i32;
};

inline std::map<std::string, ReferenceTensor> read_reference_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error(path + ": cannot be read");
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  size_t pos = 0;
  auto take = [&](void* dst, size_t n) {
    if (n > bytes.size() - pos) throw std::runtime_error(path + ": truncated");
    std::memcpy(dst, bytes.data() + pos, n);
    pos += n;
  };
  auto u32 = [&] {
    uint32_t v;
    take(&v, sizeof(v));
    return v;
  };
  char magic[4];
  take(magic, 4);
  if (std::memcmp(magic, "CTRF", 4) != 0) throw std::runtime_error(path + ": not a CTRF file");
  if (u32() != 1) throw std::runtime_error(path + ": unsupported CTRF version");
  const uint32_t count = u32();
  std::map<std::string, ReferenceTensor> out;
  for (uint32_t r = 0; r < count; ++r) {
    ReferenceTensor t;
    t.name.resize(u32());
    take(t.name.data(), t.name.size());
    t.dtype = static_cast<int>(u32());
    if (t.dtype != 0 && t.dtype != 1) throw std::runtime_error(path + ": bad dtype in " + t.name);
    const uint32_t ndim = u32();
    if (ndim > 8) throw std::runtime_error(path + ": bad rank in " + t.name);
    uint64_t numel = 1;
    for (uint32_t d = 0; d < ndim; ++d) {
      uint64_t dim;
      take(&dim, sizeof(dim));
      if (dim > (uint64_t{1} << 32)) throw std::runtime_error(path + ": bad dims in " + t.name);
      t.shape.push_back(static_cast<int64_t>(dim));
      numel *= dim;
    }
    if (numel > bytes.size()) throw std::runtime_error(path + ": truncated in " + t.name);
    if (t.dtype == 0) {
      t.f32.resize(numel);
      take(t.f32.data(), numel * sizeof(float));
    } else {
      t.i32.resize(numel);
      take(t.i32.data(), numel * sizeof(int32_t));
    }
    const std::string name = t.name;
    if (!out.emplace(name, std::move(t)).second)
      throw std::runtime_error(path + ": duplicate record " + name);
  }
  if (pos != bytes.size()) throw std::runtime_error(path + ": trailing bytes");
  return out;
}

}  // namespace cputrain::test
