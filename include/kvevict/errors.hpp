#pragma once
// Error reporting at the API boundary: every message names the offending value and
// what was expected, so a user can fix the call without reading our source.
//
// Messages are built with fmt (https://fmt.dev), used header-only: the kvevict CMake
// target links fmt::fmt-header-only, which defines FMT_HEADER_ONLY; a build without
// CMake adds -DFMT_HEADER_ONLY=1 (or links libfmt).
//
// Compile cost (bench/compile_time.sh, docs/benchmarks.md): every translation unit that
// instantiates a throwing path compiles the formatting code it reaches. Each part is
// therefore formatted by the narrowest fmt entry point for its type (strings appended,
// integers by fmt::format_int, floating point by fmt::to_string) rather than through
// fmt::format's general engine, which would be compiled for every argument type.
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>

#include <fmt/format.h>

namespace kvevict {

/// Thrown for any invalid argument at the library's API boundary.
class Error : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

namespace detail {

/// Appends one part of a message as fmt's "{}" would write it.
template <class T>
void append_part(std::string& out, const T& part) {
  if constexpr (std::is_convertible_v<const T&, std::string_view>) {
    out += std::string_view(part);
  } else if constexpr (std::is_same_v<T, char>) {
    out += part;
  } else if constexpr (std::is_same_v<T, bool>) {
    out += part ? "true" : "false";
  } else if constexpr (std::is_integral_v<T>) {
    const fmt::format_int digits(part);
    out.append(digits.data(), digits.size());
  } else if constexpr (std::is_floating_point_v<T>) {
    out += fmt::to_string(part);  // shortest text that reads back as the same value
  } else {
    out += fmt::format("{}", part);
  }
}

/// Throws kvevict::Error("kvevict: " + every part formatted in order).
template <class... Parts>
[[noreturn]] void fail(const Parts&... parts) {
  std::string message = "kvevict: ";
  (append_part(message, parts), ...);
  throw Error(message);
}

template <class... Parts>
inline void require(bool ok, const Parts&... parts) {
  if (!ok) fail(parts...);
}

}  // namespace detail
}  // namespace kvevict
