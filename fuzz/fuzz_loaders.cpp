// libFuzzer target for every loader of a file a user may hand cputrain: training checkpoints,
// weights files, tokenizer models, run configurations, GGUF model files (read, their
// configuration and vocabulary taken, text encoded and decoded, small models' weights loaded) and
// safetensors files, and Hugging Face configurations (config.json beside a tiny model's
// safetensors: its configuration taken, its weights checked and, for small models, loaded), and a
// DPO run's reference.bin (its log-probability sums, read at the counts its header gives). The
// first input byte picks the loader (and, for the checksummed formats, whether to make the trailing
// checksum valid so the parser behind it is reached); the rest is the file. Any outcome but a
// UserError or success is a finding: a crash, a sanitizer report, another exception, or a hang.
//
// CPUTRAIN_FUZZ_SEEDS=DIR fuzz_loaders writes valid files of each kind to DIR, and damaged model
// files (a GGUF file and a config.json with each count set to 0, 1, 2^31, 2^63 - 1 and -1), and
// exits.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "engine/core/error.h"
#include "engine/core/hash.h"
#include "engine/io/gguf_file.h"
#include "engine/io/safetensors_file.h"
#include "engine/text/tokenizer.h"
#include "engine/text/vocab_tokenizer.h"
#include "engine/train/adamw.h"
#include "engine/train/checkpoint_file.h"
#include "engine/train/weights_file.h"
#include "models/decoder.h"
#include "models/gguf_model.h"
#include "models/hf_config.h"
#include "models/hf_writer.h"
#include "tools/preference_rows.h"
#include "tools/run/run_config.h"

