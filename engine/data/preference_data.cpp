#include "engine/data/preference_data.h"

#include <algorithm>
#include <nlohmann/json.hpp>

#include "engine/core/error.h"
#include "engine/data/example_text.h"
#include "engine/text/tokenizer.h"

namespace cputrain {
namespace {

using json = nlohmann::json;

int64_t replies(const std::vector<ChatMessage>& messages) {
  return std::count_if(messages.begin(), messages.end(),
                       [](const ChatMessage& m) { return m.role == "assistant"; });
}

bool same(const ChatMessage& a, const ChatMessage& b) {
  return a.role == b.role && a.content == b.content;
}

// The two completions of a pair as segments after its prompt's: strings, or conversations.
struct PairText {
  std::vector<Segment> chosen, rejected;
  bool eos = true;  // strings end with EOS; a reply ends with its template's marker
  PairShape shape = PairShape::Strings;
};

PairText string_pair(const json& object, const std::string& where) {
  PairText p;
  std::string chosen = field_string(object, "chosen", where);
  std::string rejected = field_string(object, "rejected", where);
  std::string prompt;
  if (object.contains("prompt")) {
    prompt = field_string(object, "prompt", where);
  } else {
    // The text both begin with is the prompt (TRL's extract_prompt): cut at a character's
    // start, and before a space, which begins the completions' first word.
    p.shape = PairShape::ImplicitPrompt;
    size_t n = 0;
    while (n < chosen.size() && n < rejected.size() && chosen[n] == rejected[n]) ++n;
    while (n > 0 && n < chosen.size() && (static_cast<unsigned char>(chosen[n]) & 0xC0) == 0x80)
      --n;
    if (n > 0 && chosen[n - 1] == ' ') --n;
    prompt = chosen.substr(0, n);
    chosen.erase(0, n);
    rejected.erase(0, n);
  }
  if (chosen == rejected) throw UserError(where + ": \"chosen\" and \"rejected\" are the same");
  for (const auto& [text, name] : {std::pair{&chosen, "chosen"}, std::pair{&rejected, "rejected"}})
    if (blank(*text))
      throw UserError(where + ": \"" + name + "\" is empty" +
                      (p.shape == PairShape::ImplicitPrompt
                           ? " after the text it shares with the other (the prompt)"
                           : ""));
  if (!prompt.empty()) {
    p.chosen.push_back({prompt, false, false});
    p.rejected.push_back({prompt, false, false});
  }
  p.chosen.push_back({chosen, false, true});
  p.rejected.push_back({rejected, false, true});
  return p;
}

PairText conversation_pair(const json& object, const std::string& where,
                           const std::optional<ChatTemplate>& chat) {
  PairText p;
  p.shape = PairShape::Conversational;
  p.eos = false;
  std::vector<ChatMessage> chosen = read_messages(object["chosen"], "chosen", where);
  std::vector<ChatMessage> rejected = read_messages(object["rejected"], "rejected", where);
  std::vector<ChatMessage> prompt;
  if (object.contains("prompt")) {
    if (!object["prompt"].is_array())
      throw UserError(where + ": \"prompt\" is not a list of messages, as \"chosen\" is");
    prompt = read_messages(object["prompt"], "prompt", where);
  } else {
    // The messages both begin with are the prompt.
    p.shape = PairShape::ImplicitPrompt;
    size_t n = 0;
    while (n < chosen.size() && n < rejected.size() && same(chosen[n], rejected[n])) ++n;
    prompt.assign(chosen.begin(), chosen.begin() + static_cast<std::ptrdiff_t>(n));
    chosen.erase(chosen.begin(), chosen.begin() + static_cast<std::ptrdiff_t>(n));
    rejected.erase(rejected.begin(), rejected.begin() + static_cast<std::ptrdiff_t>(n));
    if (chosen.empty() && rejected.empty())
      throw UserError(where + ": \"chosen\" and \"rejected\" are the same");
  }
  if (chosen.size() == rejected.size() &&
      std::equal(chosen.begin(), chosen.end(), rejected.begin(), same))
    throw UserError(where + ": \"chosen\" and \"rejected\" are the same");
  for (const auto& [list, name] : {std::pair{&chosen, "chosen"}, std::pair{&rejected, "rejected"}})
    if (replies(*list) == 0)
      throw UserError(where + ": \"" + name + "\" has no assistant reply" +
                      (p.shape == PairShape::ImplicitPrompt
                           ? " after the messages it shares with the other (the prompt)"
                           : ""));
  if (!chat)
    throw UserError(where +
                    ": a conversational pair, and the model has no chat template cputrain "
                    "recognises (give --chat-template: " +
                    chat_family_names() + ")");
  const int64_t first = replies(prompt);
  for (const auto& [list, out] :
       {std::pair{&chosen, &p.chosen}, std::pair{&rejected, &p.rejected}}) {
    std::vector<ChatMessage> all = prompt;
    all.insert(all.end(), list->begin(), list->end());
    *out = chat_segments(*chat, all, first);
  }
  return p;
}

int64_t count(const std::vector<uint8_t>& target) {
  return std::count(target.begin(), target.end(), uint8_t{1});
}

// Fits the pair's positions (tokens - 1 each) in ctx, as TRL truncates: the prompt they share
// loses its beginning first (after the first `keep` tokens, BOS), down to one token before the
// first target; then the longer side is cut from its end, down to the other's length. Whether it
// cut.
bool fit_pair(FinetuneExample& chosen, FinetuneExample& rejected, int64_t ctx, int64_t keep) {
  int64_t c = std::ssize(chosen.tokens) - 1, r = std::ssize(rejected.tokens) - 1;
  if (ctx <= 0 || c + r <= ctx) return false;
  const auto first_target = [](const FinetuneExample& e) {
    return std::distance(e.target.begin(), std::find(e.target.begin(), e.target.end(), 1));
  };
  const int64_t removable =
      std::max<int64_t>(0, std::min(first_target(chosen), first_target(rejected)) - keep - 1);
  const int64_t k = std::min((c + r - ctx + 1) / 2, removable);
  for (FinetuneExample* e : {&chosen, &rejected}) {
    e->tokens.erase(e->tokens.begin() + keep, e->tokens.begin() + keep + k);
    e->target.erase(e->target.begin() + keep, e->target.begin() + keep + k);
  }
  c -= k;
  r -= k;
  if (c + r > ctx) {
    const int64_t half = ctx / 2;
    if (c <= half) {
      r = ctx - c;
    } else if (r <= half) {
      c = ctx - r;
    } else {
      c = half;
      r = ctx - half;
    }
  }
  for (const auto& [e, n] : {std::pair{&chosen, c}, std::pair{&rejected, r}}) {
    e->tokens.resize(static_cast<size_t>(n + 1));
    e->target.resize(static_cast<size_t>(n + 1));
  }
  return true;
}

}  // namespace

const char* pair_shape_name(PairShape shape) {
  switch (shape) {
    case PairShape::Strings:
      return "prompt/chosen/rejected";
    case PairShape::Conversational:
      return "conversational";
    case PairShape::ImplicitPrompt:
      break;
  }
  return "implicit prompt";
}

PreferenceData read_preference_jsonl(const std::string& path, const Tokenizer& tokenizer,
                                     const PreferenceDataOptions& options) {
  PreferenceData data;
  int64_t held = 0;  // bytes of the examples' tokens and targets
  for_each_json_object(
      path, "preference pairs", options.max_line_bytes,
      [&](const json& object, const std::string& where, int64_t number) {
        const bool has_chosen = object.contains("chosen"),
                   has_rejected = object.contains("rejected");
        if (!has_chosen && !has_rejected)
          throw UserError(where +
                          ": not a preference pair (no \"chosen\" and \"rejected\"; a pair is "
                          "{\"prompt\", \"chosen\", \"rejected\"} or {\"chosen\", \"rejected\"})");
        if (!has_chosen || !has_rejected)
          throw UserError(
              where + ": has \"" +
              (has_chosen ? "chosen\" but no \"rejected\"" : "rejected\" but no \"chosen\""));
        const json& chosen = object["chosen"];
        const json& rejected = object["rejected"];
        if (chosen.is_array() != rejected.is_array())
          throw UserError(where +
                          ": \"chosen\" and \"rejected\" are not of one kind (two strings, or two "
                          "lists of messages)");
        const PairText text = chosen.is_array() ? conversation_pair(object, where, options.chat)
                                                : string_pair(object, where);
        const int64_t max_tokens = options.ctx > 0 ? options.ctx + 1 : 0;
        FinetuneExample c = tokenize_segments(text.chosen, tokenizer, text.eos, max_tokens);
        FinetuneExample r = tokenize_segments(text.rejected, tokenizer, text.eos, max_tokens);
        c.line = r.line = number;
        if (c.tokens == r.tokens)
          throw UserError(where + ": \"chosen\" and \"rejected\" are the same once tokenized");
        data.cut += fit_pair(c, r, options.ctx, tokenizer.adds_bos() ? 1 : 0) ? 1 : 0;
        const int64_t targets = count(c.target) + count(r.target);
        if (count(c.target) == 0 || count(r.target) == 0) {
          ++data.dropped;
          return;
        }
        // Sides that differ only past the cut have one log-probability: nothing to prefer.
        if (c.tokens == r.tokens && c.target == r.target) {
          ++data.same;
          return;
        }
        held += static_cast<int64_t>((c.tokens.size() + r.tokens.size()) *
                                         (sizeof(int32_t) + sizeof(uint8_t)) +
                                     2 * sizeof(FinetuneExample));
        if (options.max_data_bytes > 0 && held > options.max_data_bytes)
          throw UserError(where + ": the pairs up to here hold " + std::to_string(held >> 20) +
                          " MiB of tokens, more than the memory limit lets the data hold (" +
                          std::to_string(options.max_data_bytes >> 20) +
                          " MiB; --mem-limit): give fewer pairs, or a lower --ctx");
        ++data.shapes[static_cast<size_t>(text.shape)];
        data.tokens += std::ssize(c.tokens) + std::ssize(r.tokens);
        data.targets += targets;
        data.examples.push_back(std::move(c));
        data.examples.push_back(std::move(r));
      });
  if (data.examples.empty())
    throw UserError(path + ": no preference pair" +
                    (data.dropped + data.same > 0
                         ? " with targets on both sides that differ within the context (" +
                               std::to_string(data.dropped) + " cut to nothing, " +
                               std::to_string(data.same) + " the same once cut; --ctx)"
                         : std::string(" (the file is empty)")));
  return data;
}

std::vector<PackedRow> pack_pairs(const std::vector<FinetuneExample>& examples, int64_t ctx) {
  std::vector<int64_t> sizes;
  sizes.reserve(examples.size() / 2);
  for (size_t i = 0; i + 1 < examples.size(); i += 2)
    sizes.push_back(std::ssize(examples[i].tokens) + std::ssize(examples[i + 1].tokens) - 2);
  std::vector<PackedRow> rows = pack_units(sizes, ctx);
  for (PackedRow& row : rows) {
    std::vector<int32_t> pairs = std::move(row.examples);
    row.examples.clear();
    for (const int32_t p : pairs) {
      row.examples.push_back(2 * p);
      row.examples.push_back(2 * p + 1);
    }
  }
  return rows;
}

int64_t count_pairs(std::span<const PackedRow* const> rows) {
  int64_t n = 0;
  for (const PackedRow* r : rows) n += std::ssize(r->examples) / 2;
  return n;
}

}  // namespace cputrain
