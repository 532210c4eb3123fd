#pragma once
// Model geometry and token budgets. Budgets are token counts per (layer, KV head);
// ratios are sugar that resolve to counts once the context length is known.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "errors.hpp"

namespace kvevict {

/// Shape of the attention stack the cache serves. GQA: n_heads query heads share
/// n_kv_heads key/value heads in groups of group() = n_heads / n_kv_heads.
struct Geometry {
  int n_layers = 0;
  int n_heads = 0;     ///< query heads H
  int n_kv_heads = 0;  ///< key/value heads Hkv
  int head_dim = 0;    ///< d

  /// 0 for a geometry without KV heads (the all-zero geometry of a moved-from cache), so
  /// no caller divides by zero before its own check names the problem.
  [[nodiscard]] int group() const { return n_kv_heads > 0 ? n_heads / n_kv_heads : 0; }

  KVEVICT_DEFER void validate() const {
    detail::require(n_layers > 0, "geometry: n_layers = ", n_layers, ", expected > 0");
    detail::require(n_heads > 0, "geometry: n_heads = ", n_heads, ", expected > 0");
    detail::require(n_kv_heads > 0, "geometry: n_kv_heads = ", n_kv_heads, ", expected > 0");
    detail::require(head_dim > 0, "geometry: head_dim = ", head_dim, ", expected > 0");
    detail::require(n_heads % n_kv_heads == 0, "geometry: n_heads = ", n_heads,
                    " is not a multiple of n_kv_heads = ", n_kv_heads);
    // Upper bounds, so an absurd shape is named here instead of surfacing as bad_alloc or
    // an int overflow later; each is far above any real model (Llama 3.1 405B: 126 layers
    // x 8 KV heads, 128 heads x 128 dims).
    detail::require(n_layers <= kMaxExtent && n_heads <= kMaxExtent && head_dim <= kMaxExtent,
                    "geometry: (layers ", n_layers, ", heads ", n_heads, ", head_dim ", head_dim,
                    "), expected each <= ", kMaxExtent);
    const long long heads = static_cast<long long>(n_layers) * n_kv_heads;
    detail::require(heads <= kMaxCacheHeads, "geometry: n_layers x n_kv_heads = ", n_layers,
                    " x ", n_kv_heads, " = ", heads, ", expected <= ", kMaxCacheHeads);
    const long long width = static_cast<long long>(n_heads) * head_dim;
    detail::require(width <= kMaxTokenWidth, "geometry: n_heads x head_dim = ", n_heads, " x ",
                    head_dim, " = ", width, ", expected <= ", kMaxTokenWidth);
  }
  static constexpr int kMaxExtent = 1 << 16;               ///< layers, heads, head_dim each
  static constexpr long long kMaxCacheHeads = 1 << 20;     ///< n_layers x n_kv_heads
  static constexpr long long kMaxTokenWidth = 1 << 24;     ///< n_heads x head_dim (one token)
  friend bool operator==(const Geometry&, const Geometry&) = default;
};

/// Options of Budget::pooled(): run-time per-head budgets inside a fixed layer total
/// (AdaKV-style; docs/ARCHITECTURE.md, "Budgets").
struct PoolOptions {
  /// What a policy sees as a head's capacity (HeadView::capacity) under a pooled budget.
  enum class Capacity {
    nominal,  ///< the budget's per-head count (protected band, decay, reserve as unpooled)
    share,    ///< the head's current rows (at least its floor): its band, decay and reserve
              ///< follow its share, so a head that gives rows up also protects fewer;
              ///< during set_budget the new nominal count (the rows held then may be far
              ///< above the new pool, and protecting by them could exceed it)
  };
  /// Rows every KV head keeps at least, as a fraction of its nominal capacity (AdaKV's
  /// safeguard); the policy's protected rows (min_capacity()) are kept in any case.
  double floor_fraction = 0.0;
  Capacity capacity = Capacity::nominal;
  /// Where rows move. layer: between the KV heads of one layer, each layer's total fixed
  /// (AdaKV). model: between every (layer, KV head) of the cache at a fixed cache total, so
  /// a step of layer l may evict rows of other layers (KVCache and PagedCache; IndexCache
  /// refuses it, its engine locates only the stepping layer's rows).
  enum class Scope { layer, model };
  Scope scope = Scope::layer;
  /// Share-scaled costs: before the pool compares them, each head's finite costs are
  /// multiplied by (rows it holds / its nominal count)^share_exponent. A head's attention
  /// is renormalised over the rows it holds, so the same row draws a larger share in a
  /// head that gave rows up than it would in a fuller one; this undoes part of that, and
  /// the split follows the heads' use further. 0 (the default): the policy's costs as
  /// they are. Rows the policy marks +infinity or FLT_MAX (its reserve) keep their cost,
  /// so the order within a head, and the head's own choice of victims, do not change.
  double share_exponent = 0.0;
  /// Amortised split: the pool's split between its heads is re-decided (the cross-head
  /// selection above) on every rebalance_every-th step of the pool only; on the other steps
  /// it is frozen: each head of the stepping layer gives up one row by its policy's own
  /// choose_victims (need 1, the capacity it sees as above), as under a uniform budget
  /// whose capacity is the rows the head holds, so such a step costs about a uniform one.
  /// Steps of a pool: each append of a token (decode or token-by-token prefill) to its
  /// layer (Scope::model: to any layer), counted from 0 since the budget took effect
  /// (construction or set_budget). Step k re-splits when k % rebalance_every == 0, and
  /// whenever the frozen split cannot hold the pool's rules: the pool not yet full (its
  /// rows + the incoming ones not exactly total + the incoming ones), or a head of the
  /// stepping layer holding no row, fewer rows than its floor or more than its ceiling.
  /// 1 (the default): every step re-splits (as before). In [1, 2^20].
  /// Measured on stories260K (docs/quality.md, "Pooled split re-decided every R steps"):
  /// every R > 1 tried (4-64) loses most of the run-time gain, and at 16 rows is worse than
  /// the uniform budget; it cuts the step's cost, not recommended for quality. With
  /// Frozen::schedule (below) and rebalance_fraction 1/40 it keeps most of the gain (stop 40).
  std::size_t rebalance_every = 1;
  /// What a frozen step of the amortised split (rebalance_every > 1) evicts.
  enum class Frozen {
    own,       ///< each head of the stepping layer gives up one row by its own choice (above)
    schedule,  ///< an eviction schedule: a re-split step also keeps, in the pool's order
               ///< (cost, seq, head), the next (rebalance_every - 1) x n_kv_heads cheapest
               ///< rows of the pool after its own victims (each head at most down to its
               ///< floor), as the heads they belong to; each frozen step takes the next
               ///< entries of that list, one per incoming row (an entry whose head would
               ///< go below its floor, or give its last row, is skipped), and every head so
               ///< named gives up that many rows by its policy's choose_victims, as on a
               ///< re-split step (Scope::model: rows of any layer). Rows move between the
               ///< heads as every step's split moves them, from costs at most
               ///< rebalance_every steps old. A step re-splits as above, and also when the
               ///< list runs out.
  };
  Frozen frozen = Frozen::own;
  /// The amortised split's interval in proportion to the pool: when > 0, rebalance_every
  /// is not used and each pool re-splits every max(1, floor(rebalance_fraction x its total
  /// / n_kv_heads)) steps, i.e. once its frozen steps have taken in about that fraction of
  /// its rows (a step adds n_kv_heads rows). A fixed R is a larger share of a small pool's
  /// rows, so its costs go stale faster there. In [0, 1]; 0 (the default): rebalance_every.
  /// Measured on stories260K with Frozen::schedule (docs/quality.md, "An eviction schedule
  /// for the amortised split, stop 40").
  double rebalance_fraction = 0.0;
  /// With rebalance_fraction > 0: a pool whose interval from the fraction comes out below
  /// rebalance_min steps re-splits on every step instead (R = 1), so a small pool, whose
  /// costs go stale within a few steps, keeps the every-step split while a large one
  /// amortises it. In [0, 2^20]; 0 (the default) and 1: no such rule. Measured on
  /// stories260K (docs/quality.md, "The pooled schedule, stop 41").
  std::size_t rebalance_min = 0;

