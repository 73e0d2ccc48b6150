#include "engine/io/safetensors_file.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "engine/core/error.h"
#include "engine/io/gguf_file.h"

namespace cputrain {
namespace {

namespace fs = std::filesystem;

size_t dtype_bytes(const std::string& dtype) {
  if (dtype == "F32" || dtype == "I32" || dtype == "U32") return 4;
  if (dtype == "F16" || dtype == "BF16" || dtype == "I16" || dtype == "U16") return 2;
  if (dtype == "F64" || dtype == "I64" || dtype == "U64") return 8;
  if (dtype == "I8" || dtype == "U8" || dtype == "BOOL" || dtype == "F8_E4M3" || dtype == "F8_E5M2")
    return 1;
  return 0;
}

}  // namespace

int64_t SafetensorsTensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path), file_(path) {
  const uint8_t* bytes = file_.data();
  const size_t size_ = file_.size();
  const auto bad = [&](const std::string& what) {
    return UserError(path + ": not a valid safetensors file: " + what);
  };
  if (size_ < 8) throw bad("truncated in the header length");
  uint64_t header = 0;
  std::memcpy(&header, bytes, 8);
  if (header > size_ - 8 || header > (uint64_t{100} << 20))
    throw bad("a header of " + std::to_string(header) + " bytes, more than the file holds");
  const size_t data_start = 8 + header;
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(bytes + 8, bytes + data_start);
  } catch (const nlohmann::json::exception& e) {
    throw bad(std::string("the header is not JSON (") + e.what() + ")");
  }
  if (!j.is_object()) throw bad("the header is not a JSON object");
  for (const auto& [name, entry] : j.items()) {
    if (name == "__metadata__") continue;
    SafetensorsTensor t;
    try {
      t.dtype = entry.at("dtype").get<std::string>();
      int64_t numel = 1;
      for (const auto& d : entry.at("shape")) {
        const int64_t dim = d.get<int64_t>();
        if (dim < 0 || dim > (int64_t{1} << 40) || (dim > 0 && numel > (int64_t{1} << 40) / dim))
          throw bad("tensor " + name + " has a dimension of " + std::to_string(dim));
        t.shape.push_back(dim);
        numel *= dim;
      }
      const auto offsets = entry.at("data_offsets").get<std::vector<uint64_t>>();
      if (offsets.size() != 2 || offsets[0] > offsets[1] || offsets[1] > size_ - data_start)
        throw bad("tensor " + name + "'s data runs past the end of the file (truncated)");
      const size_t element = dtype_bytes(t.dtype);
      if (element == 0) throw bad("tensor " + name + " has an unknown dtype " + t.dtype);
      if (offsets[1] - offsets[0] != static_cast<uint64_t>(numel) * element)
        throw bad("tensor " + name + " holds " + std::to_string(offsets[1] - offsets[0]) +
                  " bytes for its shape's " +
                  std::to_string(numel * static_cast<int64_t>(element)));
      t.data = {bytes + data_start + offsets[0], offsets[1] - offsets[0]};
    } catch (const nlohmann::json::exception& e) {
      throw bad("tensor " + name + ": " + e.what());
    }
    tensors_.emplace(name, std::move(t));
  }
}

SafetensorsModel::SafetensorsModel(const std::string& folder) {
  const fs::path dir(folder);
  std::vector<std::string> shards;
  if (fs::exists(dir / "model.safetensors.index.json")) {
    std::ifstream in(dir / "model.safetensors.index.json");
    std::set<std::string> unique;
    try {
      const nlohmann::json j = nlohmann::json::parse(in);
      for (const auto& [name, file] : j.at("weight_map").items())
        unique.insert(file.get<std::string>());
    } catch (const nlohmann::json::exception& e) {
      throw UserError((dir / "model.safetensors.index.json").string() + ": malformed (" + e.what() +
                      ")");
    }
    for (const std::string& file : unique) {
      if (file.find('/') != std::string::npos || !fs::exists(dir / file))
        throw UserError((dir / "model.safetensors.index.json").string() + ": shard " + file +
                        " is missing from " + folder);
      shards.push_back((dir / file).string());
    }
  } else if (fs::exists(dir / "model.safetensors")) {
    shards.push_back((dir / "model.safetensors").string());
  } else {
    throw UserError(folder + ": neither model.safetensors nor model.safetensors.index.json");
  }
  for (const std::string& shard : shards) {
    files_.push_back(std::make_unique<SafetensorsFile>(shard));
    for (const auto& [name, tensor] : files_.back()->tensors()) {
      if (index_.count(name))
        throw UserError(shard + ": tensor " + name + " is also in " + file_of(name));
      index_[name] = {&tensor, files_.size() - 1};
    }
  }
}

