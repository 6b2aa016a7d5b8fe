// Host-side argument checks: the message names the argument, the value and the rule, and becomes a
// Python ValueError (pybind11 maps std::invalid_argument).
#pragma once

#include <stdexcept>
#include <string>

namespace deep_ep {

inline void require(bool condition, const std::string& message) {
  if (!condition) throw std::invalid_argument(message);
}

}  // namespace deep_ep
