// The check the LibTorch layer's bad-argument tests make: the call raises c10::ValueError (a
// ValueError in Python) whose message holds the given fragment. Header-only, as it uses
// GoogleTest assertions; for test programs that link LibTorch.
#pragma once

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <functional>
#include <string>

namespace winnow::testing {

inline void expect_value_error(const std::function<void()>& call, const std::string& fragment) {
  try {
    call();
    ADD_FAILURE() << "no error; expected one mentioning " << fragment;
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
  }
}

}  // namespace winnow::testing
