#include <cstdio>

int main() {
  std::puts("cputrain: the command line is being assembled");
  return 1;
}
