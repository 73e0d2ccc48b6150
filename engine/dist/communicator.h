// The processes of a data-parallel job. Under an MPI launcher (`mpirun -np N cputrain ...`, with
// cputrain built against MPI) the world is MPI's: N ranks, each computing its share of the
// global batch. Anywhere else, or in a build without MPI, the world is this process alone, and
// nothing changes. Collectives are called by one thread at a time.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

namespace cputrain {

class Communicator {
 public:
  // The job's processes. MPI is initialised on the first call where the process was started by
  // an MPI launcher, and finalised at exit.
  static const Communicator& world();
  // This process alone (rank 0 of 1), whatever the world is.
  static const Communicator& solo();
  // Rank `rank` of `ranks` in shape alone, for measuring one rank's memory (the budget): its
  // collectives must not be called.
  static Communicator shape_of(int rank, int ranks) { return Communicator(rank, ranks); }
  // Whether this build can run across processes (it was built against MPI).
  static bool built_with_mpi();
  // The ranks an MPI launcher started this job with (its environment says), 1 without one,
  // whether or not this build can join them.
  static int launched_ranks();
  // This process's rank as the launcher's environment gives it (0 without one), known before
  // MPI is initialised.
  static int launched_rank();
  // The ranks of the job on this machine (1 without a launcher): they share its memory.
  static int launched_local_ranks();

  int rank() const { return rank_; }
  int size() const { return size_; }
  // Whether collectives may be called from a thread other than the main one, one thread at a
  // time (MPI_THREAD_SERIALIZED): then gradients are reduced on a thread of their own while the
  // backward pass goes on.
  bool serialized_threads() const { return serialized_; }

  // Sums `n` elements over the ranks in place: every rank gets the same sum. For a given size
  // the order of the additions is the same from run to run (two ranks: a + b on both).
  void all_reduce_sum(float* data, int64_t n) const;
  void all_reduce_sum(double* data, int64_t n) const;
  // Slots each holding one rank's addend (zero on the other ranks), such as the losses of the
  // batches each rank evaluated: their total, added in slot order, which is what one process
  // adding them all gets, bit for bit, on every rank.
  double sum_slots(std::vector<double>& slots) const;
  // Sums `send` (the sum of counts[r] elements) over the ranks; rank r receives its part,
  // counts[0] + .. + counts[r - 1] onwards, in `recv` (counts[r] elements). One order of
  // additions per size, as all_reduce_sum.
  void reduce_scatter_sum(const float* send, float* recv, const std::vector<int>& counts) const;
  // Rank r's part of `data`, [bounds[r], bounds[r + 1]), reaches every rank.
  void all_gather(float* data, const std::vector<int64_t>& bounds) const;
  // Of an array sharded by `bounds` (rank r holds elements [bounds[r], bounds[r + 1])), elements
  // [first, first + n) to rank 0, in `dst` (n elements; the other ranks may pass null), each
  // rank sending its part; `mine(at)` is where this rank holds element `at` of its part.
  void gather_to_root(int64_t first, int64_t n, const std::vector<int64_t>& bounds,
                      const std::function<const float*(int64_t at)>& mine, float* dst) const;
  // Point to point: `bytes` to rank `to`, or from rank `from`.
  void send(const void* data, int64_t bytes, int to) const;
  void receive(void* data, int64_t bytes, int from) const;
  // `data` on every rank becomes rank `root`'s.
  void broadcast(void* data, int64_t bytes, int root) const;
  void barrier() const;
  // From now on a collective that waits longer than `seconds` for the other ranks ends this
  // process with one line naming the rank and what it waited in, and the launcher ends the job:
  // a rank that has stopped or hangs, or a lost machine. 0: wait forever. Called once the ranks
  // have started together (before, rank 0 may prepare data for as long as that takes).
  void set_timeout(double seconds) const;
  // Ends every rank of the job at once, with `code` as the launcher's exit status: for an error
  // after which the others would wait for this rank forever. Returns only for a single process.
  void abort(int code) const;

 private:
  // Of more than one rank: MPI's world.
  Communicator(int rank, int size, bool serialized = false)
      : rank_(rank), size_(size), serialized_(serialized) {}
  // all_reduce_sum of floats, or of doubles.
  void sum(void* data, int64_t n, bool doubles) const;
  int rank_;
  int size_;
  bool serialized_;
};

}  // namespace cputrain
