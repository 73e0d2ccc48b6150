// A SentencePiece BPE tokenizer with byte fallback: every byte string encodes, and decoding
// gives back exactly the text that was encoded.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace sentencepiece {
class SentencePieceProcessor;
}

namespace cputrain {

class VocabTokenizer;
struct Vocabulary;

// cputrain's own tokenizer (a SentencePiece model it trains), or the vocabulary a model file
// carries (VocabTokenizer), behind one interface.
class Tokenizer {
 public:
  // The ids every cputrain tokenizer reserves.
  static constexpr int32_t kUnk = 0, kBos = 1, kEos = 2;
  // 256 byte pieces and the three above come first; BPE merges need room after them.
  static constexpr int kMinVocab = 300;
  // Above this, training is slow and the embedding large for no gain.
  static constexpr int kMaxVocab = 1 << 20;
  // Throws UserError naming --vocab unless kMinVocab <= vocab_size <= kMaxVocab.
  static void check_vocab_size(int vocab_size);

  // Trains a BPE model of at most `vocab_size` pieces on `documents` (on a fixed sample of
  // about 32 MB of them if there is more) and writes it to `model_path` atomically; a small
  // corpus may give fewer pieces. Deterministic: the same documents give the same model bytes.
  // Throws UserError for an unusable vocab size or corpus, leaving `model_path` untouched.
  static Tokenizer train(const std::vector<std::string>& documents, int vocab_size,
                         const std::string& model_path);
  // Throws UserError if the file is missing or not a SentencePiece model.
  static Tokenizer load(const std::string& model_path);
  // The tokenizer of a model file's vocabulary (engine/text/vocab_tokenizer.h).
  static Tokenizer from_vocabulary(Vocabulary vocabulary);
  // A run directory's tokenizer: <dir>/tokenizer.gguf (a model file's vocabulary, saved by
  // save_to_run) where it is there, else <dir>/tokenizer.model. model_bytes() is the file's bytes
  // either way. A UserError naming the file where neither reads.
  static Tokenizer load_run(const std::string& dir);
  // The file load_run reads for this tokenizer in `dir` ("tokenizer.gguf" or "tokenizer.model"),
  // written atomically; returns its path.
  std::string save_to_run(const std::string& dir) const;

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  // Every byte string encodes, invalid UTF-8 included, and decode gives it back exactly.
  std::vector<int32_t> encode(std::string_view text) const;
  // A piece of a longer text (a fine-tuning example as a chat template renders it): with
  // `special`, the texts of special tokens in it are those tokens (cputrain's own tokenizer has
  // none); `begins` says it begins the text or follows a special token, where a
  // SentencePiece-style vocabulary puts its dummy prefix.
  std::vector<int32_t> encode_piece(std::string_view text, bool special, bool begins) const;
  // Whether `id` is a special token: a control or user-defined one, or cputrain's BOS and EOS.
  bool is_special(int32_t id) const;
  // Whether a text begins with BOS: the vocabulary's add-BOS flag; always for cputrain's own.
  bool adds_bos() const;
  std::string decode(std::span<const int32_t> ids) const;
  std::string decode(const std::vector<int32_t>& ids) const {
    return decode(std::span<const int32_t>(ids));
  }
  int vocab_size() const;
  // The token that begins a text: BOS, or EOS where a vocabulary has no BOS (Qwen2's
  // <|endoftext|>, which also separates its documents).
  int32_t bos_id() const { return bos_; }
  int32_t eos_id() const { return eos_; }
  // The serialized model, as written to disk (empty for a model file's vocabulary).
  const std::string& model_bytes() const { return model_bytes_; }
  // What it holds on the heap: a model file's vocabulary's tables (VocabTokenizer::heap_bytes),
  // or a SentencePiece model's bytes and, estimated, four times them for its processor.
  int64_t heap_bytes() const;
  // The model file's vocabulary, or nullptr for cputrain's own tokenizer.
  const VocabTokenizer* vocabulary() const { return vocab_.get(); }
  // The tokenizer as a vocabulary a model file carries: a model file's own, or cputrain's
  // SentencePiece model as llama.cpp's SentencePiece style reads it (pieces, scores, types; no
  // dummy prefix, which cputrain's tokenizers do not add).
  Vocabulary to_vocabulary() const;

 private:
  Tokenizer(std::unique_ptr<sentencepiece::SentencePieceProcessor> processor, std::string bytes);
  explicit Tokenizer(std::shared_ptr<const VocabTokenizer> vocab);
  std::unique_ptr<sentencepiece::SentencePieceProcessor> processor_;
  std::shared_ptr<const VocabTokenizer> vocab_;
  int32_t bos_ = kBos, eos_ = kEos;
  std::string model_bytes_;
  int byte_id_[256] = {};         // the id of each byte's piece
  std::vector<int16_t> byte_of_;  // the byte an id's piece stands for, or -1
};

}  // namespace cputrain
