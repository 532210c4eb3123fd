#pragma once
// BUZZ (Zhao et al. 2024, arXiv 2410.23079): a beehive-structured cache per (layer, KV head):
// [S sinks | sample region | W window]. The sample region holds the survivors of earlier
// rebuilds ("old samples") and the tokens that slid out of the window since ("newly
// evicted"). When it exceeds T tokens a rebuild thins the old samples by position (every
// ceil(s/2)-th) and keeps one heavy hitter per chunk of s newly evicted tokens (the
// "segmented heavy hitter": local argmax of the accumulated attention).
//
// Faithful to the reference BuzzKVCacheWithAccumulation (github JunqiZhao888/buzz-llm), with
// GQA done right: a row's score is the attention of the G query heads of its group, summed,
// and selection is per KV head. Timing: the reference rebuilds after the new token has been
// appended and attended; here the rebuild runs when the next token arrives at a full head
// (capacity or row_limit = S + W + T), from the scores accumulated so far, with the incoming
// token counted in the window. The kept set is the reference's; the new token attends over
// the rebuilt cache instead of the one just before the rebuild (docs/policies/buzz.md);
// Config::reference_timing reproduces the reference's timing instead.
//
// Options: a budget mode that derives W and T from each head's capacity, and a "log n" form
// (hierarchical thinning, see Config::log_n) whose sample region grows O(log n).
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "../checked.hpp"
#include "../errors.hpp"
#include "common.hpp"

namespace kvevict::policies {

class BuzzBeehive {
 public:
  struct Config {
    std::size_t sinks = 4;        ///< S: the first tokens, never evicted
    std::size_t window = 160;     ///< W: recent tokens, the incoming one included
    std::size_t threshold = 400;  ///< T: a rebuild fires when the sample region exceeds T
    std::size_t stride = 5;       ///< s: chunk length; old samples keep every ceil(s/2)-th
    /// Derive W and T from each head's capacity C (window_for_budget): S + W + T = C, so
    /// the cache peaks exactly at the budget. Needs a finite budget; excludes log_n.
    bool budget_mode = false;
    /// Hierarchical form: old samples are grouped in generations; a rebuild adds one
    /// generation (the chunk heavy hitters) and only merges f = ceil(s/2) generations of
    /// the same level into one of the next level, keeping every f-th. The rebuild fires
    /// when the newly evicted tokens exceed T, so the sample region grows O(log n).
    bool log_n = false;
    /// Reference-exact timing (off by default): the head may hold S + W + T + 1 rows, so the
    /// token that pushes the sample region past T is appended and attended over the full
    /// cache first, and the rebuild runs when the next token arrives, over the cached rows
    /// only (window = the last W cached rows). The chunk argmax then counts the triggering
    /// token's attention, as the reference's rebuild after attention does, and every query
    /// attends over exactly the reference's rows. Bounded form only (excludes budget_mode
    /// and log_n); between the triggering step and the next append the head holds the
    /// not-yet-rebuilt S + W + T + 1 rows (the reference's transient peak).
    bool reference_timing = false;
  };

  /// W and T that budget mode uses for a head of `capacity` rows: the reference's
  /// proportion W : T = 160 : 400 = 2 : 5 of what the sinks leave, W = floor(2 (C - S) / 7)
  /// clamped to [1, C - S - 2], T = C - S - W (so C = 564, S = 4 gives 160 and 400).
  struct Split {
    std::size_t window = 0;
    std::size_t threshold = 0;
  };
  [[nodiscard]] static Split window_for_budget(std::size_t capacity, std::size_t sinks) {
    kvevict::detail::require(capacity >= sinks + 3 && capacity != Budget::kUnbounded,
                             "BuzzBeehive: budget of ", capacity, " tokens with ", sinks,
                             " sinks, expected a finite budget >= sinks + 3");
    const std::size_t rest = capacity - sinks;
    const std::size_t w = std::clamp<std::size_t>(2 * rest / 7, 1, rest - 2);
    return {w, rest - w};
  }

  /// One generation of old samples (log-n form): the rows with sinks <= seq in
  /// [begin, next generation's begin), thinned `level` times beyond the chunk selection.
  struct Generation {
    std::uint64_t begin = 0;
    unsigned level = 0;
  };

