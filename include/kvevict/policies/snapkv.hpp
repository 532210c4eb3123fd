#pragma once
// SnapKV (Li et al. 2024, arXiv 2404.14469): once, at prefill, each KV head keeps the
// observation window (the last W prompt tokens) plus the top prompt tokens by pooled
// window attention; decoding appends. Per-layer budgets (XKV, PyramidKV) come in as a
// Budget::per_layer: the selection size of a layer is its capacity minus W minus the
// decode reserve.
//
// Decode overflow (the paper's cache only grows; a bounded container must decide): when
// a head is full, the victim is the prompt row with the lowest prefill importance; rows
// without a prefill score (the window and decoded tokens) rank above every scored row
// and go oldest first. The last W arrivals are never evicted. Set decode_reserve to the
// number of tokens you will generate and nothing decoded is ever evicted.
#include <cmath>
#include <limits>

#include "common.hpp"
#include "observation.hpp"

namespace kvevict::policies {

class SnapKV {
 public:
  struct Config {
    std::size_t window = 32;  ///< SnapKV paper default (XKV uses 8)
    std::size_t kernel = 5;   ///< SnapKV paper default (XKV uses 7)
    Pooling pooling = Pooling::avg;
    std::size_t decode_reserve = 0;  ///< capacity left free at prefill for decoded tokens
  };

  SnapKV() = default;
  explicit SnapKV(Config c) : config_(c) { observation().validate(name()); }

  static constexpr Signals signals = Signals::prefill_window;
  static constexpr const char* name() { return "SnapKV"; }
  /// The window, one selected token (never zero) and the decode reserve.
  [[nodiscard]] std::size_t min_capacity() const {
    return detail::protected_plus_one(
        name(), {{"window", config_.window}, {"decode_reserve", config_.decode_reserve}});
  }
  [[nodiscard]] const Config& config() const { return config_; }
  [[nodiscard]] ObservationConfig observation() const {
    return {config_.window, config_.kernel, config_.pooling};
  }

  void bind(const CacheShape& shape) {
    scores_.bind(shape);
    pending_.assign(shape.capacity.size(), {});
    n_kv_heads_ = shape.geometry.n_kv_heads;
  }

  /// Keeps all of a prompt that fits in capacity - decode_reserve; otherwise the window
  /// plus the top (capacity - decode_reserve - W) prefix tokens of this KV head.
  KVEVICT_LAZY void prefill_keep(const PrefillView& v, std::vector<std::uint32_t>& keep) {
    auto& p = pending_[index(v.layer, v.kv_head)];
    p = Pending{};
    p.first_seq = v.first_seq;
    const std::size_t budget = v.capacity - config_.decode_reserve;
    keep.clear();
    if (v.tokens <= budget) {
      keep.resize(v.tokens);
      std::iota(keep.begin(), keep.end(), 0u);
      // Short prompt: nothing was scored, every row is unscored (ranked by age).
      p.scores.assign(v.tokens, kUnscored);
    } else {
      std::vector<float> pooled;
      observation_scores(v, observation(), pooled);
      keep = top_n_indices(pooled, budget - config_.window);
      for (std::uint32_t t : keep) p.scores.push_back(pooled[t]);
      for (std::size_t t = v.tokens - config_.window; t < v.tokens; ++t) {
        keep.push_back(static_cast<std::uint32_t>(t));
        p.scores.push_back(kUnscored);
      }
    }
    p.rows = keep;
  }

  template <class S>
  void choose_victims(const HeadView<S>& v, std::vector<std::uint32_t>& out) {
    const auto& sc = scores_.of(v.layer, v.kv_head);
    const detail::Protection prot{0, config_.window};
    detail::evict_lowest(
        v, [&](std::size_t r) { return sc[r]; },
        [&](std::size_t r) { return !prot.is_protected(v.seqs[r], v.incoming_seq); }, out, name());
  }

  template <class S>
  void on_append(const HeadView<S>& v, std::size_t row) {
    auto& p = pending_[index(v.layer, v.kv_head)];
    float s = kUnscored;
    // Prefill rows arrive in ascending order right after prefill_keep: follow a cursor.
    if (p.next < p.rows.size() && p.first_seq + p.rows[p.next] == v.incoming_seq) {
      s = p.scores[p.next++];
      if (p.next == p.rows.size()) p = Pending{};
    }
    scores_.set(v.layer, v.kv_head, row, s);
  }
  void on_move(int layer, int kv_head, std::size_t from, std::size_t to) {
    scores_.move(layer, kv_head, from, to);
  }

  /// Prefill importance of each live row (row order); +infinity for unscored rows.
  [[nodiscard]] const std::vector<float>& scores(int layer, int kv_head) const {
    return scores_.of(layer, kv_head);
  }

  static constexpr float kUnscored = std::numeric_limits<float>::infinity();

  /// Saved state for serialize.hpp: the configuration (checked on load) and each row's
  /// prefill score, which decides decode-time evictions and cannot be recomputed from rows.
  void save_state(std::vector<std::uint8_t>& out) const {
    kvevict::detail::ByteWriter w(out);
    w.put<std::uint64_t>(config_.window);
    w.put<std::uint64_t>(config_.kernel);
    w.put<std::uint64_t>(static_cast<std::uint64_t>(config_.pooling));
    w.put<std::uint64_t>(config_.decode_reserve);
    scores_.save(w);
  }
  void load_state(std::span<const std::uint8_t> in) {
    kvevict::detail::ByteReader r(in);
    const auto window = r.get<std::uint64_t>("SnapKV window");
    const auto kernel = r.get<std::uint64_t>("SnapKV kernel");
    const auto pooling = r.get<std::uint64_t>("SnapKV pooling");
    const auto reserve = r.get<std::uint64_t>("SnapKV decode_reserve");
    kvevict::detail::require(
        window == config_.window && kernel == config_.kernel &&
            pooling == static_cast<std::uint64_t>(config_.pooling) &&
            reserve == config_.decode_reserve,
        "SnapKV state: saved with window ", window, ", kernel ", kernel, ", pooling ", pooling,
        ", decode_reserve ", reserve, "; expected window ", config_.window, ", kernel ",
        config_.kernel, ", pooling ", static_cast<std::uint64_t>(config_.pooling),
        ", decode_reserve ", config_.decode_reserve);
    scores_.load(r, name(), [](float x) { return !std::isnan(x); });
    kvevict::detail::require(r.remaining() == 0, "SnapKV state: ", r.remaining(),
                             " trailing bytes");
  }

 private:
  struct Pending {
    std::uint64_t first_seq = 0;
    std::vector<std::uint32_t> rows;  ///< kept prompt indices, ascending
    std::vector<float> scores;        ///< their pooled scores
    std::size_t next = 0;
  };
  std::size_t index(int layer, int kv_head) const {
    return static_cast<std::size_t>(layer) * static_cast<std::size_t>(n_kv_heads_) +
           static_cast<std::size_t>(kv_head);
  }

  Config config_{};
  detail::RowColumn<float> scores_;
  std::vector<Pending> pending_;
  int n_kv_heads_ = 1;
};

}  // namespace kvevict::policies
