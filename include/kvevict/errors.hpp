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

#include "config.hpp"

// Separate-kernels mode (config.hpp) formats numbers out of line (append_number below, in
// the kvevict_kernels library) and needs only fmt's core API here; header-only mode includes
// fmt/format.h (format_int, the shortest float form).
#if KVEVICT_KERNELS_DECLARE_ONLY
#include <fmt/core.h>
#else
#include <fmt/format.h>
#endif

namespace kvevict {

/// Thrown for any invalid argument at the library's API boundary.
class Error : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

namespace detail {

/// Appends a number as fmt's "{}" writes it: integers by fmt::format_int, floating point by
/// fmt::to_string (the shortest text that reads back as the same value).
#if !KVEVICT_KERNELS_DECLARE_ONLY
template <class T>
inline void format_number(std::string& out, T v) {
  if constexpr (std::is_integral_v<T>) {
    const fmt::format_int digits(v);
    out.append(digits.data(), digits.size());
  } else {
    out += fmt::to_string(v);
  }
}
#endif

#if defined(KVEVICT_SEPARATE_KERNELS)
// Separate-kernels mode: one out-of-line function per widened type, in kvevict_kernels.
void append_number(std::string& out, long long v);
void append_number(std::string& out, unsigned long long v);
void append_number(std::string& out, float v);
void append_number(std::string& out, double v);
void append_number(std::string& out, long double v);
#if !KVEVICT_KERNELS_DECLARE_ONLY
void append_number(std::string& out, long long v) { format_number(out, v); }
void append_number(std::string& out, unsigned long long v) { format_number(out, v); }
void append_number(std::string& out, float v) { format_number(out, v); }
void append_number(std::string& out, double v) { format_number(out, v); }
void append_number(std::string& out, long double v) { format_number(out, v); }
#endif
#else
// Header-only: a template, so a TU compiles fmt's code only for the types it formats.
template <class T>
inline void append_number(std::string& out, T v) {
  format_number(out, v);
}
#endif

/// Appends one part of a message as fmt's "{}" would write it.
template <class T>
void append_part(std::string& out, const T& part) {
  if constexpr (std::is_convertible_v<const T&, std::string_view>) {
    out += std::string_view(part);
  } else if constexpr (std::is_same_v<T, char>) {
    out += part;
  } else if constexpr (std::is_same_v<T, bool>) {
    out += part ? "true" : "false";
  } else if constexpr (std::is_integral_v<T> && std::is_signed_v<T>) {
    append_number(out, static_cast<long long>(part));
  } else if constexpr (std::is_integral_v<T>) {
    append_number(out, static_cast<unsigned long long>(part));
  } else if constexpr (std::is_floating_point_v<T>) {
    append_number(out, part);
  } else {
    out += fmt::format("{}", part);
  }
}

/// Appends every part, formatted in order.
template <class... Parts>
void append_parts(std::string& out, const Parts&... parts) {
  (append_part(out, parts), ...);
}

/// Every part formatted in order, as one string.
template <class... Parts>
[[nodiscard]] std::string concat(const Parts&... parts) {
  std::string out;
  append_parts(out, parts...);
  return out;
}

/// Throws kvevict::Error("kvevict: " + every part formatted in order).
template <class... Parts>
[[noreturn]] void fail(const Parts&... parts) {
  std::string message = "kvevict: ";
  append_parts(message, parts...);
  throw Error(message);
}

template <class... Parts>
inline void require(bool ok, const Parts&... parts) {
  if (!ok) fail(parts...);
}

}  // namespace detail
}  // namespace kvevict