  KVEVICT_DEFER BuzzBeehive() : BuzzBeehive(Config{}) {}
  KVEVICT_DEFER explicit BuzzBeehive(Config c) : cfg_(c) {
    kvevict::detail::require(c.window >= 1, "BuzzBeehive: window = ", c.window,
                             ", expected >= 1 (the incoming token is in the window)");
    kvevict::detail::require(
        c.stride >= 3, "BuzzBeehive: stride = ", c.stride,
        ", expected >= 3 (with s <= 2 old samples are never thinned and a rebuild "
        "cannot free rows)");
    kvevict::detail::require(c.budget_mode || c.threshold >= 2,
                             "BuzzBeehive: threshold = ", c.threshold,
                             ", expected >= 2 (a rebuild of T + 1 tokens must keep at most T)");
    kvevict::detail::require(
        !(c.budget_mode && c.log_n),
        "BuzzBeehive: budget_mode and log_n both set, expected at most one (the "
        "log-n form grows past any fixed split of the budget)");
    kvevict::detail::require(
        !(c.reference_timing && (c.budget_mode || c.log_n)),
        "BuzzBeehive: reference_timing with budget_mode = ", c.budget_mode, ", log_n = ", c.log_n,
        "; expected neither (the reference timing is defined for the bounded form)");
    // min_capacity (S + 3, or S + W + 2) and the row limit S + W + T must not wrap.
    if (c.budget_mode)
      (void)detail::protected_plus_one(name(), {{"sinks", c.sinks}, {"window and threshold", 2}});
    else
      (void)detail::protected_plus_one(
          name(), {{"sinks", c.sinks}, {"window", c.window}, {"threshold", c.threshold}});
  }

  static constexpr Signals signals = Signals::attention;
  static constexpr const char* name() { return "BuzzBeehive"; }
  /// Never reads stored keys/values: IndexCache need not gather them.
  static constexpr bool reads_stored_rows = false;
  [[nodiscard]] const Config& config() const { return cfg_; }
  [[nodiscard]] std::size_t thin_stride() const { return (cfg_.stride + 1) / 2; }

  /// Budget mode: S + 3 (W = 1, T = 2). Otherwise S + W + 2: a capacity below S + W + T
  /// caps the threshold at C - S - W, which must stay >= 2.
  [[nodiscard]] std::size_t min_capacity() const {
    return cfg_.budget_mode ? cfg_.sinks + 3 : cfg_.sinks + cfg_.window + 2;
  }
  KVEVICT_DEFER void check_budget(const CacheShape& shape) const {
    if (cfg_.log_n) {
      // row_limit adds a head's old samples (at most its capacity) to S + W + T (+ 1):
      // that sum must not wrap for any finite capacity (unbounded: samples <= rows held).
      for (std::size_t c : shape.capacity)
        if (c != Budget::kUnbounded)
          (void)kvevict::detail::checked_add(base_limit(), c,
                                             "BuzzBeehive log_n: sinks + window + threshold + a "
                                             "head's capacity (its largest old-sample count)");
    }
    if (!cfg_.budget_mode) return;
    for (std::size_t c : shape.capacity)
      kvevict::detail::require(c != Budget::kUnbounded,
                               "BuzzBeehive: budget_mode with an unbounded budget, expected a "
                               "token budget to derive window and threshold from");
  }
  KVEVICT_LAZY void bind(const CacheShape& shape);

  /// S + W + T, + 1 with reference timing (the constructor checked it does not wrap).
  [[nodiscard]] std::size_t base_limit() const {
    return cfg_.sinks + cfg_.window + cfg_.threshold + (cfg_.reference_timing ? 1 : 0);
  }
  /// The rebuild trigger as a row bound: S + W + T rows (+ the old samples in the log-n
  /// form) means the sample region, counting the row that leaves the window when the next
  /// token arrives, holds T + 1. Budget mode relies on the capacity (S + W + T = C).
  [[nodiscard]] std::size_t row_limit(int layer, int kv_head) const {
    if (cfg_.budget_mode) return Budget::kUnbounded;
    // Reference timing: one row more, the token that triggers the rebuild (see Config).
    const std::size_t base = base_limit();
    return cfg_.log_n ? kvevict::detail::checked_add(base, head(layer, kv_head).samples,
                                                     "BuzzBeehive log_n row limit: S + W + T + old samples")
                      : base;
  }

