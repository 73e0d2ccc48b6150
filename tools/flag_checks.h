// CLI11 validators whose messages read as one plain line: "--lr: must be positive (got -1)".
#pragma once

#include <omp.h>

#include <CLI/CLI.hpp>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <string>

namespace cputrain {

inline CLI::Validator number_at_least(double minimum, bool strict, const std::string& what) {
  return CLI::Validator(
      [=](std::string& input) -> std::string {
        char* end = nullptr;
        errno = 0;
        const double v = std::strtod(input.c_str(), &end);
        if (input.empty() || end != input.c_str() + input.size() || errno != 0 || !std::isfinite(v))
          return "'" + input + "' is not a number";
        if (strict ? !(v > minimum) : !(v >= minimum))
          return "must be " + what + " (got " + input + ")";
        return "";
      },
      what);
}

// A number no larger than `maximum`; `why` says what a larger one would do.
inline CLI::Validator at_most(double maximum, const std::string& why) {
  return CLI::Validator(
      [=](std::string& input) -> std::string {
        const double v = std::strtod(input.c_str(), nullptr);
        if (v > maximum)
          return "must be at most " + std::to_string(static_cast<long long>(maximum)) + " (got " +
                 input + "; " + why + ")";
        return "";
      },
      "at most " + std::to_string(static_cast<long long>(maximum)));
}

inline CLI::Validator positive() {
  return number_at_least(0.0, true, "positive");
}
inline CLI::Validator non_negative() {
  return number_at_least(0.0, false, "zero or more");
}

// Parses an integer flag: digits only ("1e9" and "2.5" are refused here, not by CLI11's
// conversion). False for anything else.
inline bool parse_whole(const std::string& input, long long* value) {
  char* end = nullptr;
  errno = 0;
  *value = std::strtoll(input.c_str(), &end, 10);
  return !input.empty() && end == input.c_str() + input.size() && errno == 0;
}

// An integer flag of at least 1.
inline CLI::Validator positive_whole() {
  return CLI::Validator(
      [](std::string& input) -> std::string {
        long long v = 0;
        if (!parse_whole(input, &v)) return "'" + input + "' is not a whole number";
        if (v < 1) return "must be a positive whole number (got " + input + ")";
        return "";
      },
      "a positive whole number");
}

// --threads: a positive whole number, at most the CPUs this process may run on (more only slows
// every step down, and the budget counts no thread beyond them).
inline CLI::Validator threads_limit() {
  return CLI::Validator(
      [](std::string& input) -> std::string {
        long long v = 0;
        if (!parse_whole(input, &v) || v < 1)
          return "must be a positive whole number (got " + input + ")";
        const int cpus = omp_get_num_procs();
        if (v > cpus)
          return "more than the " + std::to_string(cpus) + " CPUs this process may run on (got " +
                 input + ")";
        return "";
      },
      "a positive whole number, at most the CPUs");
}

}  // namespace cputrain
