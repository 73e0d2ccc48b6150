// Replacing a file so that a reader sees either the old contents or the new, never a mix:
// write a temp file beside it, fsync, rename over the old one.
#pragma once

#include <cstddef>
#include <string>

namespace cputrain {

// On any failure the temp file is removed, `path` is left as it was, and a UserError names the
// file and the system's reason.
void write_file_atomic(const std::string& path, const void* data, size_t bytes);
inline void write_file_atomic(const std::string& path, const std::string& text) {
  write_file_atomic(path, text.data(), text.size());
}

}  // namespace cputrain
