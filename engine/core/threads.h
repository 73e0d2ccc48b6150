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

}  // namespace cputrain
