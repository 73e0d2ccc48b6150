#include "engine/text/vocab_tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cstdio>
#include <optional>
#include <queue>

#include "engine/core/error.h"
#include "engine/core/memory.h"
#include "engine/io/gguf_file.h"
#include "engine/text/utf8.h"

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

// The pre-tokenizers' regular expressions, as the models' tokenizer.json files give them (case
// folding of the contractions spelled out). Where there are two, the first splits the text and
// each next one splits each piece of the one before.
struct PreTokenizer {
  const char* name;
  std::array<const char*, 6> patterns;  // the unused ones null
  bool ignore_merges;
};
constexpr const char* kGpt2Pattern =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";
constexpr const char* kDigitsApartPattern =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)";
constexpr PreTokenizer kPreTokenizers[] = {
    {"gpt-2", {kGpt2Pattern}, false},
    // MPT's and OLMo's tokenizer.json give GPT-2's.
    {"mpt", {kGpt2Pattern}, false},
    {"llama-bpe",
     {"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|"
      "\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
     true},
    {"qwen2",
     {"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|"
      "\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
     false},
    // Qwen3.5's: Qwen2's with combining marks (\\p{M}) kept with the letters.
    {"qwen35",
     {"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{"
      "M}]+|"
      "\\p{N}| ?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
     false},
    // SmolLM and SmolLM2, StarCoder, Refact (and Command R's vocabulary): each digit alone, then
    // GPT-2's split without its last alternative.
    {"smollm", {"\\p{N}", kDigitsApartPattern}, false},
    {"command-r", {"\\p{N}", kDigitsApartPattern}, false},
    {"starcoder", {"\\p{N}", kDigitsApartPattern}, false},
    {"refact", {"\\p{N}", kDigitsApartPattern}, false},
    // Falcon's: runs of punctuation, GPT-2's split, then runs of three digits.
    {"falcon",
     {"[\\p{P}\\$\\+<=>\\^~\\|`]+",
      "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
      "[0-9][0-9][0-9]"},
     false},
    // DeepSeek LLM's and DeepSeek Coder's, from their tokenizer.json: line breaks, runs of each
    // script, punctuation and digits. (Not reflowed: clang-format splits these multibyte
    // strings differently each time.)
    // clang-format off
    {"deepseek-llm",
     {"[\r\n]",
      "\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+",
      "\\s?[!-/:-~！-／：-～‘-‟　-。]+",
      "\\s+$",
      "[一-龥ࠀ-一가-퟿]+",
      "\\p{N}+"},
     false},
    {"deepseek-coder",
     {"[\r\n]",
      "\\s?\\p{L}+",
      "\\s?\\p{P}+",
      "[一-龥ࠀ-一가-퟿]+",
      "\\p{N}"},
     false},
    // clang-format on
};

// UTF-8 of a code point.
std::string utf8_of(uint32_t cp) {
  std::string s;
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else if (cp < 0x800) {
    s += static_cast<char>(0xc0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3f));
  } else {
    s += static_cast<char>(0xe0 | (cp >> 12));
    s += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
    s += static_cast<char>(0x80 | (cp & 0x3f));
  }
  return s;
}

// The code point of the valid UTF-8 character of n bytes at p.
uint32_t code_point(const char* p, size_t n) {
  const auto b = [&](size_t i) { return static_cast<uint32_t>(static_cast<unsigned char>(p[i])); };
  if (n == 1) return b(0);
  if (n == 2) return ((b(0) & 0x1f) << 6) | (b(1) & 0x3f);
  if (n == 3) return ((b(0) & 0x0f) << 12) | ((b(1) & 0x3f) << 6) | (b(2) & 0x3f);
  return ((b(0) & 0x07) << 18) | ((b(1) & 0x3f) << 12) | ((b(2) & 0x3f) << 6) | (b(3) & 0x3f);
}

// `text` with each space as U+2581, and one more before it where `prefix` is set.
std::string escaped_spaces(std::string_view text, bool prefix) {
  std::string s;
  s.reserve(text.size() + 8);
  if (prefix) s += kSpace;
  for (char c : text) {
    if (c == ' ')
      s += kSpace;
    else
      s += c;
  }
  return s;
}

// `s` split into its characters, then adjacent pieces merged pairwise until no pair merges: at each
// step the pair of highest `priority(left, right)` (nullopt: the two never merge), the leftmost
// among equals. The pieces, in order.
template <typename Priority>
std::vector<std::string_view> merge_pairs(std::string_view s, const Priority& priority) {
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
  if (symbols.empty()) return {};
  symbols.back().next = -1;
  const auto piece = [&](int i) {
    return s.substr(symbols[static_cast<size_t>(i)].start, symbols[static_cast<size_t>(i)].size);
  };
  struct Pair {
    int left, right;
    double priority;
    size_t size;
  };
  const auto later = [](const Pair& a, const Pair& b) {
    return a.priority < b.priority || (a.priority == b.priority && a.left > b.left);
  };
  std::priority_queue<Pair, std::vector<Pair>, decltype(later)> queue(later);
  const auto consider = [&](int left, int right) {
    if (left < 0 || right < 0) return;
    if (const std::optional<double> p = priority(piece(left), piece(right)))
      queue.push(
          {left, right, *p,
           symbols[static_cast<size_t>(left)].size + symbols[static_cast<size_t>(right)].size});
  };
  for (int i = 0; i + 1 < static_cast<int>(symbols.size()); ++i) consider(i, i + 1);
  while (!queue.empty()) {
    const Pair p = queue.top();
    queue.pop();
    Symbol& left = symbols[static_cast<size_t>(p.left)];
    Symbol& right = symbols[static_cast<size_t>(p.right)];
    // Stale: one side was merged into something else since.
    if (left.size == 0 || right.size == 0 || left.size + right.size != p.size) continue;
    left.size += right.size;
    right.size = 0;
    left.next = right.next;
    if (right.next >= 0) symbols[static_cast<size_t>(right.next)].prev = p.left;
    consider(left.prev, p.left);
    consider(p.left, left.next);
  }
  std::vector<std::string_view> pieces;
  for (int i = 0; i >= 0; i = symbols[static_cast<size_t>(i)].next) pieces.push_back(piece(i));
  return pieces;
}

}  // namespace

Vocabulary gguf_vocabulary(const GgufFile& file) {
  const std::string& path = file.path();
  if (!file.find("tokenizer.ggml.tokens"))
    throw UserError(path + ": no tokenizer (tokenizer.ggml.tokens)");
  Vocabulary v;
  v.model = file.string("tokenizer.ggml.model", "llama");
  if (v.model != "llama" && v.model != "gpt2" && v.model != "gemma4")
    throw UserError(path + ": tokenizer " + v.model +
                    ", which cputrain does not read (it reads llama, gpt2 and gemma4)");
  if (v.model != "llama") v.merges = file.strings("tokenizer.ggml.merges");
  // Gemma 4's files name no pre-tokenizer: its model is its own.
  v.pre = file.string("tokenizer.ggml.pre", v.model == "gemma4" ? "gemma4" : "");
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
  // SentencePiece-style vocabularies default to llama's unk, bos, eos at 0, 1, 2.
  const bool spm = v.model == "llama";
  v.bos = id("tokenizer.ggml.bos_token_id", spm ? 1 : -1);
  v.eos = id("tokenizer.ggml.eos_token_id", spm ? 2 : -1);
  v.unk = id("tokenizer.ggml.unknown_token_id", spm ? 0 : -1);
  // Gemma 4 begins every text with BOS whatever its file says, as llama.cpp reads it.
  v.add_bos =
      file.flag("tokenizer.ggml.add_bos_token", spm || v.pre == "llama-bpe") || v.model == "gemma4";
  v.add_eos = file.flag("tokenizer.ggml.add_eos_token", false);
  v.add_space_prefix = file.flag("tokenizer.ggml.add_space_prefix", spm);
  v.chat_template = file.string("tokenizer.chat_template", "");
  // GGUF holds no token attributes: llama.cpp gives a model named Phi-3's special tokens rstrip
  // (but <unk>, <s> and <|endoftext|>), as its tokenizer.json does, and so does this.
  std::string name = file.string("general.name", "");
  std::transform(name.begin(), name.end(), name.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (name.find("phi-3") != std::string::npos || name.find("phi3") != std::string::npos) {
    v.rstrip.assign(v.tokens.size(), 0);
    for (size_t i = 0; i < v.tokens.size(); ++i) {
      const int32_t t = v.types.empty() ? Vocabulary::kNormal : v.types[i];
      const std::string& s = v.tokens[i];
      v.rstrip[i] = ((t == Vocabulary::kControl || t == Vocabulary::kUserDefined) && s != "<unk>" &&
                     s != "<s>" && s != "<|endoftext|>") ||
                    s == "</s>";
    }
  }
  return v;
}

void set_gguf_vocabulary(GgufWriter& w, const Vocabulary& v) {
  w.set_string("tokenizer.ggml.model", v.model);
  if (!v.pre.empty()) w.set_string("tokenizer.ggml.pre", v.pre);
  w.set_strings("tokenizer.ggml.tokens", v.tokens);
  if (!v.scores.empty()) w.set_f32s("tokenizer.ggml.scores", v.scores);
  if (!v.types.empty()) w.set_i32s("tokenizer.ggml.token_type", v.types);
  if (!v.merges.empty()) w.set_strings("tokenizer.ggml.merges", v.merges);
  if (v.bos >= 0) w.set_u32("tokenizer.ggml.bos_token_id", static_cast<uint32_t>(v.bos));
  if (v.eos >= 0) w.set_u32("tokenizer.ggml.eos_token_id", static_cast<uint32_t>(v.eos));
  if (v.unk >= 0) w.set_u32("tokenizer.ggml.unknown_token_id", static_cast<uint32_t>(v.unk));
  w.set_bool("tokenizer.ggml.add_bos_token", v.add_bos);
  w.set_bool("tokenizer.ggml.add_eos_token", v.add_eos);
  w.set_bool("tokenizer.ggml.add_space_prefix", v.add_space_prefix);
  if (!v.chat_template.empty()) w.set_string("tokenizer.chat_template", v.chat_template);
}

VocabTokenizer::VocabTokenizer(Vocabulary vocabulary) : v_(std::move(vocabulary)) {
  bpe_ = v_.model == "gpt2";
  raw_bpe_ = v_.model == "gemma4";
  ids_.reserve(v_.tokens.size());
  for (size_t i = 0; i < v_.tokens.size(); ++i) ids_.emplace(v_.tokens[i], static_cast<int32_t>(i));
  for (size_t i = 0; i < v_.tokens.size(); ++i) {
    const int32_t t = type(static_cast<int32_t>(i));
    if ((t == Vocabulary::kControl || t == Vocabulary::kUserDefined) && !v_.tokens[i].empty())
      specials_.emplace_back(v_.tokens[i], static_cast<int32_t>(i));
    has_user_defined_ =
        has_user_defined_ || (t == Vocabulary::kUserDefined && !v_.tokens[i].empty());
  }
  std::stable_sort(specials_.begin(), specials_.end(),
                   [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
  if (!bpe_) {
    for (int b = 0; b < 256; ++b) {
      char piece[8];
      std::snprintf(piece, sizeof(piece), "<0x%02X>", b);
      byte_ids_[b] = find(piece);
    }
    if (raw_bpe_) {
      merge_rank_.reserve(v_.merges.size());
      for (size_t i = 0; i < v_.merges.size(); ++i)
        merge_rank_.emplace(v_.merges[i], static_cast<int32_t>(i));
    }
    return;
  }
  // GPT-2's byte-level alphabet: printable bytes stand for themselves, the other 68 for the code
  // points from 256 up, in byte order.
  uint32_t next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
    const uint32_t cp = printable ? static_cast<uint32_t>(b) : next++;
    byte_chars_[b] = utf8_of(cp);
    char_bytes_[cp] = static_cast<uint8_t>(b);
    byte_ids_[b] = find(byte_chars_[b]);
  }
  merge_rank_.reserve(v_.merges.size());
  for (size_t i = 0; i < v_.merges.size(); ++i)
    merge_rank_.emplace(v_.merges[i], static_cast<int32_t>(i));
  const std::string pre = v_.pre.empty() || v_.pre == "default" ? "gpt-2" : v_.pre;
  const PreTokenizer* chosen = nullptr;
  for (const PreTokenizer& p : kPreTokenizers)
    if (pre == p.name) chosen = &p;
  if (!chosen)
    throw UserError("pre-tokenizer " + pre + ", which cputrain does not know (it knows " +
                    supported_pre_tokenizers() + ")");
  ignore_merges_ = chosen->ignore_merges;
  for (const char* pattern : chosen->patterns) {
    if (!pattern) continue;
    int error = 0;
    PCRE2_SIZE offset = 0;
    pcre2_code* re = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern), PCRE2_ZERO_TERMINATED,
                                   PCRE2_UTF | PCRE2_UCP, &error, &offset, nullptr);
    if (!re) throw std::logic_error("a pre-tokenizer's pattern does not compile");
    pcre2_jit_compile(re, PCRE2_JIT_COMPLETE);  // where JIT is absent, matching interprets
    regexes_.push_back(re);
  }
}

VocabTokenizer::~VocabTokenizer() {
  for (void* re : regexes_) pcre2_code_free(static_cast<pcre2_code*>(re));
}

std::string VocabTokenizer::supported_pre_tokenizers() {
  std::string names;
  for (const PreTokenizer& p : kPreTokenizers)
    names += (names.empty() ? "" : ", ") + std::string(p.name);
  return names;
}

int32_t VocabTokenizer::find(std::string_view piece) const {
  const auto it = ids_.find(piece);
  return it == ids_.end() ? -1 : it->second;
}

int32_t VocabTokenizer::type(int32_t id) const {
  return v_.types.empty() ? Vocabulary::kNormal : v_.types[static_cast<size_t>(id)];
}

int64_t VocabTokenizer::heap_bytes() const {
  // An unordered_map node: the next link, the pair and the cached hash; and the bucket array.
  const auto table = [](const auto& map, int64_t pair) {
    int64_t bytes = heap_chunk_bytes(static_cast<int64_t>(map.bucket_count() * sizeof(void*)));
    bytes += static_cast<int64_t>(map.size()) * heap_chunk_bytes(8 + pair + 8);
    return bytes;
  };
  int64_t bytes = heap_bytes_of(v_.tokens) + heap_bytes_of(v_.types) + heap_bytes_of(v_.scores) +
                  heap_bytes_of(v_.merges) + heap_bytes_of(v_.chat_template) +
                  heap_bytes_of(specials_) + heap_bytes_of(v_.rstrip);
  for (const std::string& t : v_.tokens) bytes += heap_bytes_of(t);
  for (const std::string& m : v_.merges) bytes += heap_bytes_of(m);
  for (const auto& [text, id] : specials_) bytes += heap_bytes_of(text);
  bytes += table(ids_, sizeof(Table::value_type)) + table(merge_rank_, sizeof(Table::value_type));
  for (const auto& [key, id] : ids_) bytes += heap_bytes_of(key);
  for (const auto& [key, rank] : merge_rank_) bytes += heap_bytes_of(key);
  bytes += table(char_bytes_, sizeof(std::pair<const uint32_t, uint8_t>));
  return bytes;
}

std::vector<int32_t> VocabTokenizer::encode(std::string_view text, bool special,
                                            bool begins) const {
  std::vector<int32_t> out;
  // The text between special tokens goes through the model: control tokens with `special`,
  // user-defined ones (MPT's runs of spaces, added words) always, as llama.cpp splits them out.
  // A dummy prefix (SentencePiece style) begins the text, and each text after a special token.
  bool after_special = begins;
  const auto plain = [&](std::string_view part) {
    if (part.empty()) return;
    if (bpe_)
      encode_bpe(part, out);
    else if (raw_bpe_)
      encode_raw_bpe(part, out);
    else
      encode_spm(part, v_.add_space_prefix && after_special, out);
    after_special = false;
  };
  if (!special && !has_user_defined_) {
    plain(text);
    return out;
  }
  size_t pos = 0, start = 0;
  while (pos < text.size()) {
    const auto hit = std::find_if(specials_.begin(), specials_.end(), [&](const auto& sp) {
      return (special || type(sp.second) == Vocabulary::kUserDefined) &&
             text.compare(pos, sp.first.size(), sp.first) == 0;
    });
    if (hit == specials_.end()) {
      ++pos;
      continue;
    }
    plain(text.substr(start, pos - start));
    out.push_back(hit->second);
    after_special = true;
    pos += hit->first.size();
    // A token with rstrip takes the whitespace after it.
    if (!v_.rstrip.empty() && v_.rstrip[static_cast<size_t>(hit->second)])
      while (pos < text.size() && std::isspace(static_cast<unsigned char>(text[pos]))) ++pos;
    start = pos;
  }
  plain(text.substr(start));
  return out;
}

void VocabTokenizer::encode_spm(std::string_view text, bool prefix,
                                std::vector<int32_t>& out) const {
  const std::string s = escaped_spaces(text, prefix);
  // The pair whose merge is a piece of highest score first.
  const auto score = [&](std::string_view left, std::string_view right) -> std::optional<double> {
    const int32_t id = find(std::string_view(left.data(), left.size() + right.size()));
    if (id < 0) return std::nullopt;
    return v_.scores.empty() ? 0.0 : v_.scores[static_cast<size_t>(id)];
  };
  for (const std::string_view piece : merge_pairs(s, score)) {
    const int32_t id = find(piece);
    if (id >= 0) {
      out.push_back(id);
      continue;
    }
    for (unsigned char c : piece) out.push_back(byte_token(c));
  }
}

void VocabTokenizer::encode_bpe(std::string_view text, std::vector<int32_t>& out) const {
  // Bytes that are not valid UTF-8 are words of their own; the regular expressions split the
  // valid runs (each piece of the first's split by the next), and text between matches is a
  // piece too.
  std::vector<pcre2_match_data*> matches;
  for (void* re : regexes_)
    matches.push_back(pcre2_match_data_create_from_pattern(static_cast<pcre2_code*>(re), nullptr));
  const auto split = [&](const auto& self, std::string_view run, size_t level) -> void {
    if (level == regexes_.size()) {
      encode_bpe_word(run, out);
      return;
    }
    auto* re = static_cast<pcre2_code*>(regexes_[level]);
    PCRE2_SIZE at = 0, last = 0;
    while (at < run.size()) {
      const int rc = pcre2_match(re, reinterpret_cast<PCRE2_SPTR>(run.data()), run.size(), at,
                                 PCRE2_NO_UTF_CHECK, matches[level], nullptr);
      if (rc < 0) break;
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(matches[level]);
      if (ov[1] == ov[0]) {  // an empty match: step over one character
        at = ov[0] + std::max<size_t>(1, utf8_length(run, ov[0]));
        continue;
      }
      if (ov[0] > last) self(self, run.substr(last, ov[0] - last), level + 1);
      self(self, run.substr(ov[0], ov[1] - ov[0]), level + 1);
      at = last = ov[1];
    }
    if (last < run.size()) self(self, run.substr(last), level + 1);
  };
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = pos;
    for (size_t n; end < text.size() && (n = utf8_length(text, end)) > 0;) end += n;
    if (end > pos) split(split, text.substr(pos, end - pos), 0);
    if (end < text.size()) encode_bpe_word(text.substr(end++, 1), out);
    pos = end;
  }
  for (pcre2_match_data* m : matches) pcre2_match_data_free(m);
}