  template <class S>
  void choose_victims(const HeadView<S>& v, std::vector<std::uint32_t>& out) {
    const Split p = cfg_.budget_mode ? window_for_budget(v.capacity, cfg_.sinks)
                                     : Split{cfg_.window, cfg_.threshold};
    HeadState& st = head(v.layer, v.kv_head);
    auto& sc = scores_.of(v.layer, v.kv_head);
    const std::uint64_t inc = v.incoming_seq;
    // Default: the incoming token counts in the window. Reference timing: the window is the
    // last W cached rows, the incoming token arrives after the rebuild.
    const std::uint64_t win_end = cfg_.reference_timing ? inc : inc + 1;
    const std::uint64_t win_begin = win_end > p.window ? win_end - p.window : 0;

    // The sample region in arrival order; sinks' scores restart at 0 on every rebuild.
    region_.clear();
    for (std::size_t r = 0; r < v.size; ++r) {
      const std::uint64_t q = v.seqs[r];
      if (q < cfg_.sinks)
        sc[r] = 0.0f;
      else if (q < win_begin)
        region_.push_back({q, static_cast<std::uint32_t>(r)});
    }
    std::sort(region_.begin(), region_.end(),
              [](const Item& a, const Item& b) { return a.seq < b.seq; });
    const auto first_new = static_cast<std::size_t>(
        std::partition_point(region_.begin(), region_.end(),
                             [&](const Item& it) { return it.seq < st.boundary; }) -
        region_.begin());
    victim_.assign(v.size, 0);
    const std::size_t before = out.size();
    auto evict = [&](const Item& it) {
      victim_[it.row] = 1;
      out.push_back(it.row);
    };

    if (cfg_.log_n)
      thin_generations(st, first_new, evict);
    else
      keep_every(region_.begin(), region_.begin() + static_cast<std::ptrdiff_t>(first_new),
                 thin_stride(), evict);
    for (std::size_t i = 0; i < first_new; ++i)
      if (!victim_[region_[i].row]) sc[region_[i].row] = 0.0f;  // old samples restart at 0

    // Segmented heavy hitters: one per chunk of `stride` newly evicted tokens, oldest
    // chunk first, the last one possibly short; ties go to the earliest token.
    for (std::size_t c = first_new; c < region_.size(); c += cfg_.stride) {
      const std::size_t end = std::min(region_.size(), c + cfg_.stride);
      std::size_t best = c;
      for (std::size_t i = c + 1; i < end; ++i)
        if (sc[region_[i].row] > sc[region_[best].row]) best = i;
      for (std::size_t i = c; i < end; ++i)
        if (i != best) evict(region_[i]);
    }
    if (cfg_.log_n && first_new < region_.size()) st.gens.push_back({st.boundary, 0});
    st.boundary = std::max(st.boundary, win_begin);
    ++st.rebuilds;

    // A capped log-n head thins all its generations once more (the bounded rule).
    if (cfg_.log_n)
      while (out.size() - before < v.need && collapse_generations(st, first_new, evict)) {
      }
    // Only a budget shrink (set_budget) can ask for more than the rule frees: drop the
    // oldest remaining non-sink rows, samples before window.
    if (out.size() - before < v.need) {
      fallback_.clear();
      for (std::size_t r = 0; r < v.size; ++r)
        if (!victim_[r] && v.seqs[r] >= cfg_.sinks)
          fallback_.push_back({v.seqs[r], static_cast<std::uint32_t>(r)});
      std::sort(fallback_.begin(), fallback_.end(),
                [](const Item& a, const Item& b) { return a.seq < b.seq; });
      for (std::size_t i = 0; i < fallback_.size() && out.size() - before < v.need; ++i)
        evict(fallback_[i]);
    }
    st.samples = 0;
    for (const Item& it : region_) st.samples += victim_[it.row] ? 0 : 1;
    if (cfg_.log_n) drop_empty_generations(st);
  }

