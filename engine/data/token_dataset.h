// The tokenized corpus, cached in a binary file and memory-mapped: the training split, then
// the validation split, each a run of whole documents that each begin with BOS.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "engine/text/tokenizer.h"

namespace cputrain {

class TokenDataset {
 public:
  // Every tenth document (the 10th, 20th, ...) goes to validation and the rest to training, so
  // both splits span the whole corpus (a folder's files are read in name order, often by topic)
  // and hold about 90% / 10% of the tokens. With 2 to 9 documents the last one is validation.
  // `fingerprint` identifies what the cache was built from (see prepare_data). Writes the cache
  // atomically and maps it. `progress`, when set, is called now and then with the documents
  // encoded so far and their total, from one thread.
  static TokenDataset build(const std::vector<std::string>& documents, const Tokenizer& tokenizer,
                            const std::string& cache_path, uint64_t fingerprint,
                            const std::function<void(int64_t, int64_t)>& progress = nullptr);
  // Maps an existing cache read-only. Throws UserError naming the file if it is missing,
  // truncated or not a cache.
  static TokenDataset open(const std::string& cache_path);

  TokenDataset(TokenDataset&& other) noexcept;
  TokenDataset& operator=(TokenDataset&& other) noexcept;
  TokenDataset(const TokenDataset&) = delete;
  TokenDataset& operator=(const TokenDataset&) = delete;
  ~TokenDataset();

  std::span<const int32_t> train_tokens() const { return {tokens_, train_}; }
  std::span<const int32_t> val_tokens() const { return {tokens_ + train_, total_ - train_}; }
  uint64_t fingerprint() const { return fingerprint_; }

 private:
  TokenDataset() = default;
  void unmap();

  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  const int32_t* tokens_ = nullptr;
  size_t total_ = 0;
  size_t train_ = 0;
  uint64_t fingerprint_ = 0;
};

}  // namespace cputrain
