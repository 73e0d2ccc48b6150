#include "engine/data/finetune_data.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <numeric>
#include <stdexcept>

#include "engine/core/error.h"
#include "engine/data/example_text.h"
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

// A chat's messages, with an assistant reply unless the whole conversation is learnt.
std::vector<ChatMessage> chat_messages(const json& list, const std::string& where,
                                       bool train_on_prompt) {
  std::vector<ChatMessage> messages = read_messages(list, "messages", where);
  bool reply = false;
  for (const ChatMessage& m : messages) reply = reply || m.role == "assistant";
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

FinetuneData read_finetune_jsonl(const std::string& path, const Tokenizer& tokenizer,
                                 const FinetuneDataOptions& options) {
  FinetuneData data;
  int64_t held = 0;  // bytes of the examples' tokens and targets
  for_each_json_object(
      path, "examples", options.max_line_bytes,
      [&](const json& object, const std::string& where, int64_t number) {
        std::vector<Segment> segments;
        bool ends_with_eos = true;
        ExampleShape shape;
        if (object.contains("messages")) {
          shape = ExampleShape::Chat;
          const std::vector<ChatMessage> messages =
              chat_messages(object["messages"], where, options.train_on_prompt);
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

        FinetuneExample e =
            tokenize_segments(segments, tokenizer, ends_with_eos, options.max_tokens);
        e.line = number;
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
          return;
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
      });
  if (data.examples.empty())
    throw UserError(path + ": no example" +
                    (data.dropped > 0 ? " with a target within the context (" +
                                            std::to_string(data.dropped) + " cut to nothing)"
                                      : std::string(" (the file is empty)")));
  return data;
}

std::vector<PackedRow> pack_units(const std::vector<int64_t>& sizes, int64_t ctx) {
  std::vector<int32_t> order(sizes.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int32_t>(i);
  const auto positions = [&](int32_t i) { return sizes[static_cast<size_t>(i)]; };
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return positions(a) > positions(b); });
  std::vector<PackedRow> rows;
  std::multimap<int64_t, size_t> room;  // positions left -> row
  for (const int32_t i : order) {
    const int64_t n = positions(i);
    if (n < 1 || n > ctx) throw std::invalid_argument("pack_units: a unit of 1 .. ctx positions");
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

std::vector<PackedRow> pack_examples(const std::vector<FinetuneExample>& examples, int64_t ctx) {
  std::vector<int64_t> sizes;
  sizes.reserve(examples.size());
  for (const FinetuneExample& e : examples) sizes.push_back(std::ssize(e.tokens) - 1);
  return pack_units(sizes, ctx);
}

int64_t RowPlan::steps_for(double epochs) const {
  const double steps = by_epoch
                           ? epochs * static_cast<double>(epoch_steps())
                           : epochs * static_cast<double>(rows) / static_cast<double>(per_step);
  // Whole passes are whole steps: 3 epochs of 7 steps are 21, not 22 for a rounding.
  return std::max<int64_t>(1, static_cast<int64_t>(std::ceil(steps - 1e-9)));
}

double RowPlan::epochs_of(int64_t steps) const {
  const auto R = static_cast<double>(rows);
  if (!by_epoch) return static_cast<double>(steps * per_step) / R;
  const int64_t whole = steps / epoch_steps(), left = steps % epoch_steps();
  return static_cast<double>(whole) + static_cast<double>(std::min(left * per_step, rows)) / R;
}

StepRows::StepRows(std::vector<PackedRow> rows, int64_t ctx, int64_t batch, const RowPlan& plan,
                   uint64_t seed)
    : rows_(std::move(rows)),
      order_(rows_.size(), seed),
      plan_(plan),
      inputs_(Tensor::empty(Shape{batch, ctx}, DType::I32, MemoryCategory::Workspace)),
      targets_(Tensor::empty(Shape{batch, ctx}, DType::I32, MemoryCategory::Workspace)) {}

std::span<const PackedRow* const> StepRows::take(int64_t step) {
  step_.clear();
  const int64_t per_step = plan_.per_step, R = static_cast<int64_t>(rows_.size());
  if (!plan_.by_epoch) {
    for (int64_t i = 0; i < per_step; ++i)
      step_.push_back(&rows_[order_.at((step - 1) * per_step + i)]);
    return step_;
  }
  const int64_t epoch = (step - 1) / plan_.epoch_steps();
  const int64_t first = (step - 1) % plan_.epoch_steps() * per_step;
  for (int64_t i = first; i < first + per_step; ++i)
    step_.push_back(i < R ? &rows_[order_.at(epoch * R + i)] : &empty_);
  return step_;
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
