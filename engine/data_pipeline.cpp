#include "engine/data_pipeline.h"

#include <filesystem>

#include "engine/corpus.h"
#include "engine/error.h"
#include "engine/hash.h"

namespace cputrain {

PreparedData prepare_data(const std::string& corpus, int vocab, const std::string& run_dir) {
  const std::vector<std::string> files = list_corpus_files(corpus);
  const std::string model_path = run_dir + "/tokenizer.model";
  const std::string cache_path = run_dir + "/tokens.bin";
  const uint64_t corpus_id = corpus_fingerprint(files);

  if (std::filesystem::exists(model_path) && std::filesystem::exists(cache_path)) {
    try {
      Tokenizer tokenizer = Tokenizer::load(model_path);
      TokenDataset dataset = TokenDataset::open(cache_path);
      const TokenCacheKey want{corpus_id, fnv1a(tokenizer.model_bytes()),
                               static_cast<uint64_t>(vocab)};
      if (dataset.key() == want) return {std::move(tokenizer), std::move(dataset), true};
    } catch (const UserError&) {
      // An unreadable leftover is rebuilt below.
    }
  }
  const std::vector<std::string> documents = read_documents(files);
  if (documents.empty()) throw UserError("--corpus " + corpus + ": holds no text");
  Tokenizer tokenizer = Tokenizer::train(documents, vocab, model_path);
  const TokenCacheKey key{corpus_id, fnv1a(tokenizer.model_bytes()), static_cast<uint64_t>(vocab)};
  TokenDataset dataset = TokenDataset::build(documents, tokenizer, cache_path, key);
  return {std::move(tokenizer), std::move(dataset), false};
}

}  // namespace cputrain
