#include "engine/io/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "engine/core/error.h"

namespace cputrain {

MappedFile::MappedFile(const std::string& path) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw UserError(path + ": cannot be read (" + std::strerror(errno) + ")");
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw UserError(path + ": not a regular file");
  }
  size_ = static_cast<size_t>(st.st_size);
  if (size_ > 0) {
    map_ = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (map_ == MAP_FAILED) {
      map_ = nullptr;
      ::close(fd);
      throw UserError(path + ": cannot be mapped (" + std::strerror(errno) + ")");
    }
  }
  ::close(fd);
}

MappedFile::~MappedFile() {
  if (map_) ::munmap(map_, size_);
}

namespace {

// madvise over the whole pages that hold [data, data + bytes); its result.
int advise_pages(const void* data, size_t bytes, int advice) {
  if (data == nullptr || bytes == 0) return 0;
  const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t begin = reinterpret_cast<uintptr_t>(data) & ~(page - 1);
  const size_t length = reinterpret_cast<uintptr_t>(data) + bytes - begin;
  return ::madvise(reinterpret_cast<void*>(begin), length, advice);
}

}  // namespace

void release_mapped(const void* data, size_t bytes) {
#ifndef MADV_COLD
  constexpr int MADV_COLD = 20;  // Linux 5.4's, where the headers are older
#endif
  advise_pages(data, bytes, MADV_COLD);
}

void populate_mapped(const void* data, size_t bytes) {
#ifndef MADV_POPULATE_READ
  constexpr int MADV_POPULATE_READ = 22;  // Linux 5.14's, where the headers are older
#endif
  if (advise_pages(data, bytes, MADV_POPULATE_READ) != 0) advise_pages(data, bytes, MADV_WILLNEED);
}

}  // namespace cputrain
