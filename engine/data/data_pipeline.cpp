#include "engine/data/data_pipeline.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <filesystem>
#include <optional>

#include "engine/core/error.h"
#include "engine/core/hash.h"
#include "engine/data/corpus.h"

namespace cputrain {

uint64_t data_fingerprint(uint64_t corpus_fingerprint, const Tokenizer& tokenizer) {
  return fnv1a(tokenizer.model_bytes(), fnv1a_u64(corpus_fingerprint));
}

PreparedData prepare_data(const std::string& corpus, int vocab, const std::string& run_dir,
                          const DataOptions& options) {
  const bool resuming = options.expect.has_value();
  if (!resuming && !options.fixed_tokenizer) Tokenizer::check_vocab_size(vocab);
  const std::string name = options.name.empty() ? "--corpus " + corpus : options.name;
  CorpusFiles files = find_corpus_files(corpus, options.skip_folder, name);
  const uint64_t corpus_id = corpus_fingerprint(corpus, files.text);
  const std::string model_path = run_dir + "/tokenizer.model";
  const std::string cache_path = run_dir + "/tokens.bin";
  namespace fs = std::filesystem;

  // Leftovers that cannot be read are rebuilt, never trusted.
  std::optional<Tokenizer> tokenizer;
  std::optional<TokenDataset> cache;
  // A resumed run's tokens mean what its tokenizer made them mean, and a run begun from a model
  // file keeps that model's tokenizer (tokenizer.gguf): no other will do.
  const bool fixed = resuming || options.fixed_tokenizer || fs::exists(run_dir + "/tokenizer.gguf");
  if (fs::exists(model_path) || fixed) {
    try {
      tokenizer.emplace(Tokenizer::load_run(run_dir));
    } catch (const UserError& e) {
      if (fixed) throw UserError(std::string(e.what()) + "; the run cannot go on without it");
      spdlog::warn("{}; training a new tokenizer", e.what());
    }
  }
  if (resuming && data_fingerprint(corpus_id, *tokenizer) != *options.expect)
    throw UserError(name +
                    ": its content is not what the run was trained on (the corpus "
                    "changed since the checkpoint was made); restore it, or start a new run");
  if (fs::exists(cache_path)) {
    try {
      cache.emplace(TokenDataset::open(cache_path));
    } catch (const UserError& e) {
      spdlog::warn("{}; rebuilding it", e.what());
    }
  }
  const bool cache_matches =
      tokenizer && cache && cache->fingerprint() == data_fingerprint(corpus_id, *tokenizer);
  if (!fixed && tokenizer && tokenizer->vocab_size() != vocab &&
      !(tokenizer->vocab_size() < vocab && cache_matches))
    tokenizer.reset();
  if (tokenizer && cache_matches) {
    int64_t documents = 0;
    for (auto split : {cache->train_tokens(), cache->val_tokens()})
      documents += std::count(split.begin(), split.end(), tokenizer->bos_id());
    return {std::move(*tokenizer), std::move(*cache), std::move(files), documents, true, true};
  }
  cache.reset();

  std::vector<std::string> documents = read_documents(files.text);
  if (documents.empty()) throw UserError(name + ": holds no text");
  const size_t piece_bytes = document_piece_bytes(documents);
  documents = split_long_documents(std::move(documents), piece_bytes);
  const bool reuse_tokenizer = tokenizer.has_value();
  if (!reuse_tokenizer) {
    spdlog::info("training a tokenizer of {} pieces on {} documents", vocab, documents.size());
    if (options.progress) options.progress("training the tokenizer", 0, 0);
    tokenizer.emplace(Tokenizer::train(documents, vocab, model_path));
  }
  spdlog::info("tokenizing {} documents into {}", documents.size(), cache_path);
  std::function<void(int64_t, int64_t)> on_documents;
  if (options.progress)
    on_documents = [&options](int64_t done, int64_t total) {
      options.progress("tokenizing", done, total);
    };
  TokenDataset dataset = TokenDataset::build(documents, *tokenizer, cache_path,
                                             data_fingerprint(corpus_id, *tokenizer), on_documents);
  return {std::move(*tokenizer), std::move(dataset),
          std::move(files),      static_cast<int64_t>(documents.size()),
          reuse_tokenizer,       false};
}

}  // namespace cputrain
