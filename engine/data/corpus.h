// A text corpus: one file, or a folder of files, split into documents.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace cputrain {

struct CorpusFiles {
  std::vector<std::string> text;     // the files read, in sorted path order
  std::vector<std::string> binary;   // passed over: not text (a NUL byte in their first 8 KiB)
  std::vector<std::string> skipped;  // folders passed over at the caller's request
};

// The files of a corpus: `path` itself if it is a regular file, otherwise every regular text file
// below the folder in sorted path order, skipping hidden entries, symbolic links, fortune index
// files (*.dat), binary files and the folders `skip_folder` names (a run directory inside the
// corpus). Throws UserError, naming the corpus as `name` ("--corpus PATH", or where a run's
// configuration recorded it), if `path` is missing, binary or holds no text file.
CorpusFiles find_corpus_files(const std::string& path,
                              const std::function<bool(const std::string&)>& skip_folder = nullptr,
                              const std::string& name = "");
// find_corpus_files(path).text.
std::vector<std::string> list_corpus_files(const std::string& path);

// The documents of one file. Lines holding just "%" separate documents (the fortune format);
// a file without them is one document. Documents that are only whitespace are dropped.
std::vector<std::string> split_documents(const std::string& text);

// The documents of every file, in file order. Bytes are kept as they are, invalid UTF-8
// included: the tokenizer's byte fallback encodes anything.
std::vector<std::string> read_documents(const std::vector<std::string>& files);
// The documents of the corpus at `path` (a file or a folder, as list_corpus_files reads it).
std::vector<std::string> read_documents(const std::string& path);

// Cuts every document longer than `max_bytes` into pieces of at most that many bytes, each
// ending at a paragraph break (a blank line) where one lies in its second half, else at a line
// break, else between two UTF-8 characters; pieces that are only whitespace are dropped. So a
// corpus of one large file still has documents for the validation split to take.
std::vector<std::string> split_long_documents(std::vector<std::string> documents, size_t max_bytes);
// The piece size prepare_data cuts to: a twentieth of the corpus, within [1 KiB, 64 KiB].
size_t document_piece_bytes(const std::vector<std::string>& documents);

// Identifies the corpus by its content: each file's bytes and its path below `root` (the corpus
// as given), hashed with XXH3. A copy or a `touch` keeps it; any changed byte changes it.
uint64_t corpus_fingerprint(const std::string& root, const std::vector<std::string>& files);

}  // namespace cputrain
