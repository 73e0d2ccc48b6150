// An exclusive lock on a folder for the object's lifetime: flock on <dir>/.lock, which holds the
// owner's pid. A second process gets a UserError naming `flag`, the folder and the process that
// holds it.
#pragma once

#include <string>

namespace cputrain {

inline constexpr const char* kDirLockFile = ".lock";

class DirLock {
 public:
  DirLock(const std::string& dir, const std::string& flag);
  ~DirLock();
  DirLock(const DirLock&) = delete;
  DirLock& operator=(const DirLock&) = delete;

 private:
  int fd_ = -1;
};

}  // namespace cputrain
