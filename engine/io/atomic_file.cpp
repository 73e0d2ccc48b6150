#include "engine/io/atomic_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "engine/core/error.h"

namespace cputrain {
namespace {
std::atomic<int64_t> g_write_limit{-1};
}  // namespace

void set_atomic_write_limit_for_testing(int64_t bytes) {
  g_write_limit = bytes;
}

AtomicFileWriter::AtomicFileWriter(const std::string& path)
    : path_(path), tmp_(path + ".tmp"), buffer_(1 << 20) {
  fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0)
    throw UserError(path_ + ": cannot create " + tmp_ + " (" + std::strerror(errno) +
                    "); the previous file, if any, is unchanged");
}

AtomicFileWriter::~AtomicFileWriter() {
  if (fd_ >= 0) {
    ::close(fd_);
    ::unlink(tmp_.c_str());
  }
}

void AtomicFileWriter::fail(int err) {
  ::close(fd_);
  fd_ = -1;
  ::unlink(tmp_.c_str());
  throw UserError(path_ + ": could not be written (" + std::strerror(err) +
                  "); the previous file, if any, is unchanged");
}

void AtomicFileWriter::flush() {
  size_t done = 0;
  while (done < used_) {
    const int64_t limit = g_write_limit.load();
    if (limit >= 0 && static_cast<int64_t>(used_ - done) > limit) fail(ENOSPC);
    if (limit >= 0) g_write_limit -= static_cast<int64_t>(used_ - done);
    const ssize_t n = ::write(fd_, buffer_.data() + done, used_ - done);
    if (n > 0) {
      done += static_cast<size_t>(n);
    } else if (n < 0 && errno != EINTR) {
      fail(errno);
    } else if (n == 0) {
      fail(EIO);
    }
  }
  used_ = 0;
}

void AtomicFileWriter::write(const void* data, size_t bytes) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    if (used_ == buffer_.size()) flush();
    const size_t n = std::min(bytes, buffer_.size() - used_);
    std::memcpy(buffer_.data() + used_, p, n);
    used_ += n;
    p += n;
    bytes -= n;
  }
}

void AtomicFileWriter::commit() {
  flush();
  if (::fsync(fd_) != 0) fail(errno);
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0 || std::rename(tmp_.c_str(), path_.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp_.c_str());
    throw UserError(path_ + ": could not be written (" + std::strerror(err) +
                    "); the previous file, if any, is unchanged");
  }
}

void write_file_atomic(const std::string& path, const void* data, size_t bytes) {
  AtomicFileWriter out(path);
  out.write(data, bytes);
  out.commit();
}

}  // namespace cputrain
