// A tokenizer given as a vocabulary, as GGUF files carry one (tokenizer.ggml.*): the pieces, their
// scores and types, and the special ids and flags. The SentencePiece style ("llama"): text with a
// leading space, spaces as U+2581, split into characters and merged pairwise, the pair whose merge
// is a piece of highest score first (the leftmost among equals), with byte pieces for what no
// piece covers; as llama.cpp encodes it.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace cputrain {

class GgufFile;

struct Vocabulary {
  std::string model = "llama";  // tokenizer.ggml.model
  std::string pre;              // tokenizer.ggml.pre
  std::vector<std::string> tokens;
  std::vector<float> scores;   // empty: all 0
  std::vector<int32_t> types;  // empty: all normal
  std::vector<std::string> merges;
  int32_t bos = -1, eos = -1, unk = -1;
  bool add_bos = true;
  bool add_eos = false;
  bool add_space_prefix = true;
  std::string chat_template;  // tokenizer.chat_template, empty where absent

  // llama.cpp's token types.
  static constexpr int32_t kNormal = 1, kUnknown = 2, kControl = 3, kUserDefined = 4, kUnused = 5,
                           kByte = 6;
};

// The vocabulary of a GGUF file; a UserError naming the file where it has none, or an
// inconsistent one (lengths that differ, ids out of range), or a model cputrain does not read.
Vocabulary gguf_vocabulary(const GgufFile& file);

class VocabTokenizer {
 public:
  explicit VocabTokenizer(Vocabulary vocabulary);

  // The ids of `text`, without BOS or EOS; special tokens in the text are text.
  std::vector<int32_t> encode(std::string_view text) const;
  // The text of `ids`: byte pieces as their bytes, U+2581 as a space, control tokens as nothing.
  std::string decode(std::span<const int32_t> ids) const;
  const Vocabulary& vocabulary() const { return v_; }
  int vocab_size() const { return static_cast<int>(v_.tokens.size()); }

 private:
  int32_t find(std::string_view piece) const;
  int32_t type(int32_t id) const;

  Vocabulary v_;
  std::unordered_map<std::string, int32_t> ids_;
  int32_t byte_ids_[256];
};

}  // namespace cputrain
