// safetensors, Hugging Face's weights file: an 8-byte header length, a JSON header naming each
// tensor's dtype, shape and byte range, then the data, mapped read-only. A model may be sharded
// over several files, listed by model.safetensors.index.json. Every length, offset and shape is
// checked against the file, so a truncated or corrupt one is a UserError naming it.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "engine/io/mapped_file.h"

namespace cputrain {

struct SafetensorsTensor {
  std::string dtype;           // "F32", "F16", "BF16", ...
  std::vector<int64_t> shape;  // row-major, the last dimension varies fastest
  std::span<const uint8_t> data;
  int64_t numel() const;
};

class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);

  const std::string& path() const { return path_; }
  const std::map<std::string, SafetensorsTensor>& tensors() const { return tensors_; }

 private:
  std::string path_;
  MappedFile file_;
  std::map<std::string, SafetensorsTensor> tensors_;
};

// The tensors of a Hugging Face folder: model.safetensors, or the shards
// model.safetensors.index.json lists. A UserError naming the folder where there is neither, a
// shard is missing, or a tensor appears twice.
class SafetensorsModel {
 public:
  explicit SafetensorsModel(const std::string& folder);
  // nullptr where absent.
  const SafetensorsTensor* find(const std::string& name) const;
  // The file that holds `name` (for messages).
  const std::string& file_of(const std::string& name) const;
  std::vector<std::string> names() const;
  // Every tensor named `from`... is found as `to`... instead ("model.language_model." ->
  // "model.": the text model of an image-and-text folder under the names of a text one). A
  // UserError naming the file where a new name is taken.
  void rename_prefix(const std::string& from, const std::string& to);
  // Every tensor named `prefix`... taken out of the index (a part of the folder the model leaves
  // out); returns how many.
  int64_t leave_out(const std::string& prefix);
  // Every group of tensors "<base>.experts.<e>.<rest>" (a mixture's experts one by one, e from 0
  // to the group's count less 1, each of one dtype and shape) found instead as one tensor
  // "<base>.experts.<rest>" of shape [count, ...], its experts' bytes copied together in order. A
  // UserError naming the file where a group's experts are not 0 .. count - 1 alike; returns the
  // groups.
  int64_t stack_experts();
  // Transformers 5's fused experts: "<base>.experts.gate_up_proj" ([count, 2 F, C]: each expert's
  // gate rows, then its up rows) found instead as "<base>.experts.gate_proj.weight" and
  // "<base>.experts.up_proj.weight" ([count, F, C] each, copied), and "<base>.experts.down_proj"
  // as "<base>.experts.down_proj.weight" (either name with ".weight" or without). A UserError
  // naming the file where a fused tensor is not of that shape; returns the tensors split. `keep`:
  // the fused tensor is found as "<base>.experts.gate_up_proj.weight", whole (in place).
  int64_t split_fused_experts(bool keep = false);
  // gpt-oss's experts: "<base>.experts.gate_up_proj" ([count, C, 2 F], the layer's input times
  // it; each expert's gate and up columns alternating) found instead as
  // "<base>.experts.gate_proj.weight" and "up_proj.weight" ([count, F, C] each), its
  // "gate_up_proj_bias" ([count, 2 F]) as "gate_proj.bias" and "up_proj.bias", "down_proj"
  // ([count, F, C]) as "down_proj.weight" ([count, C, F]) and "down_proj_bias" as
  // "down_proj.bias": copies, transposed. A UserError naming the file where one is not of that
  // shape, or the experts are MXFP4 blocks (gpt-oss's published folders; llama.cpp's converter
  // writes them as MXFP4 in GGUF, which cputrain reads in place); returns the layers split.
  int64_t split_gpt_oss_experts();

 private:
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  // The stacked tensors and their bytes (stack_experts).
  std::vector<std::unique_ptr<SafetensorsTensor>> stacked_;
  std::vector<std::vector<uint8_t>> stacked_bytes_;
  // Takes `bytes` as tensor `name` of `shape` and `dtype` (held here), in `file`'s place.
  void add_made(const std::string& name, const std::string& dtype, std::vector<int64_t> shape,
                std::vector<uint8_t> bytes, size_t file);
  std::map<std::string, std::pair<const SafetensorsTensor*, size_t>> index_;
};

// The FP32 values of an F32, F16 or BF16 tensor; a UserError naming the file and tensor for any
// other dtype.
std::vector<float> safetensors_values(const std::string& file, const std::string& name,
                                      const SafetensorsTensor& tensor);

}  // namespace cputrain
