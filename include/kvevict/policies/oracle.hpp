#pragma once
// Oracle: NOT a causal policy, a measurement ceiling. It stores every row, and at each
// step attend() lets each KV head's queries see only the `rows` rows that carry the most
// attention mass for the current query (summed over the group). No real policy can know
// that before attending; the gap to it is the headroom any policy could still win.
//
// Ceilings of the paged layouts (issue 14): `block_tokens` > 1 attends whole blocks of
// that many consecutive arrivals (row r in block r / block_tokens; the Oracle never evicts,
// so rows are in arrival order), the rows / block_tokens blocks of most mass; `shared`
// makes one choice per layer for all its KV heads (llama.cpp's cells), by the mass summed
// over every query head of the layer.
#include "../errors.hpp"
#include "common.hpp"

namespace kvevict::policies {

struct Oracle {
  std::size_t rows = 64;          ///< rows attended per (layer, KV head) each step
  std::size_t block_tokens = 1;  ///< attend whole blocks of this many arrivals (1..rows)
  bool shared = false;           ///< one choice per layer for all KV heads

  static constexpr Signals signals = Signals::none;
  /// Never reads stored keys/values: IndexCache skips gathering them, and a quantized
  /// KVCache does not dequantise heads for it (docs/quantized.md).
  static constexpr bool reads_stored_rows = false;
  static constexpr const char* name() { return "Oracle"; }
  [[nodiscard]] std::size_t min_capacity() const { return 1; }
  void bind(const CacheShape& shape) { check_budget(shape); }
  void check_budget(const CacheShape& shape) const {
    kvevict::detail::require(rows > 0, "Oracle: rows = 0, expected > 0");
    kvevict::detail::require(block_tokens >= 1 && block_tokens <= rows, "Oracle: block_tokens = ",
                             block_tokens, ", expected 1..rows (", rows, ")");
    detail::require_unbounded(shape, "Oracle: cache budget",
                              "the Oracle stores every row and limits attention to `rows` instead");
  }
  [[nodiscard]] std::size_t attention_limit(int, int) const { return rows; }
  [[nodiscard]] std::size_t attention_block() const { return block_tokens; }
  [[nodiscard]] bool attention_shared() const { return shared; }
  template <class S>
  void choose_victims(const HeadView<S>&, std::vector<std::uint32_t>&) {}
  template <class S>
  void on_append(const HeadView<S>&, std::size_t) {}
  void on_move(int, int, std::size_t, std::size_t) {}
  /// Saved state (serialize.hpp): the configuration, checked on load.
  KVEVICT_DEFER void save_state(std::vector<std::uint8_t>& out) const { detail::save_config(out, config_fields()); }
  KVEVICT_DEFER void load_state(std::span<const std::uint8_t> in) const {
    detail::check_config(in, name(), config_fields());
  }

 private:
  // The block and shared fields only when set: a default Oracle saves what it always did.
  KVEVICT_DEFER [[nodiscard]] std::vector<detail::Field> config_fields() const {
    std::vector<detail::Field> f{{"rows", rows}};
    if (block_tokens != 1 || shared) {
      f.emplace_back("block_tokens", block_tokens);
      f.emplace_back("shared", shared ? 1 : 0);
    }
    return f;
  }
};

}  // namespace kvevict::policies
