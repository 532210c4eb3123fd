#pragma once
// Overflow-checked size and position arithmetic, in one place: every size product the
// library computes from caller input (tokens x heads x head_dim, a policy's protected
// rows + 1, a block's last position) goes through these, so it can never wrap; an
// overflow is a kvevict::Error naming the operands and what they were for.
#include <cstddef>
#include <cstdint>
#include <limits>
#include <utility>

#include "errors.hpp"

namespace kvevict::detail {

/// a + b, or a kvevict::Error "<what...>: a + b overflows" when it does not fit size_t.
template <class... What>
std::size_t checked_add(std::size_t a, std::size_t b, What&&... what) {
  std::size_t r = 0;
  if (__builtin_add_overflow(a, b, &r))
    fail(std::forward<What>(what)..., " = ", a, " + ", b, " overflows (largest ",
         std::numeric_limits<std::size_t>::max(), ")");
  return r;
}

/// a * b, or a kvevict::Error "<what...>: a x b overflows" when it does not fit size_t.
template <class... What>
std::size_t checked_mul(std::size_t a, std::size_t b, What&&... what) {
  std::size_t r = 0;
  if (__builtin_mul_overflow(a, b, &r))
    fail(std::forward<What>(what)..., " = ", a, " x ", b, " overflows (largest ",
         std::numeric_limits<std::size_t>::max(), ")");
  return r;
}

/// first + (count - 1): the last position of a block of `count` >= 1 tokens, or a
/// kvevict::Error when it passes INT64_MAX.
template <class... What>
std::int64_t checked_last_position(std::int64_t first, std::size_t count, What&&... what) {
  // INT64_MAX - first in unsigned arithmetic: exact for every int64 `first`.
  const std::uint64_t room = static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()) -
                             static_cast<std::uint64_t>(first);
  if (count == 0 || count - 1 > room)
    fail(std::forward<What>(what)..., ": first position ", first, " + ", count,
         " tokens passes the largest position ", std::numeric_limits<std::int64_t>::max());
  return first + static_cast<std::int64_t>(count - 1);
}

}  // namespace kvevict::detail
