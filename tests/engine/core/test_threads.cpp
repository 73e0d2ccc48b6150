// Pinning the OpenMP team: every thread ends up bound to exactly the CPU pin_threads reports,
// distinct CPUs while there are enough, and later parallel regions run on those CPUs.
#include <gtest/gtest.h>
#include <omp.h>
#include <sched.h>

#include <set>
#include <vector>

#include "engine/core/threads.h"

namespace cputrain {
namespace {

TEST(Threads, PinBindsEachThreadToOneCpu) {
  const std::vector<int> before = allowed_cpus();
  ASSERT_FALSE(before.empty());
  const int saved_threads = omp_get_max_threads();
  const int team = std::max(2, static_cast<int>(before.size()));
  omp_set_num_threads(team);
  const std::vector<int> bound = pin_threads();
  ASSERT_EQ(static_cast<int>(bound.size()), team);
  std::vector<std::vector<int>> seen(static_cast<size_t>(team));
#pragma omp parallel num_threads(team)
  seen[static_cast<size_t>(omp_get_thread_num())] = allowed_cpus();
  std::set<int> distinct;
  for (int t = 0; t < team; ++t) {
    ASSERT_EQ(seen[static_cast<size_t>(t)], std::vector<int>{bound[static_cast<size_t>(t)]})
        << "thread " << t;
    distinct.insert(bound[static_cast<size_t>(t)]);
  }
  EXPECT_EQ(distinct.size(), std::min(before.size(), static_cast<size_t>(team)));
  // Undo: every thread may run anywhere it could before.
  cpu_set_t all;
  CPU_ZERO(&all);
  for (int c : before) CPU_SET(c, &all);
#pragma omp parallel num_threads(team)
  sched_setaffinity(0, sizeof(all), &all);
  omp_set_num_threads(saved_threads);
  EXPECT_EQ(allowed_cpus(), before);
}

}  // namespace
}  // namespace cputrain
