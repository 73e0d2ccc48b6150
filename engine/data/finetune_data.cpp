#include "engine/data/finetune_data.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <numeric>
#include <stdexcept>
#include <string_view>

#include "engine/core/error.h"
#include "engine/text/tokenizer.h"

namespace cputrain {
namespace {

using json = nlohmann::json;

// Stanford Alpaca's prompts, for a model without a chat template.
constexpr const char* kAlpacaPrompt =
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request.\n\n### Instruction:\n";
constexpr const char* kAlpacaPromptWithInput =
    "Below is an instruction that describes a task, paired with an input that provides further "
    "context. Write a response that appropriately completes the request.\n\n### Instruction:\n";

// A stretch of an example's text: special tokens to parse (a template's markers) or not, and
// whether its tokens are targets.
struct Segment {
  std::string text;
  bool special = false;
  bool target = false;
};

std::string field_string(const json& object, const char* name, const std::string& where) {
  const json& v = object.at(name);
  if (!v.is_string()) throw UserError(where + ": \"" + name + "\" is not a string");
  return v.get<std::string>();
}

bool blank(const std::string& s) {
  return s.find_first_not_of(" \t\n\r\f\v") == std::string::npos;
}

std::vector<Segment> chat_segments(const ChatTemplate& tmpl,
                                   const std::vector<ChatMessage>& messages) {
  std::vector<Segment> out;
  for (const ChatPiece& p : render_chat(tmpl, messages, false))
    out.push_back({p.text, p.markers, p.reply});
  return out;
}

std::vector<ChatMessage> read_messages(const json& list, const std::string& where,
                                       bool train_on_prompt) {
  if (!list.is_array()) throw UserError(where + ": \"messages\" is not a list");
  std::vector<ChatMessage> messages;
  bool reply = false;
  for (size_t i = 0; i < list.size(); ++i) {
    const std::string at = where + ": message " + std::to_string(i + 1);
    const json& m = list[i];
    if (!m.is_object() || !m.contains("role") || !m.contains("content"))
      throw UserError(at + " is not an object with \"role\" and \"content\"");
    ChatMessage message{field_string(m, "role", at), field_string(m, "content", at)};
    if (message.role != "system" && message.role != "user" && message.role != "assistant")
      throw UserError(at + " has the role \"" + message.role +
                      "\" (the roles are system, user and assistant)");
    if (message.role == "assistant") {
      if (blank(message.content)) throw UserError(at + " is an empty assistant reply");
      reply = true;
    }
    messages.push_back(std::move(message));
  }
  if (messages.empty()) throw UserError(where + ": \"messages\" is empty");
  if (!reply && !train_on_prompt)
    throw UserError(where +
                    ": no assistant reply, so nothing to learn (--train-on-prompt "
                    "learns the whole conversation)");
  return messages;
}

}  // namespace

const char* example_shape_name(ExampleShape shape) {
  switch (shape) {
    case ExampleShape::Text:
      return "text";
    case ExampleShape::PromptCompletion:
      return "prompt/completion";
    case ExampleShape::Alpaca:
      return "alpaca";
    case ExampleShape::Chat:
      break;
  }
  return "chat";
}

namespace {

// Reads the next line of `in` into `line`, refusing one longer than `max` bytes (0: any) before
// it is held whole; false at the end of the file.
bool read_line(std::istream& in, std::string& line, int64_t max, const std::string& where) {
  line.clear();
  std::streambuf& buffer = *in.rdbuf();
  for (int c = buffer.sbumpc(); c != std::char_traits<char>::eof(); c = buffer.sbumpc()) {
    if (c == '\n') return true;
    line.push_back(static_cast<char>(c));
    if (max > 0 && static_cast<int64_t>(line.size()) > max)
      throw UserError(where + ": a line longer than " + std::to_string(max >> 20) +
                      " MiB, more than the memory limit lets one example hold (--mem-limit)");
  }
  return !line.empty();
}

// The part of `text` an example of at most `max_tokens` tokens can use: a token covers at most
// a few dozen bytes, so a longer text is cut (at a character's start) before it is tokenized.
std::string_view usable_text(std::string_view text, int64_t max_tokens) {
  if (max_tokens <= 0) return text;
  size_t keep = static_cast<size_t>(max_tokens + 64) * 256;
  if (text.size() <= keep) return text;
  while (keep > 0 && (static_cast<unsigned char>(text[keep]) & 0xC0) == 0x80) --keep;
  return text.substr(0, keep);
}

}  // namespace

FinetuneData read_finetune_jsonl(const std::string& path, const Tokenizer& tokenizer,
                                 const FinetuneDataOptions& options) {
  if (std::filesystem::is_directory(path))
    throw UserError(path + ": a folder, where a JSON Lines file of examples is expected");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw UserError(path + ": cannot be read");
  FinetuneData data;
  int64_t held = 0;  // bytes of the examples' tokens and targets
  std::string line;
  for (int64_t number = 1;
       read_line(in, line, options.max_line_bytes, path + ":" + std::to_string(number)); ++number) {
    const std::string where = path + ":" + std::to_string(number);
    if (number == 1 && line.starts_with("\xEF\xBB\xBF")) line.erase(0, 3);  // a UTF-8 BOM
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (blank(line)) continue;
    json object;
    try {
      object = json::parse(line);
    } catch (const json::parse_error& e) {
      throw UserError(where + ": not valid JSON (at byte " + std::to_string(e.byte) + ")");
    }
    if (!object.is_object()) throw UserError(where + ": not a JSON object");

    std::vector<Segment> segments;
    bool ends_with_eos = true;
    ExampleShape shape;
    if (object.contains("messages")) {
      shape = ExampleShape::Chat;
      const std::vector<ChatMessage> messages =
          read_messages(object["messages"], where, options.train_on_prompt);
      if (!options.chat)
        throw UserError(where +
                        ": a chat example, and the model has no chat template cputrain "
                        "recognises (give --chat-template: " +
                        chat_family_names() + ")");
      segments = chat_segments(*options.chat, messages);
      ends_with_eos = false;  // each reply ends with the template's marker
    } else if (object.contains("text")) {
      shape = ExampleShape::Text;
      segments.push_back({field_string(object, "text", where), false, true});
    } else if (object.contains("prompt") || object.contains("completion")) {
      shape = ExampleShape::PromptCompletion;
      if (!object.contains("prompt") || !object.contains("completion"))
        throw UserError(where + ": has \"" +
                        (object.contains("prompt") ? "prompt\" but no \"completion\""
                                                   : "completion\" but no \"prompt\""));
      segments.push_back({field_string(object, "prompt", where), false, false});
      segments.push_back({field_string(object, "completion", where), false, true});
    } else if (object.contains("instruction") || object.contains("output")) {
      shape = ExampleShape::Alpaca;
      if (!object.contains("instruction") || !object.contains("output"))
        throw UserError(where + ": has \"" +
                        (object.contains("instruction") ? "instruction\" but no \"output\""
                                                        : "output\" but no \"instruction\""));
      const std::string instruction = field_string(object, "instruction", where);
      const std::string input =
          object.contains("input") ? field_string(object, "input", where) : std::string();
      const std::string output = field_string(object, "output", where);
      if (blank(output)) throw UserError(where + ": \"output\" is empty");
      if (options.chat) {
        const std::vector<ChatMessage> messages = {
            {"user", input.empty() ? instruction : instruction + "\n\n" + input},
            {"assistant", output}};
        segments = chat_segments(*options.chat, messages);
        ends_with_eos = false;
      } else {
        std::string prompt = input.empty() ? kAlpacaPrompt : kAlpacaPromptWithInput;
        prompt += instruction;
        if (!input.empty()) prompt += "\n\n### Input:\n" + input;
        prompt += "\n\n### Response:\n";
        segments.push_back({prompt, false, false});
        segments.push_back({output, false, true});
      }
    } else {
      throw UserError(where +
                      ": no field of a known shape (\"text\"; \"prompt\" and \"completion\"; "
                      "\"instruction\" and \"output\"; \"messages\")");
    }

    FinetuneExample e;
    e.line = number;
    if (tokenizer.adds_bos()) {
      e.tokens.push_back(tokenizer.bos_id());
      e.target.push_back(0);
    }
    for (const Segment& s : segments) {
      const bool begins = e.tokens.empty() || tokenizer.is_special(e.tokens.back());
      const std::vector<int32_t> ids =
          tokenizer.encode_piece(usable_text(s.text, options.max_tokens), s.special, begins);
      e.tokens.insert(e.tokens.end(), ids.begin(), ids.end());
      e.target.insert(e.target.end(), ids.size(), s.target ? 1 : 0);
    }
    if (ends_with_eos) {
      e.tokens.push_back(tokenizer.eos_id());
      e.target.push_back(1);
    }
    if (options.train_on_prompt) std::fill(e.target.begin(), e.target.end(), 1);
    e.target[0] = 0;
    if (options.max_tokens > 0 && static_cast<int64_t>(e.tokens.size()) > options.max_tokens) {
      e.tokens.resize(static_cast<size_t>(options.max_tokens));
      e.target.resize(static_cast<size_t>(options.max_tokens));
      ++data.truncated;
    }
    int64_t targets = 0;
    for (uint8_t t : e.target) targets += t;
    if (targets == 0) {
      ++data.dropped;
      continue;
    }
    held += static_cast<int64_t>(e.tokens.size() * (sizeof(int32_t) + sizeof(uint8_t)) +
                                 sizeof(FinetuneExample));
    if (options.max_data_bytes > 0 && held > options.max_data_bytes)
      throw UserError(where + ": the examples up to here hold " + std::to_string(held >> 20) +
                      " MiB of tokens, more than the memory limit lets the data hold (" +
                      std::to_string(options.max_data_bytes >> 20) +
                      " MiB; --mem-limit): give fewer examples, or a lower --ctx");
    ++data.shapes[static_cast<size_t>(shape)];
    data.tokens += static_cast<int64_t>(e.tokens.size());
    data.targets += targets;
    data.examples.push_back(std::move(e));
  }
  if (data.examples.empty())
    throw UserError(path + ": no example" +
                    (data.dropped > 0 ? " with a target within the context (" +
                                            std::to_string(data.dropped) + " cut to nothing)"
                                      : std::string(" (the file is empty)")));
  return data;
}

std::vector<PackedRow> pack_examples(const std::vector<FinetuneExample>& examples, int64_t ctx) {
  std::vector<int32_t> order(examples.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int32_t>(i);
  const auto positions = [&](int32_t i) {
    return static_cast<int64_t>(examples[static_cast<size_t>(i)].tokens.size()) - 1;
  };
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return positions(a) > positions(b); });
  std::vector<PackedRow> rows;
  std::multimap<int64_t, size_t> room;  // positions left -> row
  for (const int32_t i : order) {
    const int64_t n = positions(i);
    if (n < 1 || n > ctx)
      throw std::invalid_argument("pack_examples: an example of 2 .. ctx + 1 tokens");
    auto it = room.lower_bound(n);  // the fullest row it fits in
    size_t r;
    if (it == room.end()) {
      r = rows.size();
      rows.emplace_back();
    } else {
      r = it->second;
      room.erase(it);
    }
    rows[r].examples.push_back(i);
    rows[r].positions += n;
    if (rows[r].positions < ctx) room.emplace(ctx - rows[r].positions, r);
  }
  return rows;
}

