#pragma once
// Error reporting at the API boundary: every message names the offending value and
// what was expected, so a user can fix the call without reading our source.
//
// Messages are built with fmt (https://fmt.dev), used header-only: the kvevict CMake
// target links fmt::fmt-header-only, which defines FMT_HEADER_ONLY. A build without
// CMake defines FMT_HEADER_ONLY=1 itself or links libfmt.
#include <fmt/core.h>

#include <cstddef>
#include <stdexcept>
#include <string>

namespace kvevict {

/// Thrown for any invalid argument at the library's API boundary.
class Error : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

namespace detail {

/// "kvevict: " and one "{}" per part, cut to length at the call (at most 32 parts).
inline constexpr fmt::string_view kErrorFormat =
    "kvevict: {}{}{}{}{}{}{}{}{}{}{}{}{}{}{}{}{}{}{}{}{}{}{}{}{}{}{}{}{}{}{}{}";

/// The one place a message is formatted: the arguments arrive type-erased, so each
/// call site instantiates only the small argument store, not fmt's formatting code.
[[noreturn]] inline void throw_error(std::size_t n_parts, fmt::format_args args) {
  throw Error(fmt::vformat(fmt::string_view(kErrorFormat.data(), 9 + 2 * n_parts), args));
}

/// The message "kvevict: " followed by every part formatted with fmt's "{}" (numbers in
/// their shortest round-trip form, strings as they are).
template <class... Parts>
[[noreturn]] inline void fail(const Parts&... parts) {
  static_assert(sizeof...(Parts) <= 32, "kvevict::detail::fail takes at most 32 parts");
  throw_error(sizeof...(Parts), fmt::make_format_args(parts...));
}

template <class... Parts>
inline void require(bool ok, const Parts&... parts) {
  if (!ok) fail(parts...);
}

}  // namespace detail
}  // namespace kvevict
