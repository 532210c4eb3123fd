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
//
// Chunked prefill (Config::chunked): by default each prompt chunk after the first selects
// again, from the rows the head holds plus the chunk, with the same rule restricted to
// them: the last W arrivals are the window (their queries: the chunk's, and for a chunk
// shorter than W the previous chunks' last ones, which the policy keeps), the window's
// queries attend causally over the held rows and the chunk, the sums are pooled along
// arrival indices (dropped tokens count as the padding does), and the top
// (capacity - decode_reserve - W) prefix rows stay. A head never holds more than its
// capacity; one chunk of the whole prompt is exactly whole-prompt SnapKV.
// ChunkedPrefill::first_chunk keeps the earlier behaviour: only a layer's first block is
// selected, later ones pass through the decode rule.
#include <algorithm>
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
    ChunkedPrefill chunked = ChunkedPrefill::reselect;
  };

  SnapKV() = default;
  KVEVICT_DEFER explicit SnapKV(Config c) : config_(c) { observation().validate(name()); }

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

  KVEVICT_DEFER void bind(const CacheShape& shape) {
    scores_.bind(shape);
    pending_.assign(shape.capacity.size(), {});
    live_window_.assign(shape.capacity.size(), {});
    staged_window_.assign(shape.capacity.size(), {});
    n_kv_heads_ = shape.geometry.n_kv_heads;
    limit_.assign(static_cast<std::size_t>(shape.geometry.n_layers), Budget::kUnbounded);
    window_floats_ = static_cast<std::size_t>(shape.geometry.group()) * static_cast<std::size_t>(shape.geometry.head_dim);
  }

  /// Chunked prefill: whether a block on a layer that holds rows is selected again
  /// (ContainerCore, detail::HasPrefillReselect).
  [[nodiscard]] bool reselects_prefill() const { return config_.chunked == ChunkedPrefill::reselect; }

  /// Keeps all of a prompt that fits in capacity - decode_reserve; otherwise the window
  /// plus the top (capacity - decode_reserve - W) prefix tokens of this KV head. With held
  /// rows (chunked prefill) the view is the held rows plus the chunk, scored as above.
  KVEVICT_DEFER void prefill_keep(const PrefillView& v, std::vector<std::uint32_t>& keep) {
    const std::size_t idx = index(v.layer, v.kv_head);
    auto& p = pending_[idx];
    p = Pending{};
    stage_window(v, idx);
    const std::size_t budget = std::min(v.capacity - config_.decode_reserve,
                                        limit_.empty() ? v.capacity : limit_[static_cast<std::size_t>(v.layer)]);
    keep.clear();
    if (v.tokens <= budget) {
      keep.resize(v.tokens);
      std::iota(keep.begin(), keep.end(), 0u);
      // Short prompt: nothing was scored, every row is unscored (ranked by age).
      p.scores.assign(v.tokens, kUnscored);
    } else {
      std::vector<float> pooled;
      pool_scores(v, staged_window_[idx], pooled);
      keep = top_n_indices(pooled, budget - config_.window);
      for (std::uint32_t t : keep) p.scores.push_back(pooled[t]);
      for (std::size_t t = v.tokens - config_.window; t < v.tokens; ++t) {
        keep.push_back(static_cast<std::uint32_t>(t));
        p.scores.push_back(kUnscored);
      }
    }
    p.seqs.reserve(keep.size());
    for (std::uint32_t t : keep) p.seqs.push_back(v.seq(t));
    p.held = static_cast<std::size_t>(
        std::lower_bound(keep.begin(), keep.end(), static_cast<std::uint32_t>(v.held)) - keep.begin());
  }

  /// The pooled importance prefill_keep ranks the view's first tokens - W tokens by (the
  /// held rows, then the chunk's prefix), computed whatever the capacity; nothing changes.
  /// Empty when the view has no more than W tokens. XKV's per-layer statistics under
  /// chunked prefill (ChunkedXkvPrefill) are these, before the selection runs.
  KVEVICT_DEFER void prefill_scores(const PrefillView& v, std::vector<float>& pooled) const {
    pooled.clear();
    if (v.tokens <= config_.window) return;
    WindowQueries w;
    build_window(v, index(v.layer, v.kv_head), w);
    pool_scores(v, w, pooled);
  }

  /// Caps the rows a prompt selection on `layer` keeps below its capacity (window
  /// included), until set back with rows = Budget::kUnbounded: ChunkedXkvPrefill selects a
  /// layer whose budget is about to shrink under its current capacity with its new size.
  KVEVICT_DEFER void set_selection_limit(int layer, std::size_t rows) {
    kvevict::detail::require(layer >= 0 && static_cast<std::size_t>(layer) < limit_.size(),
                             "SnapKV::set_selection_limit: layer = ", layer, ", expected 0 <= layer < ",
                             limit_.size());
    kvevict::detail::require(rows > config_.window, "SnapKV::set_selection_limit: rows = ", rows,
                             ", expected more than the window ", config_.window);
    limit_[static_cast<std::size_t>(layer)] = rows;
  }

  /// After a selection's dropped held rows left: the held rows kept get this selection's
  /// scores (the block's kept rows get theirs in on_append), and the window's queries of
  /// this block become the ones a next, shorter chunk continues from.
  template <class S>
  void on_prefill_selected(const HeadView<S>& v) {
    const std::size_t idx = index(v.layer, v.kv_head);
    std::swap(live_window_[idx], staged_window_[idx]);
    auto& p = pending_[idx];
    auto& col = scores_.of(v.layer, v.kv_head);
    col.resize(v.size);
    const auto first = p.seqs.begin(), last = first + static_cast<std::ptrdiff_t>(p.held);
    for (std::size_t r = 0; r < v.size; ++r) {
      const auto it = std::lower_bound(first, last, v.seqs[r]);
      col[r] = it != last && *it == v.seqs[r] ? p.scores[static_cast<std::size_t>(it - first)] : kUnscored;
    }
    p.next = p.held;
    p.armed = true;  // a selection that threw before this point scores nothing
    if (p.next == p.seqs.size()) p = Pending{};
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
    if (p.armed && p.next < p.seqs.size() && p.seqs[p.next] == v.incoming_seq) {
      s = p.scores[p.next++];
      if (p.next == p.seqs.size()) p = Pending{};
    }
    scores_.set(v.layer, v.kv_head, row, s);
  }
  KVEVICT_DEFER void on_move(int layer, int kv_head, std::size_t from, std::size_t to) {
    scores_.move(layer, kv_head, from, to);
  }

  /// Prefill importance of each live row (row order); +infinity for unscored rows.
  [[nodiscard]] const std::vector<float>& scores(int layer, int kv_head) const {
    return scores_.of(layer, kv_head);
  }

  static constexpr float kUnscored = std::numeric_limits<float>::infinity();

  /// Saved state for serialize.hpp: the configuration (checked on load), each row's
  /// prefill score, which decides decode-time evictions and cannot be recomputed from rows,
  /// then the chunked-prefill rule and each head's kept window queries (the last queries of
  /// its latest prefill chunk, which a next chunk shorter than the window continues: a
  /// restored cache selects the next chunk as the original would). A save without that
  /// last part (written before it existed) loads with no window queries kept.
  KVEVICT_DEFER void save_state(std::vector<std::uint8_t>& out) const {
    kvevict::detail::ByteWriter w(out);
    w.put<std::uint64_t>(config_.window);
    w.put<std::uint64_t>(config_.kernel);
    w.put<std::uint64_t>(static_cast<std::uint64_t>(config_.pooling));
    w.put<std::uint64_t>(config_.decode_reserve);
    scores_.save(w);
    w.put<std::uint64_t>(static_cast<std::uint64_t>(config_.chunked));
    w.put<std::uint64_t>(live_window_.size());
    for (const auto& lw : live_window_) {
      w.put<std::uint64_t>(lw.rows);
      w.put<std::uint64_t>(lw.end_seq);
      w.put<std::uint64_t>(lw.q.size());
      w.put_array(lw.q.data(), lw.q.size());
    }
  }
  KVEVICT_DEFER void load_state(std::span<const std::uint8_t> in) {
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
    std::vector<WindowQueries> windows(live_window_.size());
    if (r.remaining() != 0) {  // the chunked-prefill part (absent from older saves)
      const auto chunked = r.get<std::uint64_t>("SnapKV chunked rule");
      kvevict::detail::require(chunked == static_cast<std::uint64_t>(config_.chunked),
                               "SnapKV state: saved with chunked rule ", chunked, ", expected ",
                               static_cast<std::uint64_t>(config_.chunked));
      const auto heads = r.get<std::uint64_t>("SnapKV window heads");
      kvevict::detail::require(heads == windows.size(), "SnapKV state: ", heads,
                               " window heads, expected ", windows.size());
      for (auto& lw : windows) {
        const auto rows = r.get<std::uint64_t>("SnapKV window rows");
        lw.end_seq = r.get<std::uint64_t>("SnapKV window end");
        const auto n = r.get<std::uint64_t>("SnapKV window floats");
        kvevict::detail::require(rows <= config_.window && n == rows * window_floats_,
                                 "SnapKV state: a window of ", rows, " rows and ", n,
                                 " floats, expected at most ", config_.window, " rows of ",
                                 window_floats_, " floats");
        lw.rows = static_cast<std::size_t>(rows);
        lw.q.resize(static_cast<std::size_t>(n));
        r.get_array(lw.q.data(), lw.q.size(), "SnapKV window queries");
        for (float x : lw.q)
          kvevict::detail::require(std::isfinite(x), "SnapKV state: a window query is ", x,
                                   ", expected finite");
      }
    }
    kvevict::detail::require(r.remaining() == 0, "SnapKV state: ", r.remaining(),
                             " trailing bytes");
    live_window_.swap(windows);
  }

 private:
  struct Pending {
    std::vector<std::uint64_t> seqs;  ///< arrival indices of the kept rows, ascending
    std::vector<float> scores;        ///< their pooled scores
    std::size_t held = 0;             ///< how many of them are held rows (chunked prefill)
    std::size_t next = 0;
    bool armed = false;  ///< on_prefill_selected ran: the selection is being applied
  };
  /// The last queries of a head's latest prefill block (rows x group x head_dim, arrival
  /// order, ending at arrival index end_seq - 1): a chunk shorter than the window
  /// continues them.
  struct WindowQueries {
    std::vector<float> q;
    std::size_t rows = 0;
    std::uint64_t end_seq = 0;
  };
  /// staged_window_[idx] = the last min(W, ...) queries of what has arrived at this
  /// block's end: the live stash's tail when it ends right before the block and its tokens
  /// are the last held rows, then the block's own. Becomes live in on_prefill_selected.
  KVEVICT_DEFER void stage_window(const PrefillView& v, std::size_t idx) { build_window(v, idx, staged_window_[idx]); }
  KVEVICT_DEFER void build_window(const PrefillView& v, std::size_t idx, WindowQueries& st) const {
    const std::size_t chunk = v.tokens - v.held;
    st.q.clear();
    st.rows = 0;
    st.end_seq = v.first_seq + chunk;
    if (v.queries == nullptr) return;
    const std::size_t d = static_cast<std::size_t>(v.head_dim), gd = static_cast<std::size_t>(v.group) * d;
    const std::size_t own = std::min(config_.window, chunk);
    const auto& lv = live_window_[idx];
    std::size_t prev = 0;
    if (own < config_.window && v.held > 0 && lv.rows > 0 && lv.end_seq == v.first_seq) {
      prev = std::min({config_.window - own, lv.rows, v.held});
      for (std::size_t k = 0; k < prev; ++k)  // they must be the last held rows
        if (v.held_seqs[v.held - prev + k] != v.first_seq - prev + k) prev = 0;
    }
    st.q.resize((prev + own) * gd);
    std::copy(lv.q.end() - static_cast<std::ptrdiff_t>(prev * gd), lv.q.end(), st.q.begin());
    for (std::size_t k = 0; k < own; ++k)
      for (int g = 0; g < v.group; ++g) {
        const float* q = v.query(v.tokens - own + k, g);
        std::copy(q, q + d, st.q.begin() + static_cast<std::ptrdiff_t>((prev + k) * gd + static_cast<std::size_t>(g) * d));
      }
    st.rows = prev + own;
  }
  KVEVICT_DEFER void pool_scores(const PrefillView& v, const WindowQueries& w, std::vector<float>& pooled) const {
    if (v.held == 0) {
      observation_scores(v, observation(), pooled);
      return;
    }
    kvevict::detail::require(v.queries != nullptr,
                             "SnapKV: a prefill chunk has no queries, expected T x n_heads x "
                             "head_dim (the observation window needs them)");
    std::vector<float> raw;
    detail::held_window_importance(v, config_.window, w.q.data(), w.rows, raw);
    detail::pool1d_by_seq(raw, v, config_.kernel, config_.pooling, pooled);
  }
  std::size_t index(int layer, int kv_head) const {
    return static_cast<std::size_t>(layer) * static_cast<std::size_t>(n_kv_heads_) +
           static_cast<std::size_t>(kv_head);
  }

  Config config_{};
  detail::RowColumn<float> scores_;
  std::vector<Pending> pending_;
  std::vector<WindowQueries> live_window_, staged_window_;
  int n_kv_heads_ = 1;
  std::vector<std::size_t> limit_;  ///< per layer: set_selection_limit (kUnbounded: none)
  std::size_t window_floats_ = 1;  ///< group x head_dim: one window row's queries
};

}  // namespace kvevict::policies

// Compiled-kernels mode: extern template declarations of the common caches (extern_templates.hpp).
#define KVEVICT_HAVE_SNAPKV_HPP 1
#include "../extern_templates.hpp"
