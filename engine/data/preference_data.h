// Preference pairs for DPO and ORPO: JSON Lines in the shapes TRL reads, one pair a line,
//   {"prompt": "...", "chosen": "...", "rejected": "..."}              strings, no template
//   {"prompt": [messages], "chosen": [messages], "rejected": [messages]}  conversational
//   {"chosen": [messages], "rejected": [messages]}   the messages they share first as the prompt
//   {"chosen": "...", "rejected": "..."}             the text they share first as the prompt
// each rendered into two examples, prompt + chosen and prompt + rejected, whose targets are the
// completion's tokens alone: a string completion ends with EOS; conversations are rendered with
// the chat template, the completion's assistant replies (with their end markers) the targets.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "engine/data/finetune_data.h"

namespace cputrain {

class Tokenizer;

enum class PairShape { Strings, Conversational, ImplicitPrompt };
inline constexpr int kPairShapes = 3;
// "prompt/chosen/rejected", "conversational", "implicit prompt".
const char* pair_shape_name(PairShape shape);

struct PreferenceDataOptions {
  // The chat template (the model's or --chat-template); conversational pairs need one.
  std::optional<ChatTemplate> chat;
  // The positions of a packed row: a pair's two examples share one (an example of n tokens
  // takes n - 1), so a longer pair is cut to fit (0: not cut), as TRL truncates: its prompt
  // loses its beginning first (BOS kept), down to one token; then its longer side is cut from
  // the end.
  int64_t ctx = 0;
  int64_t max_line_bytes = 0;  // as FinetuneDataOptions
  int64_t max_data_bytes = 0;
};

struct PreferenceData {
  // Two a pair: pair i's chosen at 2i, its rejected at 2i + 1.
  std::vector<FinetuneExample> examples;
  std::array<int64_t, kPairShapes> shapes{};  // pairs of each shape
  int64_t cut = 0;                            // pairs cut to fit a row
  int64_t dropped = 0;                        // pairs with no target left on a side once cut
  int64_t same = 0;                           // pairs whose sides are the same once cut
  int64_t tokens = 0;
  int64_t targets = 0;
  int64_t pairs() const { return static_cast<int64_t>(examples.size() / 2); }
};

// Reads `path`: one JSON object a line (blank lines pass). A UserError "PATH:LINE: what is wrong"
// for a line that is not a JSON object or not a pair (no "chosen" or "rejected", fields of
// different kinds, a conversation's message of another role or an empty reply, a completion
// without an assistant reply, an empty completion, chosen and rejected the same), a
// conversation where no template is known; and for a file that cannot be read or holds no pair.
PreferenceData read_preference_jsonl(const std::string& path, const Tokenizer& tokenizer,
                                     const PreferenceDataOptions& options);

// The pairs of `examples` (two a pair, as PreferenceData holds them) packed into rows of `ctx`
// positions as pack_examples packs examples, each pair whole in one row, its chosen then its
// rejected; a pair must fit in ctx.
std::vector<PackedRow> pack_pairs(const std::vector<FinetuneExample>& examples, int64_t ctx);

// The pairs `rows` hold.
int64_t count_pairs(std::span<const PackedRow* const> rows);

}  // namespace cputrain
