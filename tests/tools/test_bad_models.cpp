// Damaged and hostile model files given to every command that reads a model: a GGUF file or a
// Hugging Face config.json with a count of 0, 1, 2^31, 2^63 - 1 or -1 is refused in one line on
// stderr naming the file and the key, with a non-zero exit, within a second and under 100 MB;
// and a model holding a NaN is neither sampled, evaluated, exported nor fine-tuned.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "engine/io/gguf_file.h"
#include "tests/tools/cli_test_util.h"

namespace cputrain {
namespace {

namespace fs = std::filesystem;
using cli_test::ChildRun;
using cli_test::read_all;
using cli_test::rewrite_gguf;
using cli_test::run_cputrain;
using cli_test::run_cputrain_all;
using cli_test::TempFolder;

constexpr double kMaxSeconds = 1.0;
constexpr int64_t kMaxPeakBytes = 100 << 20;

// The counts a damaged file holds: 0, 1, 2^31, 2^63 - 1 and, where a format's integers are
// signed, -1.
const std::vector<std::pair<std::string, int64_t>>& damaged_counts() {
  static const std::vector<std::pair<std::string, int64_t>> counts = {
      {"0", 0},
      {"1", 1},
      {"2^31", int64_t{1} << 31},
      {"2^63-1", std::numeric_limits<int64_t>::max()},
      {"-1", -1}};
  return counts;
}

// A GGUF value holding `v`: u32 where it fits, u64 above, i32 below 0.
GgufValue gguf_count(int64_t v) {
  GgufValue g;
  g.type = v < 0 ? GgufType::I32 : v <= 0xffffffffLL ? GgufType::U32 : GgufType::U64;
  g.number = static_cast<double>(v);
  g.bits = static_cast<uint64_t>(v);
  return g;
}

// Every command that reads a model, given `model`, with what it needs besides; outputs go to
// `dir`, under `tag`.
std::vector<std::string> commands(const fs::path& model, const fs::path& dir,
                                  const std::string& tag) {
  const std::string m = model.string(), d = dir.string();
  return {"inspect " + m,
          "sample --model " + m + " --max-tokens 1",
          "eval --model " + m + " --text " + d + "/text.txt",
          "export --model " + m + " --out " + d + "/" + tag + "_export.gguf",
          "budget --model " + m,
          "finetune --model " + m + " --data " + d + "/data.jsonl --steps 1 --out " + d + "/" +
              tag + "_finetune",
          "train --model " + m + " --corpus " + d + "/text.txt --steps 1 --out " + d + "/" + tag +
              "_train"};
}

void write_inputs(const fs::path& dir) {
  std::ofstream(dir / "text.txt") << "Once upon a time there was a little cat. It liked to play.\n";
  std::ofstream(dir / "data.jsonl") << R"({"text": "Once upon a time there was a cat."})"
                                    << "\n";
}

// Each run: a non-zero exit, one line on stderr holding every one of `needles`, within the time
// and memory limits.
void expect_refused(const std::vector<ChildRun>& runs, const std::vector<std::string>& needles) {
  for (const ChildRun& r : runs) {
    SCOPED_TRACE(r.args);
    EXPECT_FALSE(r.timed_out);
    EXPECT_NE(r.exit_code, 0) << r.err;
    EXPECT_GT(r.exit_code, 0) << "killed by a signal: " << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    for (const std::string& needle : needles)
      EXPECT_NE(r.err.find(needle), std::string::npos) << needle << " not in " << r.err;
    EXPECT_LT(r.wall_seconds, kMaxSeconds) << r.err;
    EXPECT_LT(r.peak_rss_bytes, kMaxPeakBytes) << r.err;
  }
}

// Each damaged count the commands are given: with CPUTRAIN_BAD_MODELS_ALL set, every one of
// `keys` at every value of damaged_counts() (a few minutes); else a few of them, the rest being
// tests/models/test_model_bounds.cpp's (in process) and the fuzz seeds'.
std::vector<std::pair<std::string, int64_t>> cases(
    const std::vector<std::string>& keys, const std::vector<std::pair<std::string, int64_t>>& few) {
  if (!std::getenv("CPUTRAIN_BAD_MODELS_ALL")) return few;
  std::vector<std::pair<std::string, int64_t>> all;
  for (const std::string& key : keys)
    for (const auto& [name, value] : damaged_counts()) all.emplace_back(key, value);
  return all;
}

TEST(BadModels, GgufCountsAreRefusedInOneLineByEveryCommand) {
  REQUIRE_SHARED_MODEL("stories260K.gguf");
  const TempFolder folder("bad_gguf");
  const fs::path& dir = folder.path;
  write_inputs(dir);
  const fs::path good = cli_test::kShared / "stories260K.gguf";
  const GgufFile original(good.string());
  const auto damaged =
      cases({"llama.block_count", "llama.embedding_length", "llama.feed_forward_length",
             "llama.attention.head_count", "llama.attention.head_count_kv", "llama.context_length",
             "llama.rope.dimension_count", "llama.vocab_size", "llama.attention.key_length",
             "llama.attention.value_length"},
            {{"llama.block_count", 1000000},
             {"llama.embedding_length", int64_t{1} << 31},
             {"llama.attention.head_count", 0},
             {"llama.attention.head_count_kv", -1},
             {"llama.context_length", std::numeric_limits<int64_t>::max()},
             {"llama.vocab_size", 1}});
  int n = 0;
  for (const auto& [key, value] : damaged) {
    if (key == "llama.context_length" && value == 1) continue;  // a valid, if short, context
    SCOPED_TRACE(key + " " + std::to_string(value));
    const fs::path file = dir / ("damaged" + std::to_string(n) + ".gguf");
    const GgufValue count = gguf_count(value);
    rewrite_gguf(
        good, file,
        [&](const std::string& k, GgufValue& v) {
          if (k == key) v = count;
          return true;
        },
        nullptr,
        [&](GgufWriter& w) {
          if (!original.find(key)) w.set_value(key, count);
        });
    expect_refused(run_cputrain_all(commands(file, dir, std::to_string(n) + "g"), dir),
                   {file.string() + ": ", key});
    ++n;
  }
}

TEST(BadModels, HuggingFaceCountsAreRefusedInOneLineByEveryCommand) {
  REQUIRE_SHARED_MODEL("stories260K.gguf");
  const TempFolder folder("bad_hf");
  const fs::path& dir = folder.path;
  write_inputs(dir);
  const fs::path good = dir / "good_hf";
  const ChildRun exported =
      run_cputrain("export --model " + (cli_test::kShared / "stories260K.gguf").string() +
                       " --out " + good.string(),
                   dir);
  ASSERT_EQ(exported.exit_code, 0) << exported.err;
  const nlohmann::json config = nlohmann::json::parse(read_all(good / "config.json"));
  int n = 0;
  const auto variant = [&](const std::string& key, const nlohmann::json& value) {
    const fs::path copy = dir / ("damaged" + std::to_string(n++));
    fs::copy(good, copy, fs::copy_options::recursive);
    nlohmann::json j = config;
    j[key] = value;
    std::ofstream(copy / "config.json", std::ios::trunc) << j.dump(2);
    return copy;
  };
  const std::vector<std::string> keys = {
      "vocab_size",          "hidden_size",       "num_hidden_layers",       "num_attention_heads",
      "num_key_value_heads", "intermediate_size", "max_position_embeddings", "head_dim"};
  const auto damaged =
      cases(keys, {{"num_hidden_layers", 1000000},
                   {"hidden_size", int64_t{1} << 31},
                   {"num_attention_heads", 0},
                   {"num_key_value_heads", -1},
                   {"max_position_embeddings", std::numeric_limits<int64_t>::max()},
                   {"intermediate_size", 1}});
  for (const auto& [key, value] : damaged) {
    if (key == "max_position_embeddings" && value == 1) continue;  // a valid, if short, one
    SCOPED_TRACE(key + " " + std::to_string(value));
    const fs::path model = variant(key, value);
    expect_refused(run_cputrain_all(commands(model, dir, std::to_string(n) + "h"), dir),
                   {(model / "config.json").string() + ": ", key});
  }
  // A number given as a string or a fraction: one line naming the key, not the JSON library's.
  const bool all = std::getenv("CPUTRAIN_BAD_MODELS_ALL") != nullptr;
  for (const std::string& key : keys) {
    if (!all && key != "hidden_size") continue;
    for (const nlohmann::json& wrong : {nlohmann::json(config[key].dump()), nlohmann::json(64.5)}) {
      SCOPED_TRACE(key + " " + wrong.dump());
      const fs::path model = variant(key, wrong);
      const std::vector<ChildRun> runs =
          run_cputrain_all(commands(model, dir, std::to_string(n) + "s"), dir);
      expect_refused(runs, {(model / "config.json").string() + ": " + key + " " + wrong.dump()});
      for (const ChildRun& r : runs) EXPECT_EQ(r.err.find("json.exception"), std::string::npos);
    }
  }
}

// llama.attention.head_count 0 is blamed on the head count, not on the RoPE dimension that the
// head dimension it gives would differ from.
TEST(BadModels, AZeroHeadCountIsBlamedOnTheHeadCount) {
  REQUIRE_SHARED_MODEL("stories260K.gguf");
  const TempFolder folder("bad_heads");
  const fs::path& dir = folder.path;
  rewrite_gguf(
      cli_test::kShared / "stories260K.gguf", dir / "heads.gguf",
      [](const std::string& k, GgufValue& v) {
        if (k == "llama.attention.head_count") v = gguf_count(0);
        return true;
      },
      nullptr);
  const ChildRun r = run_cputrain("sample --model " + (dir / "heads.gguf").string(), dir);
  EXPECT_NE(r.err.find("llama.attention.head_count 0 must be positive"), std::string::npos)
      << r.err;
  EXPECT_EQ(r.err.find("rope"), std::string::npos) << r.err;
}

// A LoRA adapter file for stories260K (5 blocks, width 64) on the q projections, rank 2, F32,
// with `poison` in one of B's elements.
void write_adapter(const fs::path& path, float poison) {
  GgufWriter w;
  w.set_string("general.architecture", "llama");
  w.set_string("general.type", "adapter");
  w.set_string("adapter.type", "lora");
  w.set_f32("adapter.lora.alpha", 2.0f);
  for (int layer = 0; layer < 5; ++layer) {
    const std::string name = "blk." + std::to_string(layer) + ".attn_q.weight.lora_";
    std::vector<float> a(64 * 2, 0.01f), b(2 * 64, 0.0f);
    if (layer == 2) b[5] = poison;
    const auto bytes = [](const std::vector<float>& v) {
      return ggml_from_float(GgmlType::F32, v.data(), static_cast<int64_t>(v.size()));
    };
    w.add_tensor(name + "a", {64, 2}, GgmlType::F32, bytes(a));
    w.add_tensor(name + "b", {2, 64}, GgmlType::F32, bytes(b));
  }
  w.write(path.string());
}

TEST(BadModels, NonFiniteWeightsAreNeitherSampledEvaluatedNorExported) {
  REQUIRE_SHARED_MODEL("stories260K.gguf");
  const TempFolder folder("nan_weights");
  const fs::path& dir = folder.path;
  write_inputs(dir);
  const fs::path good = cli_test::kShared / "stories260K.gguf";
  const fs::path nan = dir / "nan.gguf";
  rewrite_gguf(good, nan, nullptr,
               [](const std::string& name, std::vector<int64_t>&, uint32_t& type,
                  std::vector<uint8_t>& data) {
                 if (name != "blk.1.attn_q.weight") return;
                 ASSERT_EQ(type, static_cast<uint32_t>(GgmlType::F32));
                 const float value = std::numeric_limits<float>::quiet_NaN();
                 std::memcpy(data.data() + 4 * 3, &value, 4);
               });
  const std::string m = nan.string();
  const std::vector<ChildRun> runs =
      run_cputrain_all({"sample --model " + m + " --max-tokens 4",
                        "eval --model " + m + " --text " + (dir / "text.txt").string(),
                        "export --model " + m + " --out " + (dir / "nan_export.gguf").string(),
                        "export --model " + m + " --out " + (dir / "nan_export_hf").string(),
                        "finetune --model " + m + " --data " + (dir / "data.jsonl").string() +
                            " --ctx 64 --steps 1 --out " + (dir / "nan_run").string()},
                       dir);
  // Named as the file names the tensor.
  expect_refused(runs, {"--model " + m + ": blk.1.attn_q.weight holds nan (element 3)"});
  EXPECT_FALSE(fs::exists(dir / "nan_export.gguf"));
  EXPECT_FALSE(fs::exists(dir / "nan_export_hf"));
  EXPECT_FALSE(fs::exists(dir / "nan_run" / "checkpoints"));

  // An adapter holding an infinity, applied or merged.
  const fs::path adapter = dir / "inf_adapter.gguf";
  write_adapter(adapter, std::numeric_limits<float>::infinity());
  const std::string g = good.string(), a = adapter.string();
  expect_refused(run_cputrain_all({"sample --model " + g + " --max-tokens 4 --adapter " + a,
                                   "eval --model " + g + " --adapter " + a + " --text " +
                                       (dir / "text.txt").string(),
                                   "export --model " + g + " --adapter " + a + " --merge --out " +
                                       (dir / "merged.gguf").string()},
                                  dir),
                 {"--adapter " + a + ": blk.2.attn_q.weight.lora_b holds inf"});
  EXPECT_FALSE(fs::exists(dir / "merged.gguf"));
  // A fine-tune's adapter.gguf holding it: named, as the file names the tensor, by every command
  // that reads the run.
  const fs::path run = dir / "run";
  ASSERT_EQ(run_cputrain("finetune --model " + g + " --data " + (dir / "data.jsonl").string() +
                             " --ctx 64 --steps 1 --out " + run.string(),
                         dir)
                .exit_code,
            0);
  fs::copy_file(adapter, run / "adapter.gguf", fs::copy_options::overwrite_existing);
  const std::string r = run.string();
  expect_refused(run_cputrain_all(
                     {"sample --run " + r + " --max-tokens 4",
                      "eval --run " + r + " --text " + (dir / "text.txt").string(),
                      "export --run " + r + " --merge --out " + (dir / "run_merged.gguf").string()},
                     dir),
                 {"--run " + r + ": " + r + "/adapter.gguf: blk.2.attn_q.weight.lora_b holds inf"});
  EXPECT_FALSE(fs::exists(dir / "run_merged.gguf"));
  // The same adapter without the infinity is applied: the check refuses nothing else.
  write_adapter(adapter, 0.5f);
  const ChildRun fine = run_cputrain("sample --model " + g + " --max-tokens 4 --adapter " + a, dir);
  EXPECT_EQ(fine.exit_code, 0) << fine.err;
}

// An embedding stored transposed ([vocab, d_model] for ggml's [d_model, vocab]) is named with the
// shape the hyperparameters give it, not blamed on another tensor.
TEST(BadModels, ATransposedEmbeddingIsNamedWithTheShapeItShouldHave) {
  REQUIRE_SHARED_MODEL("stories260K.gguf");
  const TempFolder folder("transposed");
  const fs::path& dir = folder.path;
  write_inputs(dir);
  const fs::path flipped = dir / "flipped.gguf";
  rewrite_gguf(
      cli_test::kShared / "stories260K.gguf", flipped, nullptr,
      [](const std::string& name, std::vector<int64_t>& dims, uint32_t&, std::vector<uint8_t>&) {
        if (name == "token_embd.weight") std::swap(dims[0], dims[1]);
      });
  const std::vector<ChildRun> runs = run_cputrain_all(commands(flipped, dir, "flipped"), dir);
  expect_refused(runs, {"tensor token_embd.weight has shape [512, 64] where the model's "
                        "hyperparameters give [64, 512]"});
  for (const ChildRun& r : runs) EXPECT_EQ(r.err.find("output.weight"), std::string::npos) << r.err;
}

// An adapter file whose rank is above the width of the projections it adapts is refused before
// the model is built.
TEST(BadModels, AnAdapterRankAboveItsProjectionIsRefused) {
  REQUIRE_SHARED_MODEL("stories260K.gguf");
  const TempFolder folder("rank");
  const fs::path& dir = folder.path;
  GgufWriter w;
  w.set_string("general.architecture", "llama");
  w.set_string("general.type", "adapter");
  w.set_string("adapter.type", "lora");
  const int64_t rank = 100;
  for (int layer = 0; layer < 5; ++layer) {
    const std::string name = "blk." + std::to_string(layer) + ".attn_k.weight.lora_";
    const std::vector<float> zeros(static_cast<size_t>(64 * rank), 0.0f);
    w.add_tensor(name + "a", {64, rank}, GgmlType::F32,
                 ggml_from_float(GgmlType::F32, zeros.data(), 64 * rank));
    w.add_tensor(name + "b", {rank, 32}, GgmlType::F32,
                 ggml_from_float(GgmlType::F32, zeros.data(), 32 * rank));
  }
  w.write((dir / "wide.gguf").string());
  const ChildRun r =
      run_cputrain("sample --model " + (cli_test::kShared / "stories260K.gguf").string() +
                       " --adapter " + (dir / "wide.gguf").string(),
                   dir);
  expect_refused({r}, {"rank 100: above the width of the k projection (32); at most 32"});
}

}  // namespace
}  // namespace cputrain
