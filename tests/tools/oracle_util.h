// Helpers of the tests that compare cputrain with llama.cpp (the oracle tools/install_deps.sh
// --llamacpp installs, driven by tests/oracle/llama_oracle.cpp): its logits of a model file,
// cputrain's of a loaded model, the random-weight models of tests/interop/, and running the
// cputrain binary.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "engine/core/tensor.h"
#include "tools/model_source.h"

namespace cputrain::interop_test {

namespace fs = std::filesystem;

inline const std::string kOracle = CPUTRAIN_LLAMA_ORACLE;
inline const fs::path kShared = CPUTRAIN_SHARED_MODELS;

#define REQUIRE_ORACLE()                                                                   \
  if (kOracle.empty())                                                                     \
  GTEST_SKIP() << "llama.cpp is not installed (tools/install_deps.sh --llamacpp installs " \
                  "it; tools/run_tests.sh does)"

#define REQUIRE_SHARED(file) \
  if (!fs::exists(kShared / (file))) GTEST_SKIP() << (kShared / (file)) << " is not there"

inline std::string read_all(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

inline fs::path temp_dir(const std::string& name) {
  const fs::path dir =
      fs::temp_directory_path() / ("cputrain_interop_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

// A folder removed when the object goes (for a static one, when the test binary exits).
struct TempFolder {
  fs::path path;
  ~TempFolder() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};
// BOS, then tokens drawn from the vocabulary.
inline std::vector<int32_t> token_sequence(int64_t n, int64_t vocab, int32_t bos, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> t = {bos};
  while (static_cast<int64_t>(t.size()) < n) t.push_back(static_cast<int32_t>(rng() % vocab));
  return t;
}

// llama.cpp's logits for every position, n x vocab; with a LoRA adapter file applied at scale 1
// where `adapter` is given.
inline std::vector<float> oracle_logits(const fs::path& model, const std::vector<int32_t>& tokens,
                                        const fs::path& dir, const fs::path& adapter = {}) {
  const fs::path out = dir / "oracle_logits.f32";
  std::string cmd = kOracle + " logits " + model.string() + " " + out.string();
  if (!adapter.empty()) cmd += " lora=" + adapter.string();
  for (int32_t t : tokens) {
    cmd += ' ';
    cmd += std::to_string(t);
  }
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
  const std::string bytes = read_all(out);
  std::vector<float> v(bytes.size() / sizeof(float));
  std::memcpy(v.data(), bytes.data(), v.size() * sizeof(float));
  return v;
}

// cputrain's logits for every position, n x vocab, in fp32.
inline std::vector<float> our_logits(LoadedModel& m, const std::vector<int32_t>& tokens) {
  const auto n = static_cast<int64_t>(tokens.size());
  Tensor input = Tensor::empty(Shape{1, n}, DType::I32, MemoryCategory::Workspace);
  std::copy(tokens.begin(), tokens.end(), input.i32());
  const Tensor logits = m.model->logits(input);
  return std::vector<float>(logits.f32(), logits.f32() + n * m.config.vocab);
}

inline double max_abs_difference(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0.0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i)
    worst = std::max(worst, std::abs(static_cast<double>(a[i]) - b[i]));
  std::printf("max |logit difference| %.3g\n", worst);
  return worst;
}

// Random-weight models written with llama.cpp's gguf-py (tests/interop/make_gguf_models.py), once
// per test binary.
inline const fs::path& made_models() {
  static const TempFolder dir{[] {
    const fs::path d = temp_dir("models");
    const std::string cmd = "/usr/bin/python3 " + std::string(CPUTRAIN_SOURCE_DIR) +
                            "/tests/interop/make_gguf_models.py " + CPUTRAIN_GGUF_PY + " " +
                            d.string();
    EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
    return d;
  }()};
  return dir.path;
}

// made_models()'s llama_gqa.gguf quantised by llama.cpp's own quantiser (llama_model_quantize)
// to `type` (q8_0, q4_0, q5_0, q5_1, q4_k_m, q5_k_m), made once: llama_gqa_TYPE.gguf beside it.
inline fs::path quantized_model(const std::string& type) {
  const fs::path out = made_models() / ("llama_gqa_" + type + ".gguf");
  if (!fs::exists(out)) {
    const std::string cmd = kOracle + " quantize " + (made_models() / "llama_gqa.gguf").string() +
                            " " + out.string() + ".tmp " + type + " >/dev/null 2>&1";
    EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
    fs::rename(out.string() + ".tmp", out);
  }
  return out;
}

// Runs cputrain with `args`; its exit status.
inline int cputrain(const std::string& args) {
  const std::string cmd = std::string(CPUTRAIN_BINARY) + " " + args + " >/dev/null";
  return std::system(cmd.c_str());
}

struct Result {
  int exit_code = -1;
  std::string out, err;
};
inline Result run_cputrain(const std::string& args, const fs::path& dir) {
  const std::string cmd = std::string(CPUTRAIN_BINARY) + " " + args + " >" +
                          (dir / "out.txt").string() + " 2>" + (dir / "err.txt").string();
  const int status = std::system(cmd.c_str());
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, read_all(dir / "out.txt"),
          read_all(dir / "err.txt")};
}

inline void expect_one_line_refusal(const Result& r, const std::string& needle) {
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find(needle), std::string::npos) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
}

inline fs::path write_finetune_data(const fs::path& dir) {
  const char* names[] = {"Lily", "Tom", "Sue", "Ben"};
  const char* things[] = {"ball", "cat", "tree", "cake"};
  std::ofstream out(dir / "data.jsonl");
  for (int i = 0; i < 48; ++i) {
    const std::string n = names[i % 4], t = things[(i / 4) % 4];
    out << "{\"prompt\": \"" << n << " had a " << t << ". What did " << n
        << " have?\", \"completion\": \" " << n << " had a " << t << ".\"}\n";
  }
  return dir / "data.jsonl";
}

// Each position's NLL of the next token, of logits (tokens, vocab).
inline std::vector<double> token_nll(const std::vector<float>& logits,
                                     const std::vector<int32_t>& tokens, int64_t vocab) {
  std::vector<double> out;
  for (size_t i = 0; i + 1 < tokens.size(); ++i) {
    const float* row = logits.data() + i * static_cast<size_t>(vocab);
    double max = row[0], sum = 0.0;
    for (int64_t v = 1; v < vocab; ++v) max = std::max<double>(max, row[v]);
    for (int64_t v = 0; v < vocab; ++v) sum += std::exp(row[v] - max);
    out.push_back(max + std::log(sum) - row[tokens[i + 1]]);
  }
  return out;
}

// Two sets of logits over `tokens` (n x vocab): the share of positions whose argmax they agree on,
// and each one's mean NLL of the next token.
struct Agreement {
  double argmax = 0.0;
  double nll_ours = 0.0, nll_theirs = 0.0;
};
inline Agreement agreement(const std::vector<float>& ours, const std::vector<float>& theirs,
                           const std::vector<int32_t>& tokens, int64_t vocab) {
  Agreement a;
  const size_t n = tokens.size() - 1;
  const std::vector<double> nll_ours = token_nll(ours, tokens, vocab);
  const std::vector<double> nll_theirs = token_nll(theirs, tokens, vocab);
  for (size_t i = 0; i < n; ++i) {
    const float* o = ours.data() + i * static_cast<size_t>(vocab);
    const float* t = theirs.data() + i * static_cast<size_t>(vocab);
    a.argmax += std::max_element(o, o + vocab) - o == std::max_element(t, t + vocab) - t;
    a.nll_ours += nll_ours[i];
    a.nll_theirs += nll_theirs[i];
  }
  a.argmax /= static_cast<double>(n);
  a.nll_ours /= static_cast<double>(n);
  a.nll_theirs /= static_cast<double>(n);
  std::printf("argmax agreement %.4f, mean NLL %.5f (cputrain) %.5f (llama.cpp)\n", a.argmax,
              a.nll_ours, a.nll_theirs);
  return a;
}

}  // namespace cputrain::interop_test
