#include "engine/atomic_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "engine/error.h"

namespace cputrain {

void write_file_atomic(const std::string& path, const void* data, size_t bytes) {
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw UserError(path + ": cannot create " + tmp + " (" + std::strerror(errno) + ")");
  const char* p = static_cast<const char*>(data);
  size_t done = 0;
  int err = 0;
  while (done < bytes && err == 0) {
    const ssize_t n = ::write(fd, p + done, bytes - done);
    if (n > 0) {
      done += static_cast<size_t>(n);
    } else if (n < 0 && errno != EINTR) {
      err = errno;
    }
  }
  if (err == 0 && ::fsync(fd) != 0) err = errno;
  if (::close(fd) != 0 && err == 0) err = errno;
  if (err == 0 && std::rename(tmp.c_str(), path.c_str()) != 0) err = errno;
  if (err != 0) {
    ::unlink(tmp.c_str());
    throw UserError(path + ": could not be written (" + std::strerror(err) +
                    "); the previous file, if any, is unchanged");
  }
}

}  // namespace cputrain
