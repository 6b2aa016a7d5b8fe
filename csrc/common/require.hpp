// Host-side argument checks: the message names the argument, the value and the rule, and becomes a
// Python ValueError (pybind11 maps std::invalid_argument). A macro, not a function, so that the
// message (string concatenation, std::to_string) is built only when the check fails: the checks
// run on every launch, on the host path of every call.
#pragma once

#include <stdexcept>
#include <string>

#define EP_REQUIRE(condition, message)                                   \
  do {                                                                   \
    if (!(condition)) throw std::invalid_argument(std::string(message)); \
  } while (false)
