#include "engine/weights_file.h"

#include <cstring>
#include <fstream>
#include <iterator>
#include <vector>

#include "engine/atomic_file.h"
#include "engine/binary_io.h"
#include "engine/error.h"
#include "engine/hash.h"

namespace cputrain {
namespace {

constexpr char kMagic[8] = {'C', 'T', 'W', 'E', 'I', 'G', 'H', 'T'};
constexpr uint32_t kVersion = 1;

class Reader {
 public:
  Reader(const std::string& path, const std::vector<char>& data) : path_(path), data_(data) {}
  void bytes(void* p, size_t n) {
    if (n > data_.size() - pos_) throw UserError(path_ + ": truncated weights file");
    std::memcpy(p, data_.data() + pos_, n);
    pos_ += n;
  }
  template <typename T>
  T value() {
    T v;
    bytes(&v, sizeof(v));
    return v;
  }
  std::string string(size_t limit) {
    const auto n = value<uint32_t>();
    if (n > limit) throw UserError(path_ + ": corrupt weights file (string of " + std::to_string(n) + " bytes)");
    std::string s(n, '\0');
    bytes(s.data(), n);
    return s;
  }
  size_t pos() const { return pos_; }

 private:
  std::string path_;
  const std::vector<char>& data_;
  size_t pos_ = 0;
};

std::vector<char> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw UserError(path + ": cannot open weights file");
  return std::vector<char>(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Checks magic, version and the trailing checksum.
void check_header(const std::string& path, const std::vector<char>& data) {
  if (data.size() < sizeof(kMagic) + 4 + 8 || std::memcmp(data.data(), kMagic, sizeof(kMagic)) != 0)
    throw UserError(path + ": not a cputrain weights file");
  uint32_t version;
  std::memcpy(&version, data.data() + sizeof(kMagic), 4);
  if (version != kVersion)
    throw UserError(path + ": weights file version " + std::to_string(version) + ", expected " +
                    std::to_string(kVersion));
  uint64_t stored;
  std::memcpy(&stored, data.data() + data.size() - 8, 8);
  if (fnv1a(data.data(), data.size() - 8) != stored)
    throw UserError(path + ": checksum mismatch (the weights file is corrupt or truncated)");
}

}  // namespace

void save_weights(const std::string& path, const ParameterSet& params,
                  const std::string& config_json) {
  AtomicFileWriter out(path);
  HashingWriter w(out);
  w.bytes(kMagic, sizeof(kMagic));
  w.value(kVersion);
  w.value(static_cast<uint64_t>(config_json.size()));
  w.bytes(config_json.data(), config_json.size());
  w.value(static_cast<uint32_t>(params.infos().size()));
  uint64_t count = 0;
  for (const ParameterInfo& p : params.infos()) {
    w.string(p.name);
    w.value(static_cast<uint32_t>(p.shape.ndim()));
    for (int i = 0; i < p.shape.ndim(); ++i) w.value(static_cast<uint64_t>(p.shape[i]));
    count += static_cast<uint64_t>(p.shape.numel());
  }
  w.value(count);
  for (const ParameterInfo& p : params.infos())
    w.bytes(params.weights().f32() + p.offset, static_cast<size_t>(p.shape.numel()) * 4);
  w.checksum();
  out.commit();
}

// Skips the magic and version (checked by check_header) and reads the JSON config.
static std::string read_config_block(const std::string& path, const std::vector<char>& data, Reader& r) {
  char skip[sizeof(kMagic) + 4];
  r.bytes(skip, sizeof(skip));
  const auto n = r.value<uint64_t>();
  if (n > data.size()) throw UserError(path + ": corrupt weights file");
  std::string json(n, '\0');
  r.bytes(json.data(), n);
  return json;
}

std::string read_weights_config(const std::string& path) {
  const std::vector<char> data = read_file(path);
  check_header(path, data);
  Reader r(path, data);
  return read_config_block(path, data, r);
}

void load_weights(const std::string& path, const ParameterSet& params) {
  const std::vector<char> data = read_file(path);
  check_header(path, data);
  Reader r(path, data);
  read_config_block(path, data, r);
  const auto n_params = r.value<uint32_t>();
  if (n_params != params.infos().size())
    throw UserError(path + ": holds " + std::to_string(n_params) + " parameters, the model has " +
                    std::to_string(params.infos().size()));
  for (const ParameterInfo& p : params.infos()) {
    const std::string name = r.string(4096);
    const auto ndim = r.value<uint32_t>();
    bool same = name == p.name && ndim == static_cast<uint32_t>(p.shape.ndim());
    for (uint32_t i = 0; i < ndim && i < 4; ++i)
      same = same && r.value<uint64_t>() == static_cast<uint64_t>(p.shape[static_cast<int>(i)]);
    if (!same)
      throw UserError(path + ": parameter " + name + " does not match the model's " + p.name + " " +
                      p.shape.str());
  }
  r.value<uint64_t>();
  for (const ParameterInfo& p : params.infos())
    r.bytes(params.weights().f32() + p.offset, static_cast<size_t>(p.shape.numel()) * 4);
  params.sync_bf16_copies();
}

}  // namespace cputrain