void SafetensorsModel::rename_prefix(const std::string& from, const std::string& to) {
  std::map<std::string, std::pair<const SafetensorsTensor*, size_t>> renamed;
  for (auto& [name, where] : index_) {
    const std::string now = name.starts_with(from) ? to + name.substr(from.size()) : name;
    if (!renamed.emplace(now, where).second)
      throw UserError(files_[where.second]->path() + ": tensor " + name + " is also " + now);
  }
  index_.swap(renamed);
}

int64_t SafetensorsModel::leave_out(const std::string& prefix) {
  int64_t n = 0;
  for (auto it = index_.lower_bound(prefix); it != index_.end() && it->first.starts_with(prefix);
       ++n)
    it = index_.erase(it);
  return n;
}

int64_t SafetensorsModel::stack_experts() {
  // (stacked name) -> expert -> its entry.
  std::map<std::string, std::map<int64_t, std::string>> groups;
  for (const auto& [name, where] : index_) {
    const size_t at = name.find(".experts.");
    if (at == std::string::npos) continue;
    const size_t first = at + 9, end = name.find('.', first);
    if (end == std::string::npos || end == first) continue;
    const std::string number = name.substr(first, end - first);
    if (!std::all_of(number.begin(), number.end(),
                     [](char ch) { return ch >= '0' && ch <= '9'; }) ||
        number.size() > 9)
      continue;
    groups[name.substr(0, first) + name.substr(end + 1)][std::stoll(number)] = name;
  }
  for (const auto& [stacked, experts] : groups) {
    const auto& [_, first_name] = *experts.begin();
    const auto [first, file] = index_.at(first_name);
    const auto count = static_cast<int64_t>(experts.size());
    if (experts.begin()->first != 0 || experts.rbegin()->first != count - 1)
      throw UserError(files_[file]->path() + ": the experts of " + stacked +
                      " are not numbered 0 to " + std::to_string(count - 1));
    auto t = std::make_unique<SafetensorsTensor>();
    t->dtype = first->dtype;
    t->shape = first->shape;
    t->shape.insert(t->shape.begin(), count);
    std::vector<uint8_t> bytes;
    bytes.reserve(first->data.size() * static_cast<size_t>(count));
    for (const auto& [e, name] : experts) {
      const SafetensorsTensor* x = index_.at(name).first;
      if (x->dtype != first->dtype || x->shape != first->shape)
        throw UserError(files_[index_.at(name).second]->path() + ": tensor " + name +
                        " differs from " + first_name + " in dtype or shape");
      bytes.insert(bytes.end(), x->data.begin(), x->data.end());
    }
    for (const auto& [e, name] : experts) index_.erase(name);
    stacked_bytes_.push_back(std::move(bytes));
    t->data = std::span<const uint8_t>(stacked_bytes_.back());
    index_[stacked] = {t.get(), file};
    stacked_.push_back(std::move(t));
  }
  return static_cast<int64_t>(groups.size());
}

