// The check every bad-argument test makes: the call throws winnow::Error and its message holds
// the given fragment (an argument's name, what was expected). Header-only, as it uses
// GoogleTest assertions.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "winnow/error.h"

namespace winnow::testing {

inline void expect_error(const std::function<void()>& call, const std::string& fragment) {
  try {
    call();
    ADD_FAILURE() << "no error; expected one mentioning " << fragment;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
  }
}

}  // namespace winnow::testing
