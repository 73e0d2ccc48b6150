// A model file's counts checked against the file before anything is allocated from them: a GGUF
// file or a Hugging Face config.json whose count is 0, 1, 2^31, 2^63 - 1 or negative gives a
// UserError naming the file and the key, and neither the memory accounting nor the process's
// resident set grows meanwhile. Also the LoRA rank refused above a projection's width, and
// non-finite weights found.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "engine/core/error.h"
#include "engine/core/memory.h"
#include "engine/io/gguf_file.h"
#include "engine/io/safetensors_file.h"
#include "engine/text/tokenizer.h"
#include "engine/text/vocab_tokenizer.h"
#include "engine/train/parameters.h"
#include "models/decoder.h"
#include "models/file_hyperparameters.h"
#include "models/gguf_model.h"
#include "models/hf_config.h"
#include "models/hf_writer.h"
#include "models/lora.h"

namespace cputrain {
namespace {

namespace fs = std::filesystem;

constexpr int64_t kMaxGrowthBytes = 64 << 20;

struct TempFolder {
  explicit TempFolder(const std::string& name)
      : path(fs::temp_directory_path() /
             ("cputrain_bounds_" + name + "_" + std::to_string(::getpid()))) {
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempFolder() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  fs::path path;
};

// 2 blocks of width 16, 4 heads of 4, 2 key/value heads, MLP 24, 32 tokens.
ModelConfig small_config() {
  ModelConfig c;
  c.vocab = 32;
  c.d_model = 16;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.ffn = 24;
  c.ctx = 32;
  return c;
}

Vocabulary small_vocabulary() {
  Vocabulary v;
  v.model = "llama";
  for (int i = 0; i < 32; ++i) {
    std::string token = std::to_string(i);
    token.insert(0, i < 3 ? "<s" : "t");
    if (i < 3) token += ">";
    v.tokens.push_back(token);
  }
  v.types.assign(32, Vocabulary::kNormal);
  v.types[0] = Vocabulary::kUnknown;
  v.types[1] = v.types[2] = Vocabulary::kControl;
  v.unk = 0;
  v.bos = 1;
  v.eos = 2;
  return v;
}

const std::vector<int64_t>& damaged_counts() {
  static const std::vector<int64_t> counts = {0, 1, int64_t{1} << 31,
                                              std::numeric_limits<int64_t>::max(), -1};
  return counts;
}

GgufValue gguf_count(int64_t v) {
  GgufValue g;
  g.type = v < 0 ? GgufType::I64 : v <= 0xffffffffLL ? GgufType::U32 : GgufType::U64;
  g.number = static_cast<double>(v);
  g.bits = static_cast<uint64_t>(v);
  return g;
}

// A copy of `from` with metadata `key` set to `value` (added where absent).
void rewrite_with(const fs::path& from, const fs::path& to, const std::string& key,
                  const GgufValue& value) {
  const GgufFile file(from.string());
  GgufWriter w;
  for (const auto& [k, v] : file.metadata()) w.set_value(k, k == key ? value : v);
  if (!file.find(key)) w.set_value(key, value);
  for (const GgufTensor& t : file.tensors())
    w.add_tensor(t.name, t.dims, static_cast<GgmlType>(t.type),
                 std::vector<uint8_t>(t.data.begin(), t.data.end()));
  w.write(to.string());
}

// Runs `read`, which must throw a UserError holding every one of `needles`, and checks that
// nothing was allocated meanwhile: no tensor memory, and the resident set grew by less than
// kMaxGrowthBytes.
template <typename Read>
void expect_refused_without_allocating(Read read, const std::vector<std::string>& needles) {
  const int64_t live = memory_stats().live_total_bytes;
  memory_reset_peaks();
  const bool peak_reset = process_memory_reset_peak();
  const int64_t rss = process_memory().rss_bytes;
  try {
    read();
    ADD_FAILURE() << "not refused";
  } catch (const UserError& e) {
    const std::string message = e.what();
    for (const std::string& needle : needles)
      EXPECT_NE(message.find(needle), std::string::npos) << needle << " not in " << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  }
  EXPECT_EQ(memory_stats().peak_total_bytes, live);
  if (peak_reset) {
    EXPECT_LT(process_memory().peak_rss_bytes - rss, kMaxGrowthBytes);
  }
}

class ModelBounds : public ::testing::Test {
 protected:
  void SetUp() override {
    DecoderModel model(small_config());
    model.init_weights(7);
    write_gguf((dir_.path / "good.gguf").string(), small_config(), model.parameters(),
               small_vocabulary(), GgufExport{});
    write_hf_folder((dir_.path / "hf").string(), small_config(), model.parameters(),
                    Tokenizer::from_vocabulary(small_vocabulary()), "F32");
  }
  TempFolder dir_{"files"};
};

TEST_F(ModelBounds, TheUndamagedFilesAreRead) {
  const GgufFile file((dir_.path / "good.gguf").string());
  const ModelConfig g = gguf_model_config(file, 1024);
  EXPECT_EQ(g.n_layers, 2);
  EXPECT_EQ(g.kv_heads(), 2);
  EXPECT_NO_THROW(check_gguf_weights(file, g));
  const SafetensorsModel weights((dir_.path / "hf").string());
  const ModelConfig h = hf_model_config((dir_.path / "hf").string(), weights, 1024);
  EXPECT_EQ(h.ffn, 24);
  EXPECT_EQ(h.head_size(), 4);
  EXPECT_NO_THROW(check_hf_weights(weights, h));
}

TEST_F(ModelBounds, EveryDamagedGgufCountNamesItsKey) {
  const fs::path good = dir_.path / "good.gguf", bad = dir_.path / "bad.gguf";
  for (const std::string key :
       {"llama.block_count", "llama.embedding_length", "llama.feed_forward_length",
        "llama.attention.head_count", "llama.attention.head_count_kv", "llama.context_length",
        "llama.rope.dimension_count", "llama.vocab_size", "llama.attention.key_length"})
    for (const int64_t value : damaged_counts()) {
      if (key == "llama.context_length" && value == 1) continue;  // valid
      SCOPED_TRACE(key + " " + std::to_string(value));
      rewrite_with(good, bad, key, gguf_count(value));
      expect_refused_without_allocating(
          [&] {
            const GgufFile file(bad.string());
            check_gguf_weights(file, gguf_model_config(file, 1 << 20));
          },
          {bad.string() + ": ", key + " "});
    }
}

// head_count 0 is the head count's fault, not the RoPE dimension's.
TEST_F(ModelBounds, AZeroHeadCountIsBlamedOnIt) {
  const fs::path bad = dir_.path / "heads.gguf";
  rewrite_with(dir_.path / "good.gguf", bad, "llama.attention.head_count", gguf_count(0));
  expect_refused_without_allocating([&] { gguf_model_config(GgufFile(bad.string()), 1024); },
                                    {"llama.attention.head_count 0 must be positive"});
}

// A tensor of a type cputrain does not convert is refused before the model is built, whatever
// shape it claims (its data is not bounded by the file).
TEST_F(ModelBounds, AnUnreadTensorTypeIsRefusedBeforeAllocating) {
  const GgufFile good((dir_.path / "good.gguf").string());
  GgufWriter w;
  for (const auto& [k, v] : good.metadata()) w.set_value(k, v);
  for (const GgufTensor& t : good.tensors()) {
    if (t.name == "blk.1.ffn_up.weight")  // Q4_1: blocks of 32 in 20 bytes
      w.add_tensor(t.name, t.dims, static_cast<GgmlType>(3),
                   std::vector<uint8_t>(static_cast<size_t>(t.numel() / 32 * 20), 0));
    else
      w.add_tensor(t.name, t.dims, static_cast<GgmlType>(t.type),
                   std::vector<uint8_t>(t.data.begin(), t.data.end()));
  }
  const fs::path bad = dir_.path / "q4.gguf";
  w.write(bad.string());
  expect_refused_without_allocating(
      [&] {
        const GgufFile file(bad.string());
        check_gguf_weights(file, gguf_model_config(file, 1024));
      },
      {"tensor blk.1.ffn_up.weight is Q4_1, a type cputrain does not read"});
}

TEST_F(ModelBounds, EveryDamagedHuggingFaceCountNamesItsKey) {
  const fs::path hf = dir_.path / "hf";
  std::ifstream in(hf / "config.json");
  const nlohmann::json good = nlohmann::json::parse(in);
  const auto with = [&](const std::string& key, const nlohmann::json& value) {
    nlohmann::json j = good;
    j[key] = value;
    std::ofstream(hf / "config.json", std::ios::trunc) << j.dump(2);
  };
  const std::string where = (hf / "config.json").string() + ": ";
  for (const std::string key :
       {"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "intermediate_size", "max_position_embeddings", "head_dim"}) {
    for (const int64_t value : damaged_counts()) {
      if (key == "max_position_embeddings" && value == 1) continue;  // valid
      SCOPED_TRACE(key + " " + std::to_string(value));
      with(key, value);
      expect_refused_without_allocating(
          [&] {
            const SafetensorsModel weights(hf.string());
            check_hf_weights(weights, hf_model_config(hf.string(), weights, 1 << 20));
          },
          {where, key + " "});
    }
    // A number as a string, or a fraction: the key named, not the JSON library's exception.
    with(key, good[key].dump());
    expect_refused_without_allocating(
        [&] { hf_model_config(hf.string(), 1024); },
        {where + key + " \"" + good[key].dump() + "\" is a string, not a whole number"});
    with(key, 16.5);
    expect_refused_without_allocating([&] { hf_model_config(hf.string(), 1024); },
                                      {where + key + " 16.5 is a fraction, not a whole number"});
  }
  with("rms_norm_eps", "1e-5");
  expect_refused_without_allocating([&] { hf_model_config(hf.string(), 1024); },
                                    {where + "rms_norm_eps \"1e-5\" is a string, not a number"});
  with("tie_word_embeddings", "yes");
  expect_refused_without_allocating([&] { hf_model_config(hf.string(), 1024); },
                                    {where + "tie_word_embeddings \"yes\" is a string"});
}

TEST(LoraRank, AboveTheNarrowestProjectionIsRefused) {
  const ModelConfig c = small_config();  // q 16 x 16, k and v 8 x 16, MLP 24 x 16
  LoraConfig lora;
  lora.rank = 100000;
  lora.targets[static_cast<size_t>(Projection::Q)] = true;
  try {
    check_lora_rank(c, lora, "--lora-rank");
    ADD_FAILURE() << "not refused";
  } catch (const UserError& e) {
    EXPECT_STREQ(e.what(),
                 "--lora-rank 100000: above the width of the q projection (16); at most 16");
  }
  lora.targets[static_cast<size_t>(Projection::V)] = true;
  lora.rank = 9;
  EXPECT_THROW(check_lora_rank(c, lora, "--lora-rank"), UserError);  // v is 8 wide
  lora.rank = 8;
  EXPECT_NO_THROW(check_lora_rank(c, lora, "--lora-rank"));
  lora.rank = 0;  // no adapters
  EXPECT_NO_THROW(check_lora_rank(c, lora, "--lora-rank"));
}

TEST(CheckFinite, NamesTheParameterAndTheValue) {
  ParameterSet params;
  params.add("a", Shape{2, 3}, true);
  params.add("b", Shape{4}, false);
  params.allocate();
  const std::vector<float> a = {1, 2, 3, 4, 5, 6};
  std::vector<float> b = {0, 0, 0, 0};
  params.write_values(0, a.data());
  params.write_values(1, b.data());
  EXPECT_NO_THROW(check_finite(params, "model.gguf"));
  b[2] = -std::numeric_limits<float>::infinity();
  params.write_values(1, b.data());
  try {
    check_finite(params, "model.gguf");
    ADD_FAILURE() << "not refused";
  } catch (const UserError& e) {
    EXPECT_STREQ(e.what(),
                 "model.gguf: b holds -inf (element 2), and cputrain computes with finite weights "
                 "only");
  }
  EXPECT_NO_THROW(
      check_finite(params, "model.gguf", [](const std::string& n) { return n == "a"; }));
}

}  // namespace
}  // namespace cputrain
