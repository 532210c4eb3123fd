// kernels::OpenBatch: what decay_lowest_open_batch (select.hpp) returns, the lowest open rows
// of each of up to kMaxSteps future decisions.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvevict::kernels {

/// The result of decay_lowest_open_batch: for step t (0 .. steps - 1), the min(t + 1, open
/// rows) rows with the lowest (value, key) among the rows open at step t, in that order
/// (lowest first): value[t][i], key[t][i], row[t][i] for i < count[t].
struct OpenBatch {
  static constexpr std::size_t kMaxSteps = 8;
  std::size_t steps = 0;
  std::uint32_t count[kMaxSteps] = {};
  float value[kMaxSteps][kMaxSteps] = {};
  std::uint32_t key[kMaxSteps][kMaxSteps] = {};
  std::uint32_t row[kMaxSteps][kMaxSteps] = {};

  /// Offers row r (value v, key k) to step t's list (capacity t + 1): kept when it is among
  /// the t + 1 lowest by (value, key), -0.0 == +0.0, NaN never kept.
  void offer(std::size_t t, float v, std::uint32_t k, std::uint32_t r) noexcept {
    const std::uint32_t cap = static_cast<std::uint32_t>(t + 1);
    std::uint32_t c = count[t];
    auto lower = [&](std::uint32_t i) { return v < value[t][i] || (v == value[t][i] && k < key[t][i]); };
    if (!(v == v)) return;
    if (c == cap) {
      if (!lower(c - 1)) return;
      --c;  // the last one drops out
    }
    std::uint32_t i = c;
    for (; i > 0 && lower(i - 1); --i) {
      value[t][i] = value[t][i - 1];
      key[t][i] = key[t][i - 1];
      row[t][i] = row[t][i - 1];
    }
    value[t][i] = v;
    key[t][i] = k;
    row[t][i] = r;
    count[t] = c + 1;
  }
  /// The value a row needs to be offered to step t's list: +infinity while it is not full,
  /// else its last (highest) value; rows above it cannot enter (equal ones may, by key).
  [[nodiscard]] float bar(std::size_t t) const noexcept {
    return count[t] == t + 1 ? value[t][t] : __builtin_inff();
  }
};

}  // namespace kvevict::kernels
