// cputrain against llama.cpp, the oracle tools/install_deps.sh --llamacpp installs (libllama driven
// by tests/oracle/llama_oracle.cpp): the same logits from the same GGUF file, and the published
// greedy text of a real pretrained model (../shared/models/stories260K.gguf). Tests that need the
// oracle or the shared model skip, saying which, where it is absent.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "engine/core/error.h"
#include "engine/core/memory.h"
#include "engine/core/tensor.h"
#include "engine/io/gguf_file.h"
#include "engine/io/safetensors_file.h"
#include "engine/text/chat_template.h"
#include "engine/text/vocab_tokenizer.h"
#include "engine/train/parameters.h"
#include "models/architecture.h"
#include "models/generate.h"
#include "models/gguf_model.h"
#include "models/lora.h"
#include "models/tensor_names.h"
#include "tools/budget_command.h"
#include "tools/cli_test_util.h"
#include "tools/model_source.h"
#include "tools/oracle_util.h"

namespace cputrain {
namespace {

using namespace interop_test;

TEST(LlamaCpp, Stories260kLogitsEqualLlamaCpps) {
  REQUIRE_ORACLE();
  REQUIRE_SHARED("stories260K.gguf");
  const fs::path model = kShared / "stories260K.gguf";
  LoadedModel m = load_model(model.string(), "--model", "", kDefaultImportCtx);
  EXPECT_EQ(m.config.n_kv_heads, 4);  // grouped-query attention, as the file says
  const std::vector<int32_t> tokens = token_sequence(200, m.config.vocab, m.tokenizer->bos_id(), 7);
  const std::vector<float> ours = our_logits(m, tokens);
  const TempFolder dir{temp_dir("stories")};
  const std::vector<float> theirs = oracle_logits(model, tokens, dir.path);
  ASSERT_EQ(theirs.size(), ours.size());
  EXPECT_LT(max_abs_difference(ours, theirs), 1e-4);
}

// A llama model with grouped-query attention, an untied head and theta 500000; a qwen2 model
// with q/k/v biases, a tied head and theta 1e6: llama.cpp's logits, at every position of 200
// tokens. The llama model's matrices are F16 in llama_gqa.gguf: read exactly (the same logits as
// its values widened to F32 in llama_gqa_f32.gguf, bit for bit), and compared tightly on the F32
// file, since llama.cpp rounds the activations of an F16 product to F16 on most CPUs (0.008 of
// a logit apart on an AMD Zen 4; on the F16 file the two agree within 0.02).
TEST(LlamaCpp, RandomLlamaAndQwen2LogitsEqualLlamaCpps) {
  REQUIRE_ORACLE();
  for (const char* name : {"llama_gqa_f32.gguf", "qwen2_tied.gguf"}) {
    const fs::path model = made_models() / name;
    LoadedModel m = load_model(model.string(), "--model", "", kDefaultImportCtx);
    const std::vector<int32_t> tokens =
        token_sequence(200, m.config.vocab, m.tokenizer->bos_id(), 11);
    const std::vector<float> ours = our_logits(m, tokens);
    const std::vector<float> theirs = oracle_logits(model, tokens, made_models());
    ASSERT_EQ(theirs.size(), ours.size()) << name;
    EXPECT_LT(max_abs_difference(ours, theirs), 1e-4) << name;
  }
  const fs::path f16 = made_models() / "llama_gqa.gguf";
  LoadedModel half = load_model(f16.string(), "--model", "", kDefaultImportCtx);
  LoadedModel widened =
      load_model((made_models() / "llama_gqa_f32.gguf").string(), "--model", "", kDefaultImportCtx);
  const std::vector<int32_t> tokens =
      token_sequence(200, half.config.vocab, half.tokenizer->bos_id(), 11);
  const std::vector<float> ours = our_logits(half, tokens);
  EXPECT_EQ(ours, our_logits(widened, tokens));
  EXPECT_LT(max_abs_difference(ours, oracle_logits(f16, tokens, made_models())), 0.02);
  LoadedModel qwen =
      load_model((made_models() / "qwen2_tied.gguf").string(), "--model", "", kDefaultImportCtx);
  EXPECT_TRUE(qwen.config.qkv_bias && qwen.config.tie_embeddings);
  EXPECT_EQ(qwen.config.rope_pairs, RopePairs::HalfSplit);
  EXPECT_EQ(qwen.config.rope_theta, 1e6);
}

// A Hugging Face folder of the same weights as llama_gqa.gguf (safetensors, rotate-half q and k
// rows, tokenizer.json): llama.cpp's logits on the GGUF (its F32 copy, as above).
TEST(LlamaCpp, AHuggingFaceFolderGivesItsGgufsLogits) {
  REQUIRE_ORACLE();
  const fs::path folder = made_models() / "llama_gqa_hf";
  LoadedModel m = load_model(folder.string(), "--model", "", kDefaultImportCtx);
  EXPECT_EQ(m.config.rope_pairs, RopePairs::HalfSplit);
  EXPECT_EQ(m.config.n_kv_heads, 2);
  EXPECT_EQ(m.tokenizer->bos_id(), 1);
  const std::vector<int32_t> tokens = token_sequence(200, m.config.vocab, 1, 17);
  EXPECT_LT(
      max_abs_difference(our_logits(m, tokens), oracle_logits(made_models() / "llama_gqa_f32.gguf",
                                                              tokens, made_models())),
      1e-4);
}

// 200 tokens the model itself would write from BOS (sampled at temperature 1), so that an NLL
// measures its confidence in likely text rather than its surprise at noise.
std::vector<int32_t> sampled_text(LoadedModel& m, uint64_t seed) {
  SampleOptions options;
  options.max_new_tokens = 199;
  options.temperature = 1.0f;
  options.top_k = 0;
  options.seed = seed;
  return generate(*m.model, {m.tokenizer->bos_id()}, options);
}

// Files whose arithmetic llama.cpp does in lower precision (it rounds activations to bf16 for
// BF16 matrices, and quantises them for Q8_0 and K-quant ones), read by cputrain to FP32: the
// same next token at 99% of positions or more, and a mean NLL within 0.01 nats, over a text the
// model samples. The quantised
// files are llama.cpp's own quantiser's (llama_model_quantize) from the F16 llama model.
TEST(LlamaCpp, Bf16AndQuantisedFilesAgreeWithLlamaCpp) {
  REQUIRE_ORACLE();
  const fs::path dir = made_models();
  for (const char* type : {"q8_0", "q4_0", "q5_0", "q5_1", "q4_k_m", "q5_k_m"})
    quantized_model(type);
  // The BF16 file twice: converted to FP32, and held as bf16 and computed in bf16, as sample
  // holds it.
  const std::pair<const char*, bool> files[] = {
      {"qwen2_tied_bf16.gguf", false},  {"qwen2_tied_bf16.gguf", true},
      {"llama_gqa_q8_0.gguf", false},   {"llama_gqa_q4_0.gguf", false},
      {"llama_gqa_q5_0.gguf", false},   {"llama_gqa_q5_1.gguf", false},
      {"llama_gqa_q4_k_m.gguf", false}, {"llama_gqa_q5_k_m.gguf", false}};
  // Each quantised file holds the type its name says (llama.cpp falls back to others for rows
  // its blocks do not divide).
  for (const auto& [name, type] : {std::pair{"llama_gqa_q4_0.gguf", GgmlType::Q4_0},
                                   {"llama_gqa_q5_0.gguf", GgmlType::Q5_0},
                                   {"llama_gqa_q5_1.gguf", GgmlType::Q5_1},
                                   {"llama_gqa_q5_k_m.gguf", GgmlType::Q5_K},
                                   {"llama_gqa_q4_k_m.gguf", GgmlType::Q4_K},
                                   {"llama_gqa_q8_0.gguf", GgmlType::Q8_0}}) {
    const GgufFile file((dir / name).string());
    int64_t of_type = 0;
    for (const GgufTensor& t : file.tensors()) of_type += t.type == static_cast<uint32_t>(type);
    EXPECT_GE(of_type, 7) << name;  // at least one layer's matrices
    // Every quantised tensor's values as gguf-py's dequantisation gives them, to a rounding of
    // the block's scale times its largest value (it multiplies in another order).
    const fs::path out = dir / (std::string(name) + ".values");
    const std::string cmd = "/usr/bin/python3 " + std::string(CPUTRAIN_SOURCE_DIR) +
                            "/tests/interop/dequantize.py " + CPUTRAIN_GGUF_PY + " " +
                            (dir / name).string() + " " + out.string();
    ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
    std::ifstream index(out.string() + ".txt"), values(out.string() + ".f32", std::ios::binary);
    int64_t checked = 0;
    std::string tensor;
    for (int64_t n; index >> tensor >> n; ++checked) {
      std::vector<float> want(static_cast<size_t>(n));
      values.read(reinterpret_cast<char*>(want.data()), n * 4);
      const GgufTensor* t = file.tensor(tensor);
      ASSERT_NE(t, nullptr) << tensor;
      const std::vector<float> got = gguf_tensor_values(file, *t);
      ASSERT_EQ(got.size(), want.size()) << name << " " << tensor;
      float scale = 0.0f, worst = 0.0f;
      for (size_t i = 0; i < got.size(); ++i) {
        scale = std::max(scale, std::abs(want[i]));
        worst = std::max(worst, std::abs(got[i] - want[i]));
      }
      EXPECT_LE(worst, scale * 1e-6f) << name << " " << tensor << " " << ggml_type_name(t->type);
    }
    EXPECT_GE(checked, 7) << name;
  }
  // The model the quantised files were made from, as exact FP32 values (F16).
  LoadedModel exact =
      load_model((dir / "llama_gqa.gguf").string(), "--model", "", kDefaultImportCtx, false);
  for (const auto& [name, bf16] : files) {
    const fs::path model = dir / name;
    LoadedModel m = load_model(model.string(), "--model", "", kDefaultImportCtx, bf16);
    EXPECT_EQ(m.bf16_weights, bf16) << name;
    // Held as bf16, the GEMM weights are the file's own bytes, mapped; so are quantised ones
    // (every matrix of a supported format, the embedding among them), computed quantised.
    const ParameterSet& params = m.model->parameters();
    const GgufFile file(model.string());
    int64_t quantized = 0;
    for (size_t i = 0; i < params.infos().size(); ++i) {
      const ParameterInfo& p = params.infos()[i];
      const DType held = gguf_in_place(file, p, m.config).dtype;
      EXPECT_EQ(p.mapped, (bf16 && p.bf16_copy) || dtype_quantized(held)) << name << " " << p.name;
      if (p.mapped) {
        EXPECT_EQ(p.mapped_dtype, held) << name << " " << p.name;
      }
      quantized += p.mapped && dtype_quantized(held);
    }
    const bool quantized_file = std::string(name).find("_q") != std::string::npos;
    if (quantized_file) {
      EXPECT_GE(quantized, 7) << name;
    }
    const std::vector<int32_t> tokens = sampled_text(m, 13);
    ASSERT_EQ(tokens.size(), 200u);
    const std::vector<float> ours = our_logits(m, tokens),
                             theirs = oracle_logits(model, tokens, dir);
    const Agreement a = agreement(ours, theirs, tokens, m.config.vocab);
    EXPECT_GE(a.argmax, 0.99) << name;
    EXPECT_NEAR(a.nll_ours, a.nll_theirs, 0.01) << name;
    // Per token, cputrain's NLL on the quantised weights is at least as close to the exact
    // model's as llama.cpp's (which also quantises the activations) is.
    if (!quantized_file) continue;
    const std::vector<double> fp = token_nll(our_logits(exact, tokens), tokens, m.config.vocab);
    const std::vector<double> q_ours = token_nll(ours, tokens, m.config.vocab);
    const std::vector<double> q_theirs = token_nll(theirs, tokens, m.config.vocab);
    double off_ours = 0.0, off_theirs = 0.0;
    for (size_t i = 0; i < fp.size(); ++i) {
      off_ours += std::abs(q_ours[i] - fp[i]) / static_cast<double>(fp.size());
      off_theirs += std::abs(q_theirs[i] - fp[i]) / static_cast<double>(fp.size());
    }
    std::printf("%s: mean |NLL - exact model's| %.5f (cputrain) %.5f (llama.cpp)\n", name, off_ours,
                off_theirs);
    EXPECT_LE(off_ours, off_theirs) << name;
  }
}

// llama.cpp's tokenizer test vectors (models/ggml-vocab-NAME.gguf with .inp and .out): every
// text encodes to the ids llama.cpp gives, without BOS, special tokens as text.
void expect_test_vectors(const std::string& name) {
  const fs::path base =
      fs::path(CPUTRAIN_LLAMACPP_SRC) / "models" / ("ggml-vocab-" + name + ".gguf");
  const GgufFile file(base.string());
  const Tokenizer tokenizer = Tokenizer::from_vocabulary(gguf_vocabulary(file));
  const std::string inputs = read_all(base.string() + ".inp");
  std::ifstream outputs(base.string() + ".out");
  const std::string separator = "\n__ggml_vocab_test__\n";
  size_t pos = 0, tested = 0;
  std::string expected_line;
  while (pos < inputs.size() && std::getline(outputs, expected_line)) {
    size_t end = inputs.find(separator, pos);
    if (end == std::string::npos) end = inputs.size();
    const std::string text = inputs.substr(pos, end - pos);
    pos = end + separator.size();
    std::vector<int32_t> expected;
    std::istringstream ids(expected_line);
    for (int32_t id; ids >> id;) expected.push_back(id);
    EXPECT_EQ(tokenizer.encode(text), expected) << name << ": \"" << text << "\"";
    EXPECT_EQ(tokenizer.decode(tokenizer.encode(text)), text) << name;
    ++tested;
  }
  EXPECT_GT(tested, 30u) << name;
}

// The same vocabulary as a Hugging Face folder's tokenizer.json (byte-level BPE, its
// pre-tokenizer as Hugging Face writes it, added tokens) gives the same ids over llama.cpp's test
// texts: qwen2's (a Split by its regular expression) and Command R's (SmolLM's Digits, each digit
// apart, then ByteLevel's own split); Gemma 4's (spaces replaced by U+2581, no pre-tokenizer, byte
// pieces; known by its config.json's model_type).
void expect_tokenizer_json_ids(const std::string& name, const nlohmann::json& pre_tokenizer,
                               const std::string& pre, const nlohmann::json& normalizer = nullptr,
                               const std::string& model_type = "qwen2") {
  const fs::path base =
      fs::path(CPUTRAIN_LLAMACPP_SRC) / "models" / ("ggml-vocab-" + name + ".gguf");
  const Vocabulary v = gguf_vocabulary(GgufFile(base.string()));
  nlohmann::json vocab = nlohmann::json::object(), added = nlohmann::json::array();
  for (size_t i = 0; i < v.tokens.size(); ++i) {
    if (v.types[i] == Vocabulary::kControl || v.types[i] == Vocabulary::kUserDefined)
      added.push_back(
          {{"id", i}, {"content", v.tokens[i]}, {"special", v.types[i] == Vocabulary::kControl}});
    else
      vocab[v.tokens[i]] = i;
  }
  const nlohmann::json tokenizer = {
      {"added_tokens", added},
      {"normalizer", normalizer},
      {"pre_tokenizer", pre_tokenizer},
      {"model",
       {{"type", "BPE"}, {"vocab", vocab}, {"merges", v.merges}, {"byte_fallback", true}}}};
  const TempFolder folder{temp_dir("tokenizer_json")};
  std::ofstream(folder.path / "tokenizer.json") << tokenizer.dump();
  std::ofstream(folder.path / "config.json") << nlohmann::json{{"model_type", model_type}}.dump();
  const std::string eos = v.tokens[static_cast<size_t>(v.eos)];
  std::ofstream(folder.path / "tokenizer_config.json")
      << nlohmann::json{{"eos_token", eos}, {"bos_token", nullptr}}.dump();
  const Tokenizer hf = load_tokenizer(folder.path.string(), "--model");
  const Tokenizer gguf = Tokenizer::from_vocabulary(v);
  const std::string inputs = read_all(base.string() + ".inp");
  size_t pos = 0, tested = 0;
  const std::string separator = "\n__ggml_vocab_test__\n";
  while (pos < inputs.size()) {
    size_t end = inputs.find(separator, pos);
    if (end == std::string::npos) end = inputs.size();
    const std::string text = inputs.substr(pos, end - pos);
    pos = end + separator.size();
    EXPECT_EQ(hf.encode(text), gguf.encode(text)) << name << ": " << text;
    ++tested;
  }
  EXPECT_GT(tested, 30u) << name;
  EXPECT_EQ(hf.vocabulary()->vocabulary().pre, pre);
  EXPECT_EQ(hf.eos_id(), gguf.eos_id()) << name;
}

TEST(LlamaCppVocab, TokenizerJsonGivesTheSameIds) {
  REQUIRE_ORACLE();
  const nlohmann::json byte_level = {{"type", "ByteLevel"}, {"add_prefix_space", false}};
  expect_tokenizer_json_ids(
      "qwen2",
      {{"type", "Sequence"},
       {"pretokenizers",
        {{{"type", "Split"},
          {"pattern",
           {{"Regex",
             "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| "
             "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"}}}},
         byte_level}}},
      "qwen2");
  expect_tokenizer_json_ids(
      "command-r",
      {{"type", "Sequence"},
       {"pretokenizers", {{{"type", "Digits"}, {"individual_digits", true}}, byte_level}}},
      "smollm");
  expect_tokenizer_json_ids(
      "gemma-4", nullptr, "gemma4",
      {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", "\u2581"}}, "gemma4_text");
}

TEST(LlamaCppVocab, LlamaSpmTestVectors) {
  REQUIRE_ORACLE();
  expect_test_vectors("llama-spm");
}

TEST(LlamaCppVocab, LlamaBpeTestVectors) {
  REQUIRE_ORACLE();
  expect_test_vectors("llama-bpe");
}

TEST(LlamaCppVocab, Qwen2TestVectors) {
  REQUIRE_ORACLE();
  expect_test_vectors("qwen2");
}

TEST(LlamaCppVocab, Gpt2TestVectors) {
  REQUIRE_ORACLE();
  expect_test_vectors("gpt-2");
}

// Command R's vocabulary splits text as SmolLM's does (each digit apart, then GPT-2's split):
// the two-expression pre-tokenizer of SmolLM2's files.
TEST(LlamaCppVocab, DigitsApartTestVectors) {
  REQUIRE_ORACLE();
  expect_test_vectors("command-r");
}

// What a 150k-token BPE vocabulary (Qwen2's) holds on the heap, as the memory budget counts it
// (GgufFile::heap_bytes, Tokenizer::heap_bytes), against what the heap holds once they are made
// (glibc's mallinfo2): within 10% each.
TEST(LlamaCppVocab, TheHeapOfAVocabularyIsWhatTheBudgetCounts) {
  REQUIRE_ORACLE();
  const std::string path =
      (fs::path(CPUTRAIN_LLAMACPP_SRC) / "models" / "ggml-vocab-qwen2.gguf").string();
  const int64_t before = heap_in_use_bytes();
  const auto file = std::make_unique<GgufFile>(path);
  const int64_t with_file = heap_in_use_bytes();
  const auto tokenizer =
      std::make_unique<Tokenizer>(Tokenizer::from_vocabulary(gguf_vocabulary(*file)));
  const int64_t with_tokenizer = heap_in_use_bytes();
  std::printf("file %lld counted, %lld measured; tokenizer %lld counted, %lld measured\n",
              static_cast<long long>(file->heap_bytes()),
              static_cast<long long>(with_file - before),
              static_cast<long long>(tokenizer->heap_bytes()),
              static_cast<long long>(with_tokenizer - with_file));
  EXPECT_NEAR(static_cast<double>(file->heap_bytes()), static_cast<double>(with_file - before),
              0.1 * static_cast<double>(with_file - before));
  EXPECT_NEAR(static_cast<double>(tokenizer->heap_bytes()),
              static_cast<double>(with_tokenizer - with_file),
              0.1 * static_cast<double>(with_tokenizer - with_file));
  EXPECT_GT(tokenizer->heap_bytes(), 10'000'000);
}

// Every other vocabulary llama.cpp's source ships with test vectors: the same ids on every text
// (Phi-3's SentencePiece; Qwen3.5's, MPT's, StarCoder's, Refact's, Falcon's and DeepSeek's
// pre-tokenizers; Gemma 4's BPE on raw bytes), or, for a tokenizer cputrain does not read (an
// encoder's WordPiece), one line naming it.
TEST(LlamaCppVocab, EveryShippedVocabularyMatchesOrIsRefused) {
  REQUIRE_ORACLE();
  for (const char* name : {"phi-3", "qwen35", "mpt", "starcoder", "refact", "falcon",
                           "deepseek-llm", "deepseek-coder", "gemma-4"})
    expect_test_vectors(name);
  const TempFolder dir{temp_dir("vocab_refused")};
  const fs::path models = fs::path(CPUTRAIN_LLAMACPP_SRC) / "models";
  std::ofstream(dir.path / "text.txt") << "Hello world";
  expect_one_line_refusal(
      run_cputrain("tokenize --model " + (models / "ggml-vocab-bert-bge.gguf").string() +
                       " --text " + (dir.path / "text.txt").string(),
                   dir.path),
      "tokenizer bert, which cputrain does not read (it reads llama, gpt2 and gemma4)");
  // Every vocabulary with test vectors is one of the above or of the tests before.
  size_t shipped = 0;
  for (const auto& entry : fs::directory_iterator(models))
    shipped += entry.path().extension() == ".inp";
  EXPECT_EQ(shipped, 15u);
}

// A chat turn: with special tokens parsed, <|im_start|> and <|im_end|> are their own ids, as
// llama.cpp gives them; without, they are text.
// Chat turns: with special tokens parsed, the markers are their own ids, as llama.cpp gives them
// (ChatML in Qwen2's byte-level vocabulary; Llama 2's [INST] turns with <s> and </s> in a
// SentencePiece-style one, where each text after a special token takes the dummy prefix; a
// conversation rendered with Llama 3's, ChatML's and Phi-3's templates in their vocabularies);
// without, they are text.
TEST(LlamaCppVocab, SpecialTokensInAChatTurn) {
  REQUIRE_ORACLE();
  std::vector<std::pair<std::string, std::string>> cases = {
      {"qwen2", "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"},
      {"llama-spm", "[INST] What is 2+2? [/INST] 4</s><s>[INST] And 3+3? [/INST]"}};
  // Each family's template rendering a conversation, in its family's vocabulary: Llama 3's
  // (Llama 3.x, SmolLM3), ChatML in Qwen3.5's, Phi-3's.
  const std::vector<ChatMessage> messages = {
      {"system", "Be terse."}, {"user", "What is 2+2?"}, {"assistant", "4"}, {"user", "And 3+3?"}};
  for (const auto& [vocab, family] : {std::pair{"llama-bpe", "llama3"},
                                      std::pair{"qwen35", "chatml"}, std::pair{"phi-3", "phi3"}})
    cases.emplace_back(vocab, render_chat_text(chat_template_named(family, "--chat-template", ""),
                                               messages, true));
  const TempFolder dir{temp_dir("chat")};
  for (const auto& [name, turn] : cases) {
    const fs::path vocab =
        fs::path(CPUTRAIN_LLAMACPP_SRC) / "models" / ("ggml-vocab-" + std::string(name) + ".gguf");
    const Tokenizer tokenizer =
        Tokenizer::from_vocabulary(gguf_vocabulary(GgufFile(vocab.string())));
    std::ofstream(dir.path / "turn.txt", std::ios::binary) << turn;
    for (bool special : {true, false}) {
      const std::string cmd = kOracle + " tokenize " + vocab.string() + " " +
                              (dir.path / "turn.txt").string() + (special ? " special" : "") +
                              " > " + (dir.path / "ids.txt").string();
      ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
      std::vector<int32_t> expected;
      std::istringstream ids(read_all(dir.path / "ids.txt"));
      for (int32_t id; ids >> id;) expected.push_back(id);
      const std::vector<int32_t> ours = tokenizer.vocabulary()->encode(turn, special);
      EXPECT_EQ(ours, expected) << name << (special ? " special" : " plain");
    }
  }
}

// llama.cpp's rendering of `messages` with `tmpl` (a built-in name or a file of Jinja text).
std::string oracle_chat(const std::string& tmpl, const std::vector<ChatMessage>& messages,
                        bool prompt, const fs::path& dir) {
  {
    std::ofstream out(dir / "messages.bin", std::ios::binary);
    for (const ChatMessage& m : messages) out << m.role << '\x1f' << m.content << '\x1e';
  }
  const std::string cmd = kOracle + " chat '" + tmpl + "' " + (dir / "messages.bin").string() +
                          (prompt ? " prompt" : "") + " > " + (dir / "chat.txt").string();
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
  return read_all(dir / "chat.txt");
}

// A Jinja template rendered by jinja2 as Hugging Face renders it, with no BOS text
// (tests/interop/render_chat_template.py): the reference where llama.cpp's
// llama_chat_apply_template does not render a template.
std::string jinja_chat(const fs::path& tmpl, const std::vector<ChatMessage>& messages, bool prompt,
                       const fs::path& dir) {
  nlohmann::json list = nlohmann::json::array();
  for (const ChatMessage& m : messages) list.push_back({{"role", m.role}, {"content", m.content}});
  {
    std::ofstream out(dir / "messages.json");
    out << list.dump();
  }
  const std::string cmd = "/usr/bin/python3 " + std::string(CPUTRAIN_SOURCE_DIR) +
                          "/tests/interop/render_chat_template.py '" + tmpl.string() + "' " +
                          (dir / "messages.json").string() + (prompt ? " prompt" : "") + " > " +
                          (dir / "jinja.txt").string();
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
  return read_all(dir / "jinja.txt");
}

// Chat templates against llama.cpp's llama_chat_apply_template: each family (and Llama 2's
// variants) by name, and real models' templates recognised from their Jinja text, render the
// same text, with and without the assistant's turn begun, with a system message or none, and
// with whitespace around messages that some families strip. The replies are exactly the
// assistant's contents and the marker that ends each.
TEST(LlamaCppChat, TemplatesRenderAsLlamaCppRendersThem) {
  REQUIRE_ORACLE();
  const TempFolder dir{temp_dir("chat_templates")};
  const std::vector<ChatMessage> with_system = {{"system", "You are terse."},
                                                {"user", " What is 2+2?\n"},
                                                {"assistant", "4"},
                                                {"user", "And 3+3?"},
                                                {"assistant", "  6 \n"}};
  const std::vector<ChatMessage> without(with_system.begin() + 1, with_system.end());
  const auto llama2 = [](bool system_block, bool bos, bool strip) {
    ChatTemplate t;
    t.family = ChatFamily::Llama2;
    t.system_block = system_block;
    t.bos_in_history = bos;
    t.strip = strip;
    return t;
  };
  const std::pair<std::string, ChatTemplate> named[] = {
      {"chatml", chat_template_named("chatml", "--chat-template", "")},
      {"llama3", chat_template_named("llama3", "--chat-template", "")},
      {"llama2", llama2(false, false, false)},
      {"llama2-sys", llama2(true, false, false)},
      {"llama2-sys-bos", chat_template_named("llama2", "--chat-template", "")},
      {"llama2-sys-strip", llama2(true, false, true)},
      {"mistral-v3", chat_template_named("mistral", "--chat-template", "")},
      {"zephyr", chat_template_named("zephyr", "--chat-template", "<|endoftext|>")},
      {"phi3", chat_template_named("phi3", "--chat-template", "")},
      {"gemma", chat_template_named("gemma", "--chat-template", "")}};
  size_t compared = 0;
  for (const auto& [name, tmpl] : named) {
    for (const auto* messages : {&with_system, &without}) {
      for (const bool prompt : {false, true}) {
        EXPECT_EQ(render_chat_text(tmpl, *messages, prompt),
                  oracle_chat(name, *messages, prompt, dir.path))
            << name << (prompt ? ", prompt" : "") << (messages == &without ? ", no system" : "");
        ++compared;
      }
    }
    // The replies: each assistant content (as the family writes it) and its end marker.
    std::string replies;
    for (const ChatPiece& p : render_chat(tmpl, with_system, false))
      if (p.reply) replies += p.text + "|";
    EXPECT_NE(replies.find('4'), std::string::npos) << name;
    EXPECT_EQ(replies.find("What"), std::string::npos) << name;
    EXPECT_EQ(replies.find("terse"), std::string::npos) << name;
  }
  EXPECT_EQ(compared, 40u);
  // Real templates: recognised from their text as llama.cpp recognises them.
  const fs::path templates = fs::path(CPUTRAIN_LLAMACPP_SRC) / "models" / "templates";
  const std::pair<const char*, ChatFamily> real[] = {
      {"Qwen-Qwen2.5-7B-Instruct.jinja", ChatFamily::ChatMl},
      {"HuggingFaceTB-SmolLM3-3B.jinja", ChatFamily::ChatMl},
      {"meta-llama-Llama-3.1-8B-Instruct.jinja", ChatFamily::Llama3},
      {"meta-llama-Llama-3.2-3B-Instruct.jinja", ChatFamily::Llama3},
      {"Qwen-Qwen3-0.6B.jinja", ChatFamily::ChatMl},
      {"Qwen3.5-4B.jinja", ChatFamily::ChatMl},
      {"microsoft-Phi-3.5-mini-instruct.jinja", ChatFamily::Phi3},
      {"google-gemma-2-2b-it.jinja", ChatFamily::Gemma}};
  for (const auto& [file, family] : real) {
    const std::string text = read_all(templates / file);
    const std::optional<ChatTemplate> t = detect_chat_template(text, "</s>");
    ASSERT_TRUE(t.has_value()) << file;
    EXPECT_EQ(t->family, family) << file;
    for (const bool prompt : {false, true})
      EXPECT_EQ(render_chat_text(*t, with_system, prompt),
                oracle_chat((templates / file).string(), with_system, prompt, dir.path))
          << file;
  }
  // Gemma 4's, which llama_chat_apply_template does not render: as jinja2 renders the template
  // itself, with a system turn and without, the next reply begun (after its empty thought
  // channel) and not.
  for (const char* file :
       {"google-gemma-4-31B-it.jinja", "google-gemma-4-31B-it-interleaved.jinja"}) {
    const std::optional<ChatTemplate> t = detect_chat_template(read_all(templates / file), "<eos>");
    ASSERT_TRUE(t.has_value()) << file;
    EXPECT_EQ(t->family, ChatFamily::Gemma4) << file;
    for (const std::vector<ChatMessage>* messages : {&with_system, &without})
      for (const bool prompt : {false, true})
        EXPECT_EQ(render_chat_text(*t, *messages, prompt),
                  jinja_chat(templates / file, *messages, prompt, dir.path))
            << file << (prompt ? ", prompt" : "") << (messages == &without ? ", no system" : "");
  }
  {
    // Its replies: each assistant content, trimmed, and the marker that ends it.
    std::string replies;
    for (const ChatPiece& p :
         render_chat(chat_template_named("gemma4", "--chat-template", "<eos>"), with_system, false))
      if (p.reply) replies += p.text + "|";
    EXPECT_EQ(replies, "4|<turn|>|6|<turn|>|");
  }
  // Llama 2's own template, and Mistral v0.1's (which llama.cpp renders as Llama 2's).
  const std::pair<std::string, std::string> jinja[] = {
      {"llama2-chat",
       "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set "
       "system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% "
       "set system_message = false %}{% endif %}{% for message in loop_messages %}{% if "
       "loop.index0 "
       "== 0 and system_message != false %}{% set content = '<<SYS>>\\n' + system_message + "
       "'\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}{% set content = message['content'] "
       "%}{% endif %}{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + "
       "content.strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ ' '  + "
       "content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"},
      {"mistral-instruct-v0.1",
       "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}{{ '[INST] ' "
       "+ message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ "
       "message['content'] + eos_token + ' ' }}{% endif %}{% endfor %}"}};
  for (const auto& [name, text] : jinja) {
    std::ofstream(dir.path / (name + ".jinja")) << text;
    const std::optional<ChatTemplate> t = detect_chat_template(text, "</s>");
    ASSERT_TRUE(t.has_value()) << name;
    EXPECT_EQ(t->family, ChatFamily::Llama2) << name;
    EXPECT_EQ(render_chat_text(*t, without, false),
              oracle_chat((dir.path / (name + ".jinja")).string(), without, false, dir.path))
        << name;
  }
  // Zephyr's (a zephyr turn ends with the model's EOS), and what is none of the families.
  const std::optional<ChatTemplate> zephyr = detect_chat_template(
      "{% for message in messages %}{% if message['role'] == 'user' %}{{ '<|user|>\\n' + "
      "message['content'] + eos_token }}{% elif message['role'] == 'assistant' %}{{ "
      "'<|assistant|>\\n' + message['content'] + eos_token }}{% endif %}{% endfor %}",
      "</s>");
  ASSERT_TRUE(zephyr.has_value());
  EXPECT_EQ(zephyr->family, ChatFamily::Zephyr);
  EXPECT_EQ(render_chat_text(*zephyr, without, true),
            "<|user|>\n What is 2+2?\n</s>\n<|assistant|>\n4</s>\n<|user|>\nAnd 3+3?</s>\n"
            "<|assistant|>\n  6 \n</s>\n<|assistant|>\n");
  for (const char* other :
       {"mistralai-Mistral-Nemo-Instruct-2407.jinja", "unsloth-mistral-Devstral-Small-2507.jinja"})
    EXPECT_FALSE(detect_chat_template(read_all(templates / other), "</s>").has_value()) << other;
  EXPECT_THROW(chat_template_named("vicuna", "--chat-template", ""), UserError);
}

// A corpus of a few hundred short documents.
fs::path write_corpus(const fs::path& dir) {
  std::ofstream out(dir / "corpus.txt");
  const char* words[] = {"the cat", "a dog", "sat on", "the mat", "and ran", "far away", "at noon"};
  for (int d = 0; d < 300; ++d) {
    for (int w = 0; w < 8; ++w) out << words[(d * 3 + w * 5) % 7] << (w % 4 == 3 ? ".\n" : " ");
    out << "%\n";
  }
  return dir / "corpus.txt";
}

// Runs trained here, exported: llama.cpp computes the same logits from the f32 file (the mini
// preset; a llama with half-split RoPE, which export reorders into llama.cpp's adjacent pairs, and
// q/k/v biases; one of each architecture qwen2, qwen3, smollm3, phi3, gemma3, qwen35 and gemma4
// with experts, exported as that architecture)
// and tokenizes text to the same ids; export then import gives the f32 weights bit for bit, and the
// bf16 ones as the weights rounded to bf16.
TEST(LlamaCpp, RunsExportedToGgufComputeTheSameInLlamaCpp) {
  REQUIRE_ORACLE();
  const TempFolder folder{temp_dir("export")};
  const fs::path& dir = folder.path;
  const std::string corpus = write_corpus(dir).string();
  const std::string text = "the cat sat on the mat and ran far away.\n the dog at noon";
  const std::pair<const char*, const char*> runs[] = {
      {"mini", "--preset mini"},
      {"halfsplit", "--preset tiny --rope-pairs half-split --kv-heads 2 --qkv-bias"},
      {"qwen2", "--preset tiny --arch qwen2 --tie-embeddings"},
      {"qwen3", "--preset tiny --arch qwen3 --heads 3 --kv-heads 1 --head-dim 24"},
      {"smollm3", "--preset tiny --arch smollm3 --layers 4 --tie-embeddings"},
      // (Not named phi3: llama.cpp reads the vocabulary of a model so named as Phi-3's own,
      // which holds <|endoftext|>; cputrain's own has none.)
      {"fused", "--preset tiny --arch phi3 --kv-heads 2"},
      // Windows of 8 on five layers in six, shorter than the text.
      {"gemma3", "--preset tiny --arch gemma3 --layers 6 --sliding-window 8"},
      // Gated DeltaNet in layers 0-2 and 4-6 (2 key heads read by 4 value heads), gated attention
      // in layers 3 and 7; heads of 40, RoPE on 10 of them: five pairs over M-RoPE's sections.
      {"qwen35", "--preset tiny --arch qwen35 --layers 8 --head-dim 40"},
      // Gemma 4 with per-layer embeddings, windows of 8 and 4 GELU experts of 24 beside the MLP
      // (their gate and up apart, as llama.cpp also reads them). Within 1e-3: llama.cpp's GELU
      // goes through its fp16 table in the MLP, the experts and the per-layer inputs' gate of a
      // trained model (the random files of Families.Gemma4*, drawn small, hold 1e-4).
      {"gemma4moe",
       "--preset tiny --arch gemma4 --layers 6 --sliding-window 8 --experts 4 --expert-ffn 24"}};
  for (const auto& [name, flags] : runs) {
    const fs::path run = dir / name, gguf = dir / (std::string(name) + ".gguf");
    ASSERT_EQ(
        cputrain(std::string(flags) + " --vocab 400 --ctx 64 --batch 2 --steps 3 " +
                 "--sample-tokens 1 --dtype fp32 --corpus " + corpus + " --out " + run.string()),
        0)
        << name;
    ASSERT_EQ(cputrain("export --run " + run.string() + " --out " + gguf.string()), 0) << name;
    LoadedModel ours = load_model(run.string(), "--run", "", kDefaultImportCtx);
    std::vector<int32_t> tokens = {ours.tokenizer->bos_id()};
    for (int32_t id : ours.tokenizer->encode(text)) tokens.push_back(id);
    EXPECT_LT(max_abs_difference(our_logits(ours, tokens), oracle_logits(gguf, tokens, dir)),
              std::string_view(name) == "gemma4moe" ? 1e-3 : 1e-4)
        << name;
    // The same ids from llama.cpp's tokenizer of the exported file.
    std::ofstream(dir / "text.txt", std::ios::binary) << text;
    const std::string cmd = kOracle + " tokenize " + gguf.string() + " " +
                            (dir / "text.txt").string() + " > " + (dir / "ids.txt").string();
    ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
    std::vector<int32_t> ids;
    std::istringstream in(read_all(dir / "ids.txt"));
    for (int32_t id; in >> id;) ids.push_back(id);
    EXPECT_EQ(ids, std::vector<int32_t>(tokens.begin() + 1, tokens.end())) << name;
  }
  // Export then import: f32 bit for bit, bf16 the weights rounded to bf16.
  LoadedModel trained = load_model((dir / "mini").string(), "--run", "", kDefaultImportCtx);
  const ParameterSet& p = trained.model->parameters();
  for (const char* type : {"f32", "bf16"}) {
    const fs::path gguf = dir / (std::string("mini_") + type + ".gguf");
    ASSERT_EQ(cputrain("export --run " + (dir / "mini").string() + " --type " + type + " --out " +
                       gguf.string()),
              0);
    LoadedModel back = load_model(gguf.string(), "--model", "", kDefaultImportCtx);
    const ParameterSet& q = back.model->parameters();
    ASSERT_EQ(p.infos().size(), q.infos().size());
    size_t differ = 0;
    for (size_t i = 0; i < p.infos().size(); ++i) {
      const auto n = static_cast<size_t>(p.infos()[i].shape.numel());
      std::vector<float> a(n), b(n);
      p.read_values(static_cast<int>(i), a.data());
      q.read_values(static_cast<int>(i), b.data());
      const bool matrix = p.infos()[i].shape.ndim() == 2;
      for (size_t j = 0; j < n; ++j) {
        float want = a[j];
        if (std::string(type) == "bf16" && matrix) {
          uint32_t bits;
          std::memcpy(&bits, &want, 4);
          bits = (bits + 0x7fff + ((bits >> 16) & 1)) & 0xffff0000u;
          std::memcpy(&want, &bits, 4);
        }
        differ += std::memcmp(&want, &b[j], 4) != 0;
      }
    }
    EXPECT_EQ(differ, 0u) << type;
  }
}

using cli_test::rewrite_gguf;

// Bad model files: one line naming the file and what is wrong, a non-zero exit.
TEST(ModelFiles, BadGgufFilesGetOneClearLine) {
  REQUIRE_SHARED("stories260K.gguf");
  const TempFolder folder{temp_dir("bad")};
  const fs::path& dir = folder.path;
  const fs::path good = kShared / "stories260K.gguf";
  const std::string bytes = read_all(good);
  const auto expect_refused = [&](const fs::path& file, const std::string& needle) {
    const Result r = run_cputrain("sample --model " + file.string() + " --max-tokens 1", dir);
    EXPECT_NE(r.exit_code, 0) << file;
    EXPECT_NE(r.err.find(needle), std::string::npos) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  };
  std::ofstream(dir / "truncated.gguf", std::ios::binary) << bytes.substr(0, bytes.size() / 2);
  expect_refused(dir / "truncated.gguf", "truncated: tensor");
  std::string corrupt = bytes;
  corrupt[0] = 'X';
  std::ofstream(dir / "corrupt.gguf", std::ios::binary) << corrupt;
  expect_refused(dir / "corrupt.gguf", "not a GGUF file");
  std::string huge = bytes;
  huge[8 + 7] = 0x40;  // the tensor count's top byte
  std::ofstream(dir / "huge.gguf", std::ios::binary) << huge;
  expect_refused(dir / "huge.gguf", "exceeds what the file holds");
  rewrite_gguf(
      good, dir / "arch.gguf",
      [](const std::string& key, GgufValue& v) {
        if (key == "general.architecture") v.text = "mamba";
        return true;
      },
      nullptr);
  expect_refused(dir / "arch.gguf",
                 "architecture mamba, which cputrain does not compute (it computes " +
                     architecture_names() + ")");
  rewrite_gguf(good, dir / "type.gguf", nullptr,
               [](const std::string& name, std::vector<int64_t>& dims, uint32_t& type,
                  std::vector<uint8_t>& data) {
                 if (name != "blk.0.attn_q.weight") return;
                 type = 3;  // Q4_1: blocks of 32 in 20 bytes
                 data.assign(static_cast<size_t>(dims[0] * dims[1] / 32 * 20), 0);
               });
  expect_refused(dir / "type.gguf",
                 "tensor blk.0.attn_q.weight is Q4_1, a type cputrain does not read");
  rewrite_gguf(
      good, dir / "shape.gguf",
      [](const std::string& key, GgufValue& v) {
        if (key == "llama.feed_forward_length") v.number = 100, v.bits = 100;
        return true;
      },
      nullptr);
  expect_refused(dir / "shape.gguf",
                 "tensor blk.0.ffn_gate.weight has shape [64, 172] where the model's "
                 "hyperparameters give [64, 100]");
  rewrite_gguf(
      good, dir / "notokenizer.gguf",
      [](const std::string& key, GgufValue&) { return !key.starts_with("tokenizer."); }, nullptr);
  expect_refused(dir / "notokenizer.gguf", "no tokenizer (tokenizer.ggml.tokens)");
  expect_refused(dir / "missing.gguf", "no such file or folder");
}

// Bad Hugging Face folders: one line naming the file and what is wrong, a non-zero exit.
TEST(ModelFiles, BadHuggingFaceFoldersGetOneClearLine) {
  REQUIRE_ORACLE();  // gguf-py, which writes the folder, comes with it
  const fs::path good = made_models() / "llama_gqa_hf";
  const TempFolder folder{temp_dir("badhf")};
  const fs::path& dir = folder.path;
  const auto variant = [&](const std::string& name) {
    const fs::path copy = dir / name;
    fs::copy(good, copy, fs::copy_options::recursive);
    return copy;
  };
  const auto expect_refused = [&](const fs::path& model, const std::string& needle) {
    const Result r = run_cputrain("sample --model " + model.string() + " --max-tokens 1", dir);
    EXPECT_NE(r.exit_code, 0) << model;
    EXPECT_NE(r.err.find(needle), std::string::npos) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  };
  const std::string weights = read_all(good / "model.safetensors");
  const fs::path truncated = variant("truncated");
  std::ofstream(truncated / "model.safetensors", std::ios::binary | std::ios::trunc)
      << weights.substr(0, weights.size() - 1000);
  expect_refused(truncated, "runs past the end of the file (truncated)");
  const fs::path corrupt = variant("corrupt");
  std::string damaged = weights;
  damaged[9] = '!';  // inside the JSON header
  std::ofstream(corrupt / "model.safetensors", std::ios::binary | std::ios::trunc) << damaged;
  expect_refused(corrupt, "not a valid safetensors file: the header is not JSON");
  const auto edit_config = [&](const fs::path& model, const std::string& key,
                               const nlohmann::json& value) {
    std::ifstream in(model / "config.json");
    nlohmann::json j = nlohmann::json::parse(in);
    j[key] = value;
    std::ofstream(model / "config.json", std::ios::trunc) << j.dump();
  };
  const fs::path gemma = variant("gemma");
  edit_config(gemma, "model_type", "mamba");
  expect_refused(gemma, "model_type mamba, which cputrain does not compute (it computes " +
                            hf_model_type_names() + ")");
  const fs::path shape = variant("shape");
  edit_config(shape, "intermediate_size", 384);
  expect_refused(shape,
                 "tensor model.layers.0.mlp.gate_proj.weight has shape [512, 256] where "
                 "config.json gives [384, 256]");
  const fs::path scaled = variant("scaled");
  edit_config(scaled, "rope_scaling", {{"type", "linear"}, {"factor", 2.0}});
  expect_refused(scaled, "rope_scaling");
  const fs::path untokenized = variant("untokenized");
  fs::remove(untokenized / "tokenizer.json");
  expect_refused(untokenized, "no tokenizer (tokenizer.json or tokenizer.model)");
  const fs::path sharded = variant("sharded");
  fs::remove(sharded / "model.safetensors");
  std::ofstream(sharded / "model.safetensors.index.json")
      << R"({"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}})";
  expect_refused(sharded, "shard model-00001-of-00002.safetensors is missing");
}

// inspect names what the file holds; tokenize gives llama.cpp's ids; eval --per-token gives the
// negative log-likelihoods llama.cpp's logits give.
TEST(ModelFiles, InspectTokenizeAndEvalAModelFile) {
  REQUIRE_ORACLE();
  REQUIRE_SHARED("stories260K.gguf");
  const TempFolder folder{temp_dir("commands")};
  const fs::path& dir = folder.path;
  const fs::path model = kShared / "stories260K.gguf";
  const Result inspect = run_cputrain("inspect " + model.string() + " --json", dir);
  ASSERT_EQ(inspect.exit_code, 0) << inspect.err;
  const nlohmann::json j = nlohmann::json::parse(inspect.out);
  EXPECT_EQ(j["architecture"], "llama");
  EXPECT_EQ(j["config"]["n_kv_heads"], 4);
  EXPECT_EQ(j["config"]["head_dim"], 8);
  EXPECT_EQ(j["tensors"]["F32"]["count"], 48);
  EXPECT_EQ(j["tokenizer"]["tokens"], 512);
  EXPECT_EQ(j["tokenizer"]["add_space_prefix"], true);
  EXPECT_GT(j["training_budget"]["total_bytes"].get<int64_t>(), 0);
  // The architecture's parts say what it may have; this model has no RoPE scaling.
  EXPECT_NE(j["parts"].get<std::string>().find("Llama 3's RoPE scaling where the model has it"),
            std::string::npos)
      << j["parts"];

  const std::string text = "Once upon a time, there was a little dog named Max. He liked to run.";
  std::ofstream(dir / "text.txt", std::ios::binary) << text;
  const Result ids = run_cputrain(
      "tokenize --no-bos --model " + model.string() + " --text " + (dir / "text.txt").string(),
      dir);
  ASSERT_EQ(ids.exit_code, 0) << ids.err;
  const std::string cmd = kOracle + " tokenize " + model.string() + " " +
                          (dir / "text.txt").string() + " > " + (dir / "oracle.txt").string();
  ASSERT_EQ(std::system(cmd.c_str()), 0);
  EXPECT_EQ(ids.out, read_all(dir / "oracle.txt"));

  const Result eval = run_cputrain("eval --model " + model.string() + " --text " +
                                       (dir / "text.txt").string() + " --per-token --json",
                                   dir);
  ASSERT_EQ(eval.exit_code, 0) << eval.err;
  const nlohmann::json e = nlohmann::json::parse(eval.out);
  std::vector<int32_t> tokens;
  for (const auto& t : e["per_token"]) tokens.push_back(t["id"].get<int32_t>());
  ASSERT_GT(tokens.size(), 10u);
  EXPECT_EQ(tokens[0], 1);  // BOS
  const std::vector<float> logits = oracle_logits(model, tokens, dir);
  const size_t V = 512;
  double total = 0.0;
  for (size_t i = 1; i < tokens.size(); ++i) {
    const float* row = logits.data() + (i - 1) * V;
    double max = row[0], sum = 0.0;
    for (size_t v = 1; v < V; ++v) max = std::max<double>(max, row[v]);
    for (size_t v = 0; v < V; ++v) sum += std::exp(row[v] - max);
    const double nll = max + std::log(sum) - row[tokens[i]];
    EXPECT_NEAR(e["per_token"][i]["nll"].get<double>(), nll, 1e-4) << i;
    total += nll;
  }
  EXPECT_NEAR(e["loss"].get<double>(), total / static_cast<double>(tokens.size() - 1), 1e-5);
}

// Exported as Hugging Face folders and read back: runs trained here (adjacent RoPE pairs, reordered
// into rotate-half rows; a qwen2-shaped one) and a GGUF model give the same logits and token ids
// as before; a bf16 folder holds the weights rounded to bf16.
TEST(ModelFiles, HuggingFaceExportReadsBackAsTheSameModel) {
  REQUIRE_ORACLE();  // gguf-py writes the GGUF model
  const TempFolder folder{temp_dir("hf_export")};
  const fs::path& dir = folder.path;
  const std::string corpus = write_corpus(dir).string();
  const std::string text = "the cat sat on the mat and ran far away.\n the dog at noon";
  for (const char* flags :
       {"--preset tiny --kv-heads 2", "--preset tiny --arch qwen2 --tie-embeddings",
        "--preset tiny --arch qwen3 --heads 3 --kv-heads 1 --head-dim 24",
        "--preset tiny --arch smollm3 --layers 4", "--preset tiny --arch phi3 --kv-heads 2"}) {
    const fs::path run = dir / "run", hf = dir / "hf";
    fs::remove_all(run);
    fs::remove_all(hf);
    ASSERT_EQ(
        cputrain(std::string(flags) + " --vocab 400 --ctx 64 --batch 2 --steps 3 " +
                 "--sample-tokens 1 --dtype fp32 --corpus " + corpus + " --out " + run.string()),
        0);
    ASSERT_EQ(cputrain("export --run " + run.string() + " --out " + hf.string()), 0) << flags;
    LoadedModel ours = load_model(run.string(), "--run", "", kDefaultImportCtx);
    LoadedModel back = load_model(hf.string(), "--model", "", kDefaultImportCtx);
    EXPECT_EQ(back.config.qkv_bias, ours.config.qkv_bias) << flags;
    EXPECT_EQ(back.config.architecture, ours.config.architecture) << flags;
    EXPECT_EQ(back.config.qk_norm, ours.config.qk_norm) << flags;
    EXPECT_EQ(back.config.no_rope_layers, ours.config.no_rope_layers) << flags;
    EXPECT_EQ(back.config.tie_embeddings, ours.config.tie_embeddings) << flags;
    const std::vector<int32_t> ids = ours.tokenizer->encode(text);
    EXPECT_EQ(back.tokenizer->encode(text), ids) << flags;
    std::vector<int32_t> tokens = {ours.tokenizer->bos_id()};
    tokens.insert(tokens.end(), ids.begin(), ids.end());
    EXPECT_LT(max_abs_difference(our_logits(ours, tokens), our_logits(back, tokens)), 1e-5)
        << flags;
  }
  // A GGUF model with a SentencePiece-style vocabulary: tokenizer.json with merges from its
  // scores.
  const fs::path gguf = made_models() / "llama_gqa.gguf", hf = dir / "from_gguf";
  ASSERT_EQ(cputrain("export --model " + gguf.string() + " --type bf16 --out " + hf.string()), 0);
  LoadedModel original = load_model(gguf.string(), "--model", "", kDefaultImportCtx);
  LoadedModel back = load_model(hf.string(), "--model", "", kDefaultImportCtx);
  const std::string words = "the cat sat on the mat and the dog ran far xyz";
  EXPECT_EQ(back.tokenizer->encode(words), original.tokenizer->encode(words));
  const ParameterSet& p = original.model->parameters();
  const ParameterSet& q = back.model->parameters();
  size_t differ = 0;
  for (size_t i = 0; i < p.infos().size(); ++i) {
    if (p.infos()[i].name.find("wq") != std::string::npos ||
        p.infos()[i].name.find("wk") != std::string::npos)
      continue;  // rows reordered
    const auto n = static_cast<size_t>(p.infos()[i].shape.numel());
    std::vector<float> a(n), b(n);
    p.read_values(static_cast<int>(i), a.data());
    q.read_values(static_cast<int>(i), b.data());
    for (size_t j = 0; j < n; ++j) {
      uint32_t bits;
      std::memcpy(&bits, &a[j], 4);
      bits = (bits + 0x7fff + ((bits >> 16) & 1)) & 0xffff0000u;
      float want;
      std::memcpy(&want, &bits, 4);
      differ += want != b[j];
    }
  }
  EXPECT_EQ(differ, 0u);
  // The bf16 folder held as bf16: its GEMM weights and its untied embedding (read row by row)
  // mapped from model.safetensors, the same values and logits as the folder read into FP32
  // masters.
  LoadedModel in_place = load_model(hf.string(), "--model", "", kDefaultImportCtx, true);
  ASSERT_TRUE(in_place.bf16_weights);
  const ParameterSet& r = in_place.model->parameters();
  for (size_t i = 0; i < r.infos().size(); ++i) {
    EXPECT_EQ(r.mapped(static_cast<int>(i)), r.infos()[i].bf16_copy || r.infos()[i].master_read)
        << r.infos()[i].name;
    const auto n = static_cast<size_t>(r.infos()[i].shape.numel());
    std::vector<float> a(n), b(n);
    q.read_values(static_cast<int>(i), a.data());
    r.read_values(static_cast<int>(i), b.data());
    EXPECT_EQ(a, b) << r.infos()[i].name;
  }
  expect_one_line_refusal(
      run_cputrain(
          "export --model " + gguf.string() + " --type q8_0 --out " + (dir / "q8").string(), dir),
      "--type q8_0: only for a GGUF file");
  expect_one_line_refusal(
      run_cputrain("export --model " + gguf.string() + " --out " + hf.string(), dir),
      "exists; choose another name or give --overwrite");
}

// train --model: a run begins from a pretrained model's shape, tokenizer and weights (its first
// loss far below a random model's ln(512) = 6.24), keeps the tokenizer through resume, sample and
// tokenize, and refuses shape flags.
TEST(ModelFiles, TrainingBeginsFromAModelFile) {
  REQUIRE_SHARED("stories260K.gguf");
  const TempFolder folder{temp_dir("from_model")};
  const fs::path& dir = folder.path;
  const fs::path model = kShared / "stories260K.gguf", run = dir / "run";
  const std::string corpus = write_corpus(dir).string();
  const std::string flags = "--model " + model.string() +
                            " --ctx 64 --batch 4 --sample-tokens 8 --dtype fp32 --corpus " + corpus;
  expect_one_line_refusal(run_cputrain(flags + " --d-model 32 --out " + (dir / "x").string(), dir),
                          "--d-model: the model's shape comes from --model");
  ASSERT_EQ(cputrain(flags + " --steps 3 --out " + run.string()), 0);
  EXPECT_TRUE(fs::exists(run / "tokenizer.gguf"));
  std::ifstream config_file(run / "config.json");
  const nlohmann::json config = nlohmann::json::parse(config_file);
  EXPECT_EQ(config["init"], fs::absolute(model).lexically_normal().string());
  EXPECT_EQ(config["model"]["n_kv_heads"], 4);
  std::ifstream metrics(run / "metrics.jsonl");
  std::string first;
  ASSERT_TRUE(std::getline(metrics, first));
  EXPECT_LT(nlohmann::json::parse(first)["loss"].get<double>(), 5.0) << first;
  ASSERT_EQ(cputrain("--resume " + run.string() + " --steps 5 --sample-tokens 8"), 0);
  // The run's tokenizer is the model's.
  const std::string text = "Once upon a time, a little cat sat on the mat.";
  std::ofstream(dir / "text.txt") << text;
  const Result from_run = run_cputrain(
      "tokenize --model " + run.string() + " --text " + (dir / "text.txt").string(), dir);
  const Result from_model = run_cputrain(
      "tokenize --model " + model.string() + " --text " + (dir / "text.txt").string(), dir);
  ASSERT_EQ(from_run.exit_code, 0) << from_run.err;
  EXPECT_EQ(from_run.out, from_model.out);
  const Result sampled =
      run_cputrain("sample --run " + run.string() + " --temperature 0 --max-tokens 8", dir);
  ASSERT_EQ(sampled.exit_code, 0) << sampled.err;
  EXPECT_FALSE(sampled.out.starts_with(" ")) << sampled.out;  // no dummy-prefix space shown
}

// `cputrain sample --temperature 0` from BOS is llama2.c's published greedy output, token for
// token (256 of them, as run.c -n 256 gives).
TEST(LlamaCpp, Stories260kGreedyTextIsThePublishedOne) {
  REQUIRE_SHARED("stories260K.gguf");
  const TempFolder folder{temp_dir("greedy")};
  const fs::path& dir = folder.path;
  const std::string cmd = std::string(CPUTRAIN_BINARY) + " sample --model " +
                          (kShared / "stories260K.gguf").string() +
                          " --temperature 0 --max-tokens 256 > " + (dir / "out.txt").string();
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  EXPECT_EQ(read_all(dir / "out.txt"), read_all(kShared / "stories260K.greedy.txt"));
}

}  // namespace
}  // namespace cputrain

