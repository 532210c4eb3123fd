#pragma once
// Oracle: NOT a causal policy, a measurement ceiling. It stores every row, and at each
// step attend() lets each KV head's queries see only the `rows` rows that carry the most
// attention mass for the current query (summed over the group). No real policy can know
// that before attending; the gap to it is the headroom any policy could still win.
#include "../errors.hpp"
#include "common.hpp"

namespace kvevict::policies {

struct Oracle {
  std::size_t rows = 64;  ///< rows attended per (layer, KV head) each step

  static constexpr Signals signals = Signals::none;
  /// Never reads stored keys/values: IndexCache skips gathering them, and a quantized
  /// KVCache does not dequantise heads for it (docs/quantized.md).
  static constexpr bool reads_stored_rows = false;
  static constexpr const char* name() { return "Oracle"; }
  [[nodiscard]] std::size_t min_capacity() const { return 1; }
  void bind(const CacheShape& shape) { check_budget(shape); }
  void check_budget(const CacheShape& shape) const {
    kvevict::detail::require(rows > 0, "Oracle: rows = 0, expected > 0");
    detail::require_unbounded(shape, "Oracle: cache budget",
                              "the Oracle stores every row and limits attention to `rows` instead");
  }
  [[nodiscard]] std::size_t attention_limit(int, int) const { return rows; }
  template <class S>
  void choose_victims(const HeadView<S>&, std::vector<std::uint32_t>&) {}
  template <class S>
  void on_append(const HeadView<S>&, std::size_t) {}
  void on_move(int, int, std::size_t, std::size_t) {}
  /// Saved state (serialize.hpp): the configuration, checked on load.
  void save_state(std::vector<std::uint8_t>& out) const { detail::save_config(out, {{"rows", rows}}); }
  void load_state(std::span<const std::uint8_t> in) const {
    detail::check_config(in, name(), {{"rows", rows}});
  }
};

}  // namespace kvevict::policies
