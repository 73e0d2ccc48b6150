#include "engine/tokenizer.h"

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <fstream>
#include <iterator>
#include <unordered_map>

#include "engine/atomic_file.h"
#include "engine/error.h"

namespace cputrain {
namespace {

class DocumentIterator : public sentencepiece::SentenceIterator {
 public:
  explicit DocumentIterator(const std::vector<std::string>& docs) : docs_(docs) {}
  bool done() const override { return index_ >= docs_.size(); }
  void Next() override { ++index_; }
  const std::string& value() const override { return docs_[index_]; }
  sentencepiece::util::Status status() const override { return {}; }

 private:
  const std::vector<std::string>& docs_;
  size_t index_ = 0;
};

std::unique_ptr<sentencepiece::SentencePieceProcessor> processor_from(const std::string& bytes,
                                                                      const std::string& name) {
  auto processor = std::make_unique<sentencepiece::SentencePieceProcessor>();
  const auto status = processor->LoadFromSerializedProto(bytes);
  if (!status.ok()) throw UserError(name + ": not a SentencePiece model (" + status.ToString() + ")");
  if (processor->bos_id() != Tokenizer::kBos || processor->unk_id() != Tokenizer::kUnk ||
      processor->eos_id() != Tokenizer::kEos)
    throw UserError(name + ": expected unk, bos, eos at ids 0, 1, 2");
  return processor;
}

}  // namespace

Tokenizer::Tokenizer(std::unique_ptr<sentencepiece::SentencePieceProcessor> processor,
                     std::string bytes)
    : processor_(std::move(processor)), model_bytes_(std::move(bytes)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::train(const std::vector<std::string>& documents, int vocab_size,
                           const std::string& model_path) {
  if (vocab_size < kMinVocab)
    throw UserError("--vocab " + std::to_string(vocab_size) + ": must be at least " +
                    std::to_string(kMinVocab) + " (256 byte pieces, unk, bos, eos and merges)");
  if (documents.empty()) throw UserError("the corpus holds no text to train a tokenizer on");
  // Identity normalisation and no dummy prefix, so decode(encode(text)) == text; byte fallback
  // so any byte sequence encodes. Pieces may hold runs of spaces (code, verse, ASCII art).
  const std::unordered_map<std::string, std::string> args = {
      {"model_type", "bpe"},
      {"vocab_size", std::to_string(vocab_size)},
      {"byte_fallback", "true"},
      {"character_coverage", "0.9995"},
      {"normalization_rule_name", "identity"},
      {"add_dummy_prefix", "false"},
      {"remove_extra_whitespaces", "false"},
      {"allow_whitespace_only_pieces", "true"},
      {"split_digits", "true"},
      {"max_sentence_length", "65536"},
      {"input_sentence_size", "1000000"},
      {"shuffle_input_sentence", "true"},
      {"unk_id", "0"},
      {"bos_id", "1"},
      {"eos_id", "2"},
      {"pad_id", "-1"},
      {"hard_vocab_limit", "false"},
      {"num_threads", "2"},
      {"minloglevel", "2"},
  };
  DocumentIterator it(documents);
  std::string bytes;
  const auto status = sentencepiece::SentencePieceTrainer::Train(args, &it, &bytes);
  if (!status.ok())
    throw UserError(model_path + ": tokenizer training failed: " + status.ToString());
  auto processor = processor_from(bytes, model_path);
  write_file_atomic(model_path, bytes);
  return Tokenizer(std::move(processor), std::move(bytes));
}

Tokenizer Tokenizer::load(const std::string& model_path) {
  std::ifstream in(model_path, std::ios::binary);
  if (!in) throw UserError(model_path + ": cannot be read");
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto processor = processor_from(bytes, model_path);
  return Tokenizer(std::move(processor), std::move(bytes));
}

std::vector<int32_t> Tokenizer::encode(std::string_view text) const {
  std::vector<int> ids;
  const auto status = processor_->Encode(text, &ids);
  if (!status.ok()) throw std::runtime_error("tokenizer encode: " + status.ToString());
  return std::vector<int32_t>(ids.begin(), ids.end());
}

std::string Tokenizer::decode(std::span<const int32_t> ids) const {
  const int vocab = vocab_size();
  std::vector<int> in;
  in.reserve(ids.size());
  for (int32_t id : ids)
    if (id >= 0 && id < vocab) in.push_back(id);
  std::string text;
  const auto status = processor_->Decode(in, &text);
  if (!status.ok()) throw std::runtime_error("tokenizer decode: " + status.ToString());
  return text;
}

int Tokenizer::vocab_size() const { return processor_->GetPieceSize(); }

}  // namespace cputrain
