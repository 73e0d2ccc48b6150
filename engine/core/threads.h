// Pinning the OpenMP team to CPUs: each thread of a team of omp_get_max_threads() threads is
// bound to one CPU of the process's allowed set (thread i to the i-th allowed CPU, wrapping
// around when there are more threads than CPUs). OpenMP keeps its threads between parallel
// regions, so the binding holds for every later region of that team size.
#pragma once

#include <vector>

namespace cputrain {

// Pins the team; returns the CPU of each thread, by thread number. Throws std::runtime_error
// naming the CPU when the OS refuses a binding.
std::vector<int> pin_threads();

// The CPUs the calling thread may run on.
std::vector<int> allowed_cpus();

// OpenMP's idle threads (libgomp's, between parallel regions and at barriers) spin for
// GOMP_SPINCOUNT iterations, 300000 by default (milliseconds), before they sleep. Where another
// job shares the cores, a thread spinning at a barrier holds a core that the thread it waits for
// needs, and every region takes a time slice: the step collapses. libgomp reads its environment
// once, as it loads; so where neither OMP_WAIT_POLICY nor GOMP_SPINCOUNT is set, this sets
// GOMP_SPINCOUNT to kShortSpin and starts the program again (execv of /proc/self/exe with `argv`).
// Returns where nothing needs doing, or where starting again failed (the default spin holds).
// With kShortSpin, two 2-thread mega trainings on 2 cores each keep half their speed alone; with
// 10000, a quarter; with the default, under a third (docs/BENCHMARKS.md). Fewer spins (1000,
// libgomp's own count for more threads than CPUs) cost a run alone a few percent in wake-ups.
inline constexpr int kShortSpin = 3000;
void restart_with_short_spin(char** argv);

}  // namespace cputrain
