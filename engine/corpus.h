// A text corpus: one file, or a folder of files, split into documents.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace cputrain {

// The files of a corpus: `path` itself if it is a regular file, otherwise every regular file
// below the folder in sorted path order, skipping hidden entries, symbolic links and fortune
// index files (*.dat). Throws UserError if `path` is missing or holds no file.
std::vector<std::string> list_corpus_files(const std::string& path);

// The documents of one file. Lines holding just "%" separate documents (the fortune format);
// a file without them is one document. Documents that are only whitespace are dropped.
std::vector<std::string> split_documents(const std::string& text);

// The documents of every file, in file order. Bytes are kept as they are, invalid UTF-8
// included: the tokenizer's byte fallback encodes anything.
std::vector<std::string> read_documents(const std::vector<std::string>& files);
// The documents of the corpus at `path` (a file or a folder, as list_corpus_files reads it).
std::vector<std::string> read_documents(const std::string& path);

// Identifies the corpus as it is now: the paths, sizes and modification times of its files.
uint64_t corpus_fingerprint(const std::vector<std::string>& files);

}  // namespace cputrain
