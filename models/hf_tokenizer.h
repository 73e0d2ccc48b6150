// The tokenizer of a Hugging Face folder: tokenizer.json or tokenizer.model, with
// tokenizer_config.json's special tokens and chat template.
#pragma once

#include <string>

#include "engine/text/tokenizer.h"

namespace cputrain {

// The folder's tokenizer: tokenizer.model where the vocabulary is SentencePiece-style and it is
// there, else tokenizer.json (byte-level BPE with the gpt2, llama-bpe or qwen2 pre-tokenizer, or
// SentencePiece-style BPE with byte fallback); special tokens, BOS and EOS from
// tokenizer_config.json. A UserError naming the file for a missing or unread tokenizer.
Tokenizer hf_tokenizer(const std::string& folder);

}  // namespace cputrain
