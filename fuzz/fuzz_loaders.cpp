// libFuzzer target for every loader of a file a user may hand cputrain: training checkpoints,
// weights files, tokenizer models, run configurations, GGUF model files (read, their
// configuration and vocabulary taken, text encoded and decoded, small models' weights loaded) and
// safetensors files. The
// first input byte picks the loader (and, for the checksummed formats, whether to make the trailing
// checksum valid so the parser behind it is reached); the rest is the file. Any outcome but a
// UserError or success is a finding: a crash, a sanitizer report, another exception, or a hang.
//
// CPUTRAIN_FUZZ_SEEDS=DIR fuzz_loaders writes valid files of each kind to DIR and exits.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "engine/adamw.h"
#include "engine/checkpoint_file.h"
#include "engine/error.h"
#include "engine/gguf_file.h"
#include "engine/hash.h"
#include "engine/safetensors_file.h"
#include "engine/tokenizer.h"
#include "engine/vocab_tokenizer.h"
#include "engine/weights_file.h"
#include "models/gguf_model.h"
#include "models/llama.h"
#include "tools/run_config.h"

namespace {

using namespace cputrain;

enum Kind : uint8_t { kCheckpoint, kWeights, kTokenizer, kConfig, kGguf, kSafetensors, kKinds };

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
  LlamaConfig tiny;
  tiny.vocab = 300;
  tiny.d_model = 32;
  tiny.n_layers = 1;
  tiny.n_heads = 2;
  tiny.n_kv_heads = 1;
  tiny.ffn = 64;
  tiny.ctx = 16;
  LlamaModel model(tiny);
  model.init_weights(1);
  write_gguf(base + ".gguf", tiny, model.parameters(),
             Tokenizer::load(base + ".model").to_vocabulary(), GgufExport{GgmlType::Q8_0, "fuzz"});
  seed(kGguf, false, base + ".gguf");
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
  for (const char* ext : {".ckpt", ".bin", ".model", ".json", ".gguf", ".safetensors"})
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
        const LlamaConfig config = gguf_model_config(file, 64);
        if (parameter_count(config) < 1'000'000 && config.n_layers <= 4) {
          LlamaModel model(config);
          load_gguf_weights(file, model.parameters());
        }
        break;
      }
    }
  } catch (const UserError&) {
    // the expected refusal
  }
  return 0;
}
