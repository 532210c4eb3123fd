#pragma once
// DecayedAttention: evict the row with the lowest exponentially decayed attention,
//   score <- decay * score + (attention this step, summed over the G query heads).
// decay = 1 is H2O's accumulated score, which favours old rows simply because they have
// been attended longer; decay = 0 is TOVA (Oren et al. 2024: drop the row the latest
// query attends least). In between, a row's score is its recent attention rate, so old
// and new rows compete on equal terms. Optional sinks and a recent window are protected.
#include <cmath>

#include "../errors.hpp"
#include "common.hpp"

namespace kvevict::policies {

class DecayedAttention {
 public:
  struct Config {
    float decay = 0.0f;       ///< 0 = TOVA, 1 = H2O-style accumulation
    std::size_t sinks = 0;    ///< first rows never evicted
    std::size_t recent = 0;   ///< rows that arrived last, never evicted
  };
  DecayedAttention() = default;
  explicit DecayedAttention(Config c) : config_(c) {
    kvevict::detail::require(std::isfinite(c.decay) && c.decay >= 0.0f && c.decay <= 1.0f,
                             "DecayedAttention: decay = ", c.decay, ", expected in [0, 1]");
  }

  static constexpr Signals signals = Signals::attention;
  static constexpr const char* name() { return "DecayedAttention"; }
  [[nodiscard]] const Config& config() const { return config_; }
  [[nodiscard]] std::size_t min_capacity() const { return config_.sinks + config_.recent + 1; }
  void bind(const CacheShape& shape) { scores_.bind(shape); }
  template <class S>
  void choose_victims(const HeadView<S>& v, std::vector<std::uint32_t>& out) {
    const auto& sc = scores_.of(v.layer, v.kv_head);
    const detail::Protection prot{config_.sinks, config_.recent};
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
    const float g = config_.decay;
    for (std::size_t r = 0; r < a.size; ++r) sc[r] = g * sc[r] + a.summed(r);
  }
  [[nodiscard]] const std::vector<float>& scores(int layer, int kv_head) const {
    return scores_.of(layer, kv_head);
  }

 private:
  Config config_{};
  detail::RowColumn<float> scores_;
};

}  // namespace kvevict::policies
