#include "engine/text/tokenizer.h"

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <fstream>
#include <iterator>
#include <thread>
#include <unordered_map>

#include "engine/core/error.h"
#include "engine/core/hash.h"
#include "engine/core/memory.h"
#include "engine/io/atomic_file.h"
#include "engine/io/gguf_file.h"
#include "engine/text/utf8.h"
#include "engine/text/vocab_tokenizer.h"

namespace cputrain {
namespace {

// SentencePiece trains on "sentences" and skips any longer than max_sentence_length, so a
// corpus of whole books would leave it nothing. Documents are cut into pieces of at most
// kChunkBytes at line ends (a longer line at a UTF-8 character boundary), and a large corpus is
// sampled down to about kSampleBytes by a fixed hash of the chunk index, so training time is
// bounded and the same corpus always gives the same tokenizer.
constexpr size_t kChunkBytes = 4096;
constexpr uint64_t kSampleBytes = uint64_t{32} << 20;

std::vector<std::string> training_chunks(const std::vector<std::string>& documents) {
  uint64_t total = 0;
  for (const std::string& d : documents) total += d.size();
  // Keep chunk k when splitmix64(k) falls below keep_below: a fraction ~ kSampleBytes / total.
  const uint64_t keep_below =
      total <= kSampleBytes
          ? UINT64_MAX
          : static_cast<uint64_t>(std::ldexp(static_cast<double>(kSampleBytes) / total, 64));
  std::vector<std::string> chunks;
  uint64_t k = 0;
  auto emit = [&](std::string_view piece) {
    if (splitmix64(k++) <= keep_below) chunks.emplace_back(piece);
  };
  for (const std::string& doc : documents) {
    const std::string_view text(doc);
    size_t begin = 0;
    while (begin < text.size()) {
      size_t end = begin;
      // Whole lines while they fit.
      while (end < text.size()) {
        size_t line_end = text.find('\n', end);
        line_end = line_end == std::string_view::npos ? text.size() : line_end + 1;
        if (line_end - begin > kChunkBytes) break;
        end = line_end;
      }
      if (end == begin) {  // one line longer than a chunk: cut before a continuation byte
        end = begin + kChunkBytes;
        while (end > begin + 1 && (static_cast<unsigned char>(text[end]) & 0xC0) == 0x80) --end;
      }
      emit(text.substr(begin, end - begin));
      begin = end;
    }
  }
  return chunks;
}

class ChunkIterator : public sentencepiece::SentenceIterator {
 public:
  explicit ChunkIterator(const std::vector<std::string>& chunks) : chunks_(chunks) {}
  bool done() const override { return index_ >= chunks_.size(); }
  void Next() override { ++index_; }
  const std::string& value() const override { return chunks_[index_]; }
  sentencepiece::util::Status status() const override { return {}; }