  template <class S>
  void on_append(const HeadView<S>& v, std::size_t row) {
    scores_.set(v.layer, v.kv_head, row, 0.0f);  // the reference starts new tokens at 0 too
  }
  KVEVICT_DEFER void on_move(int layer, int kv_head, std::size_t from, std::size_t to) {
    scores_.move(layer, kv_head, from, to);
  }
  /// H2O-style accumulation: the G query heads' probabilities summed, then added.
  KVEVICT_DEFER void observe(const AttentionView& a) {
    float* sc = scores_.of(a.layer, a.kv_head).data();
    const std::size_t n = a.size;
    // Group sum first (the container's one checked pass), then one add per row, as the
    // reference.
    const float* s = detail::group_sums(a, sum_);
    for (std::size_t r = 0; r < n; ++r) sc[r] += s[r];
  }

  /// Serialisation hooks (serialize.hpp): the shape, each head's rebuild state, the scores.
  KVEVICT_LAZY void save_state(std::vector<std::uint8_t>& out) const;
  KVEVICT_LAZY void load_state(std::span<const std::uint8_t> in);

  // --- inspection (tests, benchmarks, reports) -----------------------------------------
  /// Accumulated score of each live row, in row order.
  [[nodiscard]] const std::vector<float>& scores(int layer, int kv_head) const {
    return scores_.of(layer, kv_head);
  }
  [[nodiscard]] std::size_t rebuilds(int layer, int kv_head) const {
    return head(layer, kv_head).rebuilds;
  }
  /// Live old samples (rows kept by earlier rebuilds).
  [[nodiscard]] std::size_t samples(int layer, int kv_head) const {
    return head(layer, kv_head).samples;
  }
  /// Log-n form: the generations of old samples, oldest first.
  [[nodiscard]] const std::vector<Generation>& generations(int layer, int kv_head) const {
    return head(layer, kv_head).gens;
  }

 private:
  struct Item {
    std::uint64_t seq;
    std::uint32_t row;
  };
  struct HeadState {
    std::uint64_t boundary = 0;  // old samples: sinks <= seq < boundary
    std::size_t samples = 0;
    std::size_t rebuilds = 0;
    std::vector<Generation> gens;  // log-n form only
  };

  // Mode bits carried by save_state: a state only loads into a policy of the same form.
  [[nodiscard]] std::uint8_t flags() const {
    return static_cast<std::uint8_t>(int{cfg_.budget_mode} | (int{cfg_.log_n} << 1) |
                                     (int{cfg_.reference_timing} << 2));
  }

  // Keeps items first, first + f, first + 2f, ... of [first, last); evicts the rest.
  template <class It, class Evict>
  static void keep_every(It first, It last, std::size_t f, Evict&& evict) {
    std::size_t i = 0;
    for (It it = first; it != last; ++it, ++i)
      if (i % f != 0) evict(*it);
  }

  // Range of region_ indices [lo, hi) holding generation g's live rows (old part only).
  std::pair<std::size_t, std::size_t> members(const HeadState& st, std::size_t g,
                                              std::size_t first_new) const {
    auto seq_at = [&](std::uint64_t s) {
      return static_cast<std::size_t>(
          std::partition_point(region_.begin(),
                               region_.begin() + static_cast<std::ptrdiff_t>(first_new),
                               [&](const Item& it) { return it.seq < s; }) -
          region_.begin());
    };
    const std::size_t lo = seq_at(st.gens[g].begin);
    const std::size_t hi = g + 1 < st.gens.size() ? seq_at(st.gens[g + 1].begin) : first_new;
    return {lo, hi};
  }

  // Thins the rows of generations [g, g + count) as one and replaces them by a single
  // generation of `level`. Rows already evicted in this rebuild are skipped.
  template <class Evict>
  void merge(HeadState& st, std::size_t g, std::size_t count, unsigned level, std::size_t first_new,
             Evict& evict) {
    const std::size_t lo = members(st, g, first_new).first;
    const std::size_t hi = members(st, g + count - 1, first_new).second;
    std::size_t i = 0;
    for (std::size_t k = lo; k < hi; ++k) {
      if (victim_[region_[k].row]) continue;
      if (i++ % thin_stride() != 0) evict(region_[k]);
    }
    st.gens[g].level = level;
    st.gens.erase(st.gens.begin() + static_cast<std::ptrdiff_t>(g + 1),
                  st.gens.begin() + static_cast<std::ptrdiff_t>(g + count));
  }

