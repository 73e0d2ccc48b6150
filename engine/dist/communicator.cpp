#include "engine/dist/communicator.h"

#include <pthread.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#ifdef CPUTRAIN_HAVE_MPI
#include <mpi.h>
#endif

namespace cputrain {

namespace {

#ifdef CPUTRAIN_HAVE_MPI
// Whether an MPI launcher started this process (Open MPI's mpirun, or a PMI launcher).
bool launched_by_mpi() {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"})
    if (std::getenv(name) != nullptr) return true;
  return false;
}
#endif

int env_int(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr ? std::atoi(value) : 0;
}

// A collective in progress: since when (steady clock, ns; 0: none) and what it is.
std::atomic<int64_t> waiting_since{0};
std::atomic<const char*> waiting_in{""};

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Marks the scope of a collective call for the watchdog (Communicator::set_timeout).
struct Waiting {
  explicit Waiting(const char* what) {
    waiting_in = what;
    waiting_since = now_ns();
  }
  ~Waiting() { waiting_since = 0; }
  Waiting(const Waiting&) = delete;
  Waiting& operator=(const Waiting&) = delete;
};

// Collectives take int counts: larger buffers go in pieces of 2^30 elements.
constexpr int64_t kPiece = int64_t{1} << 30;

}  // namespace

bool Communicator::built_with_mpi() {
#ifdef CPUTRAIN_HAVE_MPI
  return true;
#else
  return false;
#endif
}

int Communicator::launched_ranks() {
  return std::max({1, env_int("OMPI_COMM_WORLD_SIZE"), env_int("PMI_SIZE")});
}

int Communicator::launched_rank() {
  for (const char* name : {"OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"})
    if (std::getenv(name) != nullptr) return env_int(name);
  return 0;
}

int Communicator::launched_local_ranks() {
  return std::max({1, env_int("OMPI_COMM_WORLD_LOCAL_SIZE"), env_int("MPI_LOCALNRANKS")});
}

const Communicator& Communicator::solo() {
  static const Communicator alone(0, 1);
  return alone;
}

const Communicator& Communicator::world() {
#ifdef CPUTRAIN_HAVE_MPI
  static const Communicator* const world = [] {
    if (!launched_by_mpi()) return &solo();
    int provided = 0;
    // A rank's thread waiting in a collective shares its core with the rank's compute: Open MPI
    // yields it while it polls rather than spinning (unless the environment says otherwise).
    setenv("OMPI_MCA_mpi_yield_when_idle", "1", 0);
    // The threads MPI starts inherit SIGINT and SIGTERM blocked: they are for the thread that
    // takes them (tools/run/stop_signals.h), not the default action on whichever thread gets them.
    sigset_t stop, before;
    sigemptyset(&stop);
    sigaddset(&stop, SIGINT);
    sigaddset(&stop, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &stop, &before);
    MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided);
    pthread_sigmask(SIG_SETMASK, &before, nullptr);
    std::atexit([] {
      int finalized = 0;
      MPI_Finalized(&finalized);
      if (!finalized) MPI_Finalize();
    });
    int rank = 0, size = 1;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    static const Communicator mpi(rank, size, provided >= MPI_THREAD_SERIALIZED);
    return &mpi;
  }();
  return *world;
#else
  return solo();
#endif
}

void Communicator::all_reduce_sum(float* data, int64_t n) const {
  sum(data, n, false);
}

void Communicator::all_reduce_sum(double* data, int64_t n) const {
  sum(data, n, true);
}

void Communicator::sum(void* data, int64_t n, bool doubles) const {
  if (size_ == 1) return;
  const Waiting waiting("summing");
#ifdef CPUTRAIN_HAVE_MPI
  const size_t bytes = doubles ? sizeof(double) : sizeof(float);
  for (int64_t i = 0; i < n; i += kPiece)
    MPI_Allreduce(MPI_IN_PLACE, static_cast<char*>(data) + static_cast<size_t>(i) * bytes,
                  static_cast<int>(std::min(kPiece, n - i)), doubles ? MPI_DOUBLE : MPI_FLOAT,
                  MPI_SUM, MPI_COMM_WORLD);
#else
  (void)data, (void)n, (void)doubles;
#endif
}

namespace {

void require_mpi(const char* what) {
#ifndef CPUTRAIN_HAVE_MPI
  throw std::logic_error(std::string("Communicator::") + what + " of several ranks without MPI");
#else
  (void)what;
#endif
}

}  // namespace

double Communicator::sum_slots(std::vector<double>& slots) const {
  all_reduce_sum(slots.data(), static_cast<int64_t>(slots.size()));
  double total = 0.0;
  for (const double s : slots) total += s;
  return total;
}

