#include "engine/dist/gradient_reducer.h"

#include <algorithm>
#include <chrono>

#include "engine/core/memory.h"
#include "engine/io/offload.h"

namespace cputrain {

namespace {

double ms_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
      .count();
}

}  // namespace

GradientReducer::GradientReducer(const Communicator& comm, float* grads, int64_t n, int64_t bucket,
                                 std::vector<int64_t> shards)
    : comm_(comm),
      grads_(grads),
      n_(n),
      bucket_(std::max<int64_t>(1, std::min<int64_t>(bucket, int64_t{1} << 30))),
      reducing_ms_(std::make_shared<double>(0.0)),
      shards_(std::move(shards)) {
  if (!shards_.empty())
    received_ = Tensor::empty(Shape{std::max<int64_t>(1, std::min(bucket_, n))}, DType::F32,
                              MemoryCategory::Workspace);
  if (comm.size() > 1 && comm.serialized_threads() && !measuring())
    thread_ = std::make_unique<IoQueue>();
}

GradientReducer::~GradientReducer() {
  if (thread_) thread_->drain();
}

void GradientReducer::begin() {
  started_ = 0;
  *reducing_ms_ = 0.0;
}

void GradientReducer::start(int64_t k) {
  const int64_t end = n_ - k * bucket_;
  const int64_t first = std::max<int64_t>(0, end - bucket_);
  auto reduce = [this, first, end, total = reducing_ms_] {
    const auto t = std::chrono::steady_clock::now();
    if (shards_.empty()) {
      comm_.all_reduce_sum(grads_ + first, end - first);
    } else {
      std::vector<int> counts(static_cast<size_t>(comm_.size()));
      for (size_t r = 0; r < counts.size(); ++r)
        counts[r] = static_cast<int>(
            std::max<int64_t>(0, std::min(end, shards_[r + 1]) - std::max(first, shards_[r])));
      comm_.reduce_scatter_sum(grads_ + first, received_.f32(), counts);
      const size_t me = static_cast<size_t>(comm_.rank());
      if (counts[me] > 0)
        std::copy_n(received_.f32(), counts[me], grads_ + std::max(first, shards_[me]));
    }
    *total += ms_since(t);
  };
  if (thread_)
    last_ticket_ = thread_->submit(std::move(reduce));
  else
    reduce();
}

void GradientReducer::final_from(int64_t offset) {
  // Without a thread of their own the buckets wait for finish(): reducing them here would stop
  // the backward pass as long.
  if (!thread_) return;
  while (started_ < buckets() && std::max<int64_t>(0, n_ - (started_ + 1) * bucket_) >= offset)
    start(started_++);
}

double GradientReducer::finish() {
  const auto t = std::chrono::steady_clock::now();
  while (started_ < buckets()) start(started_++);
  if (thread_ && last_ticket_ >= 0) thread_->wait(last_ticket_);
  return ms_since(t);
}

double GradientReducer::reducing_ms() const {
  return *reducing_ms_;
}

}  // namespace cputrain
