#include "engine/corpus.h"

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <system_error>

#include "engine/error.h"
#include "engine/hash.h"

namespace cputrain {
namespace fs = std::filesystem;

namespace {

bool is_hidden(const fs::path& p) {
  return p.filename().string().starts_with(".");
}

bool only_whitespace(const std::string& s) {
  return std::all_of(s.begin(), s.end(), [](unsigned char c) { return std::isspace(c) != 0; });
}

}  // namespace

std::vector<std::string> list_corpus_files(const std::string& path) {
  std::error_code ec;
  const fs::file_status status = fs::status(path, ec);
  if (ec || !fs::exists(status)) throw UserError("--corpus " + path + ": no such file or folder");
  if (fs::is_regular_file(status)) return {path};
  if (!fs::is_directory(status))
    throw UserError("--corpus " + path + ": not a regular file or a folder");
  std::vector<std::string> files;
  fs::recursive_directory_iterator it(path, fs::directory_options::skip_permission_denied, ec);
  if (ec) throw UserError("--corpus " + path + ": " + ec.message());
  for (; it != fs::recursive_directory_iterator(); it.increment(ec)) {
    if (ec) throw UserError("--corpus " + path + ": " + ec.message());
    const fs::directory_entry& entry = *it;
    if (is_hidden(entry.path())) {
      if (entry.is_directory(ec)) it.disable_recursion_pending();
      continue;
    }
    if (entry.is_symlink(ec)) {
      it.disable_recursion_pending();
      continue;
    }
    if (!entry.is_regular_file(ec) || entry.path().extension() == ".dat") continue;
    files.push_back(entry.path().string());
  }
  std::sort(files.begin(), files.end());
  if (files.empty()) throw UserError("--corpus " + path + ": the folder holds no text files");
  return files;
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

uint64_t corpus_fingerprint(const std::vector<std::string>& files) {
  uint64_t h = kFnvOffset;
  for (const std::string& file : files) {
    std::error_code ec;
    const uint64_t size = fs::file_size(file, ec);
    const auto mtime = fs::last_write_time(file, ec).time_since_epoch().count();
    h = fnv1a(file, h);
    h = fnv1a_u64(ec ? 0 : size, h);
    h = fnv1a_u64(static_cast<uint64_t>(mtime), h);
  }
  return h;
}

}  // namespace cputrain
