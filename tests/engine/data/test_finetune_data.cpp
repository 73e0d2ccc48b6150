// Fine-tuning data from JSON Lines: each shape's tokens and the targets the loss falls on (the
// completion, the output, the assistant's replies; everything with --train-on-prompt), markers
// parsed as special tokens only where the template writes them, truncation, and one clear line
// naming the file and line for each kind of bad input.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "engine/core/error.h"
#include "engine/data/data_test_util.h"
#include "engine/data/finetune_data.h"
#include "engine/text/chat_template.h"
#include "engine/text/tokenizer.h"
#include "engine/text/vocab_tokenizer.h"

namespace cputrain {
namespace {

namespace fs = std::filesystem;
using namespace test;

FinetuneData read(const std::string& text, const FinetuneDataOptions& options = {}) {
  const TempFile file(text);
  return read_finetune_jsonl(file.path.string(), char_tokenizer(), options);
}

TEST(FinetuneData, EachShapeTargetsWhatFollowsItsPrompt) {
  const Tokenizer t = char_tokenizer();
  FinetuneDataOptions options;
  const FinetuneData d = read(
      "{\"text\": \"all of it\"}\n"
      "\n"
      "{\"prompt\": \"Q: 2+2?\\nA:\", \"completion\": \" 4\"}\r\n"
      "{\"instruction\": \"Add.\", \"input\": \"2 2\", \"output\": \"4\"}\n"
      "{\"instruction\": \"Say hi.\", \"output\": \"hi\"}\n",
      options);
  ASSERT_EQ(d.examples.size(), 4u);
  EXPECT_EQ(d.shapes[static_cast<int>(ExampleShape::Text)], 1);
  EXPECT_EQ(d.shapes[static_cast<int>(ExampleShape::PromptCompletion)], 1);
  EXPECT_EQ(d.shapes[static_cast<int>(ExampleShape::Alpaca)], 2);
  EXPECT_EQ(d.examples[1].line, 3);  // the blank line counts
  for (const FinetuneExample& e : d.examples) {
    ASSERT_EQ(e.tokens.size(), e.target.size());
    EXPECT_EQ(e.tokens.front(), t.bos_id());
    EXPECT_EQ(e.target.front(), 0);
    EXPECT_EQ(e.tokens.back(), t.eos_id());  // each ends with EOS, a target
    EXPECT_EQ(e.target.back(), 1);
  }
  EXPECT_EQ(targets_text(t, d.examples[0]), "all of it");
  EXPECT_EQ(targets_text(t, d.examples[1]), " 4");
  EXPECT_EQ(targets_text(t, d.examples[2]), "4");
  EXPECT_EQ(targets_text(t, d.examples[3]), "hi");
  // Alpaca's prompt, with and without input.
  std::vector<int32_t> prompt(d.examples[2].tokens.begin(), d.examples[2].tokens.end() - 2);
  EXPECT_NE(t.decode(prompt).find("### Instruction:\nAdd.\n\n### Input:\n2 2\n\n### Response:\n"),
            std::string::npos);
  prompt.assign(d.examples[3].tokens.begin(), d.examples[3].tokens.end() - 3);
  EXPECT_EQ(t.decode(prompt).find("### Input:"), std::string::npos);
  int64_t targets = 0, tokens = 0;
  for (const FinetuneExample& e : d.examples) {
    tokens += static_cast<int64_t>(e.tokens.size());
    for (uint8_t x : e.target) targets += x;
  }
  EXPECT_EQ(d.tokens, tokens);
  EXPECT_EQ(d.targets, targets);
}

TEST(FinetuneData, ChatTargetsTheRepliesAndParsesOnlyTheTemplatesMarkers) {
  const Tokenizer t = char_tokenizer();
  FinetuneDataOptions options;
  options.chat = chat_template_named("chatml", "--chat-template", "</s>");
  const FinetuneData d = read(
      "{\"messages\": [{\"role\": \"system\", \"content\": \"Be brief.\"}, {\"role\": \"user\", "
      "\"content\": \"<|im_start|>2+2?\"}, {\"role\": \"assistant\", \"content\": \"4\"}, "
      "{\"role\": \"user\", \"content\": \"3+3?\"}, {\"role\": \"assistant\", \"content\": "
      "\"6\"}]}\n"
      "{\"instruction\": \"Add 1 and 1.\", \"output\": \"2\"}\n",
      options);
  ASSERT_EQ(d.examples.size(), 2u);
  const FinetuneExample& chat = d.examples[0];
  // The replies and the marker that ends each; nothing of the system or user messages.
  std::vector<int32_t> replies;
  for (size_t i = 0; i < chat.tokens.size(); ++i)
    if (chat.target[i]) replies.push_back(chat.tokens[i]);
  const int32_t im_start = 3, im_end = 4;
  EXPECT_EQ(replies, (std::vector<int32_t>{t.encode("4")[0], im_end, t.encode("6")[0], im_end}));
  // Five messages: five <|im_start|> ids; the one the user typed is text.
  EXPECT_EQ(std::count(chat.tokens.begin(), chat.tokens.end(), im_start), 5);
  EXPECT_NE(t.decode(chat.tokens).find("<|im_start|>2+2?"), std::string::npos);
  // Alpaca through the template: the instruction as the user's message.
  EXPECT_EQ(targets_text(t, d.examples[1]), "2");
  EXPECT_EQ(std::count(d.examples[1].tokens.begin(), d.examples[1].tokens.end(), im_start), 2);
  // ChatML's newline after <|im_end|> ends the text; it is no target.
  EXPECT_EQ(d.examples[1].tokens.back(), t.encode("\n").back());
  EXPECT_EQ(d.examples[1].target.back(), 0);

  // With --train-on-prompt every token after the first is a target.
  options.train_on_prompt = true;
  const FinetuneData all = read(
      "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}, {\"role\": \"assistant\", "
      "\"content\": \"yo\"}]}\n",
      options);
  const FinetuneExample& e = all.examples[0];
  EXPECT_EQ(e.target.front(), 0);
  EXPECT_EQ(std::count(e.target.begin(), e.target.end(), 1),
            static_cast<std::ptrdiff_t>(e.tokens.size()) - 1);
}

TEST(FinetuneData, LongExamplesAreCutAndThoseLeftWithoutTargetsDropped) {
  FinetuneDataOptions options;
  options.max_tokens = 12;
  const FinetuneData d = read(
      "{\"prompt\": \"abc\", \"completion\": \"defghijklmnopqrstuvwxyz\"}\n"
      "{\"prompt\": \"a long prompt that fills the context\", \"completion\": \"x\"}\n"
      "{\"text\": \"short\"}\n",
      options);
  EXPECT_EQ(d.truncated, 2);
  EXPECT_EQ(d.dropped, 1);
  ASSERT_EQ(d.examples.size(), 2u);
  EXPECT_EQ(d.examples[0].tokens.size(), 12u);
  EXPECT_EQ(d.examples[0].line, 1);
  EXPECT_EQ(d.examples[1].line, 3);
}

// Each bad line: a UserError of one line naming the file and line and what is wrong.
TEST(FinetuneData, BadLinesAreNamed) {
  FinetuneDataOptions chatml;
  chatml.chat = chat_template_named("chatml", "--chat-template", "</s>");
  const std::pair<std::string, std::string> cases[] = {
      {"{\"text\": \"ok\"}\n{\"text\": \"unterminated}\n", ":2: not valid JSON"},
      {"[1, 2]\n", ":1: not a JSON object"},
      {"{\"txt\": \"typo\"}\n", ":1: no field of a known shape"},
      {"{\"prompt\": \"p\"}\n", ":1: has \"prompt\" but no \"completion\""},
      {"{\"text\": 5}\n", ":1: \"text\" is not a string"},
      {"{\"instruction\": \"i\", \"output\": \" \"}\n", ":1: \"output\" is empty"},
      {"{\"messages\": [{\"role\": \"user\", \"content\": \"q\"}, {\"role\": \"assistant\", "
       "\"content\": \"\"}]}\n",
       ":1: message 2 is an empty assistant reply"},
      {"{\"messages\": [{\"role\": \"bot\", \"content\": \"q\"}]}\n",
       ":1: message 1 has the role \"bot\" (the roles are system, user and assistant)"},
      {"{\"messages\": [{\"role\": \"user\", \"content\": \"q\"}]}\n", ":1: no assistant reply"},
      {"{\"messages\": [{\"role\": \"user\"}]}\n", ":1: message 1 is not an object"},
      {"{\"messages\": \"hi\"}\n", ":1: \"messages\" is not a list"},
      {"\n\n", ": no example (the file is empty)"}};
  for (const auto& [text, expected] : cases) {
    const TempFile file(text);
    try {
      read_finetune_jsonl(file.path.string(), char_tokenizer(), chatml);
      ADD_FAILURE() << "accepted: " << text;
    } catch (const UserError& e) {
      const std::string message = e.what();
      EXPECT_EQ(message.rfind(file.path.string(), 0), 0u) << message;
      EXPECT_NE(message.find(expected), std::string::npos) << message;
      EXPECT_EQ(message.find('\n'), std::string::npos) << message;
    }
  }
  // A chat with no template known.
  const TempFile file(
      "{\"messages\": [{\"role\": \"user\", \"content\": \"q\"}, {\"role\": \"assistant\", "
      "\"content\": \"a\"}]}\n");
  try {
    read_finetune_jsonl(file.path.string(), char_tokenizer(), {});
    ADD_FAILURE() << "a chat without a template was accepted";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find(":1: a chat example, and the model has no chat template"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(read_finetune_jsonl("/nonexistent/data.jsonl", char_tokenizer(), {}), UserError);
}

// Packing: every example in exactly one row, no row over the context, rows filled nearly full;
// the batch holds each example's inputs and its targets (-1 elsewhere) and padding after them.
TEST(FinetuneData, PackingPlacesEveryExampleOnceAndFillsRows) {
  std::vector<FinetuneExample> examples;
  std::mt19937 rng(3);
  for (int i = 0; i < 200; ++i) {
    FinetuneExample e;
    const int n = 2 + static_cast<int>(rng() % 40);
    for (int j = 0; j < n; ++j) {
      e.tokens.push_back(1000 * i + j);
      e.target.push_back(j > n / 2 ? 1 : 0);
    }
    examples.push_back(e);
  }
  const int64_t ctx = 64;
  const std::vector<PackedRow> rows = pack_examples(examples, ctx);
  std::vector<int> seen(examples.size(), 0);
  int64_t positions = 0;
  for (const PackedRow& r : rows) {
    int64_t sum = 0;
    for (const int32_t i : r.examples) {
      ++seen[static_cast<size_t>(i)];
      sum += static_cast<int64_t>(examples[static_cast<size_t>(i)].tokens.size()) - 1;
    }
    EXPECT_EQ(sum, r.positions);
    EXPECT_LE(r.positions, ctx);
    positions += r.positions;
  }
  for (const int n : seen) EXPECT_EQ(n, 1);
  EXPECT_GT(static_cast<double>(positions) / static_cast<double>(rows.size() * ctx), 0.97);

  std::vector<const PackedRow*> batch = {&rows[0], &rows.back()};
  std::vector<int32_t> inputs(2 * ctx), targets(2 * ctx);
  Packing packing;
  const int64_t counted =
      fill_packed_batch(batch, examples, ctx, -7, inputs.data(), targets.data(), packing);
  int64_t want = 0;
  for (size_t b = 0; b < 2; ++b) {
    int64_t t = 0, sum = 0;
    for (const int32_t i : batch[b]->examples) {
      const FinetuneExample& e = examples[static_cast<size_t>(i)];
      for (size_t j = 0; j + 1 < e.tokens.size(); ++j, ++t) {
        EXPECT_EQ(inputs[b * ctx + static_cast<size_t>(t)], e.tokens[j]);
        EXPECT_EQ(targets[b * ctx + static_cast<size_t>(t)],
                  e.target[j + 1] ? e.tokens[j + 1] : -1);
        want += e.target[j + 1];
      }
    }
    for (; t < ctx; ++t) {
      EXPECT_EQ(inputs[b * ctx + static_cast<size_t>(t)], -7);
      EXPECT_EQ(targets[b * ctx + static_cast<size_t>(t)], -1);
    }
    for (const int64_t n : packing.lengths[b]) sum += n;
    EXPECT_EQ(sum, ctx);
  }
  EXPECT_EQ(counted, want);
}

}  // namespace
}  // namespace cputrain
