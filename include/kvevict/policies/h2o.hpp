#pragma once
// H2O (Zhang et al. 2023): a recent window plus the heavy hitters by accumulated
// attention. GQA: a row's score is the attention of its G query heads, summed.
// Decision timing: the victim is chosen when the next token arrives, from the scores
// accumulated so far, so the cache never holds more than its budget.
#include <cmath>

#include "common.hpp"

namespace kvevict::policies {

class H2O {
 public:
  struct Config {
    std::size_t recent = 10;  ///< rows that arrived last, never evicted
    std::size_t sinks = 0;    ///< optional first rows never evicted (0 = plain H2O)
  };
  H2O() = default;
  explicit H2O(Config c) : recent(c.recent), sinks(c.sinks) {}
  std::size_t recent = 10;
  std::size_t sinks = 0;

  static constexpr Signals signals = Signals::attention;
  static constexpr const char* name() { return "H2O"; }
  [[nodiscard]] std::size_t min_capacity() const { return sinks + recent + 1; }
  void bind(const CacheShape& shape) { scores_.bind(shape); }
  template <class S>
  void choose_victims(const HeadView<S>& v, std::vector<std::uint32_t>& out) {
    const auto& sc = scores_.of(v.layer, v.kv_head);
    const detail::Protection prot{sinks, recent};
    detail::evict_lowest(
        v, [&](std::size_t r) { return sc[r]; },
        [&](std::size_t r) { return !prot.is_protected(v.seqs[r], v.incoming_seq); }, out,
        name());
  }
  template <class S>
  void on_append(const HeadView<S>& v, std::size_t row) {
    scores_.set(v.layer, v.kv_head, row, 0.0f);
  }
  void on_move(int layer, int kv_head, std::size_t from, std::size_t to) {
    scores_.move(layer, kv_head, from, to);
  }
  void observe(const AttentionView& a) {
    auto& sc = scores_.of(a.layer, a.kv_head);
    for (std::size_t r = 0; r < a.size; ++r) sc[r] += a.summed(r);
  }
  /// Saved state (serialize.hpp): the configuration, checked on load, and every score.
  void save_state(std::vector<std::uint8_t>& out) const {
    kvevict::detail::ByteWriter w(out);
    w.put<std::uint64_t>(recent);
    w.put<std::uint64_t>(sinks);
    scores_.save(w);
  }
  void load_state(std::span<const std::uint8_t> in) {
    kvevict::detail::ByteReader r(in);
    const auto rc = r.get<std::uint64_t>("H2O recent");
    const auto sk = r.get<std::uint64_t>("H2O sinks");
    kvevict::detail::require(rc == recent && sk == sinks, "H2O state: saved with recent = ", rc,
                             ", sinks = ", sk, ", expected recent = ", recent, ", sinks = ", sinks);
    scores_.load(r, name(), [](float x) { return std::isfinite(x) && x >= 0.0f; });
    kvevict::detail::require(r.remaining() == 0, "H2O state: ", r.remaining(), " trailing bytes");
  }
  /// Accumulated score of each live row (row order), for inspection and tests.
  [[nodiscard]] const std::vector<float>& scores(int layer, int kv_head) const {
    return scores_.of(layer, kv_head);
  }

 private:
  detail::RowColumn<float> scores_;
};

}  // namespace kvevict::policies
