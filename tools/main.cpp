#include "engine/core/threads.h"
#include "tools/cli.h"

int main(int argc, char** argv) {
  // Before OpenMP starts a thread: idle threads that spin briefly, then sleep.
  cputrain::restart_with_short_spin(argv);
  return cputrain::run_cli(argc, argv);
}