int64_t fill_packed_batch(std::span<const PackedRow* const> rows,
                          const std::vector<FinetuneExample>& examples, int64_t ctx, int32_t pad,
                          int32_t* inputs, int32_t* targets, Packing& packing) {
  packing.lengths.assign(rows.size(), {});
  int64_t counted = 0;
  for (size_t b = 0; b < rows.size(); ++b) {
    int32_t* in = inputs + static_cast<int64_t>(b) * ctx;
    int32_t* tg = targets + static_cast<int64_t>(b) * ctx;
    int64_t t = 0;
    for (const int32_t i : rows[b]->examples) {
      const FinetuneExample& e = examples[static_cast<size_t>(i)];
      const int64_t n = static_cast<int64_t>(e.tokens.size()) - 1;
      for (int64_t j = 0; j < n; ++j) {
        in[t + j] = e.tokens[static_cast<size_t>(j)];
        const bool target = e.target[static_cast<size_t>(j + 1)] != 0;
        tg[t + j] = target ? e.tokens[static_cast<size_t>(j + 1)] : -1;
        counted += target;
      }
      packing.lengths[b].push_back(n);
      t += n;
    }
    if (t < ctx) {
      std::fill(in + t, in + ctx, pad);
      std::fill(tg + t, tg + ctx, -1);
      packing.lengths[b].push_back(ctx - t);
    }
  }
  return counted;
}

int64_t count_targets(std::span<const PackedRow* const> rows,
                      const std::vector<FinetuneExample>& examples) {
  int64_t n = 0;
  for (const PackedRow* r : rows)
    for (const int32_t i : r->examples)
      for (const uint8_t t : examples[static_cast<size_t>(i)].target) n += t;
  return n;
}

int64_t most_targets(const std::vector<PackedRow>& rows,
                     const std::vector<FinetuneExample>& examples, int64_t batch) {
  std::vector<int64_t> counts;
  counts.reserve(rows.size());
  for (const PackedRow& r : rows) {
    const PackedRow* one = &r;
    counts.push_back(count_targets(std::span<const PackedRow* const>(&one, 1), examples));
  }
  const auto n = static_cast<size_t>(std::clamp<int64_t>(batch, 0, std::ssize(counts)));
  std::partial_sort(counts.begin(), counts.begin() + static_cast<std::ptrdiff_t>(n), counts.end(),
                    std::greater<>());
  return std::accumulate(counts.begin(), counts.begin() + static_cast<std::ptrdiff_t>(n),
                         int64_t{0});
}

}  // namespace cputrain