void VocabTokenizer::encode_bpe_word(std::string_view word, std::vector<int32_t>& out) const {
  std::string mapped;
  for (unsigned char c : word) mapped += byte_chars_[c];
  if (ignore_merges_) {
    if (const int32_t id = find(mapped); id >= 0) {
      out.push_back(id);
      return;
    }
  }
  // The symbols: one per mapped character at first.
  std::vector<std::string> symbols;
  for (size_t pos = 0; pos < mapped.size();) {
    const size_t n = std::max<size_t>(1, utf8_length(mapped, pos));
    symbols.emplace_back(mapped.substr(pos, n));
    pos += n;
  }
  // Merge the pair of lowest rank (the leftmost among equals) until none is a merge.
  std::string pair;  // "left right", reused
  while (symbols.size() > 1) {
    int32_t best_rank = INT32_MAX;
    size_t best = 0;
    for (size_t i = 0; i + 1 < symbols.size(); ++i) {
      pair.assign(symbols[i]).append(1, ' ').append(symbols[i + 1]);
      const auto it = merge_rank_.find(pair);
      if (it != merge_rank_.end() && it->second < best_rank) {
        best_rank = it->second;
        best = i;
      }
    }
    if (best_rank == INT32_MAX) break;
    symbols[best] += symbols[best + 1];
    symbols.erase(symbols.begin() + static_cast<std::ptrdiff_t>(best) + 1);
  }
  for (const std::string& sym : symbols) {
    if (const int32_t id = find(sym); id >= 0) {
      out.push_back(id);
      continue;
    }
    // Not a token: its bytes, each a token of GPT-2's alphabet.
    for (size_t pos = 0; pos < sym.size();) {
      const size_t n = std::max<size_t>(1, utf8_length(sym, pos));
      const auto it = char_bytes_.find(code_point(sym.data() + pos, n));
      if (it == char_bytes_.end()) {
        if (v_.unk < 0) throw UserError("the vocabulary has no token for \"" + sym + "\"");
        out.push_back(v_.unk);
      } else {
        out.push_back(byte_token(it->second));
      }
      pos += n;
    }
  }
}

