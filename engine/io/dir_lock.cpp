#include "engine/io/dir_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <fstream>

#include "engine/core/error.h"

namespace cputrain {

DirLock::DirLock(const std::string& dir, const std::string& flag) {
  const std::string path = dir + "/" + kDirLockFile;
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0) throw UserError(flag + " " + dir + ": cannot create " + path);
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    std::ifstream in(path);
    std::string pid;
    std::getline(in, pid);
    ::close(fd_);
    fd_ = -1;
    throw UserError(flag + " " + dir + ": in use by another cputrain process" +
                    (pid.empty() ? std::string() : " (pid " + pid + ")") +
                    "; wait for it to end, or stop it");
  }
  const std::string pid = std::to_string(::getpid()) + "\n";
  if (::ftruncate(fd_, 0) != 0 || ::pwrite(fd_, pid.data(), pid.size(), 0) < 0) {
    // The lock holds without the pid; only the message of a second process is poorer.
  }
}

DirLock::~DirLock() {
  if (fd_ >= 0) ::close(fd_);  // releases the flock
}

}  // namespace cputrain
