// What the readers of JSON Lines examples share (finetune_data.h, preference_data.h): lines read
// within a memory limit, string and message fields checked, and an example's stretches of text
// tokenized with the tokens the loss falls on marked.
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "engine/data/finetune_data.h"
#include "engine/text/chat_template.h"

namespace cputrain {

class Tokenizer;

// Each JSON object of the JSON Lines file `path` to `each`, with where it is ("PATH:LINE") and
// its line's number; blank lines pass. A UserError for a folder or an unreadable file (`what`:
// what the file should hold, "examples"), a line longer than `max_line_bytes` (0: any; refused
// before it is held whole), and a line that is not valid JSON or not an object.
void for_each_json_object(
    const std::string& path, const char* what, int64_t max_line_bytes,
    const std::function<void(const nlohmann::json& object, const std::string& where,
                             int64_t number)>& each);

// object[name] as a string; a UserError "WHERE: "name" is not a string".
std::string field_string(const nlohmann::json& object, const char* name, const std::string& where);
// Whether s is empty or whitespace alone.
bool blank(const std::string& s);

// The list `list` (the field `field`) as chat messages of the roles system, user and assistant,
// with no empty assistant reply; a UserError naming `where`, the field and the message for
// anything else, and for an empty list.
std::vector<ChatMessage> read_messages(const nlohmann::json& list, const char* field,
                                       const std::string& where);

// A stretch of an example's text: special tokens to parse (a template's markers) or not, and
// whether its tokens are targets.
struct Segment {
  std::string text;
  bool special = false;
  bool target = false;
};

// The conversation's pieces as segments, the assistant's replies the targets: all of them, or
// from the `first_reply`-th (from 0) on, the earlier ones being part of a prompt.
std::vector<Segment> chat_segments(const ChatTemplate& tmpl,
                                   const std::vector<ChatMessage>& messages,
                                   int64_t first_reply = 0);

// The segments tokenized (BOS first where the tokenizer adds it, EOS last with `eos`, a target),
// each cut before tokenizing to what an example of at most `max_tokens` tokens can use (0: all).
// The first token is never a target.
FinetuneExample tokenize_segments(const std::vector<Segment>& segments, const Tokenizer& tokenizer,
                                  bool eos, int64_t max_tokens);

}  // namespace cputrain