namespace cputrain {
namespace {

using namespace interop_test;

// LoRA over a quantised base (llama.cpp's Q8_0 and Q4_K_M files), held quantised: the adapter
// trained in bf16 gives, over that base, llama.cpp's logits within the bounds of its quantised
// activations (argmax at 99% of positions or more, mean NLL within 0.01), over a text the adapted
// model samples; merged into the base (export --merge, F32), llama.cpp computes ours.
TEST(LlamaCppLora, AnAdapterTrainedOverAQuantisedBaseGivesLlamaCppsLogits) {
  REQUIRE_ORACLE();
  const TempFolder folder{temp_dir("lora_quant")};
  const fs::path& dir = folder.path;
  const fs::path data = write_finetune_data(dir);
  for (const char* type : {"q8_0", "q4_k_m"}) {
    const fs::path base = quantized_model(type);
    const fs::path run = dir / type;
    const Result r =
        run_cputrain("finetune --model " + base.string() + " --data " + data.string() + " --out " +
                         run.string() + " --steps 4 --dtype bf16 --lr 1e-2 --ctx 64 --batch 2",
                     dir);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    EXPECT_NE(r.out.find("quantised weights read in place"), std::string::npos) << r.out;
    const fs::path adapter = run / "adapter.gguf";
    LoadedModel plain = load_model(base.string(), "--model", "", kDefaultImportCtx);
    LoadedModel with =
        load_model(base.string(), "--model", "", kDefaultImportCtx, false, adapter.string());
    const std::vector<int32_t> tokens = sampled_text(with, 17);
    const std::vector<float> ours = our_logits(with, tokens);
    const Agreement a =
        agreement(ours, oracle_logits(base, tokens, dir, adapter), tokens, with.config.vocab);
    EXPECT_GE(a.argmax, 0.99) << type;
    EXPECT_NEAR(a.nll_ours, a.nll_theirs, 0.01) << type;
    EXPECT_GT(max_abs_difference(ours, our_logits(plain, tokens)), 1e-2) << type;
    const fs::path merged = run / "merged.gguf";
    ASSERT_EQ(cputrain("export --model " + base.string() + " --adapter " + adapter.string() +
                       " --merge --out " + merged.string()),
              0);
    EXPECT_LT(max_abs_difference(ours, oracle_logits(merged, tokens, dir)), 1e-4) << type;
    // Merged and written as q4_k (Q4_K_M's mix): the tensors of the types llama.cpp's own
    // quantiser gives the merged model for Q4_K_M, each as near the merged values as llama.cpp's
    // (its RMS error within 2% of that of llama.cpp's tensor, and the tensors the adapter left
    // alone, already on the base's grid, exact); llama.cpp loads it and computes cputrain's
    // logits on it (argmax at 97% of positions, mean NLL within 0.01).
    const fs::path q4k = run / "merged_q4k.gguf", theirs_q4k = run / "merged_q4_k_m.gguf";
    ASSERT_EQ(cputrain("export --model " + base.string() + " --adapter " + adapter.string() +
                       " --merge --type q4_k --out " + q4k.string()),
              0);
    ASSERT_EQ(std::system((kOracle + " quantize " + merged.string() + " " + theirs_q4k.string() +
                           " q4_k_m >/dev/null 2>&1")
                              .c_str()),
              0);
    const GgufFile exact(merged.string()), mine(q4k.string()), reference(theirs_q4k.string());
    ASSERT_EQ(mine.tensors().size(), reference.tensors().size());
    for (const GgufTensor& t : reference.tensors()) {
      ASSERT_NE(mine.tensor(t.name), nullptr) << t.name;
      EXPECT_EQ(ggml_type_name(mine.tensor(t.name)->type), ggml_type_name(t.type)) << t.name;
      if (t.dims.size() != 2) continue;
      const std::vector<float> x = gguf_tensor_values(exact, *exact.tensor(t.name));
      const std::vector<float> a = gguf_tensor_values(mine, *mine.tensor(t.name));
      const std::vector<float> b = gguf_tensor_values(reference, t);
      double ea = 0.0, eb = 0.0;
      for (size_t i = 0; i < x.size(); ++i) {
        ea += (static_cast<double>(a[i]) - x[i]) * (static_cast<double>(a[i]) - x[i]);
        eb += (static_cast<double>(b[i]) - x[i]) * (static_cast<double>(b[i]) - x[i]);
      }
      EXPECT_LE(std::sqrt(ea), 1.02 * std::sqrt(eb)) << type << " " << t.name;
    }
    LoadedModel ours_q = load_model(q4k.string(), "--model", "", kDefaultImportCtx);
    const Agreement b = agreement(our_logits(ours_q, tokens), oracle_logits(q4k, tokens, dir),
                                  tokens, with.config.vocab);
    // (A merged adapter trained at a high rate makes a flatter model than the base: near-ties
    // between the first two logits, which llama.cpp's 8-bit activations may swap, are more
    // common on its text, so the argmax bound is looser than the base's.)
    EXPECT_GE(b.argmax, 0.97) << type;
    EXPECT_NEAR(b.nll_ours, b.nll_theirs, 0.01) << type;
  }
}

// Prompt/completion pairs in plain ASCII, for any vocabulary.
// A few steps of `cputrain finetune` (LoRA on all seven projections, fp32) on stories260K (GQA,
// adjacent RoPE pairs) and on a qwen2 model (biases, a tied head, half-split RoPE): llama.cpp
// with the base GGUF and the adapter file computes what cputrain computes with the adapter,
// within 1e-4, and both differ from the base. The adapter is refused on another architecture,
// on other shapes, and on a base of the same shape with other weights (its fingerprint); a copy
// of the base in another format takes it.
TEST(LlamaCppLora, FineTunedAdapterGivesLlamaCppsLogits) {
  REQUIRE_ORACLE();
  REQUIRE_SHARED("stories260K.gguf");
  const TempFolder folder{temp_dir("lora")};
  const fs::path& dir = folder.path;
  const fs::path data = write_finetune_data(dir);
  const fs::path models[] = {kShared / "stories260K.gguf", made_models() / "qwen2_tied.gguf"};
  for (const fs::path& base : models) {
    const fs::path run = dir / ("ft_" + base.stem().string());
    ASSERT_EQ(
        cputrain("finetune --model " + base.string() + " --data " + data.string() + " --out " +
                 run.string() + " --steps 4 --dtype fp32 --lr 1e-2 --ctx 64 --batch 2 --accum 1"),
        0)
        << base;
    const fs::path adapter = run / "adapter.gguf";
    ASSERT_TRUE(fs::exists(adapter)) << adapter;
    LoadedModel plain = load_model(base.string(), "--model", "", kDefaultImportCtx);
    LoadedModel with =
        load_model(base.string(), "--model", "", kDefaultImportCtx, false, adapter.string());
    EXPECT_EQ(with.model->lora().rank, 16) << base;
    const std::vector<int32_t> tokens =
        token_sequence(48, plain.tokenizer->vocab_size(), plain.tokenizer->bos_id(), 5);
    const std::vector<float> ours = our_logits(with, tokens);
    const std::vector<float> theirs = oracle_logits(base, tokens, dir, adapter);
    ASSERT_EQ(ours.size(), theirs.size());
    EXPECT_LT(max_abs_difference(ours, theirs), 1e-4) << base;
    EXPECT_GT(max_abs_difference(ours, our_logits(plain, tokens)), 1e-3) << base;
    // Merged into the base (export --merge): llama.cpp computes the same from the one file.
    const fs::path merged = run / "merged.gguf";
    ASSERT_EQ(cputrain("export --model " + base.string() + " --adapter " + adapter.string() +
                       " --merge --out " + merged.string()),
              0);
    EXPECT_LT(max_abs_difference(ours, oracle_logits(merged, tokens, dir)), 1e-4) << base;
    // PEFT's files: the same adapters under Hugging Face's module names, B's q rows in
    // rotate-half order.
    const nlohmann::json config =
        nlohmann::json::parse(read_all(run / "peft" / "adapter_config.json"));
    EXPECT_EQ(config["peft_type"], "LORA");
    EXPECT_EQ(config["r"], 16);
    EXPECT_EQ(config["lora_alpha"], 32.0);
    EXPECT_EQ(config["lora_dropout"], 0.0);
    EXPECT_EQ(config["target_modules"].size(), 7u);
    const SafetensorsFile peft((run / "peft" / "adapter_model.safetensors").string());
    const ParameterSet& p = with.model->parameters();
    const int qb = p.find("layers.0.attention.wq.lora_b");
    const std::string qb_name = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight";
    ASSERT_EQ(peft.tensors().count(qb_name), 1u);
    EXPECT_EQ(safetensors_values(peft.path(), qb_name, peft.tensors().at(qb_name)),
              parameter_values(p, qb, with.config, RopePairs::HalfSplit));
    int64_t adapters = 0;
    for (const ParameterInfo& info : p.infos()) adapters += is_lora_parameter(info.name);
    EXPECT_EQ(static_cast<int64_t>(peft.tensors().size()), adapters);
  }
  // Refusals, each one line.
  const fs::path stories_adapter = dir / "ft_stories260K" / "adapter.gguf";
  const auto refused = [&](const fs::path& model, const std::string& needle) {
    expect_one_line_refusal(run_cputrain("sample --model " + model.string() + " --adapter " +
                                             stories_adapter.string() + " --max-tokens 1",
                                         dir),
                            needle);
  };
  refused(made_models() / "qwen2_tied.gguf", "an adapter for a llama model, not this qwen2 one");
  refused(made_models() / "llama_gqa.gguf", "where this model takes");
  ASSERT_EQ(cputrain("finetune --model " + (kShared / "stories260K.gguf").string() + " --data " +
                     data.string() + " --out " + (dir / "full").string() +
                     " --full --steps 2 --dtype fp32 --lr 1e-2 --ctx 64 --batch 2 --accum 1"),
            0);
  refused(dir / "full" / "model.gguf", "an adapter trained on another base model");
  ASSERT_EQ(cputrain("export --model " + (kShared / "stories260K.gguf").string() +
                     " --type bf16 --out " + (dir / "copy.gguf").string()),
            0);
  EXPECT_EQ(run_cputrain("sample --model " + (dir / "copy.gguf").string() + " --adapter " +
                             stories_adapter.string() + " --max-tokens 1",
                         dir)
                .exit_code,
            0);
}

}  // namespace
}  // namespace cputrain

