#pragma once
// DecayedAttention: evict the row with the lowest exponentially decayed attention,
//   score <- decay * score + (attention this step, summed over the G query heads).
// decay = 1 is H2O's accumulated score, which favours old rows simply because they have
// been attended longer; decay = 0 is TOVA (Oren et al. 2024: drop the row the latest
// query attends least). In between, a row's score is its recent attention rate, so old
// and new rows compete on equal terms. Optional sinks and a recent window are protected.
//
// Both knobs can scale with each head's capacity C, which is what transfers across
// budgets: `horizon` h sets decay = 1 - h / C (a row's score remembers about C / h steps),
// and `recent_fraction` f protects the floor(f * C) most recent rows. recommended() is
// the setting chosen on stories260K (docs/quality.md): h = 3, f = 1/2, one sink.
#include <algorithm>
#include <cmath>

#include "../bytes.hpp"
#include "../errors.hpp"
#include "common.hpp"

namespace kvevict::policies {

class H2O;

class DecayedAttention {
 public:
  struct Config {
    float decay = 0.0f;       ///< 0 = TOVA, 1 = H2O-style accumulation (when horizon = 0)
    std::size_t sinks = 0;    ///< first rows never evicted
    std::size_t recent = 0;   ///< rows that arrived last, never evicted
    float horizon = 0.0f;     ///< > 0: decay = 1 - horizon / capacity, per head
    float recent_fraction = 0.0f;  ///< protect max(recent, floor(fraction * capacity)) rows
  };
  DecayedAttention() = default;
  explicit DecayedAttention(Config c) : config_(c) {
    kvevict::detail::require(std::isfinite(c.decay) && c.decay >= 0.0f && c.decay <= 1.0f,
                             "DecayedAttention: decay = ", c.decay, ", expected in [0, 1]");
    kvevict::detail::require(std::isfinite(c.horizon) && c.horizon >= 0.0f,
                             "DecayedAttention: horizon = ", c.horizon, ", expected >= 0");
    kvevict::detail::require(
        std::isfinite(c.recent_fraction) && c.recent_fraction >= 0.0f && c.recent_fraction < 1.0f,
        "DecayedAttention: recent_fraction = ", c.recent_fraction, ", expected in [0, 1)");
  }
  /// The setting recommended for streaming generation (chosen on held-in streams of
  /// stories260K, reported on held-out ones: docs/quality.md).
  static DecayedAttention recommended() {
    return DecayedAttention(Config{.sinks = 1, .horizon = 3.0f, .recent_fraction = 0.5f});
  }

  /// Decay used for a head of `capacity` rows.
  [[nodiscard]] float decay_for(std::size_t capacity) const {
    if (config_.horizon <= 0.0f || capacity == Budget::kUnbounded) return config_.decay;
    return std::clamp(1.0f - config_.horizon / static_cast<float>(capacity), 0.0f, 1.0f);
  }
  /// Recent rows protected in a head of `capacity` rows (always leaves one evictable slot).
  [[nodiscard]] std::size_t recent_for(std::size_t capacity) const {
    std::size_t r = config_.recent;
    if (capacity != Budget::kUnbounded)
      r = std::max(r, static_cast<std::size_t>(config_.recent_fraction *
                                               static_cast<float>(capacity)));
    if (r > config_.recent && capacity != Budget::kUnbounded && capacity > config_.sinks)
      r = std::min(r, std::max(config_.recent, capacity - config_.sinks - 1));
    return r;
  }

