#include "engine/vocab_tokenizer.h"

#include <cstdio>
#include <queue>

#include "engine/error.h"
#include "engine/gguf_file.h"

namespace cputrain {
namespace {

constexpr std::string_view kSpace = "\xe2\x96\x81";  // U+2581, SentencePiece's space

size_t utf8_char_bytes(unsigned char lead) {
  if (lead < 0x80) return 1;
  if ((lead & 0xe0) == 0xc0) return 2;
  if ((lead & 0xf0) == 0xe0) return 3;
  if ((lead & 0xf8) == 0xf0) return 4;
  return 1;
}

// The byte a piece "<0xAB>" stands for, or -1.
int byte_of_piece(const std::string& piece) {
  unsigned value = 0;
  char end = 0;
  if (piece.size() == 6 && std::sscanf(piece.c_str(), "<0x%2X%c", &value, &end) == 2 && end == '>')
    return static_cast<int>(value);
  return -1;
}

}  // namespace

Vocabulary gguf_vocabulary(const GgufFile& file) {
  const std::string& path = file.path();
  if (!file.find("tokenizer.ggml.tokens"))
    throw UserError(path + ": no tokenizer (tokenizer.ggml.tokens)");
  Vocabulary v;
  v.model = file.string("tokenizer.ggml.model", "llama");
  if (v.model != "llama")
    throw UserError(path + ": tokenizer " + v.model +
                    ", which cputrain does not read yet (it reads llama)");
  v.pre = file.string("tokenizer.ggml.pre", "");
  v.tokens = file.strings("tokenizer.ggml.tokens");
  const int64_t n = static_cast<int64_t>(v.tokens.size());
  if (file.find("tokenizer.ggml.scores")) {
    for (double s : file.numbers("tokenizer.ggml.scores"))
      v.scores.push_back(static_cast<float>(s));
    if (static_cast<int64_t>(v.scores.size()) != n)
      throw UserError(path + ": tokenizer.ggml.scores has " + std::to_string(v.scores.size()) +
                      " entries for " + std::to_string(n) + " tokens");
  }
  if (file.find("tokenizer.ggml.token_type")) {
    for (double t : file.numbers("tokenizer.ggml.token_type"))
      v.types.push_back(static_cast<int32_t>(t));
    if (static_cast<int64_t>(v.types.size()) != n)
      throw UserError(path + ": tokenizer.ggml.token_type has " + std::to_string(v.types.size()) +
                      " entries for " + std::to_string(n) + " tokens");
  }
  const auto id = [&](const char* key, int64_t fallback) {
    const int64_t i = file.integer(key, fallback);
    if (i < -1 || i >= n)
      throw UserError(path + ": " + key + " " + std::to_string(i) +
                      " is not a token id (there are " + std::to_string(n) + ")");
    return static_cast<int32_t>(i);
  };
  v.bos = id("tokenizer.ggml.bos_token_id", 1);
  v.eos = id("tokenizer.ggml.eos_token_id", 2);
  v.unk = id("tokenizer.ggml.unknown_token_id", 0);
  v.add_bos = file.flag("tokenizer.ggml.add_bos_token", true);
  v.add_eos = file.flag("tokenizer.ggml.add_eos_token", false);
  v.add_space_prefix = file.flag("tokenizer.ggml.add_space_prefix", true);
  v.chat_template = file.string("tokenizer.chat_template", "");
  return v;
}

VocabTokenizer::VocabTokenizer(Vocabulary vocabulary) : v_(std::move(vocabulary)) {
  ids_.reserve(v_.tokens.size());
  for (size_t i = 0; i < v_.tokens.size(); ++i) ids_.emplace(v_.tokens[i], static_cast<int32_t>(i));
  for (int b = 0; b < 256; ++b) {
    char piece[8];
    std::snprintf(piece, sizeof(piece), "<0x%02X>", b);
    byte_ids_[b] = find(piece);
  }
}

int32_t VocabTokenizer::find(std::string_view piece) const {
  const auto it = ids_.find(std::string(piece));
  return it == ids_.end() ? -1 : it->second;
}

int32_t VocabTokenizer::type(int32_t id) const {
  return v_.types.empty() ? Vocabulary::kNormal : v_.types[static_cast<size_t>(id)];
}

std::vector<int32_t> VocabTokenizer::encode(std::string_view text) const {
  std::vector<int32_t> out;
  if (text.empty()) return out;
  std::string s;
  s.reserve(text.size() + 8);
  if (v_.add_space_prefix) s += kSpace;
  for (char c : text) {
    if (c == ' ')
      s += kSpace;
    else
      s += c;
  }
  // The symbols, one per character at first, as a linked list.
  struct Symbol {
    size_t start, size;
    int prev, next;
  };
  std::vector<Symbol> symbols;
  for (size_t pos = 0; pos < s.size();) {
    const size_t n = std::min(utf8_char_bytes(static_cast<unsigned char>(s[pos])), s.size() - pos);
    const int i = static_cast<int>(symbols.size());
    symbols.push_back({pos, n, i - 1, i + 1});
    pos += n;
  }
  symbols.back().next = -1;
  // Candidate merges: the higher score first, then the leftmost.
  struct Pair {
    int left, right;
    float score;
    size_t size;
  };
  const auto later = [](const Pair& a, const Pair& b) {
    return a.score < b.score || (a.score == b.score && a.left > b.left);
  };
  std::priority_queue<Pair, std::vector<Pair>, decltype(later)> queue(later);
  const auto consider = [&](int left, int right) {
    if (left < 0 || right < 0) return;
    const size_t size = symbols[left].size + symbols[right].size;
    const int32_t id = find(std::string_view(s).substr(symbols[left].start, size));
    if (id < 0) return;
    queue.push({left, right, v_.scores.empty() ? 0.0f : v_.scores[static_cast<size_t>(id)], size});
  };
  for (int i = 0; i + 1 < static_cast<int>(symbols.size()); ++i) consider(i, i + 1);
  while (!queue.empty()) {
    const Pair p = queue.top();
    queue.pop();
    Symbol& left = symbols[p.left];
    Symbol& right = symbols[p.right];
    // Stale: one side was merged into something else since.
    if (left.size == 0 || right.size == 0 || left.size + right.size != p.size) continue;
    left.size += right.size;
    right.size = 0;
    left.next = right.next;
    if (right.next >= 0) symbols[right.next].prev = p.left;
    consider(left.prev, p.left);
    consider(p.left, left.next);
  }
  for (int i = 0; i >= 0; i = symbols[i].next) {
    const std::string_view piece = std::string_view(s).substr(symbols[i].start, symbols[i].size);
    const int32_t id = find(piece);
    if (id >= 0) {
      out.push_back(id);
      continue;
    }
    for (unsigned char c : piece) out.push_back(byte_ids_[c] >= 0 ? byte_ids_[c] : v_.unk);
  }
  return out;
}

std::string VocabTokenizer::decode(std::span<const int32_t> ids) const {
  std::string text;
  for (int32_t id : ids) {
    if (id < 0 || id >= vocab_size()) continue;
    const std::string& piece = v_.tokens[static_cast<size_t>(id)];
    switch (type(id)) {
      case Vocabulary::kByte: {
        const int b = byte_of_piece(piece);
        if (b >= 0) text.push_back(static_cast<char>(b));
        break;
      }
      case Vocabulary::kControl:
      case Vocabulary::kUnused:
        break;
      case Vocabulary::kUserDefined:
        text += piece;
        break;
      default:
        for (size_t pos = 0; pos < piece.size();) {
          if (piece.compare(pos, kSpace.size(), kSpace) == 0) {
            text.push_back(' ');
            pos += kSpace.size();
          } else {
            text.push_back(piece[pos++]);
          }
        }
    }
  }
  return text;
}

}  // namespace cputrain
