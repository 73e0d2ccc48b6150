// The tokenized corpus, cached in a binary file and memory-mapped: the training split, then
// the validation split, each a run of documents that each begin with BOS.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "engine/tokenizer.h"

namespace cputrain {

// What a cache was built from; a cache is reused only when all of it matches.
struct TokenCacheKey {
  uint64_t corpus = 0;     // corpus_fingerprint of the files
  uint64_t tokenizer = 0;  // FNV-1a of the serialized tokenizer model
  uint64_t vocab = 0;      // the vocabulary size that was asked for
  bool operator==(const TokenCacheKey&) const = default;
};

class TokenDataset {
 public:
  // Every tenth document (the 10th, 20th, ...) goes to validation, the rest to training, so
  // both splits span the whole corpus and are cut at document boundaries. Writes the cache
  // atomically and maps it.
  static TokenDataset build(const std::vector<std::string>& documents, const Tokenizer& tokenizer,
                            const std::string& cache_path, const TokenCacheKey& key);
  // Maps an existing cache. Throws UserError naming the file if it is missing, truncated or not
  // a cache.
  static TokenDataset open(const std::string& cache_path);

  TokenDataset(TokenDataset&& other) noexcept;
  TokenDataset& operator=(TokenDataset&& other) noexcept;
  TokenDataset(const TokenDataset&) = delete;
  TokenDataset& operator=(const TokenDataset&) = delete;
  ~TokenDataset();

  std::span<const int32_t> train_tokens() const { return {tokens_, train_}; }
  std::span<const int32_t> val_tokens() const { return {tokens_ + train_, total_ - train_}; }
  const TokenCacheKey& key() const { return key_; }
  int64_t train_documents() const { return train_docs_; }
  int64_t val_documents() const { return val_docs_; }

 private:
  TokenDataset() = default;
  void unmap();

  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  const int32_t* tokens_ = nullptr;
  size_t total_ = 0;
  size_t train_ = 0;
  int64_t train_docs_ = 0;
  int64_t val_docs_ = 0;
  TokenCacheKey key_;
};

}  // namespace cputrain
