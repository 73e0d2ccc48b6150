// Preference pairs from JSON Lines: each of TRL's shapes gives a chosen and a rejected example
// whose targets are the completion alone (a conversation's replies after the prompt), the prompt
// they share taken where the line gives none, long pairs cut to share a row (the prompt's
// beginning first), pairs packed whole,
// and one line naming the file and line for each kind of bad input.
#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "engine/core/error.h"
#include "engine/data/data_test_util.h"
#include "engine/data/preference_data.h"

namespace cputrain {
namespace {

using namespace test;

PreferenceData read(const std::string& text, const PreferenceDataOptions& options = {}) {
  const TempFile file(text);
  return read_preference_jsonl(file.path.string(), char_tokenizer(), options);
}

PreferenceDataOptions chatml() {
  PreferenceDataOptions o;
  o.chat = chat_template_named("chatml", "--chat-template", "</s>");
  return o;
}

// The text of an example's tokens that are not targets (its prompt), decoded.
std::string prompt_text(const Tokenizer& t, const FinetuneExample& e) {
  std::vector<int32_t> ids;
  for (size_t i = 0; i < e.tokens.size() && !e.target[i]; ++i) ids.push_back(e.tokens[i]);
  return t.decode(ids);
}

TEST(PreferenceData, EachShapeTargetsItsCompletionsAfterTheSharedPrompt) {
  const Tokenizer t = char_tokenizer();
  const PreferenceData d = read(
      "{\"prompt\": \"Q: 2+2?\", \"chosen\": \" 4\", \"rejected\": \" 5\"}\n"
      "\n"
      "{\"chosen\": \"The sky is blue.\", \"rejected\": \"The sky is green.\"}\n"
      "{\"prompt\": [{\"role\": \"user\", \"content\": \"hi\"}], "
      "\"chosen\": [{\"role\": \"assistant\", \"content\": \"hello\"}], "
      "\"rejected\": [{\"role\": \"assistant\", \"content\": \"go\"}]}\n"
      "{\"chosen\": [{\"role\": \"user\", \"content\": \"a\"}, {\"role\": \"assistant\", "
      "\"content\": \"b\"}, {\"role\": \"user\", \"content\": \"c\"}, {\"role\": \"assistant\", "
      "\"content\": \"yes\"}], \"rejected\": [{\"role\": \"user\", \"content\": \"a\"}, {\"role\": "
      "\"assistant\", \"content\": \"b\"}, {\"role\": \"user\", \"content\": \"c\"}, {\"role\": "
      "\"assistant\", \"content\": \"no\"}]}\n",
      chatml());
  ASSERT_EQ(d.pairs(), 4);
  EXPECT_EQ(d.shapes[static_cast<int>(PairShape::Strings)], 1);
  EXPECT_EQ(d.shapes[static_cast<int>(PairShape::ImplicitPrompt)], 2);
  EXPECT_EQ(d.shapes[static_cast<int>(PairShape::Conversational)], 1);
  EXPECT_EQ(d.examples[2].line, 3);  // the blank line counts
  EXPECT_EQ(targets_text(t, d.examples[0]), " 4");
  EXPECT_EQ(targets_text(t, d.examples[1]), " 5");
  EXPECT_EQ(prompt_text(t, d.examples[0]), "Q: 2+2?");
  EXPECT_EQ(prompt_text(t, d.examples[1]), "Q: 2+2?");
  EXPECT_EQ(d.examples[0].tokens.back(), t.eos_id());  // a string completion ends with EOS
  EXPECT_EQ(d.examples[0].target.back(), 1);
  // The text both begin with, up to the space before the word where they part.
  EXPECT_EQ(prompt_text(t, d.examples[2]), "The sky is");
  EXPECT_EQ(targets_text(t, d.examples[2]), " blue.");
  EXPECT_EQ(targets_text(t, d.examples[3]), " green.");
  // Conversations: the completion's reply and its end marker; the prompt's reply is no target.
  const int32_t im_end = t.encode_piece("<|im_end|>", true, true).back();
  const char* replies[] = {"hello", "go", "yes", "no"};
  for (size_t i = 4; i < 8; ++i) {
    EXPECT_EQ(targets_text(t, d.examples[i]), replies[i - 4]);
    std::vector<int32_t> targeted;
    for (size_t j = 0; j < d.examples[i].tokens.size(); ++j)
      if (d.examples[i].target[j]) targeted.push_back(d.examples[i].tokens[j]);
    EXPECT_EQ(targeted.back(), im_end) << i;
    EXPECT_EQ(std::count(targeted.begin(), targeted.end(), im_end), 1) << i;
  }
  EXPECT_NE(prompt_text(t, d.examples[6]).find("assistant\nb"), std::string::npos);
  int64_t tokens = 0, targets = 0;
  for (const FinetuneExample& e : d.examples) {
    tokens += std::ssize(e.tokens);
    for (const uint8_t x : e.target) targets += x;
    EXPECT_EQ(e.target.front(), 0);
  }
  EXPECT_EQ(d.tokens, tokens);
  EXPECT_EQ(d.targets, targets);
}

// A pair whose sides part only past the cut has one log-probability on both sides, and so no
// preference to learn: it is dropped and counted, not trained on with a gradient of zero.
TEST(PreferenceData, PairsTheSameOnceCutAreDroppedAndCounted) {
  const std::string parting_late =
      "{\"prompt\": \"p\", \"chosen\": \"abcdefghijklmnopqrstuvwxyzA\", \"rejected\": "
      "\"abcdefghijklmnopqrstuvwxyzB\"}\n";
  PreferenceDataOptions o;
  o.ctx = 24;
  const PreferenceData d =
      read(parting_late + "{\"prompt\": \"q\", \"chosen\": \"x\", \"rejected\": \"y\"}\n", o);
  EXPECT_EQ(d.pairs(), 1);
  EXPECT_EQ(d.same, 1);
  EXPECT_EQ(d.dropped, 0);
  try {
    read(parting_late, o);
    ADD_FAILURE() << "a file of such pairs alone is read";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("1 the same once cut; --ctx"), std::string::npos)
        << e.what();
  }
  o.ctx = 64;  // both sides whole: they differ
  EXPECT_EQ(read(parting_late, o).same, 0);
}

TEST(PreferenceData, LongPairsAreCutToShareARowAndPackedWhole) {
  PreferenceDataOptions o;
  o.ctx = 24;
  // Chosen of 30 characters, rejected of 6: the chosen side is cut to what the rejected leaves.
  const PreferenceData d = read(
      "{\"prompt\": \"p\", \"chosen\": \"abcdefghijklmnopqrstuvwxyz0123\", \"rejected\": "
      "\"short\"}\n"
      "{\"prompt\": \"p\", \"chosen\": \"abcdefghijklmnopqrstuvwxyz\", \"rejected\": "
      "\"ABCDEFGHIJKLMNOPQRSTUVWXYZ\"}\n"
      "{\"prompt\": \"q\", \"chosen\": \"x\", \"rejected\": \"y\"}\n"
      "{\"prompt\": \"r\", \"chosen\": \"xy\", \"rejected\": \"yz\"}\n"
      "{\"prompt\": \"0123456789\", \"chosen\": \"ab\", \"rejected\": \"cd\"}\n",
      o);
  ASSERT_EQ(d.pairs(), 5);
  EXPECT_EQ(d.cut, 3);
  for (int64_t p = 0; p < d.pairs(); ++p) {
    const auto c = std::ssize(d.examples[static_cast<size_t>(2 * p)].tokens) - 1;
    const auto r = std::ssize(d.examples[static_cast<size_t>(2 * p + 1)].tokens) - 1;
    EXPECT_LE(c + r, o.ctx) << p;
  }
  // The short side keeps all of itself; two long sides share the row evenly.
  EXPECT_EQ(std::ssize(d.examples[1].tokens), 1 + 1 + 5 + 1);  // BOS, "p", "short", EOS
  EXPECT_EQ(std::ssize(d.examples[0].tokens) - 1, o.ctx - 7);
  EXPECT_EQ(std::ssize(d.examples[2].tokens) - 1, o.ctx / 2);
  EXPECT_EQ(std::ssize(d.examples[3].tokens) - 1, o.ctx / 2);
  // A long prompt loses its beginning (after BOS) first, and the completions stay whole.
  const Tokenizer t = char_tokenizer();
  for (const size_t i : {size_t{8}, size_t{9}}) {
    EXPECT_EQ(std::ssize(d.examples[i].tokens) - 1, o.ctx / 2) << i;
    EXPECT_EQ(d.examples[i].tokens.front(), t.bos_id());
    EXPECT_EQ(prompt_text(t, d.examples[i]), "123456789");
  }
  EXPECT_EQ(targets_text(t, d.examples[8]), "ab");
  EXPECT_EQ(targets_text(t, d.examples[9]), "cd");

  const std::vector<PackedRow> rows = pack_pairs(d.examples, o.ctx);
  std::multiset<int32_t> placed;
  for (const PackedRow& row : rows) {
    int64_t positions = 0;
    ASSERT_EQ(row.examples.size() % 2, 0u);
    for (size_t k = 0; k < row.examples.size(); k += 2) {
      EXPECT_EQ(row.examples[k] % 2, 0);  // chosen, then its rejected
      EXPECT_EQ(row.examples[k + 1], row.examples[k] + 1);
    }
    for (const int32_t i : row.examples) {
      placed.insert(i);
      positions += std::ssize(d.examples[static_cast<size_t>(i)].tokens) - 1;
    }
    EXPECT_EQ(positions, row.positions);
    EXPECT_LE(positions, o.ctx);
  }
  EXPECT_EQ(placed.size(), d.examples.size());
  EXPECT_EQ(std::set<int32_t>(placed.begin(), placed.end()).size(), d.examples.size());
  EXPECT_EQ(rows.size(), 4u);  // the two short pairs share a row
  std::vector<const PackedRow*> all;
  for (const PackedRow& r : rows) all.push_back(&r);
  EXPECT_EQ(count_pairs(all), 5);
}

TEST(PreferenceData, BadLinesAreNamed) {
  const auto error = [](const std::string& text, const PreferenceDataOptions& o = chatml()) {
    const TempFile file(text);
    try {
      read_preference_jsonl(file.path.string(), char_tokenizer(), o);
    } catch (const UserError& e) {
      const std::string what = e.what();
      EXPECT_EQ(what.find('\n'), std::string::npos) << what;
      const std::string name = file.path.string();
      return what.starts_with(name) ? what.substr(name.size()) : "(not naming the file) " + what;
    }
    return std::string("(no error)");
  };
  const std::string ok = "{\"prompt\": \"a\", \"chosen\": \"b\", \"rejected\": \"c\"}\n";
  EXPECT_EQ(error(ok + "{\"prompt\": \"a\", \"completion\": \"b\"}\n"),
            ":2: not a preference pair (no \"chosen\" and \"rejected\"; a pair is {\"prompt\", "
            "\"chosen\", \"rejected\"} or {\"chosen\", \"rejected\"})");
  EXPECT_EQ(error("{\"chosen\": \"b\"}\n"), ":1: has \"chosen\" but no \"rejected\"");
  EXPECT_EQ(error("[1]\n"), ":1: not a JSON object");
  EXPECT_EQ(error("{\"chosen\": \n"), ":1: not valid JSON (at byte 12)");
  EXPECT_EQ(error("{\"chosen\": \"b\", \"rejected\": [{\"role\": \"assistant\", \"content\": "
                  "\"x\"}]}\n"),
            ":1: \"chosen\" and \"rejected\" are not of one kind (two strings, or two lists of "
            "messages)");
  EXPECT_EQ(error("{\"prompt\": 3, \"chosen\": \"b\", \"rejected\": \"c\"}\n"),
            ":1: \"prompt\" is not a string");
  EXPECT_EQ(error("{\"prompt\": \"a\", \"chosen\": \"b\", \"rejected\": \"b\"}\n"),
            ":1: \"chosen\" and \"rejected\" are the same");
  EXPECT_EQ(error("{\"prompt\": \"a\", \"chosen\": \" \", \"rejected\": \"b\"}\n"),
            ":1: \"chosen\" is empty");
  EXPECT_EQ(error("{\"chosen\": \"same start\", \"rejected\": \"same start and more\"}\n"),
            ":1: \"chosen\" is empty after the text it shares with the other (the prompt)");
  const std::string reply = "[{\"role\": \"assistant\", \"content\": \"x\"}]";
  EXPECT_EQ(error("{\"prompt\": \"a\", \"chosen\": " + reply + ", \"rejected\": " + reply + "}\n"),
            ":1: \"prompt\" is not a list of messages, as \"chosen\" is");
  EXPECT_EQ(error("{\"chosen\": " + reply + ", \"rejected\": " + reply + "}\n"),
            ":1: \"chosen\" and \"rejected\" are the same");
  EXPECT_EQ(error("{\"chosen\": [{\"role\": \"user\", \"content\": \"x\"}], \"rejected\": " +
                  reply + "}\n"),
            ":1: \"chosen\" has no assistant reply after the messages it shares with the other "
            "(the prompt)");
  EXPECT_EQ(error("{\"chosen\": [{\"role\": \"bot\", \"content\": \"x\"}], \"rejected\": " + reply +
                  "}\n"),
            ":1: \"chosen\" message 1 has the role \"bot\" (the roles are system, user and "
            "assistant)");
  EXPECT_EQ(error("{\"chosen\": [{\"role\": \"user\", \"content\": \"x\"}, {\"role\": "
                  "\"assistant\", \"content\": \"y\"}], \"rejected\": " +
                      reply + "}\n",
                  PreferenceDataOptions{}),
            ":1: a conversational pair, and the model has no chat template cputrain recognises "
            "(give --chat-template: chatml, llama3, llama2, mistral, zephyr, phi3, gemma, gemma4)");
  EXPECT_EQ(error(""), ": no preference pair (the file is empty)");
}

}  // namespace
}  // namespace cputrain
