#pragma once
// KeyDiff (Park et al. 2025, arXiv 2504.15364; reference: NVIDIA kvpress, KeyDiffPress):
// keep the keys that differ from the rest. The anchor is the mean of the L2-normalised keys
// of the head; a key's score is its cosine similarity to the anchor, and the key most
// similar to it (the most redundant) is evicted. No attention and no queries are needed.
//
// Per KV head (GQA-native by construction: keys are per KV head, the G query heads play no
// part). The anchor is taken over the live rows and the incoming key, the set the paper's
// block-wise rule chooses from; the incoming row itself is never a victim here (the
// container decides before it is written). A zero key has no direction: it is normalised
// to zero (cosine 0). Optional sinks and a recent band are never evicted (the paper has
// neither; both default to 0).
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "../errors.hpp"
#include "common.hpp"

namespace kvevict::policies {

class KeyDiff {
 public:
  struct Config {
    std::size_t sinks = 0;         ///< first rows never evicted
    std::size_t recent = 0;        ///< rows that arrived last, never evicted
    float recent_fraction = 0.0f;  ///< protect max(recent, floor(fraction x capacity)) rows
  };
  KeyDiff() = default;
  explicit KeyDiff(Config c) : config_(c) {
    detail::require_fraction(name(), "recent_fraction", c.recent_fraction);
  }

  static constexpr Signals signals = Signals::none;
  static constexpr const char* name() { return "KeyDiff"; }
  [[nodiscard]] const Config& config() const { return config_; }
  [[nodiscard]] std::size_t min_capacity() const {
    return detail::protected_plus_one(name(), {{"sinks", config_.sinks}, {"recent", config_.recent}});
  }
  [[nodiscard]] std::size_t recent_for(std::size_t capacity) const {
    return detail::recent_rows(config_.recent, config_.recent_fraction, config_.sinks, capacity);
  }
  void bind(const CacheShape& shape) {
    inv_norms_.bind(shape);
    d_ = static_cast<std::size_t>(shape.geometry.head_dim);
  }

  template <class S>
  void choose_victims(const HeadView<S>& v, std::vector<std::uint32_t>& out) {
    const auto& inv = inv_norms_.of(v.layer, v.kv_head);
    const std::size_t d = d_;
    // Anchor direction: the sum of the unit keys (its length does not change the ranking).
    anchor_.assign(d, 0.0);
    for (std::size_t r = 0; r < v.size; ++r) {
      const auto k = v.key(r);
      for (std::size_t j = 0; j < d; ++j) anchor_[j] += static_cast<double>(k[j]) * inv[r];
    }
    if (v.incoming_key != nullptr) {
      const double in = inverse_norm(std::span<const float>(v.incoming_key, d));
      for (std::size_t j = 0; j < d; ++j) anchor_[j] += static_cast<double>(v.incoming_key[j]) * in;
    }
    // Rank by the negated similarity k_hat . anchor: the most similar row is evicted first.
    score_.resize(v.size);
    for (std::size_t r = 0; r < v.size; ++r) {
      const auto k = v.key(r);
      double dot = 0.0;
      for (std::size_t j = 0; j < d; ++j) dot += static_cast<double>(k[j]) * anchor_[j];
      score_[r] = -dot * inv[r];
    }
    const detail::Protection prot{config_.sinks, recent_for(v.capacity)};
    detail::evict_lowest(
        v, [&](std::size_t r) { return score_[r]; },
        [&](std::size_t r) { return !prot.is_protected(v.seqs[r], v.incoming_seq); }, out,
        name());
  }
  template <class S>
  void on_append(const HeadView<S>& v, std::size_t row) {
    inv_norms_.set(v.layer, v.kv_head, row, inverse_norm(v.key(row)));
  }
  void on_move(int layer, int kv_head, std::size_t from, std::size_t to) {
    inv_norms_.move(layer, kv_head, from, to);
  }

  /// Negated anchor similarities of the last choose_victims call, one per live row.
  [[nodiscard]] const std::vector<double>& last_scores() const { return score_; }

 private:
  template <class S>
  static double inverse_norm(std::span<const S> key) {
    double s = 0.0;
    for (const S& x : key) s += static_cast<double>(x) * static_cast<double>(x);
    return s > 0.0 ? 1.0 / std::sqrt(s) : 0.0;
  }

  Config config_{};
  std::size_t d_ = 0;
  detail::RowColumn<double> inv_norms_;
  std::vector<double> anchor_, score_;
};

}  // namespace kvevict::policies
