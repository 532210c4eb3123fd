#pragma once
// KNorm (Devoto et al. 2024): keys with a small L2 norm draw the most attention, so
// evict the key with the largest norm. Needs no attention at all.
#include <cmath>

#include "common.hpp"

namespace kvevict::policies {

class KNorm {
 public:
  struct Config {
    std::size_t sinks = 0;   ///< first rows never evicted
    std::size_t recent = 0;  ///< rows that arrived last, never evicted
  };
  KNorm() = default;
  KVEVICT_DEFER explicit KNorm(Config c) : sinks(c.sinks), recent(c.recent) {}
  std::size_t sinks = 0;
  std::size_t recent = 0;

  static constexpr Signals signals = Signals::none;
  static constexpr const char* name() { return "KNorm"; }
  [[nodiscard]] std::size_t min_capacity() const {
    return detail::protected_plus_one(name(), {{"sinks", sinks}, {"recent", recent}});
  }
  KVEVICT_DEFER void bind(const CacheShape& shape) { norms_.bind(shape); }
  template <class S>
  void choose_victims(const HeadView<S>& v, std::vector<std::uint32_t>& out) {
    const auto& nr = norms_.of(v.layer, v.kv_head);
    const detail::Protection prot{sinks, recent};
    // Largest norm first: rank by the negated norm.
    detail::evict_lowest(
        v, [&](std::size_t r) { return -nr[r]; },
        [&](std::size_t r) { return !prot.is_protected(v.seqs[r], v.incoming_seq); }, out,
        name());
  }
  template <class S>
  void on_append(const HeadView<S>& v, std::size_t row) {
    float s = 0.0f;
    for (const S& x : v.key(row)) s += static_cast<float>(x) * static_cast<float>(x);
    norms_.set(v.layer, v.kv_head, row, std::sqrt(s));
  }
  KVEVICT_DEFER void on_move(int layer, int kv_head, std::size_t from, std::size_t to) {
    norms_.move(layer, kv_head, from, to);
  }
  /// Saved state (serialize.hpp): the configuration, checked on load (norms are rebuilt
  /// from the stored keys).
  KVEVICT_DEFER void save_state(std::vector<std::uint8_t>& out) const {
    detail::save_config(out, {{"sinks", sinks}, {"recent", recent}});
  }
  KVEVICT_DEFER void load_state(std::span<const std::uint8_t> in) const {
    detail::check_config(in, name(), {{"sinks", sinks}, {"recent", recent}});
  }

 private:
  detail::RowColumn<float> norms_;
};

}  // namespace kvevict::policies