  /// The run-time per-head split kvevict recommends for DecayedAttention::recommended() and
  /// its variants: one pool for the whole cache (Scope::model), each head's band, decay and
  /// reserve following its share (Capacity::share), a floor of 1/4 of the nominal rows,
  /// share-scaled costs (e = 1/2), and the split re-decided once the eviction schedule's
  /// frozen steps took in 1/20 of the pool's rows, every step for a pool whose interval
  /// comes out below 9 steps. Each setting was chosen on stories260K's tuning streams
  /// (docs/quality.md, "The pooled schedule, stop 41", and the sections it cites); held out
  /// it gets 53 / 101 / 98 / 90% of the calibrated per-head gain over uniform budgets at
  /// 16 / 32 / 64 / 128 rows, and its step's cost is measured in docs/benchmarks.md
  /// ("Quiet run after stop 44's merges"). For a per-layer pool (AdaKV's form,
  /// each layer's total fixed) set `scope = Scope::layer` on the result.
  static constexpr PoolOptions recommended() {
    PoolOptions o;
    o.floor_fraction = 0.25;
    o.capacity = Capacity::share;
    o.scope = Scope::model;
    o.share_exponent = 0.5;
    o.frozen = Frozen::schedule;
    o.rebalance_fraction = 1.0 / 20;
    o.rebalance_min = 9;
    return o;
  }
};

/// Rows a cache may hold: one count per (layer, KV head). `unbounded()` is the full cache.
class Budget {
 public:
  static constexpr std::size_t kUnbounded = std::numeric_limits<std::size_t>::max();