  // Carry, as in a base-f counter: whenever f generations share a level, merge them into
  // one of the next level. Runs before the new generation is pushed, so fresh heavy
  // hitters survive one period unthinned, as in the bounded form.
  template <class Evict>
  void thin_generations(HeadState& st, std::size_t first_new, Evict& evict) {
    const std::size_t f = thin_stride();
    for (unsigned level = 0;; ++level) {
      std::size_t first = 0, count = 0;
      for (std::size_t g = 0; g < st.gens.size(); ++g)
        if (st.gens[g].level == level && count++ == 0) first = g;
      // Levels fall from oldest to newest, so a level's generations are adjacent.
      if (count >= f) merge(st, first, f, level + 1, first_new, evict);
      unsigned top = 0;
      for (const auto& gen : st.gens) top = std::max(top, gen.level);
      if (top <= level) break;
    }
  }

  // Budget-capped log-n head: thin every old generation once more, as one generation.
  template <class Evict>
  bool collapse_generations(HeadState& st, std::size_t first_new, Evict& evict) {
    const std::size_t old = st.gens.size() - (first_new < region_.size() ? 1 : 0);
    std::size_t live = 0;
    for (std::size_t i = 0; i < first_new; ++i) live += victim_[region_[i].row] ? 0 : 1;
    if (old == 0 || live <= 1) return false;
    unsigned top = 0;
    for (std::size_t g = 0; g < old; ++g) top = std::max(top, st.gens[g].level);
    merge(st, 0, old, top + 1, first_new, evict);
    return true;
  }

  KVEVICT_LAZY void drop_empty_generations(HeadState& st);

  HeadState& head(int layer, int kv_head) {
    return heads_[static_cast<std::size_t>(layer) * static_cast<std::size_t>(n_kv_heads_) +
                  static_cast<std::size_t>(kv_head)];
  }
  const HeadState& head(int layer, int kv_head) const {
    return heads_[static_cast<std::size_t>(layer) * static_cast<std::size_t>(n_kv_heads_) +
                  static_cast<std::size_t>(kv_head)];
  }

