// The one exception type winnow throws at its API boundary. Kernels below the boundary assume
// valid arguments; everything a caller can get wrong is checked before any work starts, and
// nothing is written to outputs when a check fails.
#pragma once

#include <stdexcept>
#include <string>

namespace winnow {

enum class ErrorKind {
  invalid_argument,  // a shape, dtype, device, stride or option the operation does not accept
  unsupported,       // valid in principle, but this build or backend cannot run it
  runtime,           // a failure while running (a CUDA launch error, an allocation)
};

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& message) : std::runtime_error(message), kind_(kind) {}
  ErrorKind kind() const { return kind_; }

 private:
  ErrorKind kind_;
};

}  // namespace winnow
