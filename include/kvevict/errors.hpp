#pragma once
// Error reporting at the API boundary: every message names the offending value and
// what was expected, so a user can fix the call without reading our source.
//
// Messages are built with the standard library alone (std::to_chars): kvevict has no
// formatting dependency, so an engine that includes any kvevict header pays neither fmt's
// parse cost (~1 s of CPU per translation unit with g++ 12, docs/benchmarks.md) nor a link
// dependency.
//
// Numbers are written as fmt's "{}" writes them: integers in decimal, floating point in the
// shortest digits that read back as the same value, fixed notation for decimal exponents
// -4..15 and scientific beyond (format_number below).
#include <cstddef>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>

#include "config.hpp"

#if !KVEVICT_KERNELS_DECLARE_ONLY
#include <charconv>
#endif

namespace kvevict {

/// Thrown for any invalid argument at the library's API boundary.
class Error : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

namespace detail {

/// Appends a number: integers in decimal, floating point in the shortest round-trip form
/// (std::to_chars), "nan" / "inf" / "-inf" for the non-finite values.
#if !KVEVICT_KERNELS_DECLARE_ONLY
template <class T>
inline void format_number(std::string& out, T v) {
  char buffer[64];  // 20 digits for 64-bit integers; <= 41 chars for the shortest long double
  std::to_chars_result r{};
  if constexpr (std::is_integral_v<T>) {
    r = std::to_chars(buffer, buffer + sizeof buffer, v);
  } else {
    // fmt's "{}" layout: the shortest round-trip digits, fixed notation when the decimal
    // exponent is in [-4, 16) (500000, 0.0001), scientific otherwise (1e+16, 1e-05).
    r = std::to_chars(buffer, buffer + sizeof buffer, v, std::chars_format::scientific);
    if (r.ec == std::errc()) {
      const std::string_view text(buffer, static_cast<std::size_t>(r.ptr - buffer));
      const std::size_t e = text.find('e');  // none for inf / nan
      int exponent = 0;
      if (e != std::string_view::npos &&
          std::from_chars(text.data() + e + (text[e + 1] == '+' ? 2 : 1), text.data() + text.size(),
                          exponent).ec == std::errc() &&
          exponent >= -4 && exponent < 16)
        r = std::to_chars(buffer, buffer + sizeof buffer, v, std::chars_format::fixed);
    }
  }
  if (r.ec == std::errc()) out.append(buffer, r.ptr);
  else out += "<unformattable number>";
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
// Header-only: a template, so a TU compiles only the conversions for the types it formats.
template <class T>
inline void append_number(std::string& out, T v) {
  format_number(out, v);
}
#endif

/// Appends one part of a message: text as it is, bool as true/false, numbers as above,
/// enumerations as their underlying number.
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
  } else if constexpr (std::is_enum_v<T>) {
    append_part(out, static_cast<std::underlying_type_t<T>>(part));
  } else {
    static_assert(std::is_arithmetic_v<T>, "kvevict::detail::append_part: a message part is "
                                           "text, a number, a bool or an enumeration");
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

/// One part of an error message with its type erased (issue 19's include cost): fail()
/// packs its parts into an array of these and hands it to one function, fail_message,
/// instead of compiling a formatter per argument list. Formatted as append_part formats
/// the part it was made from.
struct MessagePart {
  enum class Kind : unsigned char { text, character, boolean, signed_int, unsigned_int, f32, f64, f80 };
  Kind kind;
  union {
    struct {
      const char* data;
      std::size_t size;
    } text;
    char character;
    bool boolean;
    long long signed_int;
    unsigned long long unsigned_int;
    float f32;
    double f64;
    long double f80;
  };
};

/// The MessagePart of one part (what append_part accepts).
template <class T>
MessagePart message_part(const T& part) {
  MessagePart m;
  if constexpr (std::is_convertible_v<const T&, std::string_view>) {
    const std::string_view text(part);
    m.kind = MessagePart::Kind::text;
    m.text = {text.data(), text.size()};
  } else if constexpr (std::is_same_v<T, char>) {
    m.kind = MessagePart::Kind::character;
    m.character = part;
  } else if constexpr (std::is_same_v<T, bool>) {
    m.kind = MessagePart::Kind::boolean;
    m.boolean = part;
  } else if constexpr (std::is_integral_v<T> && std::is_signed_v<T>) {
    m.kind = MessagePart::Kind::signed_int;
    m.signed_int = static_cast<long long>(part);
  } else if constexpr (std::is_integral_v<T>) {
    m.kind = MessagePart::Kind::unsigned_int;
    m.unsigned_int = static_cast<unsigned long long>(part);
  } else if constexpr (std::is_same_v<T, float>) {
    m.kind = MessagePart::Kind::f32;
    m.f32 = part;
  } else if constexpr (std::is_same_v<T, double>) {
    m.kind = MessagePart::Kind::f64;
    m.f64 = part;
  } else if constexpr (std::is_same_v<T, long double>) {
    m.kind = MessagePart::Kind::f80;
    m.f80 = part;
  } else if constexpr (std::is_enum_v<T>) {
    return message_part(static_cast<std::underlying_type_t<T>>(part));
  } else {
    static_assert(std::is_arithmetic_v<T>, "kvevict::detail::fail: a message part is "
                                           "text, a number, a bool or an enumeration");
  }
  return m;
}

/// Throws kvevict::Error("kvevict: " + the n parts formatted in order). Header-only: a
/// function template (KVEVICT_LAZY), compiled only in a file that can fail; separate-kernels
/// mode: defined once in kvevict_kernels.
#if defined(KVEVICT_SEPARATE_KERNELS)
[[noreturn]] void fail_message(const MessagePart* parts, std::size_t n);
#endif
#if !KVEVICT_KERNELS_DECLARE_ONLY
KVEVICT_LAZY [[noreturn]] KVEVICT_KERNEL_FN void fail_message(const MessagePart* parts, std::size_t n) {
  std::string message = "kvevict: ";
  for (std::size_t i = 0; i < n; ++i) {
    const MessagePart& p = parts[i];
    switch (p.kind) {
      case MessagePart::Kind::text: message.append(p.text.data, p.text.size); break;
      case MessagePart::Kind::character: append_part(message, p.character); break;
      case MessagePart::Kind::boolean: append_part(message, p.boolean); break;
      case MessagePart::Kind::signed_int: append_part(message, p.signed_int); break;
      case MessagePart::Kind::unsigned_int: append_part(message, p.unsigned_int); break;
      case MessagePart::Kind::f32: append_part(message, p.f32); break;
      case MessagePart::Kind::f64: append_part(message, p.f64); break;
      case MessagePart::Kind::f80: append_part(message, p.f80); break;
    }
  }
  throw Error(message);
}
#endif

/// Throws kvevict::Error("kvevict: " + every part formatted in order). The parts are taken
/// by value (a cold path: copies only when throwing) so that string literals decay to
/// `const char*`: one fail / message_part instantiation per list of part types, not one per
/// literal length (issue 19's include cost; require() below keeps its references).
template <class... Parts>
[[noreturn]] void fail(const Parts... parts) {
  if constexpr (sizeof...(Parts) == 0) {
    fail_message(nullptr, 0);
  } else {
    const MessagePart list[] = {message_part(parts)...};
    fail_message(list, sizeof...(Parts));
  }
}

template <class... Parts>
inline void require(bool ok, const Parts&... parts) {
  if (!ok) fail(parts...);
}

}  // namespace detail
}  // namespace kvevict
