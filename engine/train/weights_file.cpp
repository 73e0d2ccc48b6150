#include "engine/train/weights_file.h"

#include <vector>

#include "engine/core/error.h"
#include "engine/io/atomic_file.h"
#include "engine/io/binary_io.h"

namespace cputrain {
namespace {

constexpr char kMagic[8] = {'C', 'T', 'W', 'E', 'I', 'G', 'H', 'T'};
constexpr uint32_t kVersion = 1;
constexpr uint64_t kMaxJson = 1 << 20;

}  // namespace

void save_weights(const std::string& path, const ParameterSet& params,
                  const std::string& config_json) {
  AtomicFileWriter out(path);
  HashingWriter w(out);
  w.preamble(kMagic, kVersion, config_json);
  w.value(static_cast<uint32_t>(params.infos().size()));
  uint64_t count = 0;
  for (const ParameterInfo& p : params.infos()) {
    w.string(p.name);
    w.value(static_cast<uint32_t>(p.shape.ndim()));
    for (int i = 0; i < p.shape.ndim(); ++i) w.value(static_cast<uint64_t>(p.shape[i]));
    count += static_cast<uint64_t>(p.shape.numel());
  }
  w.value(count);
  std::vector<float> widened;  // a parameter that lives as bf16 alone, as FP32
  for (size_t i = 0; i < params.infos().size(); ++i) {
    const ParameterInfo& p = params.infos()[i];
    const auto bytes = static_cast<size_t>(p.shape.numel()) * 4;
    if (p.offset >= 0) {
      w.bytes(params.weights().f32() + p.offset, bytes);
      continue;
    }
    widened.resize(static_cast<size_t>(p.shape.numel()));
    params.read_values(static_cast<int>(i), widened.data());
    w.bytes(widened.data(), bytes);
  }
  w.checksum();
  out.commit();
}

std::string read_weights_config(const std::string& path) {
  FileReader r(path, "weights file");
  return r.preamble(kMagic, kVersion, kMaxJson);
}

void load_weights(const std::string& path, const ParameterSet& params) {
  FileReader r(path, "weights file");
  r.preamble(kMagic, kVersion, kMaxJson);
  const auto n_params = r.value<uint32_t>();
  if (n_params != params.infos().size())
    throw UserError(path + ": holds " + std::to_string(n_params) +
                    " parameter tensors, the model has " + std::to_string(params.infos().size()));
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
  std::vector<float> values;  // for a parameter that lives as bf16 alone
  for (size_t i = 0; i < params.infos().size(); ++i) {
    const ParameterInfo& p = params.infos()[i];
    const auto bytes = static_cast<size_t>(p.shape.numel()) * 4;
    if (p.offset >= 0) {
      r.bytes(params.weights().f32() + p.offset, bytes);
      continue;
    }
    values.resize(static_cast<size_t>(p.shape.numel()));
    r.bytes(values.data(), bytes);
    params.write_values(static_cast<int>(i), values.data());
  }
  params.sync_bf16_copies();
}

}  // namespace cputrain
