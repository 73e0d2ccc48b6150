#include "engine/io/offload.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <utility>

#include "engine/core/error.h"
#include "engine/io/dir_lock.h"

namespace cputrain {
namespace {

std::string reason(int error) {
  return std::strerror(error);
}

}  // namespace

StateFile::StateFile(std::string path, int64_t elements) : path_(std::move(path)) {
  fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd_ < 0) throw UserError(path_ + ": cannot create (" + reason(errno) + ")");
  const auto bytes = static_cast<off_t>(elements * 4);
  // Every block reserved now: a write later cannot meet a full disk.
  if (bytes > 0) {
    if (const int e = ::posix_fallocate(fd_, 0, bytes); e != 0) {
      ::close(fd_);
      fd_ = -1;
      std::error_code ec;
      std::filesystem::remove(path_, ec);
      const std::string size = bytes >= (off_t{1} << 20) ? std::to_string(bytes >> 20) + " MiB"
                                                         : std::to_string(bytes) + " bytes";
      throw UserError(path_ + ": cannot reserve " + size + " (" + reason(e) + ")");
    }
  }
}

StateFile::~StateFile() {
  if (fd_ < 0) return;
  ::close(fd_);
  std::error_code ec;
  std::filesystem::remove(path_, ec);
}

namespace {

// All n elements at `offset` read into (or written from) `data`, across short transfers and
// interrupted calls.
void transfer(int fd, const std::string& path, bool writing, int64_t offset, int64_t n,
              char* data) {
  size_t left = static_cast<size_t>(n) * 4;
  auto at = static_cast<off_t>(offset * 4);
  while (left > 0) {
    const ssize_t done = writing ? ::pwrite(fd, data, left, at) : ::pread(fd, data, left, at);
    if (done < 0 && errno == EINTR) continue;
    if (done <= 0)
      throw UserError(path + (writing ? ": cannot write (" : ": cannot read (") +
                      (done < 0 ? reason(errno) : std::string("end of file")) + ")");
    data += done;
    at += done;
    left -= static_cast<size_t>(done);
  }
}

}  // namespace

void StateFile::read(int64_t offset, int64_t n, float* dst) const {
  transfer(fd_, path_, false, offset, n, reinterpret_cast<char*>(dst));
}

void StateFile::write(int64_t offset, int64_t n, const float* src) const {
  // pwrite only reads the buffer.
  transfer(fd_, path_, true, offset, n, const_cast<char*>(reinterpret_cast<const char*>(src)));
}

OffloadDir::OffloadDir(const std::string& dir) : path_(dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) throw UserError("--offload " + dir + ": cannot create (" + ec.message() + ")");
  lock_ = std::make_unique<DirLock>(dir, "--offload");
}

OffloadDir::~OffloadDir() = default;

std::unique_ptr<StateFile> OffloadDir::file(const std::string& name, int64_t elements) const {
  return std::make_unique<StateFile>(path_ + "/" + name, elements);
}

IoQueue::IoQueue() : worker_([this] { run(); }) {}

IoQueue::~IoQueue() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  changed_.notify_all();
  worker_.join();
}

int64_t IoQueue::submit(std::function<void()> job) {
  std::lock_guard<std::mutex> lock(mutex_);
  jobs_.push_back(std::move(job));
  changed_.notify_all();
  return ++submitted_;
}

void IoQueue::wait(int64_t ticket) {
  std::unique_lock<std::mutex> lock(mutex_);
  changed_.wait(lock, [&] { return done_ >= ticket || failed_; });
  if (!failed_) return;
  // No job touches the caller's buffers once this returns: the rest are passed over first.
  changed_.wait(lock, [&] { return done_ == submitted_; });
  failed_ = false;
  if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
}

void IoQueue::drain() {
  int64_t last = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    last = submitted_;
  }
  wait(last);
}

void IoQueue::run() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    changed_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
    if (jobs_.empty()) return;  // stopping, nothing left
    std::function<void()> job = std::move(jobs_.front());
    jobs_.pop_front();
    if (!failed_) {
      lock.unlock();
      std::exception_ptr error;
      try {
        job();
      } catch (...) {
        error = std::current_exception();
      }
      lock.lock();
      if (error) {
        failed_ = true;
        error_ = error;
      }
    }
    ++done_;
    changed_.notify_all();
  }
}

}  // namespace cputrain
