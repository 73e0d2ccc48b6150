// From a corpus path to a tokenizer and a token cache in the run directory, reusing both when
// the corpus, the tokenizer and the vocabulary are unchanged.
#pragma once

#include <string>

#include "engine/token_dataset.h"
#include "engine/tokenizer.h"

namespace cputrain {

struct PreparedData {
  Tokenizer tokenizer;
  TokenDataset dataset;
  bool reused = false;  // both came from an earlier run in the same directory
};

// run_dir must exist. Writes run_dir/tokenizer.model and run_dir/tokens.bin.
PreparedData prepare_data(const std::string& corpus, int vocab, const std::string& run_dir);

}  // namespace cputrain
