// CLI11 validators whose messages read as one plain line: "--lr: must be positive (got -1)".
#pragma once

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

inline CLI::Validator positive() {
  return number_at_least(0.0, true, "positive");
}
inline CLI::Validator non_negative() {
  return number_at_least(0.0, false, "zero or more");
}

}  // namespace cputrain