namespace {

using namespace cputrain;

enum Kind : uint8_t {
  kCheckpoint,
  kWeights,
  kTokenizer,
  kConfig,
  kGguf,
  kSafetensors,
  kHfConfig,
  kReference,
  kKinds
};

void make_params(ParameterSet& p) {
  p.add("w", Shape{4, 3}, true, true);
  p.add("g", Shape{3}, false);
  p.allocate();
}

const std::string& scratch_path() {
  static const std::string path =
      std::filesystem::temp_directory_path() / ("cputrain_fuzz_" + std::to_string(::getpid()));
  return path;
}

// The tiny model of the GGUF and Hugging Face seeds: 1 block of width 32, 2 heads, 1 key/value
// head, MLP 64, 300 tokens.
ModelConfig tiny_config() {
  ModelConfig tiny;
  tiny.vocab = 300;
  tiny.d_model = 32;
  tiny.n_layers = 1;
  tiny.n_heads = 2;
  tiny.n_kv_heads = 1;
  tiny.ffn = 64;
  tiny.ctx = 16;
  return tiny;
}

// A Hugging Face folder of the tiny model (config.json, model.safetensors, tokenizer files),
// made once: a kHfConfig input replaces its config.json.
const std::string& hf_folder() {
  static const std::string folder = [] {
    const std::string dir = scratch_path() + "_hf";
    std::atexit([] { std::filesystem::remove_all(scratch_path() + "_hf"); });
    DecoderModel model(tiny_config());
    model.init_weights(1);
    Vocabulary v;
    for (int i = 0; i < 300; ++i) v.tokens.push_back("t" + std::to_string(i));
    write_hf_folder(dir, tiny_config(), model.parameters(),
                    Tokenizer::from_vocabulary(std::move(v)), "F32");
    return dir;
  }();
  return folder;
}

// The counts a damaged model file holds.
constexpr int64_t kDamagedCounts[] = {0, 1, int64_t{1} << 31, std::numeric_limits<int64_t>::max(),
                                      -1};

// The GGUF file at `from` with metadata `key` set to `value` (added where absent): u32 where it
// fits, u64 above, i64 below 0.
void write_damaged_gguf(const std::string& from, const std::string& to, const std::string& key,
                        int64_t value) {
  GgufValue count;
  count.type = value < 0 ? GgufType::I64 : value <= 0xffffffffLL ? GgufType::U32 : GgufType::U64;
  count.number = static_cast<double>(value);
  count.bits = static_cast<uint64_t>(value);
  const GgufFile file(from);
  GgufWriter w;
  for (const auto& [k, v] : file.metadata()) w.set_value(k, k == key ? count : v);
  if (!file.find(key)) w.set_value(key, count);
  for (const GgufTensor& t : file.tensors())
    w.add_tensor(t.name, t.dims, static_cast<GgmlType>(t.type),
                 std::vector<uint8_t>(t.data.begin(), t.data.end()));
  w.write(to);
}

void write_seeds(const std::string& dir) {
  std::filesystem::create_directories(dir);
  auto seed = [&](Kind kind, bool fix, const std::string& file) {
    std::ifstream in(file, std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::ofstream out(dir + "/" + std::to_string(kind) + (fix ? "f" : ""), std::ios::binary);
    out.put(static_cast<char>(kind + (fix ? kKinds : 0)));
    out << bytes;
  };
  ParameterSet params;
  make_params(params);
  for (int64_t i = 0; i < params.numel(); ++i)
    params.weights().f32()[i] = 0.1f * static_cast<float>(i);
  AdamW adamw(params, AdamWConfig{});
  RunConfig config;
  config.preset = "tiny";
  config.corpus = "corpus.txt";
  const std::string json = run_config_to_json(config);
  const std::string base = scratch_path();
  save_checkpoint(base + ".ckpt", params, adamw, CheckpointInfo{3, 3, 0x1234, json});
  save_weights(base + ".bin", params, json);
  std::vector<std::string> docs;
  for (int i = 0; i < 200; ++i)
    docs.push_back("The quick brown fox " + std::to_string(i) + " jumps over the lazy dog.");
  Tokenizer::train(docs, 300, base + ".model");
  std::ofstream(base + ".json") << json;
  for (bool fix : {false, true}) {
    seed(kCheckpoint, fix, base + ".ckpt");
    seed(kWeights, fix, base + ".bin");
  }
  seed(kTokenizer, false, base + ".model");
  seed(kConfig, false, base + ".json");
  // A GGUF model of the tiny shape, with cputrain's tokenizer as its vocabulary.
  const ModelConfig tiny = tiny_config();
  DecoderModel model(tiny);
  model.init_weights(1);
  write_gguf(base + ".gguf", tiny, model.parameters(),
             Tokenizer::load(base + ".model").to_vocabulary(), GgufExport{GgmlType::Q8_0, "fuzz"});
  seed(kGguf, false, base + ".gguf");
  // Damaged model files: each count of the GGUF file and of config.json at each damaged value.
  const char* gguf_keys[] = {"llama.block_count",
                             "llama.embedding_length",
                             "llama.feed_forward_length",
                             "llama.attention.head_count",
                             "llama.attention.head_count_kv",
                             "llama.attention.key_length",
                             "llama.attention.value_length",
                             "llama.context_length",
                             "llama.rope.dimension_count",
                             "llama.vocab_size"};
  const char* hf_keys[] = {
      "vocab_size",          "hidden_size",       "num_hidden_layers",       "num_attention_heads",
      "num_key_value_heads", "intermediate_size", "max_position_embeddings", "head_dim",
      "sliding_window"};
  std::ifstream config_in(hf_folder() + "/config.json");
  const nlohmann::json hf_config = nlohmann::json::parse(config_in);
  std::ofstream(base + ".hf.json") << hf_config.dump(2);
  seed(kHfConfig, false, base + ".hf.json");
  int damaged = 0;
  const auto damaged_seed = [&](Kind kind, const std::string& file) {
    std::ifstream in(file, std::ios::binary);
    std::ofstream out(dir + "/damaged" + std::to_string(damaged++), std::ios::binary);
    out.put(static_cast<char>(kind));
    out << in.rdbuf();
  };
  for (const int64_t value : kDamagedCounts) {
    for (const char* key : gguf_keys) {
      write_damaged_gguf(base + ".gguf", base + ".damaged.gguf", key, value);
      damaged_seed(kGguf, base + ".damaged.gguf");
    }
    for (const char* key : hf_keys) {
      nlohmann::json j = hf_config;
      j[key] = value;
      if (std::string(key) == "sliding_window") j["use_sliding_window"] = true;
      std::ofstream(base + ".hf.json", std::ios::trunc) << j.dump(2);
      damaged_seed(kHfConfig, base + ".hf.json");
    }
  }
  {  // a safetensors file of two tensors
    const std::string header =
        R"({"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}, )"
        R"("b": {"dtype": "BF16", "shape": [4], "data_offsets": [16, 24]}})";
    const uint64_t n = header.size();
    std::ofstream out(base + ".safetensors", std::ios::binary);
    out.write(reinterpret_cast<const char*>(&n), 8);
    out << header << std::string(24, '\x3f');
  }
  seed(kSafetensors, false, base + ".safetensors");
  std::ofstream(base + ".ref", std::ios::binary)
      << reference_bytes(0x1234, ReferenceLogProbs{{-3.5, -7.25, -1.0}, {-2.0}});
  for (bool fix : {false, true}) seed(kReference, fix, base + ".ref");
  for (const char* ext : {".ckpt", ".bin", ".model", ".json", ".gguf", ".safetensors",
                          ".damaged.gguf", ".hf.json", ".ref"})
    std::remove((base + ext).c_str());
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  if (const char* dir = std::getenv("CPUTRAIN_FUZZ_SEEDS")) {
    write_seeds(dir);
    std::exit(0);
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const int kind = data[0] % kKinds;
  const bool fix_checksum = (data[0] / kKinds) % 2 == 1;
  std::string file(reinterpret_cast<const char*>(data + 1), size - 1);
  if (fix_checksum && file.size() >= 8) {
    const uint64_t h = fnv1a(file.data(), file.size() - 8);
    std::memcpy(file.data() + file.size() - 8, &h, 8);
  }
  const std::string& path = scratch_path();
  std::ofstream(path, std::ios::binary | std::ios::trunc)
      .write(file.data(), static_cast<std::streamsize>(file.size()));
  try {
    switch (kind) {
      case kCheckpoint: {
        ParameterSet params;
        make_params(params);
        AdamW adamw(params, AdamWConfig{});
        load_checkpoint(path, params, &adamw);
        break;
      }
      case kWeights: {
        ParameterSet params;
        make_params(params);
        load_weights(path, params);
        read_weights_config(path);
        break;
      }
      case kTokenizer: {
        const Tokenizer t = Tokenizer::load(path);
        t.decode(t.encode("fuzz \xff\xfe text"));
        break;
      }
      case kConfig:
        read_run_config(path);
        break;
      case kSafetensors: {
        const SafetensorsFile file(path);
        for (const auto& [name, tensor] : file.tensors())
          if (tensor.dtype == "F32" || tensor.dtype == "F16" || tensor.dtype == "BF16")
            safetensors_values(path, name, tensor);
        break;
      }
      case kGguf: {
        const GgufFile file(path);
        const Tokenizer t = Tokenizer::from_vocabulary(gguf_vocabulary(file));
        t.decode(t.encode("fuzz \xff\xfe text"));
        const ModelConfig config = gguf_model_config(file, 64);
        check_gguf_weights(file, config);
        if (parameter_count(config) < 1'000'000 && config.n_layers <= 4) {
          DecoderModel model(config);
          load_gguf_weights(file, model.parameters(), config);
        }
        break;
      }
      case kHfConfig: {
        const std::string& folder = hf_folder();
        std::ofstream(folder + "/config.json", std::ios::binary | std::ios::trunc)
            .write(file.data(), static_cast<std::streamsize>(file.size()));
        const SafetensorsModel weights(folder);
        const ModelConfig config = hf_model_config(folder, weights, 64);
        check_hf_weights(weights, config);
        if (parameter_count(config) < 1'000'000 && config.n_layers <= 4) {
          DecoderModel model(config);
          load_hf_weights(weights, model.parameters(), config);
        }
        break;
      }
      case kReference: {
        // At the fingerprint and counts its header gives, so that the sums are reached.
        uint64_t fields[3] = {};
        if (file.size() >= 32) std::memcpy(fields, file.data() + 8, sizeof fields);
        std::string why;
        parse_reference(file, fields[0], static_cast<size_t>(fields[1]),
                        static_cast<size_t>(fields[2]), &why);
        break;
      }
    }
  } catch (const UserError&) {
    // the expected refusal
  }
  return 0;
}
