#include "engine/core/threads.h"

#include <omp.h>
#include <sched.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

namespace cputrain {

std::vector<int> allowed_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0)
    throw std::runtime_error(std::string("sched_getaffinity: ") + std::strerror(errno));
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  return cpus;
}

void restart_with_short_spin(char** argv) {
  if (std::getenv("OMP_WAIT_POLICY") != nullptr || std::getenv("GOMP_SPINCOUNT") != nullptr) return;
  if (setenv("GOMP_SPINCOUNT", std::to_string(kShortSpin).c_str(), 0) != 0) return;
  execv("/proc/self/exe", argv);
}

std::vector<int> pin_threads() {
  const std::vector<int> cpus = allowed_cpus();
  if (cpus.empty()) throw std::runtime_error("pin_threads: no CPU allowed");
  const int team = omp_get_max_threads();
  std::vector<int> bound(static_cast<size_t>(team), -1);
  std::vector<int> errors(static_cast<size_t>(team), 0);
#pragma omp parallel num_threads(team)
  {
    const int t = omp_get_thread_num();
    const int cpu = cpus[static_cast<size_t>(t) % cpus.size()];
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(cpu, &one);
    bound[static_cast<size_t>(t)] = cpu;
    if (sched_setaffinity(0, sizeof(one), &one) != 0) errors[static_cast<size_t>(t)] = errno;
  }
  for (int t = 0; t < team; ++t)
    if (errors[static_cast<size_t>(t)] != 0)
      throw std::runtime_error("binding thread " + std::to_string(t) + " to CPU " +
                               std::to_string(bound[static_cast<size_t>(t)]) + ": " +
                               std::strerror(errors[static_cast<size_t>(t)]));
  return bound;
}

}  // namespace cputrain
