#include "models/gguf_model.h"

#include <algorithm>
#include <set>
#include <stdexcept>

#include "engine/core/error.h"
#include "engine/train/parameters.h"
#include "models/file_hyperparameters.h"
#include "models/llama.h"
#include "models/lora.h"
#include "models/tensor_names.h"

namespace cputrain {
namespace {

// Our parameter name's parts, and llama.cpp's.

}  // namespace

std::string gguf_supported_architectures() {
  return "llama, qwen2";
}

LlamaConfig gguf_model_config(const GgufFile& file, int64_t max_ctx) {
  const std::string arch = file.string("general.architecture");
  if (arch != "llama" && arch != "qwen2")
    throw UserError(file.path() + ": architecture " + arch +
                    ", which cputrain does not compute (it computes " +
                    gguf_supported_architectures() + ")");
  const std::string& p = arch;
  const auto given = [&](const std::string& key) {
    return FileHyperparameter{
        key, file.find(key) ? std::optional<int64_t>(file.integer(key)) : std::nullopt};
  };
  FileHyperparameters hp;
  hp.where = file.path();
  hp.naming = TensorNaming::Gguf;
  hp.vocab = given(p + ".vocab_size");
  hp.d_model = given(p + ".embedding_length");
  hp.n_layers = given(p + ".block_count");
  hp.n_heads = given(p + ".attention.head_count");
  hp.n_kv_heads = given(p + ".attention.head_count_kv");
  hp.head_dim = given(p + ".attention.key_length");
  hp.ffn = given(p + ".feed_forward_length");
  hp.ctx = given(p + ".context_length");
  hp.rope_dim = given(p + ".rope.dimension_count");
  for (const FileHyperparameter* required :
       {&hp.d_model, &hp.n_layers, &hp.n_heads, &hp.ffn, &hp.ctx})
    if (!required->value) throw UserError(file.path() + ": no metadata " + required->key);
  const std::string scaling = file.string(p + ".rope.scaling.type", "none");
  if (scaling != "none" || file.tensor("rope_freqs.weight"))
    throw UserError(file.path() + ": RoPE scaling (" +
                    (scaling != "none" ? scaling : std::string("rope_freqs.weight")) +
                    "), which cputrain does not compute");
  LlamaConfig c;
  c.norm_eps = static_cast<float>(file.number(p + ".attention.layer_norm_rms_epsilon", 1e-5));
  c.rope_theta = file.number(p + ".rope.freq_base", 10000.0);
  c.rope_pairs = arch == "qwen2" ? RopePairs::HalfSplit : RopePairs::Adjacent;
  c.tie_embeddings = file.tensor("output.weight") == nullptr;
  c.qkv_bias = file.tensor("blk.0.attn_q.bias") != nullptr;
  std::vector<std::string> names;
  names.reserve(file.tensors().size());
  for (const GgufTensor& t : file.tensors()) names.push_back(t.name);
  check_file_hyperparameters(
      hp, names,
      [&](const std::string& name) -> std::optional<std::vector<int64_t>> {
        const GgufTensor* t = file.tensor(name);
        if (!t) return std::nullopt;
        return std::vector<int64_t>(t->dims.rbegin(), t->dims.rend());
      },
      c);
  c.head_dim = c.head_size();
  if (file.integer(p + ".attention.value_length", c.head_dim) != c.head_dim)
    throw UserError(file.path() + ": " + p +
                    ".attention.value_length differs from key_length, "
                    "which cputrain does not compute");
  c.ctx = std::min(c.ctx, max_ctx);
  if (const auto problem = validate(c))
    throw UserError(file.path() +
                    ": the model's hyperparameters do not fit together: " + problem->str());
  return c;
}

std::string gguf_tensor_name(const std::string& parameter) {
  return tensor_name(parameter, TensorNaming::Gguf);
}

namespace {

// The file's tensor of parameter `info` (of LlamaModel), of its shape and of a type cputrain
// converts; a UserError naming the file and tensor otherwise.
const GgufTensor& gguf_tensor_of(const GgufFile& file, const ParameterInfo& info) {
  const std::string name = gguf_tensor_name(info.name);
  const GgufTensor* t = file.tensor(name);
  if (!t) throw UserError(file.path() + ": no tensor " + name + " (the model's " + info.name + ")");
  std::vector<int64_t> expected;
  for (int d = info.shape.ndim() - 1; d >= 0; --d) expected.push_back(info.shape[d]);
  if (t->dims != expected)
    throw UserError(file.path() + ": tensor " + name + " has shape " + shape_text(t->dims) +
                    " where the model's hyperparameters give " + shape_text(expected));
  check_tensor_type(file, *t);
  return *t;
}

// Every tensor of the file is one of `used`'s (a tied model's may hold the head as well, a copy
// of the embedding); a UserError naming the first that is not.
void check_no_other_tensors(const GgufFile& file, const std::set<std::string>& used) {
  for (const GgufTensor& t : file.tensors()) {
    if (used.count(t.name) || t.name == "output.weight") continue;
    throw UserError(file.path() + ": tensor " + t.name + " has no place in the " +
                    file.string("general.architecture") + " model cputrain computes");
  }
}

}  // namespace

void check_gguf_weights(const GgufFile& file, const LlamaConfig& config) {
  ParameterSet declared;
  LlamaModel::declare_parameters(config, declared);
  std::set<std::string> used;
  for (const ParameterInfo& info : declared.infos()) used.insert(gguf_tensor_of(file, info).name);
  check_no_other_tensors(file, used);
}

void load_gguf_weights(const GgufFile& file, const ParameterSet& params) {
  std::set<std::string> used;
  for (size_t i = 0; i < params.infos().size(); ++i) {
    const ParameterInfo& info = params.infos()[i];
    if (is_lora_parameter(info.name)) continue;  // adapters are not the file's
    const GgufTensor* t = &gguf_tensor_of(file, info);
    const std::string& name = t->name;
    // A BF16 tensor into a parameter held as bf16 alone is read in place or copied as it is.
    if (params.mapped(static_cast<int>(i))) {
      if (t->type != static_cast<uint32_t>(GgmlType::BF16))
        throw std::logic_error("load_gguf_weights: " + name + " mapped but not BF16");
    } else if (t->type == static_cast<uint32_t>(GgmlType::BF16) &&
               params.bf16_only(static_cast<int>(i))) {
      params.write_bf16_values(static_cast<int>(i), t->data.data());
    } else {
      const std::vector<float> values = gguf_tensor_values(file, *t);
      params.write_values(static_cast<int>(i), values.data());
    }
    used.insert(name);
  }
  check_no_other_tensors(file, used);
}

const void* gguf_bf16_in_place(const GgufFile& file, const ParameterInfo& parameter) {
  const GgufTensor* t = file.tensor(gguf_tensor_name(parameter.name));
  if (!t || t->type != static_cast<uint32_t>(GgmlType::BF16)) return nullptr;
  std::vector<int64_t> dims;
  for (int d = parameter.shape.ndim() - 1; d >= 0; --d) dims.push_back(parameter.shape[d]);
  if (t->dims != dims || t->data.size() != static_cast<size_t>(t->numel()) * 2) return nullptr;
  return t->data.data();
}

namespace {

// llama.cpp's general.file_type for the matrices' type.
uint32_t file_type(GgmlType type) {
  switch (type) {
    case GgmlType::F16:
      return 1;
    case GgmlType::Q8_0:
      return 7;
    case GgmlType::BF16:
      return 32;
    default:
      return 0;
  }
}

}  // namespace

namespace {

// The architecture write_gguf writes a model of `c` as.
bool as_qwen2(const LlamaConfig& c) {
  return c.qkv_bias && c.rope_pairs == RopePairs::HalfSplit;
}

}  // namespace

void write_lora_gguf(const std::string& path, const LlamaConfig& c, const ParameterSet& params,
                     double alpha, const std::string& name) {
  const bool qwen2 = as_qwen2(c);
  GgufWriter w;
  w.set_string("general.architecture", qwen2 ? "qwen2" : "llama");
  w.set_string("general.type", "adapter");
  w.set_string("general.name", name);
  w.set_string("adapter.type", "lora");
  w.set_f32("adapter.lora.alpha", static_cast<float>(alpha));
  w.set_string("cputrain.base_fingerprint", fingerprint_text(base_fingerprint(c, params)));
  bool any = false;
  for (size_t i = 0; i < params.infos().size(); ++i) {
    const ParameterInfo& info = params.infos()[i];
    if (!is_lora_parameter(info.name)) continue;
    const std::vector<float> values = parameter_values(
        params, static_cast<int>(i), c, qwen2 ? RopePairs::HalfSplit : RopePairs::Adjacent);
    w.add_tensor(gguf_tensor_name(info.name), {info.shape[1], info.shape[0]}, GgmlType::F32,
                 ggml_from_float(GgmlType::F32, values.data(), info.shape.numel()));
    any = true;
  }
  if (!any) throw std::logic_error("write_lora_gguf: a model without adapters");
  w.write(path);
}

LoraConfig lora_gguf_config(const GgufFile& file) {
  if (file.string("general.type", "") != "adapter" || file.string("adapter.type", "") != "lora")
    throw UserError(file.path() + ": not a LoRA adapter (general.type " +
                    file.string("general.type", "model") + ")");
  LoraConfig lora;
  lora.alpha = file.number("adapter.lora.alpha", 0.0);
  const char* gguf_names[kProjectionCount] = {"attn_q",   "attn_k", "attn_v",  "attn_output",
                                              "ffn_gate", "ffn_up", "ffn_down"};
  for (const GgufTensor& t : file.tensors()) {
    if (!t.name.ends_with(".weight.lora_a") && !t.name.ends_with(".weight.lora_b"))
      throw UserError(file.path() + ": tensor " + t.name + " is not a LoRA adapter's");
    bool known = false;
    for (int j = 0; j < kProjectionCount; ++j) {
      if (t.name.find(std::string(".") + gguf_names[j] + ".weight.lora_") == std::string::npos)
        continue;
      lora.targets[static_cast<size_t>(j)] = true;
      known = true;
    }
    if (!known)
      throw UserError(file.path() + ": tensor " + t.name +
                      " adapts a projection cputrain does not compute");
    if (t.name.ends_with(".lora_a") && t.dims.size() == 2) {
      if (lora.rank != 0 && lora.rank != t.dims[1])
        throw UserError(file.path() + ": adapters of more than one rank");
      lora.rank = t.dims[1];
    }
  }
  if (lora.rank <= 0) throw UserError(file.path() + ": no adapter tensors");
  if (!(lora.alpha > 0.0)) lora.alpha = static_cast<double>(lora.rank);  // llama.cpp's default
  return lora;
}

void load_lora_gguf(const GgufFile& file, const LlamaConfig& c, const ParameterSet& params) {
  const bool qwen2 = as_qwen2(c);
  const std::string arch = file.string("general.architecture", "");
  if (arch != (qwen2 ? "qwen2" : "llama"))
    throw UserError(file.path() + ": an adapter for a " + arch + " model, not this " +
                    (qwen2 ? "qwen2" : "llama") + " one");
  // Shapes first, then the base's fingerprint, then the values.
  std::vector<std::pair<size_t, const GgufTensor*>> adapters;
  for (size_t i = 0; i < params.infos().size(); ++i) {
    const ParameterInfo& info = params.infos()[i];
    if (!is_lora_parameter(info.name)) continue;
    const std::string name = gguf_tensor_name(info.name);
    const GgufTensor* t = file.tensor(name);
    if (!t) throw UserError(file.path() + ": no tensor " + name);
    const std::vector<int64_t> expected = {info.shape[1], info.shape[0]};
    if (t->dims != expected)
      throw UserError(file.path() + ": tensor " + name + " has shape " + shape_text(t->dims) +
                      " where this model takes " + shape_text(expected));
    adapters.emplace_back(i, t);
  }
  if (adapters.size() != file.tensors().size())
    throw UserError(file.path() + ": " + std::to_string(file.tensors().size()) +
                    " tensors, of which this model takes " + std::to_string(adapters.size()));
  const std::string want = fingerprint_text(base_fingerprint(c, params));
  const std::string got = file.string("cputrain.base_fingerprint", want);
  if (got != want)
    throw UserError(file.path() + ": an adapter trained on another base model (fingerprint " + got +
                    ", this model's " + want + ")");
  for (const auto& [i, t] : adapters) {
    std::vector<float> values = gguf_tensor_values(file, *t);
    reorder_qk_rows(values, params.infos()[i], c,
                    qwen2 ? RopePairs::HalfSplit : RopePairs::Adjacent, c.rope_pairs);
    params.write_values(static_cast<int>(i), values.data());
  }
}

GgmlType write_gguf(const std::string& path, const LlamaConfig& c, const ParameterSet& params,
                    const Vocabulary& v, const GgufExport& options) {
  const bool qwen2 = as_qwen2(c);
  const std::string arch = qwen2 ? "qwen2" : "llama";
  GgmlType matrices = options.type;
  if (matrices == GgmlType::Q8_0) {
    for (const ParameterInfo& info : params.infos())
      if (info.shape.ndim() == 2 && info.shape[1] % 32 != 0) matrices = GgmlType::F16;
  }
  GgufWriter w;
  w.set_string("general.architecture", arch);
  w.set_string("general.name", options.name);
  w.set_u32("general.file_type", file_type(matrices));
  w.set_u32(arch + ".context_length", static_cast<uint32_t>(c.ctx));
  w.set_u32(arch + ".embedding_length", static_cast<uint32_t>(c.d_model));
  w.set_u32(arch + ".block_count", static_cast<uint32_t>(c.n_layers));
  w.set_u32(arch + ".feed_forward_length", static_cast<uint32_t>(c.ffn));
  w.set_u32(arch + ".attention.head_count", static_cast<uint32_t>(c.n_heads));
  w.set_u32(arch + ".attention.head_count_kv", static_cast<uint32_t>(c.kv_heads()));
  w.set_u32(arch + ".attention.key_length", static_cast<uint32_t>(c.head_size()));
  w.set_u32(arch + ".attention.value_length", static_cast<uint32_t>(c.head_size()));
  w.set_f32(arch + ".attention.layer_norm_rms_epsilon", c.norm_eps);
  w.set_f32(arch + ".rope.freq_base", static_cast<float>(c.rope_theta));
  w.set_u32(arch + ".rope.dimension_count", static_cast<uint32_t>(c.head_size()));
  w.set_u32(arch + ".vocab_size", static_cast<uint32_t>(c.vocab));
  set_gguf_vocabulary(w, v);
  for (size_t i = 0; i < params.infos().size(); ++i) {
    const ParameterInfo& info = params.infos()[i];
    if (is_lora_parameter(info.name))
      throw std::logic_error("write_gguf: a model with adapters (merge them first)");
    const std::string name = gguf_tensor_name(info.name);
    // llama.cpp's llama rotates adjacent pairs; qwen2 keeps Hugging Face's half-split rows.
    const std::vector<float> values = parameter_values(
        params, static_cast<int>(i), c, qwen2 ? RopePairs::HalfSplit : RopePairs::Adjacent);
    std::vector<int64_t> dims;
    for (int d = info.shape.ndim() - 1; d >= 0; --d) dims.push_back(info.shape[d]);
    const GgmlType type = info.shape.ndim() == 2 ? matrices : GgmlType::F32;
    w.add_tensor(name, dims, type, ggml_from_float(type, values.data(), info.shape.numel()));
  }
  w.write(path);
  return matrices;
}

}  // namespace cputrain
