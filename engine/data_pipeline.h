// From a corpus path to a tokenizer and a token cache in the run directory, reusing both when
// nothing they were made from has changed.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "engine/token_dataset.h"
#include "engine/tokenizer.h"

namespace cputrain {

struct PreparedData {
  Tokenizer tokenizer;
  TokenDataset dataset;
  int64_t documents = 0;          // in both splits
  bool tokenizer_reused = false;  // run_dir/tokenizer.model was loaded, not trained
  bool cache_reused = false;      // run_dir/tokens.bin was mapped, not rebuilt
};

// What a token cache is made from: the corpus files (corpus_fingerprint), the vocabulary size
// that was asked for and the tokenizer model's bytes.
uint64_t data_fingerprint(uint64_t corpus_fingerprint, int vocab, const Tokenizer& tokenizer);

// run_dir must exist. Loads run_dir/tokenizer.model if it is readable and has `vocab` pieces
// (or the cache below was made with it for this `vocab`), else trains one; so a run directory
// keeps its tokenizer, and a checkpoint its meaning, while the vocabulary stays the same.
// Maps run_dir/tokens.bin if its fingerprint matches, else rebuilds it. Both files are written
// atomically. Throws UserError for a missing or empty corpus or an unusable vocab.
// `progress`, when set, hears of the long phases: (phase, done, total), total 0 where the
// phase cannot tell how far it is (training the tokenizer).
using DataProgress = std::function<void(const std::string&, int64_t, int64_t)>;
PreparedData prepare_data(const std::string& corpus, int vocab, const std::string& run_dir,
                          const DataProgress& progress = nullptr);

}  // namespace cputrain