  /// No limit: every appended row is kept (the full-cache reference).
  static Budget unbounded() { return Budget(Kind::unbounded, {}, {}); }

  /// The same token count for every layer and KV head.
  static Budget uniform(long long tokens) {
    check_count(tokens, "budget");
    return Budget(Kind::uniform, {static_cast<std::size_t>(tokens)}, {});
  }

  /// One token count per layer (shared by that layer's KV heads).
  KVEVICT_DEFER static Budget per_layer(const std::vector<long long>& tokens) {
    detail::require(!tokens.empty(), "budget: per-layer vector is empty, expected one entry per layer");
    std::vector<std::size_t> v;
    for (std::size_t l = 0; l < tokens.size(); ++l) {
      check_count(tokens[l], "budget for layer ", l);
      v.push_back(static_cast<std::size_t>(tokens[l]));
    }
    return Budget(Kind::per_layer, std::move(v), {});
  }

  /// One token count per (layer, KV head): tokens[layer][kv_head].
  KVEVICT_DEFER static Budget per_head(const std::vector<std::vector<long long>>& tokens) {
    detail::require(!tokens.empty(), "budget: per-head table is empty, expected one row per layer");
    std::vector<std::size_t> v;
    std::vector<std::size_t> widths;
    for (std::size_t l = 0; l < tokens.size(); ++l) {
      widths.push_back(tokens[l].size());
      for (std::size_t h = 0; h < tokens[l].size(); ++h) {
        check_count(tokens[l][h], "budget for layer ", l, " KV head ", h);
        v.push_back(static_cast<std::size_t>(tokens[l][h]));
      }
    }
    return Budget(Kind::per_head, std::move(v), std::move(widths));
  }

  /// Sugar: a fraction of a context length, rounded to nearest, at least one token.
  KVEVICT_DEFER static Budget ratio(double fraction, long long context_tokens) {
    detail::require(std::isfinite(fraction) && fraction > 0.0 && fraction <= 1.0,
                    "budget: ratio = ", fraction, ", expected in (0, 1]");
    detail::require(context_tokens > 0, "budget: context length = ", context_tokens,
                    ", expected > 0");
    auto t = static_cast<long long>(std::llround(fraction * static_cast<double>(context_tokens)));
    return uniform(t < 1 ? 1 : t);
  }

  [[nodiscard]] bool is_unbounded() const { return kind_ == Kind::unbounded; }