void VocabTokenizer::encode_raw_bpe(std::string_view text, std::vector<int32_t>& out) const {
  // Each line and each run of line breaks a word of its own. A run of line breaks that is a token
  // is that token.
  const std::string s = escaped_spaces(text, false);
  const std::string_view all(s);
  for (size_t pos = 0; pos < all.size();) {
    const bool breaks = all[pos] == '\n';
    size_t end = pos;
    while (end < all.size() && (all[end] == '\n') == breaks) ++end;
    const std::string_view word = all.substr(pos, end - pos);
    pos = end;
    if (breaks)
      if (const int32_t id = find(word); id >= 0) {
        out.push_back(id);
        continue;
      }
    encode_ranked_word(word, out);
  }
}

void VocabTokenizer::encode_ranked_word(std::string_view word, std::vector<int32_t>& out) const {
  // The pair whose merge ranks lowest first.
  std::string pair;  // "left right", reused
  const auto rank = [&](std::string_view left, std::string_view right) -> std::optional<double> {
    pair.assign(left).append(1, ' ').append(right);
    const auto it = merge_rank_.find(pair);
    if (it == merge_rank_.end()) return std::nullopt;
    return -static_cast<double>(it->second);
  };
  for (const std::string_view piece : merge_pairs(word, rank)) {
    if (const int32_t id = find(piece); id >= 0) {
      out.push_back(id);
      continue;
    }
    // Not a token: its bytes, each a byte piece where the vocabulary has one.
    for (unsigned char c : piece)
      if (byte_ids_[c] >= 0) out.push_back(byte_ids_[c]);
  }
}

int32_t VocabTokenizer::byte_token(uint8_t b) const {
  if (byte_ids_[b] >= 0) return byte_ids_[b];
  if (v_.unk >= 0) return v_.unk;
  char hex[8];
  std::snprintf(hex, sizeof hex, "0x%02X", b);
  throw UserError(std::string("the vocabulary has no token for the byte ") + hex +
                  ", and no unknown token: the text cannot be encoded");
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
        if (bpe_) {
          // GPT-2's printable characters back to the bytes they stand for.
          for (size_t pos = 0; pos < piece.size();) {
            const size_t n = std::max<size_t>(1, utf8_length(piece, pos));
            const auto it = char_bytes_.find(code_point(piece.data() + pos, n));
            if (it != char_bytes_.end())
              text.push_back(static_cast<char>(it->second));
            else
              text.append(piece, pos, n);
            pos += n;
          }
          break;
        }
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
  // The dummy prefix encode put before the text is not part of it, as SentencePiece decodes.
  if (!bpe_ && v_.add_space_prefix && text.starts_with(' ')) text.erase(0, 1);
  return text;
}

}  // namespace cputrain
