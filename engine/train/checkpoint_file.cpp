#include "engine/train/checkpoint_file.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <sstream>

#include "engine/core/error.h"
#include "engine/io/binary_io.h"

namespace cputrain {
namespace {

constexpr char kMagic[8] = {'C', 'T', 'C', 'K', 'P', 'T', '0', '1'};
constexpr uint32_t kVersion = 1;
constexpr uint64_t kMaxJson = 1 << 20;

std::string hex(uint64_t v) {
  std::ostringstream s;
  s << std::hex << v;
  return s.str();
}

// Opens a checkpoint (magic, version, checksum) and reads its header; leaves r at the arrays.
CheckpointInfo read_header(FileReader& r, uint64_t* n) {
  const std::string text = r.preamble(kMagic, kVersion, kMaxJson);
  CheckpointInfo info;
  try {
    const nlohmann::json j = nlohmann::json::parse(text);
    info.step = j.at("step").get<int64_t>();
    info.adamw_step = j.at("adamw_step").get<int64_t>();
    info.data_fingerprint = std::stoull(j.at("data_fingerprint").get<std::string>(), nullptr, 16);
    info.config_json = j.at("config").dump(2) + "\n";
    if (j.contains("frozen_fingerprint"))
      info.frozen_fingerprint =
          std::stoull(j.at("frozen_fingerprint").get<std::string>(), nullptr, 16);
  } catch (const std::exception& e) {
    r.corrupt(std::string("corrupt checkpoint header (") + e.what() + ")");
  }
  *n = r.value<uint64_t>();
  if (*n > r.size() / 12) r.corrupt("corrupt checkpoint (" + std::to_string(*n) + " weights)");
  if (r.size() != r.pos() + *n * 12 + 8)
    r.corrupt("corrupt checkpoint (its size does not match its header)");
  return info;
}

// The trainable parameters' weights laid out as their gradients are (ParameterInfo::
// grad_offset): where nothing is frozen or offloaded, the weights buffer itself.
bool all_trainable(const ParameterSet& params) {
  return params.numel() == params.trainable_numel() && !params.offloaded();
}

// The trainable parameters in the checkpoint's layout (their gradients'): `each(index,
// padding)` for every one, with the padding elements before it, then `tail(padding)` with those
// after the last, up to n.
template <typename Each, typename Tail>
void in_layout(const ParameterSet& params, uint64_t n, Each each, Tail tail) {
  uint64_t at = 0;
  for (size_t i = 0; i < params.infos().size(); ++i) {
    const ParameterInfo& p = params.infos()[i];
    if (!p.trainable) continue;
    each(static_cast<int>(i), static_cast<uint64_t>(p.grad_offset) - at);
    at = static_cast<uint64_t>(p.grad_offset + p.shape.numel());
  }
  tail(n - at);
}

// AdamW's m, then v, through one buffer (offloaded, they are never whole in RAM):
// `each(second, at, count, buffer)` for each chunk of their n elements.
template <typename Each>
void in_state_chunks(uint64_t n, Each each) {
  constexpr uint64_t kChunk = uint64_t{1} << 20;
  std::vector<float> chunk(static_cast<size_t>(std::min(n, kChunk)));
  for (const bool second : {false, true})
    for (uint64_t at = 0; at < n; at += chunk.size())
      each(second, at, std::min<uint64_t>(chunk.size(), n - at), chunk.data());
}

}  // namespace

void save_checkpoint(const std::string& path, const ParameterSet& params, const AdamW& adamw,
                     const CheckpointInfo& info) {
  nlohmann::json j = {{"step", info.step},
                      {"adamw_step", info.adamw_step},
                      {"data_fingerprint", hex(info.data_fingerprint)},
                      {"config", nlohmann::json::parse(info.config_json)}};
  if (const uint64_t frozen = params.frozen_fingerprint(); frozen != 0)
    j["frozen_fingerprint"] = hex(frozen);
  const std::string text = j.dump();
  AtomicFileWriter out(path);
  HashingWriter w(out);
  w.preamble(kMagic, kVersion, text);
  const auto n = static_cast<uint64_t>(params.trainable_numel());
  w.value(n);
  if (all_trainable(params)) {
    w.bytes(params.weights().f32(), n * 4);
  } else {
    // One parameter at a time (from RAM or its state file), the padding between them zeros.
    std::vector<float> values;
    const std::vector<float> zeros(16, 0.0f);
    in_layout(
        params, n,
        [&](int i, uint64_t padding) {
          w.bytes(zeros.data(), padding * 4);
          values.resize(static_cast<size_t>(params.infos()[static_cast<size_t>(i)].shape.numel()));
          params.read_values(i, values.data());
          w.bytes(values.data(), values.size() * 4);
        },
        [&](uint64_t padding) { w.bytes(zeros.data(), padding * 4); });
  }
  in_state_chunks(n, [&](bool second, uint64_t at, uint64_t k, float* chunk) {
    adamw.read_state(second, static_cast<int64_t>(at), static_cast<int64_t>(k), chunk);
    w.bytes(chunk, k * 4);
  });
  w.checksum();
  out.commit();
}

void share_checkpoint_state(const ParameterSet& params, AdamW& adamw, bool saving) {
  params.serve_sharded_masters(saving);
  in_state_chunks(static_cast<uint64_t>(adamw.state_numel()), [&](bool second, uint64_t at,
                                                                  uint64_t k, float* chunk) {
    if (saving)
      adamw.read_state(second, static_cast<int64_t>(at), static_cast<int64_t>(k), chunk);
    else
      adamw.write_state(second, static_cast<int64_t>(at), static_cast<int64_t>(k), chunk);
  });
}

CheckpointInfo read_checkpoint_info(const std::string& path) {
  FileReader r(path, "checkpoint");
  uint64_t n = 0;
  return read_header(r, &n);
}

CheckpointInfo load_checkpoint(const std::string& path, const ParameterSet& params, AdamW* adamw) {
  FileReader r(path, "checkpoint");
  uint64_t n = 0;
  CheckpointInfo info = read_header(r, &n);
  if (n != static_cast<uint64_t>(params.trainable_numel()))
    throw UserError(path + ": holds " + std::to_string(n) + " weights, the model trains " +
                    std::to_string(params.trainable_numel()));
  if (info.frozen_fingerprint != params.frozen_fingerprint())
    throw UserError(path + ": was trained on other frozen weights (fingerprint " +
                    hex(info.frozen_fingerprint) + ", the model's " +
                    hex(params.frozen_fingerprint()) + ")");
  if (all_trainable(params)) {
    r.bytes(params.weights().f32(), n * 4);
  } else {
    // One parameter at a time (into RAM or its state file), the padding passed over.
    std::vector<float> values, skipped(16);
    in_layout(
        params, n,
        [&](int i, uint64_t padding) {
          r.bytes(skipped.data(), padding * 4);
          values.resize(static_cast<size_t>(params.infos()[static_cast<size_t>(i)].shape.numel()));
          r.bytes(values.data(), values.size() * 4);
          params.share_values(i, values.data());
        },
        [&](uint64_t padding) { r.bytes(skipped.data(), padding * 4); });
  }
  if (adamw != nullptr) {
    in_state_chunks(n, [&](bool second, uint64_t at, uint64_t k, float* chunk) {
      r.bytes(chunk, k * 4);
      adamw->write_state(second, static_cast<int64_t>(at), static_cast<int64_t>(k), chunk);
    });
    adamw->set_step_count(info.adamw_step);
  }
  params.sync_bf16_copies();
  return info;
}

std::string checkpoint_dir(const std::string& run_dir) {
  return run_dir + "/checkpoints";
}

std::string checkpoint_path(const std::string& run_dir, int64_t step) {
  char name[32];
  std::snprintf(name, sizeof(name), "/step-%08lld.ckpt", static_cast<long long>(step));
  return checkpoint_dir(run_dir) + name;
}

std::vector<std::pair<int64_t, std::string>> list_checkpoints(const std::string& run_dir) {
  std::vector<std::pair<int64_t, std::string>> found;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(checkpoint_dir(run_dir), ec)) {
    const std::string name = e.path().filename().string();
    if (name.size() != 18 || name.rfind("step-", 0) != 0 || !name.ends_with(".ckpt")) continue;
    char* end = nullptr;
    const long long step = std::strtoll(name.c_str() + 5, &end, 10);
    if (end == name.c_str() + 13) found.emplace_back(step, e.path().string());
  }
  std::sort(found.begin(), found.end());
  return found;
}

}  // namespace cputrain
