// Training state kept on disk instead of in RAM (--offload DIR): the FP32 master weights of the
// matrices a bf16 run computes from their bf16 copies, and AdamW's m and v. Each is one file of
// FP32 elements in DIR whose space is reserved when it is made, so a disk too small is found
// before the first step and not in the middle of a write; it is read and written with pread and
// pwrite. The files are scratch: a run's state of record is its checkpoints (written from the
// files, never from a second copy in RAM), so a resumed run makes them anew from its checkpoint,
// and they are removed when the run ends.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace cputrain {

// One file of FP32 elements, made (truncated) and its space reserved on construction, removed
// on destruction. Errors are UserErrors naming the file and the system's reason.
class StateFile {
 public:
  StateFile(std::string path, int64_t elements);
  ~StateFile();
  StateFile(const StateFile&) = delete;
  StateFile& operator=(const StateFile&) = delete;

  void read(int64_t offset, int64_t n, float* dst) const;
  void write(int64_t offset, int64_t n, const float* src) const;

 private:
  std::string path_;
  int fd_ = -1;
};

// The folder the state files of one run live in, created if missing and held with a lock
// (DIR/.lock), so that a second run given the same folder is refused in one line naming the
// first.
class DirLock;

class OffloadDir {
 public:
  explicit OffloadDir(const std::string& dir);
  ~OffloadDir();
  OffloadDir(const OffloadDir&) = delete;
  OffloadDir& operator=(const OffloadDir&) = delete;

  // A state file DIR/name of `elements` FP32 elements.
  std::unique_ptr<StateFile> file(const std::string& name, int64_t elements) const;

 private:
  std::string path_;
  std::unique_ptr<DirLock> lock_;
};

// One worker thread running jobs (reads and writes of state files; reading mapped weights ahead)
// in the order they are submitted, so that the caller computes on one chunk while the next is
// read and the one before is written. A job's exception is rethrown by the next wait, once every
// job submitted has been passed over (none runs after a failure).
class IoQueue {
 public:
  IoQueue();
  ~IoQueue();
  IoQueue(const IoQueue&) = delete;
  IoQueue& operator=(const IoQueue&) = delete;

  // Queues `job`; returns its ticket.
  int64_t submit(std::function<void()> job);
  // Blocks until the job of `ticket`, and so every job before it, is done.
  void wait(int64_t ticket);
  // Blocks until every job submitted is done.
  void drain();

 private:
  void run();

  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<std::function<void()>> jobs_;  // queued, not started
  int64_t submitted_ = 0;
  int64_t done_ = 0;          // run, or passed over after a failure
  bool failed_ = false;       // a job threw: the ones after it are passed over
  std::exception_ptr error_;  // the first failure, until a wait rethrows it
  bool stop_ = false;
  std::thread worker_;
};

}  // namespace cputrain
