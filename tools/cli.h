// The cputrain command line: `train` (the default subcommand) and `sample`.
#pragma once

namespace cputrain {

// Parses argv and runs the chosen subcommand. Returns the process exit code: 0 on success,
// 1 for bad input (reported as one line on stderr), CLI11's codes for malformed flags.
int run_cli(int argc, char** argv);

}  // namespace cputrain