 private:
  const std::vector<std::string>& chunks_;
  size_t index_ = 0;
};

std::unique_ptr<sentencepiece::SentencePieceProcessor> processor_from(const std::string& bytes,
                                                                      const std::string& name) {
  auto processor = std::make_unique<sentencepiece::SentencePieceProcessor>();
  const auto status = processor->LoadFromSerializedProto(bytes);
  if (!status.ok())
    throw UserError(name + ": not a SentencePiece model (" + status.ToString() + ")");
  if (processor->bos_id() != Tokenizer::kBos || processor->unk_id() != Tokenizer::kUnk ||
      processor->eos_id() != Tokenizer::kEos)
    throw UserError(name + ": expected unk, bos, eos at ids 0, 1, 2");
  return processor;
}

}  // namespace

Tokenizer::Tokenizer(std::unique_ptr<sentencepiece::SentencePieceProcessor> processor,
                     std::string bytes)
    : processor_(std::move(processor)), model_bytes_(std::move(bytes)) {
  byte_of_.assign(static_cast<size_t>(processor_->GetPieceSize()), -1);
  for (int b = 0; b < 256; ++b) {
    char piece[8];
    std::snprintf(piece, sizeof(piece), "<0x%02X>", b);
    const int id = processor_->PieceToId(piece);
    byte_id_[b] = id;
    if (id > 0 && processor_->IsByte(id))
      byte_of_[static_cast<size_t>(id)] = static_cast<int16_t>(b);
  }
}
Tokenizer::Tokenizer(std::shared_ptr<const VocabTokenizer> vocab)
    : vocab_(std::move(vocab)), bos_(vocab_->vocabulary().bos), eos_(vocab_->vocabulary().eos) {}

Tokenizer Tokenizer::from_vocabulary(Vocabulary vocabulary) {
  return Tokenizer(std::make_shared<const VocabTokenizer>(std::move(vocabulary)));
}

Tokenizer Tokenizer::load_run(const std::string& dir) {
  const std::string gguf = dir + "/tokenizer.gguf";
  if (!std::ifstream(gguf).good()) return load(dir + "/tokenizer.model");
  Tokenizer t = from_vocabulary(gguf_vocabulary(GgufFile(gguf)));
  std::ifstream in(gguf, std::ios::binary);
  t.model_bytes_.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  return t;
}

std::string Tokenizer::save_to_run(const std::string& dir) const {
  if (!vocab_) {
    write_file_atomic(dir + "/tokenizer.model", model_bytes_);
    return dir + "/tokenizer.model";
  }
  // The vocabulary as a GGUF file of metadata alone.
  const Vocabulary& v = vocab_->vocabulary();
  GgufWriter w;
  w.set_string("general.architecture", "tokenizer");
  set_gguf_vocabulary(w, v);
  w.write(dir + "/tokenizer.gguf");
  return dir + "/tokenizer.gguf";
}

Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

void Tokenizer::check_vocab_size(int vocab_size) {
  if (vocab_size < kMinVocab)
    throw UserError("--vocab " + std::to_string(vocab_size) + ": must be at least " +
                    std::to_string(kMinVocab) + " (256 byte pieces, unk, bos, eos and merges)");
  if (vocab_size > kMaxVocab)
    throw UserError("--vocab " + std::to_string(vocab_size) +
                    ": more pieces than cputrain trains (" + std::to_string(kMaxVocab) +
                    " at most; real models use 32000 to 256000)");
}

Tokenizer Tokenizer::train(const std::vector<std::string>& documents, int vocab_size,
                           const std::string& model_path) {
  check_vocab_size(vocab_size);
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
      // Room for invalid UTF-8 bytes, which normalisation turns into 3-byte U+FFFD.
      {"max_sentence_length", std::to_string(3 * kChunkBytes)},
      {"input_sentence_size", "0"},  // sampled above, deterministically
      {"shuffle_input_sentence", "false"},
      {"unk_id", "0"},
      {"bos_id", "1"},
      {"eos_id", "2"},
      {"pad_id", "-1"},
      {"hard_vocab_limit", "false"},
      {"num_threads", "2"},
      {"minloglevel", "2"},
  };
  const std::vector<std::string> chunks = training_chunks(documents);
  ChunkIterator it(chunks);
  std::string bytes;
  // On a thread of its own, so the trainer's millions of small allocations go to that thread's
  // malloc arena: left in the main heap they would stretch it to several times what a training
  // step holds there, and a step's small blocks, spread over it, would touch more pages in one
  // run than in the next, past the budget.
  sentencepiece::util::Status status;
  std::exception_ptr failure;
  std::thread([&] {
    try {
      status = sentencepiece::SentencePieceTrainer::Train(args, &it, &bytes);
    } catch (...) {
      failure = std::current_exception();
    }
  }).join();
  if (failure) std::rethrow_exception(failure);
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

std::vector<int32_t> Tokenizer::encode_piece(std::string_view text, bool special,
                                             bool begins) const {
  if (vocab_) return vocab_->encode(text, special, begins);
  return encode(text);
}

bool Tokenizer::is_special(int32_t id) const {
  if (vocab_) return id >= 0 && id < vocab_->vocab_size() && vocab_->is_special(id);
  return id == kBos || id == kEos;
}

bool Tokenizer::adds_bos() const {
  return vocab_ ? vocab_->vocabulary().add_bos && bos_ >= 0 : true;
}

std::vector<int32_t> Tokenizer::encode(std::string_view text) const {
  if (vocab_) return vocab_->encode(text);
  // SentencePiece turns a byte that is not part of valid UTF-8 into U+FFFD; such bytes are
  // encoded here as their byte pieces instead, so every byte string round-trips.
  std::vector<int32_t> out;
  std::vector<int> ids;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = pos;
    for (size_t n; end < text.size() && (n = utf8_length(text, end)) > 0;) end += n;
    if (end > pos) {
      const auto status = processor_->Encode(text.substr(pos, end - pos), &ids);
      if (!status.ok()) throw std::runtime_error("tokenizer encode: " + status.ToString());
      out.insert(out.end(), ids.begin(), ids.end());
    }
    if (end < text.size()) out.push_back(byte_id_[static_cast<unsigned char>(text[end++])]);
    pos = end;
  }
  return out;
}

