// Per-op wall-clock timers (cputrain train --profile): where a training step's time goes, by op
// and pass, with the FLOPs of the ops that multiply matrices. Off by default; a scope then costs
// a branch. Scopes nest and each keeps only its own time: an op's time excludes the GEMM scopes
// inside it, a checkpoint region's backward excludes the ops it recomputes and runs.
//
// Scopes are opened and closed on the thread that runs the step (ops parallelise inside their
// kernels), not inside parallel regions.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace cputrain::profiler {

// Step: optimizer and other per-step work. Enclosing: the pass of the innermost open scope
// (Step where there is none), for helpers both passes call.
enum class Pass { Forward, Backward, Step, Enclosing };

void set_enabled(bool on);
bool enabled();
// Drops everything recorded so far.
void reset();

class Scope {
 public:
  // `name` must outlive the profile (a string literal). `flops`: the arithmetic done inside the
  // scope itself (0 for ops that only move memory).
  Scope(const char* name, Pass pass, double flops = 0.0);
  ~Scope();
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  bool active_;
};

// Adds FLOPs to the innermost open scope (one whose count is known only inside it).
void add_flops(double flops);

struct Entry {
  std::string name;
  Pass pass;
  int64_t calls = 0;
  double seconds = 0.0;  // own time, nested scopes excluded
  double flops = 0.0;
};
// Everything recorded since the last reset, the most time first.
std::vector<Entry> entries();

std::string_view pass_name(Pass pass);

// A table of `list` over `steps` steps that took `seconds` in all: per step, each entry's
// milliseconds, share of the step, GFLOP/s (where it has FLOPs) and calls, the most time first,
// then the time no scope covered. One line per row, header first.
std::vector<std::string> report(const std::vector<Entry>& list, int64_t steps, double seconds);

// The clock scopes read, in seconds (default: steady_clock); tests substitute their own.
using Clock = double (*)();
void set_clock(Clock clock);

}  // namespace cputrain::profiler
