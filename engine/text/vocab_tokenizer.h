// A tokenizer given as a vocabulary, as GGUF files carry one (tokenizer.ggml.*): the pieces, their
// scores and types, the merges, and the special ids and flags; as llama.cpp encodes it.
// - SentencePiece style ("llama"): text with a leading space, spaces as U+2581, split into
//   characters and merged pairwise, the pair whose merge is a piece of highest score first (the
//   leftmost among equals), with byte pieces for what no piece covers.
// - Byte-level BPE ("gpt2"): text split into words by the pre-tokenizer's regular expressions
//   (PCRE2; gpt-2, llama-bpe for Llama 3, qwen2, smollm for SmolLM2), each word's bytes written as
//   GPT-2's printable characters and merged by the rank of the merges, the lowest first.
// - Gemma 4's BPE ("gemma4"): spaces as U+2581, each line and each run of line breaks a word,
//   merged by rank on the text's own bytes, with byte pieces for what no piece covers.
#pragma once

#include <cstdint>
#include <functional>
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
  // Per token, 1 where the whitespace after it in a text is dropped (its rstrip: Phi-3's special
  // tokens); empty: none.
  std::vector<uint8_t> rstrip;

  // llama.cpp's token types.
  static constexpr int32_t kNormal = 1, kUnknown = 2, kControl = 3, kUserDefined = 4, kUnused = 5,
                           kByte = 6;
};

// The vocabulary of a GGUF file; a UserError naming the file where it has none, or an
// inconsistent one (lengths that differ, ids out of range), or a model cputrain does not read.
Vocabulary gguf_vocabulary(const GgufFile& file);
// Its inverse: the vocabulary as the tokenizer.ggml.* metadata gguf_vocabulary reads.
class GgufWriter;
void set_gguf_vocabulary(GgufWriter& writer, const Vocabulary& vocabulary);

class VocabTokenizer {
 public:
  // A UserError for a pre-tokenizer cputrain does not know.
  explicit VocabTokenizer(Vocabulary vocabulary);
  ~VocabTokenizer();
  VocabTokenizer(const VocabTokenizer&) = delete;
  VocabTokenizer& operator=(const VocabTokenizer&) = delete;

  // What it holds on the heap, as glibc's malloc takes it (engine/core/memory.h): the
  // vocabulary, its look-up tables and the special tokens (not PCRE2's compiled expressions).
  int64_t heap_bytes() const;

  // The ids of `text`, without BOS or EOS. The texts of user-defined tokens in it (MPT's runs of
  // spaces) are those tokens, as llama.cpp gives them; with `special`, those of control tokens
  // (such as <|im_start|>) too, else they are text like any other. In a SentencePiece-style
  // vocabulary each text after such a token takes the dummy prefix as the text's start does.
  // With `begins` false the text continues one (after text, not a special token) and takes no
  // dummy prefix at its start.
  std::vector<int32_t> encode(std::string_view text, bool special = false,
                              bool begins = true) const;
  // Whether `id` is a control or user-defined token (one `special` parses).
  bool is_special(int32_t id) const {
    const int32_t t = type(id);
    return t == Vocabulary::kControl || t == Vocabulary::kUserDefined;
  }
  // The text of `ids`, from the start of a text: byte pieces as their bytes, U+2581 as a space,
  // control tokens as nothing, and without the space of the dummy prefix (decode(encode(t)) == t).
  std::string decode(std::span<const int32_t> ids) const;
  // "gpt-2, llama-bpe, qwen2, smollm, command-r".
  static std::string supported_pre_tokenizers();
  const Vocabulary& vocabulary() const { return v_; }
  int vocab_size() const { return static_cast<int>(v_.tokens.size()); }

 private:
  int32_t find(std::string_view piece) const;
  int32_t type(int32_t id) const;
  // The token of byte `b` where no piece covers it: its byte piece, else the unknown token; a
  // UserError where the vocabulary has neither.
  int32_t byte_token(uint8_t b) const;
  void encode_spm(std::string_view text, bool prefix, std::vector<int32_t>& out) const;
  void encode_bpe(std::string_view text, std::vector<int32_t>& out) const;
  void encode_bpe_word(std::string_view word, std::vector<int32_t>& out) const;
  void encode_raw_bpe(std::string_view text, std::vector<int32_t>& out) const;
  // `word` merged by the ranks of merge_rank_, its pieces' ids (byte pieces where a piece is not
  // a token).
  void encode_ranked_word(std::string_view word, std::vector<int32_t>& out) const;

  Vocabulary v_;
  bool bpe_ = false;            // byte-level BPE (gpt2)
  bool raw_bpe_ = false;        // BPE on the text's bytes (gemma4)
  bool ignore_merges_ = false;  // llama-bpe: a word that is a token is that token
  // Looked up by string_view, without a string made for each look-up.
  struct Hash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };
  using Table = std::unordered_map<std::string, int32_t, Hash, std::equal_to<>>;
  Table ids_;
  Table merge_rank_;  // "left right" -> rank
  int32_t byte_ids_[256];
  std::string byte_chars_[256];                       // GPT-2's printable character for each byte
  std::unordered_map<uint32_t, uint8_t> char_bytes_;  // and back, by code point
  std::vector<std::pair<std::string, int32_t>> specials_;  // longest first
  bool has_user_defined_ = false;  // some of specials_ are user-defined tokens
  std::vector<void*> regexes_;     // the pre-tokenizer's expressions, in order (pcre2_code)
};

}  // namespace cputrain