int64_t SafetensorsModel::split_fused_experts(bool keep) {
  std::vector<std::string> fused, down;
  for (const auto& [name, where] : index_) {
    const std::string bare = name.ends_with(".weight") ? name.substr(0, name.size() - 7) : name;
    if (bare.ends_with(".experts.gate_up_proj")) fused.push_back(name);
    if (bare.ends_with(".experts.down_proj") && bare == name) down.push_back(name);
  }
  for (const std::string& name : down) {
    const auto where = index_.at(name);
    index_.erase(name);
    if (!index_.emplace(name + ".weight", where).second)
      throw UserError(files_[where.second]->path() + ": tensor " + name + " is also " + name +
                      ".weight");
  }
  for (const std::string& name : fused) {
    const auto [t, file] = index_.at(name);
    if (t->shape.size() != 3 || t->shape[1] % 2 != 0 || t->numel() == 0)
      throw UserError(files_[file]->path() + ": tensor " + name +
                      " is not each expert's gate and up rows ([experts, 2 F, C])");
    const std::string base =
        name.substr(0, name.find(".experts.gate_up_proj") + std::string(".experts.").size());
    if (keep) {
      const std::string whole = base + "gate_up_proj.weight";
      if (whole == name) continue;
      index_.erase(name);
      if (!index_.emplace(whole, std::pair{t, file}).second)
        throw UserError(files_[file]->path() + ": tensor " + name + " is also " + whole);
      continue;
    }
    const int64_t E = t->shape[0], F = t->shape[1] / 2;
    const auto row = static_cast<size_t>(t->data.size() / static_cast<size_t>(E * 2 * F));
    for (const int64_t half : {0, 1}) {
      auto part = std::make_unique<SafetensorsTensor>();
      part->dtype = t->dtype;
      part->shape = {E, F, t->shape[2]};
      std::vector<uint8_t> bytes;
      bytes.reserve(row * static_cast<size_t>(E * F));
      for (int64_t e = 0; e < E; ++e) {
        const auto from = t->data.begin() + static_cast<std::ptrdiff_t>(
                                                row * static_cast<size_t>((2 * e + half) * F));
        bytes.insert(bytes.end(), from,
                     from + static_cast<std::ptrdiff_t>(row * static_cast<size_t>(F)));
      }
      stacked_bytes_.push_back(std::move(bytes));
      part->data = std::span<const uint8_t>(stacked_bytes_.back());
      const std::string now = base + (half == 0 ? "gate_proj.weight" : "up_proj.weight");
      if (!index_.emplace(now, std::pair{part.get(), file}).second)
        throw UserError(files_[file]->path() + ": tensor " + name + " is also " + now);
      stacked_.push_back(std::move(part));
    }
    index_.erase(name);
  }
  return static_cast<int64_t>(fused.size());
}

void SafetensorsModel::add_made(const std::string& name, const std::string& dtype,
                                std::vector<int64_t> shape, std::vector<uint8_t> bytes,
                                size_t file) {
  auto t = std::make_unique<SafetensorsTensor>();
  t->dtype = dtype;
  t->shape = std::move(shape);
  stacked_bytes_.push_back(std::move(bytes));
  t->data = std::span<const uint8_t>(stacked_bytes_.back());
  if (!index_.emplace(name, std::pair{t.get(), file}).second)
    throw UserError(files_[file]->path() + ": tensor " + name + " appears twice");
  stacked_.push_back(std::move(t));
}