namespace cputrain {
namespace {

using namespace interop_test;

// A BF16 base, and a quantised one (Q4_K_M: Q4_K and Q6_K tensors), is read in place from its
// file: the budget and --mem-limit cover the rest, and each step records the RSS's anonymous part
// and its mapped files' pages apart. A limit above the rest but below the rest and the base
// fine-tunes; one below the rest is refused. `budget --model` gives the fine-tune's figures.
TEST(FineTune, ABaseReadInPlaceIsApartFromTheMemoryLimit) {
  REQUIRE_ORACLE();  // the made models need llama.cpp's gguf-py
  const TempFolder folder{temp_dir("ft_mapped")};
  const fs::path& dir = folder.path;
  const fs::path data = write_finetune_data(dir);
  for (const fs::path& model :
       {made_models() / "qwen2_tied_bf16.gguf", quantized_model("q4_k_m")}) {
    const std::string name = model.stem().string();
    const std::string flags = "finetune --model " + model.string() + " --data " + data.string() +
                              " --ctx 64 --batch 2 --steps 2 --dtype bf16";
    const Result in_ram = run_cputrain(flags + " --out " + (dir / (name + "a")).string(), dir);
    ASSERT_EQ(in_ram.exit_code, 0) << in_ram.err;
    EXPECT_EQ(in_ram.out.find("read ahead"), std::string::npos) << in_ram.out;
    const auto losses = [&](const char* run) {
      std::ifstream in(dir / (name + run) / "metrics.jsonl");
      std::vector<double> l;
      for (std::string line; std::getline(in, line);) {
        const nlohmann::json j = nlohmann::json::parse(line);
        if (j.contains("step")) l.push_back(j["loss"].get<double>());
      }
      return l;
    };
    std::ifstream in(dir / (name + "a") / "metrics.jsonl");
    std::string line;
    ASSERT_TRUE(std::getline(in, line));
    const nlohmann::json step = nlohmann::json::parse(line);
    const auto budget = step["budget_bytes"].get<int64_t>();
    const auto mapped = step["mapped_bytes"].get<int64_t>();
    // Every matrix at the file's size: bf16's two bytes a value, or Q4_K_M's blocks.
    int64_t matrices = 0;
    const GgufFile file(model.string());
    for (const GgufTensor& t : file.tensors())
      if (t.dims.size() == 2) matrices += static_cast<int64_t>(t.data.size());
    EXPECT_NEAR(static_cast<double>(mapped), static_cast<double>(matrices), 64.0 * 32) << name;
    EXPECT_GT(step["rss_file_bytes"].get<int64_t>(), 0);
    EXPECT_GT(step["rss_anon_bytes"].get<int64_t>(), 0);
    EXPECT_LT(step["rss_anon_bytes"].get<int64_t>(), step["rss_bytes"].get<int64_t>());
    const auto gib = [](double bytes) {
      return std::to_string(bytes / (1024.0 * 1024.0 * 1024.0));
    };
    const Result fits =
        run_cputrain(flags + " --mem-limit " +
                         gib(static_cast<double>(budget) + 0.5 * static_cast<double>(mapped)) +
                         " --out " + (dir / (name + "b")).string(),
                     dir);
    EXPECT_EQ(fits.exit_code, 0) << fits.err;
    // The base does not fit beside the budget there: it is read ahead, and the steps compute the
    // same, bit for bit.
    EXPECT_NE(fits.out.find("each block is read ahead"), std::string::npos) << fits.out;
    EXPECT_EQ(losses("b"), losses("a")) << name;
    EXPECT_EQ(losses("a").size(), 2u);
    // cputrain budget --model knows the same: what the base gives in place, and the rest.
    const Result b = run_cputrain("budget --model " + model.string() +
                                      " --lora-rank 16 --batch 2 --accum 4 --ctx 64 --dtype bf16 "
                                      "--json",
                                  dir);
    ASSERT_EQ(b.exit_code, 0) << b.err;
    const nlohmann::json j = nlohmann::json::parse(b.out);
    EXPECT_EQ(j["mapped_bytes"].get<int64_t>(), mapped) << name;
    EXPECT_EQ(j["total_bytes"].get<int64_t>(), budget) << name;
    EXPECT_EQ(j["total_with_mapped_bytes"].get<int64_t>(), budget + mapped) << name;
    // The table names the file's pages as such, apart from the bf16 copies, and counts them in
    // whether it fits: beside the rest, or only with the base read from the disk every pass.
    const std::string budget_flags = "budget --model " + model.string() +
                                     " --lora-rank 16 --batch 2 --accum 4 --ctx 64 --dtype bf16";
    const Result roomy = run_cputrain(
        budget_flags + " --mem-limit " + gib(static_cast<double>(budget + mapped) + 1e6), dir);
    ASSERT_EQ(roomy.exit_code, 0) << roomy.err;
    const std::string row = "base read in place (the file's pages)";
    ASSERT_NE(roomy.out.find(row), std::string::npos) << roomy.out;
    // On its own row, and not within the bf16 weight copies' as well (those of the adapters
    // alone, a small part of the base).
    const size_t row_at = roomy.out.find(row);
    EXPECT_NE(roomy.out.substr(row_at, roomy.out.find('\n', row_at) - row_at)
                  .find("+" + format_bytes(mapped)),
              std::string::npos)
        << roomy.out;
    if (const size_t at = roomy.out.find("bf16 weight copies"); at != std::string::npos) {
      const double copies = std::stod(roomy.out.substr(at + 38));
      EXPECT_LT(copies * 1024 * 1024, 0.25 * static_cast<double>(mapped)) << roomy.out;
    }
    EXPECT_NE(roomy.out.find("-> fits\n"), std::string::npos) << roomy.out;
    const Result tight =
        run_cputrain(budget_flags + " --mem-limit " +
                         gib(static_cast<double>(budget) + 0.5 * static_cast<double>(mapped)),
                     dir);
    EXPECT_EQ(tight.exit_code, 0) << tight.err;
    EXPECT_NE(tight.out.find("-> fits, with the base read from the disk every pass"),
              std::string::npos)
        << tight.out;
    expect_one_line_refusal(
        run_cputrain(flags + " --mem-limit " + gib(0.9 * static_cast<double>(budget)) + " --out " +
                         (dir / (name + "c")).string(),
                     dir),
        "the fine-tune needs");
  }
}

}  // namespace
}  // namespace cputrain