  Config cfg_;
  int n_kv_heads_ = 1;
  detail::RowColumn<float> scores_;
  std::vector<HeadState> heads_;
  std::vector<Item> region_, fallback_;  // scratch, reused across rebuilds
  std::vector<char> victim_;
  std::vector<float> sum_;
};

// BuzzBeehive's members whose bodies instantiate standard templates (the per-head state
// vectors): KVEVICT_LAZY header-only, in kvevict_kernels in separate-kernels mode (config.hpp).
#if !KVEVICT_KERNELS_DECLARE_ONLY
KVEVICT_LAZY_DEF KVEVICT_KERNEL_FN void BuzzBeehive::bind(const CacheShape& shape) {
  check_budget(shape);
  scores_.bind(shape);
  heads_.assign(shape.capacity.size(), {});
  n_kv_heads_ = shape.geometry.n_kv_heads;
}

KVEVICT_LAZY_DEF KVEVICT_KERNEL_FN void BuzzBeehive::save_state(std::vector<std::uint8_t>& out) const {
  kvevict::detail::ByteWriter w(out);
  for (std::size_t x : {cfg_.sinks, cfg_.window, cfg_.threshold, cfg_.stride})
    w.put<std::uint64_t>(x);
  w.put<std::uint8_t>(flags());
  w.put<std::uint64_t>(heads_.size());
  for (const HeadState& h : heads_) {
    w.put<std::uint64_t>(h.boundary);
    w.put<std::uint64_t>(h.samples);
    w.put<std::uint64_t>(h.rebuilds);
    w.put<std::uint64_t>(h.gens.size());
    for (const Generation& g : h.gens) {
      w.put<std::uint64_t>(g.begin);
      w.put<std::uint32_t>(g.level);
    }
  }
  scores_.save(w);
}

KVEVICT_LAZY_DEF KVEVICT_KERNEL_FN void BuzzBeehive::load_state(std::span<const std::uint8_t> in) {
  kvevict::detail::ByteReader r(in);
  std::size_t saved[4];
  for (auto& x : saved) x = static_cast<std::size_t>(r.get<std::uint64_t>("BUZZ shape"));
  const auto saved_flags = r.get<std::uint8_t>("BUZZ flags");
  kvevict::detail::require(
      saved[0] == cfg_.sinks && saved[1] == cfg_.window && saved[2] == cfg_.threshold &&
          saved[3] == cfg_.stride && saved_flags == flags(),
      "BuzzBeehive state: saved with sinks ", saved[0], ", window ", saved[1], ", threshold ",
      saved[2], ", stride ", saved[3], ", flags ", int{saved_flags}, "; expected ", cfg_.sinks, ", ",
      cfg_.window, ", ", cfg_.threshold, ", ", cfg_.stride, ", ", int{flags()},
      " (flags: 1 budget_mode, 2 log_n, 4 reference_timing)");
  const auto n = r.get<std::uint64_t>("BUZZ head count");
  kvevict::detail::require(n == heads_.size(), "BuzzBeehive state: ", n, " heads, expected ",
                           heads_.size());
  std::vector<HeadState> fresh(heads_.size());
  for (std::size_t i = 0; i < fresh.size(); ++i) {
    HeadState& h = fresh[i];
    h.boundary = r.get<std::uint64_t>("BUZZ boundary");
    h.samples = static_cast<std::size_t>(r.get<std::uint64_t>("BUZZ samples"));
    h.rebuilds = static_cast<std::size_t>(r.get<std::uint64_t>("BUZZ rebuilds"));
    // Counters consistent with the restored rows (on_append ran over them first).
    const std::size_t rows = scores_.of(static_cast<int>(i / static_cast<std::size_t>(n_kv_heads_)),
                                        static_cast<int>(i % static_cast<std::size_t>(n_kv_heads_)))
                                 .size();
    kvevict::detail::require(h.samples <= rows, "BuzzBeehive state: head ", i, " has ", h.samples,
                             " old samples, expected <= its ", rows, " rows");
    const auto gens = r.get<std::uint64_t>("BUZZ generations");
    kvevict::detail::require(gens <= r.remaining() / 12, "BuzzBeehive state: ", gens,
                             " generations, more than the input holds");
    for (std::uint64_t g = 0; g < gens; ++g) {
      const auto begin = r.get<std::uint64_t>("BUZZ generation begin");
      const auto level = r.get<std::uint32_t>("BUZZ generation level");
      kvevict::detail::require((h.gens.empty() || begin >= h.gens.back().begin) && begin <= h.boundary,
                               "BuzzBeehive state: head ", i, " generation ", g, " begins at ",
                               begin, ", expected non-decreasing and <= the boundary ", h.boundary);
      h.gens.push_back({begin, level});
    }
  }
  scores_.load(r, name(), [](float x) { return std::isfinite(x) && x >= 0.0f; });
  kvevict::detail::require(r.remaining() == 0, "BuzzBeehive state: ", r.remaining(),
                           " trailing bytes");
  heads_.swap(fresh);
}

KVEVICT_LAZY_DEF KVEVICT_KERNEL_FN void BuzzBeehive::drop_empty_generations(HeadState& st) {
  // A generation whose rows all left (fallback) only costs bookkeeping; drop it.
  std::vector<Generation> kept;
  for (std::size_t g = 0; g < st.gens.size(); ++g) {
    const std::uint64_t end = g + 1 < st.gens.size() ? st.gens[g + 1].begin : st.boundary;
    bool any = false;
    for (const Item& it : region_)
      if (it.seq >= st.gens[g].begin && it.seq < end && !victim_[it.row]) {
        any = true;
        break;
      }
    if (any) kept.push_back(st.gens[g]);
  }
  if (!kept.empty()) kept.front().begin = std::min(kept.front().begin, st.gens.front().begin);
  st.gens.swap(kept);
}
#endif  // !KVEVICT_KERNELS_DECLARE_ONLY

}  // namespace kvevict::policies
