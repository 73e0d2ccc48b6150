// The sum of a data-parallel step's gradients over the ranks, in buckets reduced as the backward
// pass makes them final (ParameterSet::gradients_final_from), on a thread of their own while the
// pass goes on to the blocks below.
//
// The buffer is cut into buckets of `bucket` elements counted from its end (the head's and the
// top blocks' gradients, which the backward pass finishes first), and the buckets are reduced
// one at a time in that order, each by the same collective call every step: a run reduces alike
// from step to step and from run to run, whatever the timing. A bucket starts once the gradients
// are final from its start; finish() starts the rest and waits.
//
// Sharded (ZeRO-1, AdamW's shards), a bucket is summed into the ranks whose shards it covers
// alone (reduce-scatter): each rank ends with the sum of its shard, in place, and the rest of its
// buffer as it was. The bytes moved are half an all-reduce's; the gathering of the updated
// masters (AdamW) moves the other half.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "engine/core/tensor.h"
#include "engine/dist/communicator.h"

namespace cputrain {

class IoQueue;

class GradientReducer {
 public:
  // `grads`: the n elements summed over `comm`'s ranks. Where the communicator allows no thread
  // of its own (Communicator::serialized_threads), finish() reduces every bucket itself.
  // `shards`: bounds of the ranks' shards (shard_bounds), or empty to sum the whole buffer on
  // every rank. Sharded, a bucket's receiving buffer is allocated (Workspace), also while
  // measuring, where nothing else is done.
  GradientReducer(const Communicator& comm, float* grads, int64_t n, int64_t bucket,
                  std::vector<int64_t> shards = {});
  ~GradientReducer();
  GradientReducer(const GradientReducer&) = delete;
  GradientReducer& operator=(const GradientReducer&) = delete;

  // A pass whose gradients are to be reduced begins: no bucket is started.
  void begin();
  // The gradients from `offset` to the end are final: the buckets within them start.
  void final_from(int64_t offset);
  // Starts the buckets not yet started and waits for all; returns the milliseconds waited (the
  // reduction not hidden behind the backward pass).
  double finish();
  // Milliseconds spent reducing (the collectives' time) since begin().
  double reducing_ms() const;
  int64_t buckets() const { return (n_ + bucket_ - 1) / bucket_; }
  // Buckets started since begin().
  int64_t started() const { return started_; }

 private:
  void start(int64_t k);  // bucket k: [max(0, n - (k + 1) bucket), n - k bucket)

  const Communicator& comm_;
  float* grads_;
  int64_t n_;
  int64_t bucket_;
  int64_t started_ = 0;  // buckets 0 .. started_ - 1 are queued or done
  std::unique_ptr<IoQueue> thread_;
  int64_t last_ticket_ = -1;
  std::shared_ptr<double> reducing_ms_;  // written by the thread, read after a wait
  std::vector<int64_t> shards_;
  Tensor received_;  // sharded: a bucket's part of this rank's shard, summed
};

}  // namespace cputrain
