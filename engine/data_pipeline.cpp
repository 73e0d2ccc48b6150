#include "engine/data_pipeline.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <filesystem>
#include <optional>

#include "engine/corpus.h"
#include "engine/error.h"
#include "engine/hash.h"

namespace cputrain {

uint64_t data_fingerprint(uint64_t corpus_fingerprint, int vocab, const Tokenizer& tokenizer) {
  uint64_t h = fnv1a_u64(corpus_fingerprint);
  h = fnv1a_u64(static_cast<uint64_t>(vocab), h);
  return fnv1a(tokenizer.model_bytes(), h);
}

PreparedData prepare_data(const std::string& corpus, int vocab, const std::string& run_dir,
                          const DataProgress& progress) {
  Tokenizer::check_vocab_size(vocab);
  const std::vector<std::string> files = list_corpus_files(corpus);
  const uint64_t corpus_id = corpus_fingerprint(files);
  const std::string model_path = run_dir + "/tokenizer.model";
  const std::string cache_path = run_dir + "/tokens.bin";
  namespace fs = std::filesystem;

  // Leftovers that cannot be read are rebuilt, never trusted.
  std::optional<Tokenizer> tokenizer;
  std::optional<TokenDataset> cache;
  if (fs::exists(model_path)) {
    try {
      tokenizer.emplace(Tokenizer::load(model_path));
    } catch (const UserError& e) {
      spdlog::warn("{}; training a new tokenizer", e.what());
    }
  }
  if (fs::exists(cache_path)) {
    try {
      cache.emplace(TokenDataset::open(cache_path));
    } catch (const UserError& e) {
      spdlog::warn("{}; rebuilding it", e.what());
    }
  }
  // A small corpus can give fewer pieces than asked for; the cache then vouches for the match.
  const bool cache_matches =
      tokenizer && cache && cache->fingerprint() == data_fingerprint(corpus_id, vocab, *tokenizer);
  if (tokenizer && tokenizer->vocab_size() != vocab && !cache_matches) tokenizer.reset();
  if (cache_matches) {
    int64_t documents = 0;
    for (auto split : {cache->train_tokens(), cache->val_tokens()})
      documents += std::count(split.begin(), split.end(), tokenizer->bos_id());
    return {std::move(*tokenizer), std::move(*cache), documents, true, true};
  }
  cache.reset();

  const std::vector<std::string> documents = read_documents(files);
  if (documents.empty()) throw UserError("--corpus " + corpus + ": holds no text");
  const bool reuse_tokenizer = tokenizer.has_value();
  if (!reuse_tokenizer) {
    spdlog::info("training a tokenizer of {} pieces on {} documents", vocab, documents.size());
    if (progress) progress("training the tokenizer", 0, 0);
    tokenizer.emplace(Tokenizer::train(documents, vocab, model_path));
  }
  spdlog::info("tokenizing {} documents into {}", documents.size(), cache_path);
  std::function<void(int64_t, int64_t)> on_documents;
  if (progress)
    on_documents = [&progress](int64_t done, int64_t total) {
      progress("tokenizing", done, total);
    };
  TokenDataset dataset =
      TokenDataset::build(documents, *tokenizer, cache_path,
                          data_fingerprint(corpus_id, vocab, *tokenizer), on_documents);
  return {std::move(*tokenizer), std::move(dataset), static_cast<int64_t>(documents.size()),
          reuse_tokenizer, false};
}

}  // namespace cputrain
