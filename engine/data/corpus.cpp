#include "engine/data/corpus.h"

#include <xxhash.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <string_view>
#include <system_error>

#include "engine/core/error.h"

namespace cputrain {
namespace fs = std::filesystem;

namespace {

bool is_hidden(const fs::path& p) {
  return p.filename().string().starts_with(".");
}

bool only_whitespace(std::string_view s) {
  return std::all_of(s.begin(), s.end(), [](unsigned char c) { return std::isspace(c) != 0; });
}

// Text, as git and grep tell it: no NUL byte in the first 8 KiB.
bool is_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  char head[8192];
  in.read(head, sizeof(head));
  return std::find(head, head + in.gcount(), '\0') == head + in.gcount();
}

// Where a piece of at most `max` bytes starting at `from` ends: after a paragraph break in its
// second half, else after a line break there, else before a UTF-8 lead byte.
size_t piece_end(std::string_view text, size_t from, size_t max) {
  const size_t limit = from + max;
  if (limit >= text.size()) return text.size();
  const size_t half = from + max / 2;
  const std::string_view second_half = text.substr(half, limit - half);
  const size_t para = second_half.rfind("\n\n");
  if (para != std::string_view::npos) return half + para + 2;
  const size_t line = second_half.rfind('\n');
  if (line != std::string_view::npos) return half + line + 1;
  size_t cut = limit;
  while (cut > from + 1 && (static_cast<unsigned char>(text[cut]) & 0xC0) == 0x80) --cut;
  return cut;
}

}  // namespace

CorpusFiles find_corpus_files(const std::string& path,
                              const std::function<bool(const std::string&)>& skip_folder,
                              const std::string& name) {
  const std::string what = name.empty() ? "--corpus " + path : name;
  std::error_code ec;
  const fs::file_status status = fs::status(path, ec);
  if (ec || !fs::exists(status)) throw UserError(what + ": no such file or folder");
  CorpusFiles found;
  if (fs::is_regular_file(status)) {
    if (!is_text_file(path))
      throw UserError(what +
                      ": not a text file (it holds NUL bytes); give a text file or a folder "
                      "of them");
    found.text.push_back(path);
    return found;
  }
  if (!fs::is_directory(status)) throw UserError(what + ": not a regular file or a folder");
  fs::recursive_directory_iterator it(path, fs::directory_options::skip_permission_denied, ec);
  if (ec) throw UserError(what + ": " + ec.message());
  for (; it != fs::recursive_directory_iterator(); it.increment(ec)) {
    if (ec) throw UserError(what + ": " + ec.message());
    const fs::directory_entry& entry = *it;
    if (is_hidden(entry.path())) {
      if (entry.is_directory(ec)) it.disable_recursion_pending();
      continue;
    }
    if (entry.is_symlink(ec)) {
      it.disable_recursion_pending();
      continue;
    }
    if (entry.is_directory(ec)) {
      if (skip_folder && skip_folder(entry.path().string())) {
        it.disable_recursion_pending();
        found.skipped.push_back(entry.path().string());
      }
      continue;
    }
    if (!entry.is_regular_file(ec) || entry.path().extension() == ".dat") continue;
    (is_text_file(entry.path().string()) ? found.text : found.binary)
        .push_back(entry.path().string());
  }
  std::sort(found.text.begin(), found.text.end());
  std::sort(found.binary.begin(), found.binary.end());
  std::sort(found.skipped.begin(), found.skipped.end());
  if (found.text.empty())
    throw UserError(what + ": the folder holds no text files" +
                    (found.binary.empty()
                         ? std::string()
                         : " (" + std::to_string(found.binary.size()) +
                               " binary files passed over, such as " + found.binary[0] + ")"));
  return found;
}

std::vector<std::string> list_corpus_files(const std::string& path) {
  return find_corpus_files(path).text;
}

std::vector<std::string> split_documents(const std::string& text) {
  std::vector<std::string> docs;
  std::string current;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    const bool last = end == std::string::npos;
    if (last) end = text.size();
    std::string_view line(text.data() + pos, end - pos);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line == "%") {
      if (!only_whitespace(current)) docs.push_back(std::move(current));
      current.clear();
    } else {
      current.append(text, pos, end - pos);
      if (!last) current.push_back('\n');
    }
    pos = end + 1;
  }
  if (!only_whitespace(current)) docs.push_back(std::move(current));
  return docs;
}

std::vector<std::string> read_documents(const std::vector<std::string>& files) {
  std::vector<std::string> docs;
  for (const std::string& file : files) {
    std::ifstream in(file, std::ios::binary);
    if (!in) throw UserError(file + ": cannot be read");
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (in.bad()) throw UserError(file + ": read error");
    for (std::string& d : split_documents(text)) docs.push_back(std::move(d));
  }
  return docs;
}

std::vector<std::string> read_documents(const std::string& path) {
  return read_documents(list_corpus_files(path));
}

std::vector<std::string> split_long_documents(std::vector<std::string> documents,
                                              size_t max_bytes) {
  std::vector<std::string> out;
  out.reserve(documents.size());
  for (std::string& doc : documents) {
    if (doc.size() <= max_bytes) {
      out.push_back(std::move(doc));
      continue;
    }
    const std::string_view text(doc);
    for (size_t from = 0; from < text.size();) {
      const size_t end = piece_end(text, from, max_bytes);
      const std::string_view piece = text.substr(from, end - from);
      if (!only_whitespace(piece)) out.emplace_back(piece);
      from = end;
    }
  }
  return out;
}

size_t document_piece_bytes(const std::vector<std::string>& documents) {
  size_t total = 0;
  for (const std::string& d : documents) total += d.size();
  return std::clamp<size_t>(total / 20, size_t{1} << 10, size_t{64} << 10);
}

uint64_t corpus_fingerprint(const std::string& root, const std::vector<std::string>& files) {
  XXH3_state_t* state = XXH3_createState();
  if (state == nullptr) throw std::bad_alloc();
  const std::unique_ptr<XXH3_state_t, XXH_errorcode (*)(XXH3_state_t*)> owner(state,
                                                                              XXH3_freeState);
  XXH3_64bits_reset(state);
  std::vector<char> buffer(size_t{1} << 20);
  for (const std::string& file : files) {
    // The path below the corpus (empty for a one-file corpus), then the length and the bytes.
    const std::string below = fs::path(file).lexically_relative(root).string();
    const std::string name = below == "." ? std::string() : below;
    const uint64_t name_size = name.size();
    XXH3_64bits_update(state, &name_size, sizeof(name_size));
    XXH3_64bits_update(state, name.data(), name.size());
    std::ifstream in(file, std::ios::binary);
    if (!in) throw UserError(file + ": cannot be read");
    uint64_t size = 0;
    while (in) {
      in.read(buffer.data(), static_cast<std::streamsize>(buffer.size()));
      const auto n = static_cast<size_t>(in.gcount());
      XXH3_64bits_update(state, buffer.data(), n);
      size += n;
    }
    if (in.bad()) throw UserError(file + ": read error");
    XXH3_64bits_update(state, &size, sizeof(size));
  }
  return XXH3_64bits_digest(state);
}

}  // namespace cputrain
