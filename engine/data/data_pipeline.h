// From a corpus path to a tokenizer and a token cache in the run directory, reusing both when
// nothing they were made from has changed.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "engine/data/corpus.h"
#include "engine/data/token_dataset.h"
#include "engine/text/tokenizer.h"

namespace cputrain {

struct PreparedData {
  Tokenizer tokenizer;
  TokenDataset dataset;
  CorpusFiles files;              // what was read of the corpus, and what was passed over
  int64_t documents = 0;          // in both splits
  bool tokenizer_reused = false;  // run_dir/tokenizer.model was loaded, not trained
  bool cache_reused = false;      // run_dir/tokens.bin was mapped, not rebuilt
};

// What a token cache is made from: the corpus's content (corpus_fingerprint) and the tokenizer
// model's bytes (which hold the vocabulary size it was trained for).
uint64_t data_fingerprint(uint64_t corpus_fingerprint, const Tokenizer& tokenizer);

// `progress`, when set, hears of the long phases: (phase, done, total), total 0 where the
// phase cannot tell how far it is (training the tokenizer).
using DataProgress = std::function<void(const std::string&, int64_t, int64_t)>;

struct DataOptions {
  // Folders below the corpus not to read, such as a run directory inside it.
  std::function<bool(const std::string&)> skip_folder;
  // How messages name the corpus; empty: "--corpus PATH".
  std::string name;
  // For a resumed run: the data fingerprint its checkpoint was made on. The run's tokenizer is
  // then kept as it is, and a corpus that no longer gives that fingerprint is refused before any
  // file is written.
  std::optional<uint64_t> expect;
  // The run's tokenizer is in run_dir already (saved there from a model file): it is loaded,
  // never trained, whatever `vocab` says. So is tokenizer.gguf wherever it is there.
  bool fixed_tokenizer = false;
  DataProgress progress;
};

// run_dir must exist. Loads run_dir/tokenizer.model if it is readable and has `vocab` pieces
// (or fewer, where the cache below was made with it: a small corpus gives fewer pieces than
// asked), else trains one; so a run directory keeps its tokenizer, and a checkpoint its meaning,
// while the vocabulary stays the same. Maps run_dir/tokens.bin if its fingerprint matches, else
// rebuilds it. Documents are cut to document_piece_bytes first. Both files are written
// atomically. Throws UserError for a missing, binary or empty corpus or an unusable vocab.
PreparedData prepare_data(const std::string& corpus, int vocab, const std::string& run_dir,
                          const DataOptions& options = {});

}  // namespace cputrain
