#pragma once
// Error reporting at the API boundary: every message names the offending value and
// what was expected, so a user can fix the call without reading our source.
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace kvevict {

/// Thrown for any invalid argument at the library's API boundary.
class Error : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

namespace detail {

template <class... Parts>
[[noreturn]] inline void fail(Parts&&... parts) {
  std::ostringstream os;
  (os << ... << std::forward<Parts>(parts));
  throw Error("kvevict: " + os.str());
}

template <class... Parts>
inline void require(bool ok, Parts&&... parts) {
  if (!ok) fail(std::forward<Parts>(parts)...);
}

}  // namespace detail
}  // namespace kvevict