void Communicator::reduce_scatter_sum(const float* send, float* recv,
                                      const std::vector<int>& counts) const {
  if (size_ == 1) {
    std::copy_n(send, counts.at(0), recv);
    return;
  }
  require_mpi("reduce_scatter_sum");
  const Waiting waiting("summing gradients");
#ifdef CPUTRAIN_HAVE_MPI
  MPI_Reduce_scatter(send, recv, counts.data(), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
#endif
}

void Communicator::all_gather(float* data, const std::vector<int64_t>& bounds) const {
  if (size_ == 1) return;
  require_mpi("all_gather");
  const Waiting waiting("gathering weights");
#ifdef CPUTRAIN_HAVE_MPI
  if (bounds.back() < kPiece) {
    std::vector<int> counts(static_cast<size_t>(size_)), d(static_cast<size_t>(size_));
    for (size_t r = 0; r < counts.size(); ++r) {
      d[r] = static_cast<int>(bounds[r]);
      counts[r] = static_cast<int>(bounds[r + 1] - bounds[r]);
    }
    MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, data, counts.data(), d.data(), MPI_FLOAT,
                   MPI_COMM_WORLD);
    return;
  }
  // Beyond an int's offsets: each rank's part from it, in pieces.
  for (int r = 0; r < size_; ++r)
    broadcast(data + bounds[static_cast<size_t>(r)],
              (bounds[static_cast<size_t>(r) + 1] - bounds[static_cast<size_t>(r)]) * 4, r);
#else
  (void)data, (void)bounds;
#endif
}

void Communicator::gather_to_root(int64_t first, int64_t n, const std::vector<int64_t>& bounds,
                                  const std::function<const float*(int64_t)>& mine,
                                  float* dst) const {
  for (int r = 0; r < size_; ++r) {
    const int64_t a = std::max(first, bounds[static_cast<size_t>(r)]);
    const int64_t b = std::min(first + n, bounds[static_cast<size_t>(r) + 1]);
    if (a >= b) continue;
    if (r == rank_ && rank_ == 0)
      std::copy_n(mine(a), b - a, dst + (a - first));
    else if (r == rank_)
      send(mine(a), (b - a) * 4, 0);
    else if (rank_ == 0)
      receive(dst + (a - first), (b - a) * 4, r);
  }
}

void Communicator::send(const void* data, int64_t bytes, int to) const {
  require_mpi("send");
  const Waiting waiting("sending");
#ifdef CPUTRAIN_HAVE_MPI
  for (int64_t i = 0; i < bytes; i += kPiece)
    MPI_Send(static_cast<const char*>(data) + i, static_cast<int>(std::min(kPiece, bytes - i)),
             MPI_BYTE, to, 0, MPI_COMM_WORLD);
#else
  (void)data, (void)bytes, (void)to;
#endif
}

void Communicator::receive(void* data, int64_t bytes, int from) const {
  require_mpi("receive");
  const Waiting waiting("receiving");
#ifdef CPUTRAIN_HAVE_MPI
  for (int64_t i = 0; i < bytes; i += kPiece)
    MPI_Recv(static_cast<char*>(data) + i, static_cast<int>(std::min(kPiece, bytes - i)), MPI_BYTE,
             from, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
#else
  (void)data, (void)bytes, (void)from;
#endif
}

void Communicator::broadcast(void* data, int64_t bytes, int root) const {
  if (size_ == 1) return;
  const Waiting waiting("broadcasting");
#ifdef CPUTRAIN_HAVE_MPI
  for (int64_t i = 0; i < bytes; i += kPiece)
    MPI_Bcast(static_cast<char*>(data) + i, static_cast<int>(std::min(kPiece, bytes - i)), MPI_BYTE,
              root, MPI_COMM_WORLD);
#else
  (void)data, (void)bytes, (void)root;
#endif
}

void Communicator::barrier() const {
  if (size_ == 1) return;
  const Waiting waiting("a barrier");
#ifdef CPUTRAIN_HAVE_MPI
  MPI_Barrier(MPI_COMM_WORLD);
#endif
}

void Communicator::set_timeout(double seconds) const {
  if (size_ == 1 || seconds <= 0.0) return;
  static std::once_flag started;
  std::call_once(started, [this, seconds] {
    std::thread([rank = rank_, seconds] {
      // Signals are for the threads that handle them (tools/run/stop_signals.h).
      sigset_t all;
      sigfillset(&all);
      pthread_sigmask(SIG_BLOCK, &all, nullptr);
      const auto limit = static_cast<int64_t>(seconds * 1e9);
      for (;;) {
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        const int64_t since = waiting_since;
        if (since == 0 || now_ns() - since < limit) continue;
        std::fprintf(stderr,
                     "cputrain: error: rank %d: no answer from the other ranks for %.0f s (in %s): "
                     "one of them has stopped, hangs or cannot be reached; this rank ends, and "
                     "with it the job (--rank-timeout sets the wait)\n",
                     rank, seconds, waiting_in.load());
        std::fflush(stderr);
        std::_Exit(1);
      }
    }).detach();
  });
}

void Communicator::abort(int code) const {
  if (size_ == 1) return;
#ifdef CPUTRAIN_HAVE_MPI
  MPI_Abort(MPI_COMM_WORLD, code);
#else
  (void)code;
#endif
}

}  // namespace cputrain
