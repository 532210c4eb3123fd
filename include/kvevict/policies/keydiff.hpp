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
//
// kvevict extension `rescore_every` = R (1 = the rule above, every decision): the anchor
// and every row's score are recomputed on every R-th decision of a head only; a row
// appended in between is scored on arrival against the last anchor, and a decision is the
// victim search over the kept scores, O(n).
#include <algorithm>
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
    std::size_t rescore_every = 1;  ///< rescore all rows every R-th decision (1..2^20)
  };
  KeyDiff() = default;
  explicit KeyDiff(Config c) : config_(c) {
    detail::require_fraction(name(), "recent_fraction", c.recent_fraction);
    kvevict::detail::require(c.rescore_every >= 1 && c.rescore_every <= (1u << 20), name(),
                             ": rescore_every = ", c.rescore_every, ", expected 1..", 1u << 20);
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
    hkv_ = static_cast<std::size_t>(shape.geometry.n_kv_heads);
    if (config_.rescore_every > 1) {
      const std::size_t heads = static_cast<std::size_t>(shape.geometry.n_layers) * hkv_;
      stale_.bind(shape);
      decisions_.assign(heads, 0);
      frozen_.assign(heads, 0);
      frozen_anchor_.assign(heads * d_, 0.0);
    }
  }

  template <class S>
  void choose_victims(const HeadView<S>& v, std::vector<std::uint32_t>& out) {
    if (config_.rescore_every > 1) {
      // Amortised: rescore on every R-th decision of the head (freezing the anchor for
      // arrivals), then the lowest kept float score among the open rows (masked argmin).
      const std::size_t h = head_index(v.layer, v.kv_head);
      auto& kept = stale_.of(v.layer, v.kv_head);
      if (decisions_[h]++ % config_.rescore_every == 0) {
        score_rows(v);
        for (std::size_t r = 0; r < v.size; ++r) kept[r] = static_cast<float>(score_[r]);
        std::copy(anchor_.begin(), anchor_.end(),
                  frozen_anchor_.begin() + static_cast<std::ptrdiff_t>(h * d_));
        frozen_[h] = 1;
      }
      const std::size_t recent = recent_for(v.capacity);
      if (v.need == 1) {  // one pass (kernels::lowest_open): the row evict_lowest_masked finds
        out.push_back(detail::open_victim(
            kernels::lowest_open(kept.data(), v.seqs, v.size, config_.sinks,
                                 detail::open_below(v, recent)),
            name()));
        return;
      }
      detail::evict_lowest_masked(v, kept.data(),
                                  detail::protection_bits(v, config_.sinks, recent, bits_), out,
                                  name());
      return;
    }
    score_rows(v);
    detail::evict_lowest_protected(v, score_, config_.sinks, recent_for(v.capacity), out, name());
  }
  template <class S>
  void on_append(const HeadView<S>& v, std::size_t row) {
    const double in = inverse_norm(v.key(row));
    inv_norms_.set(v.layer, v.kv_head, row, in);
    if (config_.rescore_every == 1) return;
    // Arrival between rescorings: the negated similarity to the last anchor.
    const std::size_t h = head_index(v.layer, v.kv_head);
    double s = 0.0;
    if (frozen_[h] != 0) {
      const auto k = v.key(row);
      const double* a = frozen_anchor_.data() + h * d_;
      double dot = 0.0;
      for (std::size_t j = 0; j < d_; ++j) dot += static_cast<double>(k[j]) * a[j];
      s = -dot * in;
    }
    stale_.set(v.layer, v.kv_head, row, static_cast<float>(s));
  }
  void on_move(int layer, int kv_head, std::size_t from, std::size_t to) {
    inv_norms_.move(layer, kv_head, from, to);
    if (config_.rescore_every > 1) stale_.move(layer, kv_head, from, to);
  }

  /// Negated anchor similarities of the last choose_victims call, one per live row (with
  /// rescore_every > 1: of the last rescoring).
  [[nodiscard]] const std::vector<double>& last_scores() const { return score_; }

 private:
  std::size_t head_index(int layer, int kv_head) const {
    return static_cast<std::size_t>(layer) * hkv_ + static_cast<std::size_t>(kv_head);
  }
  // anchor_ and score_ for every live row (the rule in the header).
  template <class S>
  void score_rows(const HeadView<S>& v) {
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
  }

  template <class S>
  static double inverse_norm(std::span<const S> key) {
    double s = 0.0;
    for (const S& x : key) s += static_cast<double>(x) * static_cast<double>(x);
    return s > 0.0 ? 1.0 / std::sqrt(s) : 0.0;
  }

  Config config_{};
  std::size_t d_ = 0, hkv_ = 1;
  detail::RowColumn<double> inv_norms_;
  // rescore_every > 1: per row, its score as of the last rescoring or its arrival; per
  // (layer, KV head), decisions so far, whether an anchor is frozen, and the anchor.
  detail::RowColumn<float> stale_;
  std::vector<std::uint64_t> decisions_, bits_;
  std::vector<unsigned char> frozen_;
  std::vector<double> frozen_anchor_;
  std::vector<double> anchor_, score_;
};

}  // namespace kvevict::policies
