#include "tools/cli.h"

int main(int argc, char** argv) {
  return cputrain::run_cli(argc, argv);
}
