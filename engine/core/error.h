// Errors caused by what the user gave us (a flag, a file, a value). The CLI prints what() as
// one line and exits non-zero; everything else is a bug and may abort.
#pragma once

#include <stdexcept>
#include <string>

namespace cputrain {

class UserError : public std::runtime_error {
 public:
  explicit UserError(const std::string& message) : std::runtime_error(message) {}
};

}  // namespace cputrain