  /// The same capacities, pooled: a layer (PoolOptions::Scope::layer) or the whole cache
  /// (Scope::model) holds at most the sum of its KV heads' capacities, and how those rows
  /// split between the heads moves at run time. When a step would take the pool over its
  /// total, the victims are chosen across all its heads by the policy's comparable eviction
  /// cost (the `eviction_costs` hook: DecayedAttention, H2O, ExpectedAttention);
  /// a policy without that hook keeps the nominal per-head capacities (the same decisions
  /// as without pooling). The nominal capacity is what a policy sees as
  /// HeadView::capacity (its protected band, decay and reserve follow it).
  KVEVICT_DEFER [[nodiscard]] Budget pooled(PoolOptions o = {}) const {
    detail::require(kind_ != Kind::unbounded,
                    "budget: pooled() of an unbounded budget, expected a finite budget");
    detail::require(std::isfinite(o.floor_fraction) && o.floor_fraction >= 0.0 &&
                        o.floor_fraction <= 1.0,
                    "budget: pooled floor_fraction = ", o.floor_fraction, ", expected in [0, 1]");
    detail::require(o.capacity == PoolOptions::Capacity::nominal ||
                        o.capacity == PoolOptions::Capacity::share,
                    "budget: pooled capacity = ", static_cast<int>(o.capacity),
                    ", expected PoolOptions::Capacity::nominal or share");
    detail::require(o.scope == PoolOptions::Scope::layer || o.scope == PoolOptions::Scope::model,
                    "budget: pooled scope = ", static_cast<int>(o.scope),
                    ", expected PoolOptions::Scope::layer or model");
    detail::require(std::isfinite(o.share_exponent) && o.share_exponent >= 0.0 &&
                        o.share_exponent <= 8.0,
                    "budget: pooled share_exponent = ", o.share_exponent, ", expected in [0, 8]");
    detail::require(o.rebalance_every >= 1 && o.rebalance_every <= (std::size_t{1} << 20),
                    "budget: pooled rebalance_every = ", o.rebalance_every, ", expected in [1, 2^20]");
    detail::require(std::isfinite(o.rebalance_fraction) && o.rebalance_fraction >= 0.0 &&
                        o.rebalance_fraction <= 1.0,
                    "budget: pooled rebalance_fraction = ", o.rebalance_fraction, ", expected in [0, 1]");
    detail::require(o.rebalance_min <= (std::size_t{1} << 20),
                    "budget: pooled rebalance_min = ", o.rebalance_min, ", expected in [0, 2^20]");
    detail::require(o.frozen == PoolOptions::Frozen::own || o.frozen == PoolOptions::Frozen::schedule,
                    "budget: pooled frozen = ", static_cast<int>(o.frozen),
                    ", expected PoolOptions::Frozen::own or schedule");
    Budget b = *this;
    b.pooled_ = true;
    b.pool_ = o;
    return b;
  }
  [[nodiscard]] bool is_pooled() const { return pooled_; }
  [[nodiscard]] const PoolOptions& pool_options() const { return pool_; }

  /// Checks the budget against a geometry (layer count, KV heads per layer).
  KVEVICT_DEFER void validate(const Geometry& g) const {
    if (kind_ == Kind::per_layer) {
      detail::require(counts_.size() == static_cast<std::size_t>(g.n_layers),
                      "budget: per-layer vector has ", counts_.size(), " entries, expected ",
                      g.n_layers, " (one per layer)");
    } else if (kind_ == Kind::per_head) {
      detail::require(widths_.size() == static_cast<std::size_t>(g.n_layers),
                      "budget: per-head table has ", widths_.size(), " rows, expected ",
                      g.n_layers, " (one per layer)");
      for (std::size_t l = 0; l < widths_.size(); ++l)
        detail::require(widths_[l] == static_cast<std::size_t>(g.n_kv_heads),
                        "budget: per-head table row ", l, " has ", widths_[l],
                        " entries, expected ", g.n_kv_heads, " (one per KV head)");
    }
  }

  /// Capacity in rows of (layer, kv_head); validate() first.
  [[nodiscard]] std::size_t capacity(int layer, int kv_head, int n_kv_heads) const {
    switch (kind_) {
      case Kind::unbounded: return kUnbounded;
      case Kind::uniform: return counts_[0];
      case Kind::per_layer: return counts_[static_cast<std::size_t>(layer)];
      case Kind::per_head:
        return counts_[static_cast<std::size_t>(layer) * static_cast<std::size_t>(n_kv_heads) +
                       static_cast<std::size_t>(kv_head)];
    }
    return kUnbounded;
  }

 private:
  enum class Kind { unbounded, uniform, per_layer, per_head };
  Budget(Kind k, std::vector<std::size_t> c, std::vector<std::size_t> w)
      : kind_(k), counts_(std::move(c)), widths_(std::move(w)) {}

  template <class... Where>
  static void check_count(long long tokens, Where&&... where) {
    detail::require(tokens > 0, std::forward<Where>(where)..., " = ", tokens,
                    " tokens, expected > 0");
  }

  Kind kind_;
  std::vector<std::size_t> counts_;
  std::vector<std::size_t> widths_;
  bool pooled_ = false;
  PoolOptions pool_{};
};

}  // namespace kvevict