  static constexpr Signals signals = Signals::attention;
  static constexpr const char* name() { return "DecayedAttention"; }
  [[nodiscard]] const Config& config() const { return config_; }
  [[nodiscard]] std::size_t min_capacity() const { return config_.sinks + config_.recent + 1; }
  void bind(const CacheShape& shape) {
    scores_.bind(shape);
    hkv_ = static_cast<std::size_t>(shape.geometry.n_kv_heads);
    decay_.clear();
    for (std::size_t c : shape.capacity) decay_.push_back(decay_for(c));
  }
  template <class S>
  void choose_victims(const HeadView<S>& v, std::vector<std::uint32_t>& out) {
    const auto& sc = scores_.of(v.layer, v.kv_head);
    // The capacity may have changed through set_budget: follow it.
    decay_[head_index(v.layer, v.kv_head)] = decay_for(v.capacity);
    const detail::Protection prot{config_.sinks, recent_for(v.capacity)};
    detail::evict_lowest(
        v, [&](std::size_t r) { return sc[r]; },
        [&](std::size_t r) { return !prot.is_protected(v.seqs[r], v.incoming_seq); }, out, label_);
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
    const float g = decay_[head_index(a.layer, a.kv_head)];
    for (std::size_t r = 0; r < a.size; ++r) sc[r] = g * sc[r] + a.summed(r);
  }
  /// Saved state for serialize.hpp: the configuration (checked on load), the per-head
  /// decays (they follow set_budget) and the scores.
  void save_state(std::vector<std::uint8_t>& out) const {
    kvevict::detail::ByteWriter w(out);
    w.put<float>(config_.decay);
    w.put<std::uint64_t>(config_.sinks);
    w.put<std::uint64_t>(config_.recent);
    w.put<float>(config_.horizon);
    w.put<float>(config_.recent_fraction);
    w.put<std::uint64_t>(decay_.size());
    for (float d : decay_) w.put<float>(d);
    scores_.save(w);
  }
  void load_state(std::span<const std::uint8_t> in) {
    kvevict::detail::ByteReader r(in);
    const auto decay = r.get<float>("DecayedAttention decay");
    const auto sinks = r.get<std::uint64_t>("DecayedAttention sinks");
    const auto recent = r.get<std::uint64_t>("DecayedAttention recent");
    const auto horizon = r.get<float>("DecayedAttention horizon");
    const auto fraction = r.get<float>("DecayedAttention recent_fraction");
    kvevict::detail::require(
        decay == config_.decay && sinks == config_.sinks && recent == config_.recent &&
            horizon == config_.horizon && fraction == config_.recent_fraction,
        "DecayedAttention state: saved with decay ", decay, ", sinks ", sinks, ", recent ", recent,
        ", horizon ", horizon, ", recent_fraction ", fraction, "; expected decay ", config_.decay,
        ", sinks ", config_.sinks, ", recent ", config_.recent, ", horizon ", config_.horizon,
        ", recent_fraction ", config_.recent_fraction);
    const auto n = r.get<std::uint64_t>("DecayedAttention head count");
    kvevict::detail::require(n == decay_.size(), "DecayedAttention state: ", n,
                             " heads, expected ", decay_.size());
    std::vector<float> decays(decay_.size());
    for (auto& d : decays) {
      d = r.get<float>("DecayedAttention head decay");
      kvevict::detail::require(std::isfinite(d) && d >= 0.0f && d <= 1.0f,
                               "DecayedAttention state: head decay ", d, ", expected in [0, 1]");
    }
    scores_.load(r, name(), [](float x) { return std::isfinite(x) && x >= 0.0f; });
    kvevict::detail::require(r.remaining() == 0, "DecayedAttention state: ", r.remaining(),
                             " trailing bytes");
    decay_ = std::move(decays);
  }
  [[nodiscard]] const std::vector<float>& scores(int layer, int kv_head) const {
    return scores_.of(layer, kv_head);
  }

 private:
  // H2O is this policy at decay 1; it keeps its own name and save format (h2o.hpp).
  friend class H2O;
  std::size_t head_index(int layer, int kv_head) const {
    return static_cast<std::size_t>(layer) * hkv_ + static_cast<std::size_t>(kv_head);
  }

  Config config_{};
  detail::RowColumn<float> scores_;
  std::size_t hkv_ = 1;
  std::vector<float> decay_;    ///< per (layer, KV head)
  const char* label_ = name();  ///< the policy named in errors (H2O when it wraps this)
};

}  // namespace kvevict::policies
