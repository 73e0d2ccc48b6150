// What the tests of the JSON Lines readers share: a tokenizer of single characters, a temporary
// file of the test's text, and an example's targets decoded.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "engine/data/finetune_data.h"
#include "engine/text/tokenizer.h"
#include "engine/text/vocab_tokenizer.h"

namespace cputrain {
namespace test {

namespace fs = std::filesystem;

// A SentencePiece-style vocabulary of single characters: <unk> <s> </s>, ChatML's markers as
// control tokens, "▁" and printable ASCII as pieces, and the 256 byte pieces for the rest.
inline Tokenizer char_tokenizer() {
  Vocabulary v;
  v.model = "llama";
  const auto add = [&](const std::string& piece, int32_t type) {
    v.tokens.push_back(piece);
    v.scores.push_back(0.0f);
    v.types.push_back(type);
  };
  add("<unk>", Vocabulary::kUnknown);
  add("<s>", Vocabulary::kControl);
  add("</s>", Vocabulary::kControl);
  add("<|im_start|>", Vocabulary::kControl);
  add("<|im_end|>", Vocabulary::kControl);
  add("\xE2\x96\x81", Vocabulary::kNormal);
  for (char c = '!'; c <= '~'; ++c) add(std::string(1, c), Vocabulary::kNormal);
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof name, "<0x%02X>", b);
    add(name, Vocabulary::kByte);
  }
  v.unk = 0;
  v.bos = 1;
  v.eos = 2;
  v.add_space_prefix = false;
  return Tokenizer::from_vocabulary(std::move(v));
}

struct TempFile {
  fs::path path;
  explicit TempFile(const std::string& text)
      // The process and the suite in the name: two suites' tests of one name (BadLinesAreNamed)
      // may run at once, each in its own test program.
      : path(fs::temp_directory_path() /
             ("cputrain_ft_" + std::to_string(::getpid()) + "_" +
              ::testing::UnitTest::GetInstance()->current_test_info()->test_suite_name() + "_" +
              ::testing::UnitTest::GetInstance()->current_test_info()->name() + ".jsonl")) {
    std::ofstream(path, std::ios::binary) << text;
  }
  ~TempFile() { fs::remove(path); }
};

// The targets' tokens, decoded.
inline std::string targets_text(const Tokenizer& t, const FinetuneExample& e) {
  std::vector<int32_t> ids;
  for (size_t i = 0; i < e.tokens.size(); ++i)
    if (e.target[i]) ids.push_back(e.tokens[i]);
  return t.decode(ids);
}

}  // namespace test
}  // namespace cputrain
