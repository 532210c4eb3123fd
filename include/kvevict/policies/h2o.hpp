#pragma once
// H2O (Zhang et al. 2023): a recent window plus the heavy hitters by accumulated
// attention. GQA: a row's score is the attention of its G query heads, summed.
// Decision timing: the victim is chosen when the next token arrives, from the scores
// accumulated so far, so the cache never holds more than its budget.
// It is DecayedAttention at decay 1 (score += attention, never forgotten): the rule lives
// there; H2O keeps its own name, configuration and save format.
#include <cmath>

#include "common.hpp"
#include "decayed_attention.hpp"

namespace kvevict::policies {

class H2O {
 public:
  struct Config {
    std::size_t recent = 10;  ///< rows that arrived last, never evicted
    std::size_t sinks = 0;    ///< optional first rows never evicted (0 = plain H2O)
  };
  H2O() = default;
  KVEVICT_DEFER explicit H2O(Config c) : recent(c.recent), sinks(c.sinks) {}
  std::size_t recent = 10;  ///< read at bind()
  std::size_t sinks = 0;    ///< read at bind()

  static constexpr Signals signals = Signals::attention;
  static constexpr const char* name() { return "H2O"; }
  /// Never reads stored keys/values: IndexCache need not gather them.
  static constexpr bool reads_stored_rows = false;
  [[nodiscard]] std::size_t min_capacity() const {
    return detail::protected_plus_one(name(), {{"sinks", sinks}, {"recent", recent}});
  }
  KVEVICT_DEFER void bind(const CacheShape& shape) {
    inner_ = DecayedAttention({.decay = 1.0f, .sinks = sinks, .recent = recent});
    inner_.label_ = name();
    inner_.bind(shape);
  }
  template <class S>
  void choose_victims(const HeadView<S>& v, std::vector<std::uint32_t>& out) {
    inner_.choose_victims(v, out);
  }
  /// Pooled budgets: the accumulated score of each row, +infinity for protected rows
  /// (DecayedAttention::eviction_costs at decay 1).
  template <class S>
  void eviction_costs(const HeadView<S>& v, std::vector<float>& out) {
    inner_.eviction_costs(v, out);
  }
  /// Pooled budgets: choose_victims reusing eviction_costs' protection
  /// (DecayedAttention::pooled_victims).
  template <class S>
  void pooled_victims(const HeadView<S>& v, std::vector<std::uint32_t>& out) {
    inner_.pooled_victims(v, out);
  }
  template <class S>
  void on_append(const HeadView<S>& v, std::size_t row) {
    inner_.on_append(v, row);
  }
  KVEVICT_DEFER void on_move(int layer, int kv_head, std::size_t from, std::size_t to) {
    inner_.on_move(layer, kv_head, from, to);
  }
  KVEVICT_DEFER void observe(const AttentionView& a) { inner_.observe(a); }
  /// Saved state (serialize.hpp): the configuration, checked on load, and every score.
  KVEVICT_DEFER void save_state(std::vector<std::uint8_t>& out) const {
    kvevict::detail::ByteWriter w(out);
    w.put<std::uint64_t>(recent);
    w.put<std::uint64_t>(sinks);
    inner_.scores_.save(w);
  }
  KVEVICT_DEFER void load_state(std::span<const std::uint8_t> in) {
    inner_.memo_.clear();  // derived from the scores; pooled_victims recomputes without it
    kvevict::detail::ByteReader r(in);
    const auto rc = r.get<std::uint64_t>("H2O recent");
    const auto sk = r.get<std::uint64_t>("H2O sinks");
    kvevict::detail::require(rc == recent && sk == sinks, "H2O state: saved with recent = ", rc,
                             ", sinks = ", sk, ", expected recent = ", recent, ", sinks = ", sinks);
    inner_.scores_.load(r, name(), [](float x) { return std::isfinite(x) && x >= 0.0f; });
    kvevict::detail::require(r.remaining() == 0, "H2O state: ", r.remaining(), " trailing bytes");
  }
  /// Accumulated score of each live row (row order), for inspection and tests.
  [[nodiscard]] const std::vector<float>& scores(int layer, int kv_head) const {
    return inner_.scores(layer, kv_head);
  }

 private:
  DecayedAttention inner_;
};

}  // namespace kvevict::policies

// Compiled-kernels mode: extern template declarations of the common caches (extern_templates.hpp).
#define KVEVICT_HAVE_H2O_HPP 1
#include "../extern_templates.hpp"