std::string Tokenizer::decode(std::span<const int32_t> ids) const {
  if (vocab_) return vocab_->decode(ids);
  // Byte pieces are their bytes, whatever they spell (SentencePiece would turn invalid UTF-8
  // into U+FFFD); runs of other pieces go through SentencePiece.
  const int vocab = vocab_size();
  std::string text;
  std::vector<int> run;
  auto flush = [&] {
    if (run.empty()) return;
    std::string piece;
    const auto status = processor_->Decode(run, &piece);
    if (!status.ok()) throw std::runtime_error("tokenizer decode: " + status.ToString());
    text += piece;
    run.clear();
  };
  for (int32_t id : ids) {
    if (id < 0 || id >= vocab) continue;
    const int16_t byte = byte_of_[static_cast<size_t>(id)];
    if (byte < 0) {
      run.push_back(id);
      continue;
    }
    flush();
    text.push_back(static_cast<char>(byte));
  }
  flush();
  return text;
}

Vocabulary Tokenizer::to_vocabulary() const {
  if (vocab_) return vocab_->vocabulary();
  Vocabulary v;
  v.model = "llama";
  const int n = processor_->GetPieceSize();
  for (int id = 0; id < n; ++id) {
    v.tokens.push_back(processor_->IdToPiece(id));
    v.scores.push_back(processor_->GetScore(id));
    v.types.push_back(processor_->IsUnknown(id)   ? Vocabulary::kUnknown
                      : processor_->IsControl(id) ? Vocabulary::kControl
                      : processor_->IsByte(id)    ? Vocabulary::kByte
                      : processor_->IsUnused(id)  ? Vocabulary::kUnused
                                                  : Vocabulary::kNormal);
  }
  v.bos = kBos;
  v.eos = kEos;
  v.unk = kUnk;
  v.add_bos = true;
  v.add_eos = false;
  // cputrain's models add no dummy prefix; a SentencePiece model that does (Llama 2's) says so by
  // encoding "a" as "\xe2\x96\x81a".
  std::vector<std::string> pieces;
  v.add_space_prefix = processor_->Encode("a", &pieces).ok() && !pieces.empty() &&
                       pieces[0].starts_with("\xe2\x96\x81");
  return v;
}

int Tokenizer::vocab_size() const {
  return vocab_ ? vocab_->vocab_size() : processor_->GetPieceSize();
}

int64_t Tokenizer::heap_bytes() const {
  if (vocab_) return vocab_->heap_bytes();
  return 5 * heap_bytes_of(model_bytes_) + heap_bytes_of(byte_of_);
}

}  // namespace cputrain
