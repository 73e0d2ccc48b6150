#include "engine/data/example_text.h"

#include <filesystem>
#include <fstream>
#include <string_view>

#include "engine/core/error.h"
#include "engine/text/tokenizer.h"

namespace cputrain {
namespace {

// The part of `text` an example of at most `max_tokens` tokens can use: a token covers at most
// a few dozen bytes, so a longer text is cut (at a character's start) before it is tokenized.
std::string_view usable_text(std::string_view text, int64_t max_tokens) {
  if (max_tokens <= 0) return text;
  size_t keep = static_cast<size_t>(max_tokens + 64) * 256;
  if (text.size() <= keep) return text;
  while (keep > 0 && (static_cast<unsigned char>(text[keep]) & 0xC0) == 0x80) --keep;
  return text.substr(0, keep);
}

// Reads the next line of `in` into `line`, refusing one longer than `max` bytes (0: any) before
// it is held whole; false at the end of the file. A UTF-8 BOM on the first line and a line's
// closing '\r' are taken off.
bool read_example_line(std::istream& in, std::string& line, int64_t max, int64_t number,
                       const std::string& where) {
  line.clear();
  std::streambuf& buffer = *in.rdbuf();
  bool any = false;
  for (int c = buffer.sbumpc(); c != std::char_traits<char>::eof(); c = buffer.sbumpc()) {
    any = true;
    if (c == '\n') break;
    line.push_back(static_cast<char>(c));
    if (max > 0 && static_cast<int64_t>(line.size()) > max)
      throw UserError(where + ": a line longer than " + std::to_string(max >> 20) +
                      " MiB, more than the memory limit lets one example hold (--mem-limit)");
  }
  if (!any) return false;
  if (number == 1 && line.starts_with("\xEF\xBB\xBF")) line.erase(0, 3);  // a UTF-8 BOM
  if (!line.empty() && line.back() == '\r') line.pop_back();
  return true;
}

}  // namespace

void for_each_json_object(
    const std::string& path, const char* what, int64_t max_line_bytes,
    const std::function<void(const nlohmann::json& object, const std::string& where,
                             int64_t number)>& each) {
  if (std::filesystem::is_directory(path))
    throw UserError(path + ": a folder, where a JSON Lines file of " + what + " is expected");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw UserError(path + ": cannot be read");
  std::string line;
  for (int64_t number = 1;
       read_example_line(in, line, max_line_bytes, number, path + ":" + std::to_string(number));
       ++number) {
    const std::string where = path + ":" + std::to_string(number);
    if (blank(line)) continue;
    nlohmann::json object;
    try {
      object = nlohmann::json::parse(line);
    } catch (const nlohmann::json::parse_error& e) {
      throw UserError(where + ": not valid JSON (at byte " + std::to_string(e.byte) + ")");
    }
    if (!object.is_object()) throw UserError(where + ": not a JSON object");
    each(object, where, number);
  }
}

std::string field_string(const nlohmann::json& object, const char* name, const std::string& where) {
  const nlohmann::json& v = object.at(name);
  if (!v.is_string()) throw UserError(where + ": \"" + name + "\" is not a string");
  return v.get<std::string>();
}

bool blank(const std::string& s) {
  return s.find_first_not_of(" \t\n\r\f\v") == std::string::npos;
}

std::vector<ChatMessage> read_messages(const nlohmann::json& list, const char* field,
                                       const std::string& where) {
  const std::string name = std::string("\"") + field + "\"";
  if (!list.is_array()) throw UserError(where + ": " + name + " is not a list");
  // The messages of a chat example are "message N"; those of another field "FIELD message N".
  const std::string of = std::string(field) == "messages" ? "" : name + " ";
  std::vector<ChatMessage> messages;
  for (size_t i = 0; i < list.size(); ++i) {
    const std::string at = where + ": " + of + "message " + std::to_string(i + 1);
    const nlohmann::json& m = list[i];
    if (!m.is_object() || !m.contains("role") || !m.contains("content"))
      throw UserError(at + " is not an object with \"role\" and \"content\"");
    ChatMessage message{field_string(m, "role", at), field_string(m, "content", at)};
    if (message.role != "system" && message.role != "user" && message.role != "assistant")
      throw UserError(at + " has the role \"" + message.role +
                      "\" (the roles are system, user and assistant)");
    if (message.role == "assistant" && blank(message.content))
      throw UserError(at + " is an empty assistant reply");
    messages.push_back(std::move(message));
  }
  if (messages.empty()) throw UserError(where + ": " + name + " is empty");
  return messages;
}

std::vector<Segment> chat_segments(const ChatTemplate& tmpl,
                                   const std::vector<ChatMessage>& messages, int64_t first_reply) {
  std::vector<Segment> out;
  // A reply is a run of pieces marked `reply` (its content and the marker that ends it).
  int64_t reply = -1;
  bool in_reply = false;
  for (const ChatPiece& p : render_chat(tmpl, messages, false)) {
    if (p.reply && !in_reply) ++reply;
    in_reply = p.reply;
    out.push_back({p.text, p.markers, p.reply && reply >= first_reply});
  }
  return out;
}

FinetuneExample tokenize_segments(const std::vector<Segment>& segments, const Tokenizer& tokenizer,
                                  bool eos, int64_t max_tokens) {
  FinetuneExample e;
  if (tokenizer.adds_bos()) {
    e.tokens.push_back(tokenizer.bos_id());
    e.target.push_back(0);
  }
  for (const Segment& s : segments) {
    const bool begins = e.tokens.empty() || tokenizer.is_special(e.tokens.back());
    const std::vector<int32_t> ids =
        tokenizer.encode_piece(usable_text(s.text, max_tokens), s.special, begins);
    e.tokens.insert(e.tokens.end(), ids.begin(), ids.end());
    e.target.insert(e.target.end(), ids.size(), s.target ? 1 : 0);
  }
  if (eos) {
    e.tokens.push_back(tokenizer.eos_id());
    e.target.push_back(1);
  }
  if (!e.target.empty()) e.target[0] = 0;
  return e;
}

}  // namespace cputrain