int64_t SafetensorsModel::split_gpt_oss_experts() {
  std::vector<std::string> layers;
  for (const auto& [name, where] : index_) {
    if (name.ends_with(".experts.gate_up_proj_blocks") ||
        name.ends_with(".experts.down_proj_blocks"))
      throw UserError(files_[where.second]->path() + ": tensor " + name +
                      ", experts as MXFP4 blocks, which cputrain reads from GGUF (llama.cpp's "
                      "convert_hf_to_gguf.py writes them so, and cputrain holds them in place)");
    if (name.ends_with(".experts.gate_up_proj"))
      layers.push_back(name.substr(0, name.size() - std::string("gate_up_proj").size()));
  }
  // Rows of `rows` elements (`bytes` each) of matrix `m` of `mat` matrices, transposed, taking
  // every `step`-th column from `first`: [mat, cols / step, rows].
  const auto transposed = [](const SafetensorsTensor& t, int64_t mat, int64_t rows, int64_t cols,
                             int64_t first, int64_t step) {
    const size_t bytes = dtype_bytes(t.dtype);
    const int64_t out_rows = cols / step;
    std::vector<uint8_t> out(static_cast<size_t>(mat * out_rows * rows) * bytes);
    for (int64_t m = 0; m < mat; ++m)
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < out_rows; ++c)
          std::memcpy(
              out.data() + static_cast<size_t>((m * out_rows + c) * rows + r) * bytes,
              t.data.data() + static_cast<size_t>((m * rows + r) * cols + first + c * step) * bytes,
              bytes);
    return out;
  };
  for (const std::string& base : layers) {
    const auto need = [&](const std::string& rest) {
      const auto it = index_.find(base + rest);
      if (it == index_.end())
        throw UserError(files_[index_.at(base + "gate_up_proj").second]->path() + ": tensor " +
                        base + "gate_up_proj without " + base + rest);
      return it->second;
    };
    const auto [gu, file] = need("gate_up_proj");
    const auto [gub, bias_file] = need("gate_up_proj_bias");
    const auto [down, down_file] = need("down_proj");
    const auto [db, db_file] = need("down_proj_bias");
    const std::string path = files_[file]->path();
    if (gu->shape.size() != 3 || gu->shape[2] % 2 != 0 || dtype_bytes(gu->dtype) == 0)
      throw UserError(path + ": tensor " + base + "gate_up_proj is not [experts, C, 2 F]");
    const int64_t E = gu->shape[0], C = gu->shape[1], F = gu->shape[2] / 2;
    const auto check = [&](const SafetensorsTensor* t, const std::string& rest,
                           std::vector<int64_t> shape) {
      if (t->shape != shape || t->dtype != gu->dtype)
        throw UserError(path + ": tensor " + base + rest + " is not [" + std::to_string(shape[0]) +
                        ", " + std::to_string(shape[1]) +
                        (shape.size() == 3 ? ", " + std::to_string(shape[2]) : "") + "] of " +
                        gu->dtype + " beside " + base + "gate_up_proj");
    };
    check(gub, "gate_up_proj_bias", {E, 2 * F});
    check(down, "down_proj", {E, F, C});
    check(db, "down_proj_bias", {E, C});
    for (const int64_t half : {0, 1}) {
      const std::string part = half == 0 ? "gate_proj" : "up_proj";
      add_made(base + part + ".weight", gu->dtype, {E, F, C}, transposed(*gu, E, C, 2 * F, half, 2),
               file);
      // The bias: every other element, a transpose of rows of one.
      add_made(base + part + ".bias", gu->dtype, {E, F}, transposed(*gub, E, 1, 2 * F, half, 2),
               bias_file);
    }
    add_made(base + "down_proj.weight", down->dtype, {E, C, F}, transposed(*down, E, F, C, 0, 1),
             down_file);
    add_made(base + "down_proj.bias", db->dtype, {E, C},
             std::vector<uint8_t>(db->data.begin(), db->data.end()), db_file);
    for (const char* rest : {"gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"})
      index_.erase(base + rest);
  }
  return static_cast<int64_t>(layers.size());
}

const SafetensorsTensor* SafetensorsModel::find(const std::string& name) const {
  const auto it = index_.find(name);
  return it == index_.end() ? nullptr : it->second.first;
}

const std::string& SafetensorsModel::file_of(const std::string& name) const {
  return files_[index_.at(name).second]->path();
}

std::vector<std::string> SafetensorsModel::names() const {
  std::vector<std::string> out;
  for (const auto& [name, _] : index_) out.push_back(name);
  return out;
}

std::vector<float> safetensors_values(const std::string& file, const std::string& name,
                                      const SafetensorsTensor& t) {
  std::vector<float> values(static_cast<size_t>(t.numel()));
  if (t.dtype == "F32")
    ggml_to_float(GgmlType::F32, t.data.data(), values.data(), t.numel());
  else if (t.dtype == "F16")
    ggml_to_float(GgmlType::F16, t.data.data(), values.data(), t.numel());
  else if (t.dtype == "BF16")
    ggml_to_float(GgmlType::BF16, t.data.data(), values.data(), t.numel());
  else
    throw UserError(file + ": tensor " + name + " is " + t.dtype +
                    ", a dtype cputrain does not read (F32, F16, BF16)");
  return values;
}

}  // namespace cputrain
