// Sets an environment variable for a scope and puts back what was there when the scope ends,
// also when a failed ASSERT_* or an exception leaves it early, so that one test's switch
// (WINNOW_DENSE_ENTMAX_BACKWARD and the like) never leaks into the tests after it.
#pragma once

#include <cstdlib>
#include <optional>
#include <stdexcept>
#include <string>

namespace winnow::testing {

class ScopedEnv {
 public:
  ScopedEnv(const char* name, const std::string& value) : name_(name) {
    if (const char* old = std::getenv(name)) previous_ = old;
    if (::setenv(name, value.c_str(), 1) != 0) throw std::runtime_error(std::string("setenv failed for ") + name);
  }
  ~ScopedEnv() {
    if (previous_) {
      ::setenv(name_.c_str(), previous_->c_str(), 1);
    } else {
      ::unsetenv(name_.c_str());
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::string name_;
  std::optional<std::string> previous_;
};

}  // namespace winnow::testing
