#pragma once
// Pooled budgets (Budget::pooled(), AdaKV-style, arXiv 2407.11550): a pool (one layer, or
// with PoolOptions::Scope::model the whole cache) holds at most the sum of its KV heads'
// nominal capacities, and the split between its heads moves at run time. This header holds
// the rules the container core applies (container_core.hpp runs the flow, for every
// layout):
//   - LayerPool: per pool the row total, per head a floor, a ceiling and a storage chunk;
//   - pooled_victim_counts: how many victims each head of a pool gives up, chosen across
//     the heads by the policy's comparable eviction costs (policy.hpp, HasEvictionCosts);
//   - pool_grown_rows / pool_release_rows: storage that follows a head's changing share.
//
// The selection, written out (tests/test_layer_pool.cpp checks it against a brute-force
// transcription): after the step head h holds n_h - k_h + incoming_h rows (incoming_h: 1
// for the heads of the stepping layer, 0 for other layers' heads and for a budget change).
// Every head must stay at or above min(floor_h, n_h + incoming_h) and at or below
// ceiling_h; the pool must end at or below its total. Rows with an infinite (or NaN) cost
// are never counted. A head above its ceiling first gives its cheapest rows; the rest of
// the pool's need is the cheapest rows of the whole pool, ordered by (cost, seq, head): on
// equal costs the older row, then the lower head. Only the counts k_h are decided here;
// the policy's choose_victims picks the k_h rows of each head (so its protection and
// reserve rules still hold; its optional pooled_victims makes the same choice reusing the
// protection of the eviction_costs pass).
//
// PoolOptions::rebalance_every = R > 1 (the amortised split): the selection above runs on
// step k of the pool (counted from 0 since the budget took effect; a layer pool steps when
// its layer appends, a model pool when any layer does) when k % R == 0, and whenever the
// frozen split cannot hold the rules (pool_frozen in container_core.hpp: the pool not full,
// or a stepping head empty, below its floor or above its ceiling). On the other steps each
// head of the stepping layer gives up one row by its policy's choose_victims (need 1):
// every head keeps its rows, so the pool stays at its total and no floor or ceiling moves.
// Under Capacity::nominal a head holding fewer rows than its policy's protected band sees
// every row protected; its choose_victims then takes what the policy takes when it must
// (the selection would not count those rows); Capacity::share has no such head (the
// capacity it sees is at least its floor, which is above the protected rows).
//
// PoolOptions::Frozen::schedule (the eviction schedule): a re-split step of a pool with
// R > 1 asks the selection above for `extra` = min((R - 1) x n_kv_heads, total) more rows:
// after the `need` rows of the step, the next `extra` candidates of the same order (cost,
// seq, head), each head offering at most its rows above its floor in all, kept as the list
// of their heads (pooled_victim_counts' `schedule`). A frozen step takes one entry per
// incoming row beyond what a ceiling forces (container_core.hpp, pool_schedule_counts),
// skipping an entry whose head would fall below its floor or give its last row; each head
// named gives that many rows by its choose_victims. The list runs out: the step re-splits.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "checked.hpp"
#include "errors.hpp"
#include "geometry.hpp"
#include "kernels/row_dots.hpp"

namespace kvevict::detail {

/// Storage slack of a pooled head: it grows by chunk rows past its nominal capacity and is
/// released down to size + chunk once it holds more than size + 2 x chunk, so a layer
/// allocates at most its total + 2 x the sum of its heads' chunks (about 1/8 over).
inline std::size_t pool_chunk(std::size_t nominal) { return std::max<std::size_t>(1, (nominal + 15) / 16); }

/// A pooled budget resolved against a geometry and the nominal capacities.
struct LayerPool {
  bool on = false;
  bool share = false;  ///< PoolOptions::Capacity::share: the policy sees max(floor, rows)
  bool model = false;  ///< PoolOptions::Scope::model: one pool for the whole cache
  std::vector<std::size_t> total;    ///< per pool (each layer, or the one model pool): rows
  std::vector<std::size_t> floor;    ///< per (layer, KV head): rows it keeps at least
  std::vector<std::size_t> ceiling;  ///< per (layer, KV head): rows it may hold at most
  std::vector<std::size_t> chunk;    ///< per (layer, KV head): storage growth step
  std::vector<std::size_t> nominal;  ///< per (layer, KV head): the budget's count
  double exponent = 0.0;             ///< PoolOptions::share_exponent
  std::size_t every = 1;             ///< PoolOptions::rebalance_every (per pool: every_of)
  std::vector<std::size_t> every_at; ///< per pool, from PoolOptions::rebalance_fraction (else empty)
  bool schedule = false;             ///< PoolOptions::Frozen::schedule

  /// `caps` are the nominal capacities (layer-major); `min_rows` the policy's min_capacity().
  KVEVICT_DEFER static LayerPool resolve(const Geometry& g, const Budget& b, const std::vector<std::size_t>& caps,
                           std::size_t min_rows) {
    LayerPool p;
    if (!b.is_pooled()) return p;
    p.on = true;
    p.share = b.pool_options().capacity == PoolOptions::Capacity::share;
    p.model = b.pool_options().scope == PoolOptions::Scope::model;
    const std::size_t width = p.model ? caps.size() : static_cast<std::size_t>(g.n_kv_heads);
    const double f = b.pool_options().floor_fraction;
    p.exponent = b.pool_options().share_exponent;
    p.every = b.pool_options().rebalance_every;
    p.schedule = b.pool_options().frozen == PoolOptions::Frozen::schedule;
    p.nominal = caps;
    for (std::size_t first = 0; first < caps.size(); first += width) {
      std::size_t total = 0, floors = 0;
      for (std::size_t i = first; i < first + width; ++i) {
        const std::size_t cap = caps[i];
        total = checked_add(total, cap, "budget: pooled total");
        const auto frac = static_cast<std::size_t>(std::ceil(f * static_cast<double>(cap)));
        const std::size_t fl = std::min(cap, std::max(min_rows, frac));
        p.floor.push_back(fl);
        floors += fl;
        p.chunk.push_back(pool_chunk(cap));
      }
      p.total.push_back(total);
      const double frac = b.pool_options().rebalance_fraction;
      if (frac > 0.0) {  // steps in which the frozen steps take in frac of the pool's rows
        const std::size_t every = std::max<std::size_t>(
            1, static_cast<std::size_t>(std::floor(frac * static_cast<double>(total) /
                                                   static_cast<double>(g.n_kv_heads))));
        // PoolOptions::rebalance_min: a pool this small re-splits on every step.
        p.every_at.push_back(every < b.pool_options().rebalance_min ? 1 : every);
      }
      for (std::size_t i = first; i < first + width; ++i) p.ceiling.push_back(total - (floors - p.floor[i]));
    }
    return p;
  }
  /// The re-split interval of pool `p` (PoolOptions::rebalance_every or rebalance_fraction).
  [[nodiscard]] std::size_t every_of(std::size_t p) const { return every_at.empty() ? every : every_at[p]; }
  /// The pool of `layer` (its index in total) and the heads it spans, [first, last).
  [[nodiscard]] std::size_t pool_of(int layer) const { return model ? 0 : static_cast<std::size_t>(layer); }
  [[nodiscard]] std::pair<std::size_t, std::size_t> heads_of(int layer, std::size_t hkv) const {
    if (model) return {0, floor.size()};
    const std::size_t first = static_cast<std::size_t>(layer) * hkv;
    return {first, first + hkv};
  }
  [[nodiscard]] std::size_t max_ceiling() const {
    return ceiling.empty() ? 0 : *std::max_element(ceiling.begin(), ceiling.end());
  }
};

/// PoolOptions::share_exponent: the factor (rows / nominal)^exponent scale_pool_costs
/// applies (1 when exponent is 0 or nominal 0: no scaling).
inline float pool_cost_factor(std::size_t rows, std::size_t nominal, double exponent) {
  if (exponent == 0.0 || nominal == 0) return 1.0f;
  return static_cast<float>(std::pow(static_cast<double>(rows) / static_cast<double>(nominal), exponent));
}
/// scale_pool_costs with its factor `f` from pool_cost_factor (f = 1: no change).
inline void scale_pool_costs_by(std::span<float> costs, float f) {
  if (f == 1.0f) return;
  constexpr float top = std::numeric_limits<float>::max();
  const float below = std::nextafter(top, 0.0f);
  for (float& c : costs) {  // branch-free, so it vectorises
    const float scaled = std::min(c * f, below);
    c = c < top ? scaled : c;
  }
}
/// PoolOptions::share_exponent: scales a head's `costs` (its `rows` rows) by
/// (rows / nominal)^exponent, in place. Rows at FLT_MAX or above (the policy's reserve and
/// never-evicted rows) and NaN keep their cost; a scaled cost stays below FLT_MAX, so it
/// still ranks before the reserve.
inline void scale_pool_costs(std::span<float> costs, std::size_t rows, std::size_t nominal,
                             double exponent) {
  if (costs.empty()) return;
  scale_pool_costs_by(costs, pool_cost_factor(rows, nominal, exponent));
}

/// Scratch of pooled_victim_counts (kept by the caller so a step allocates nothing new).
struct PoolScratch {
  struct Cand {
    float cost;
    std::uint64_t seq;
    std::uint32_t head;
  };
  std::vector<Cand> head_rows, chosen;
  std::vector<std::uint32_t> order;  ///< pooled_victim_counts: the heads in visiting order
  std::vector<std::uint32_t> rows;  ///< a head's rows at or below a guessed bound
  std::vector<float> bound;         ///< pool_contenders: the gathered rows' costs
  /// pooled_schedule_counts: a guess at the cost bound of the next long selection (the
  /// last one's last kept cost, 5% over; NaN: none yet), and how often the guess held
  /// (`guessed`) or the selection gathered every finite row (`rescanned`), for the tests.
  float schedule_guess = std::numeric_limits<float>::quiet_NaN();
  std::size_t guessed = 0, rescanned = 0;
  /// pooled_victim_counts under the pool bound, for the tests: heads whose rows at or below
  /// it were gathered, and heads whose kept prefix (gathered under a bound as high) held them.
  std::size_t bound_gathered = 0, bound_reused = 0;
  static bool before(const Cand& a, const Cand& b) {
    if (a.cost != b.cost) return a.cost < b.cost;
    if (a.seq != b.seq) return a.seq < b.seq;
    return a.head < b.head;
  }
  /// Keeps the `limit` first candidates (by before()) offered so far in the max-heap
  /// `heap`: false when `c` is not among them (nothing changed).
  static bool keep_first(std::vector<Cand>& heap, std::size_t limit, const Cand& c) {
    const auto less = [](const Cand& a, const Cand& b) { return before(a, b); };
    if (heap.size() < limit) {
      heap.push_back(c);
      std::push_heap(heap.begin(), heap.end(), less);
      return true;
    }
    if (limit == 0 || !less(c, heap.front())) return false;
    std::pop_heap(heap.begin(), heap.end(), less);
    heap.back() = c;
    std::push_heap(heap.begin(), heap.end(), less);
    return true;
  }
};

/// Of the rows idx[0, m) (costs[idx[j]] finite, not NaN), moves to the front those that
/// can be among the `keep` first by (cost, seq): the rows costing at most the keep-th
/// smallest cost (ties included), and returns how many (at least keep; m when keep >= m).
/// The costs are hot (just written) and the arrival indices cold, so the caller reads the
/// arrival indices of these rows only. `scratch` holds the m costs.
inline std::size_t pool_contenders(const float* costs, std::uint32_t* idx, std::size_t m,
                                   std::size_t keep, std::vector<float>& scratch) {
  if (keep >= m) return m;
  if (keep == 0) return 0;
  scratch.resize(m);
  for (std::size_t j = 0; j < m; ++j) scratch[j] = costs[idx[j]];
  std::nth_element(scratch.begin(), scratch.begin() + static_cast<std::ptrdiff_t>(keep - 1), scratch.end());
  const float kth = scratch[keep - 1];
  std::size_t n = 0;
  for (std::size_t j = 0; j < m; ++j) {
    const std::uint32_t r = idx[j];
    idx[n] = r;
    n += costs[r] <= kth ? 1 : 0;
  }
  return n;
}

/// A head's cheapest rows as the last selection found them (sorted by PoolScratch::before),
/// kept by the caller: while the head's costs are unchanged (PoolHead::reuse) the next
/// selection takes its rows from here instead of scanning the head again when the prefix is
/// long enough (rows of a total order: the first k of the head's order are the first k of
/// any longer prefix); after they changed, its costs only guess the bound of the next scan.
///
/// A prefix gathered under the pool's bound (pooled_victim_counts, `bounded`) holds every
/// finite row costing at most `below`, however few: the head's first rows, and its next
/// row costs more than `below`. A later selection reuses it while its candidates' bound is
/// at or below `below` (no row past the prefix can be among them).
struct PoolPrefix {
  std::vector<PoolScratch::Cand> rows;
  bool complete = false;  ///< rows holds every row with a finite cost
  bool bounded = false;   ///< rows holds every finite row costing at most `below`
  float below = 0.0f;
  std::size_t evictable = 0;  ///< the head's finite rows (when bounded)
  void clear() {
    rows.clear();
    complete = bounded = false;
  }
};

/// One head of a layer as the selection sees it.
struct PoolHead {
  std::size_t size = 0;     ///< live rows n_h
  std::size_t incoming = 0; ///< rows the step adds to it (1 for the stepping layer's heads)
  std::size_t floor = 0;    ///< rows it keeps at least
  std::size_t ceiling = 0;  ///< rows it may hold at most
  const float* costs = nullptr;          ///< size comparable costs (may be null when size == 0)
  const std::uint64_t* seqs = nullptr;   ///< size arrival indices
  PoolPrefix* prefix = nullptr;  ///< optional: the head's kept cheapest rows (refreshed here)
  bool reuse = false;  ///< prefix was stored for these very costs and rows (else rebuilt)
};

/// pooled_victim_counts with a schedule (`extra` > 0, `need` > 0) and no head above its
/// ceiling: the same counts and list, from one pass over the pool instead of a sorted
/// prefix per head. Every head offers its min(rows above its floor, need + extra) cheapest
/// finite rows; the list is the first need + extra offered rows of the pool. A bound on
/// the cost: a head's finite rows at or below it are its cheapest, so the offered rows at
/// or below it are exactly the gathered rows, each head's trimmed to what it offers (its
/// cheapest by (cost, seq)); once they are at least need + extra, the rows chosen are the
/// first of them (every other offered row costs more). First the bound guessed from the
/// last such selection, then, when fewer rows lie below it, every finite row (the
/// gathered rows are then every offered row). One nth_element and one sort of the kept
/// rows give the order. The heads' kept prefixes are cleared (no sorted prefix is built).
KVEVICT_DEFER inline void pooled_schedule_counts(std::span<const PoolHead> heads, std::size_t need,
                                   std::size_t extra, std::vector<std::size_t>& counts,
                                   PoolScratch& s, const char* policy,
                                   std::vector<std::uint32_t>& schedule) {
  constexpr float top = std::numeric_limits<float>::max();
  const std::size_t kept = need + extra;
  const auto less = [](const PoolScratch::Cand& a, const PoolScratch::Cand& b) {
    return PoolScratch::before(a, b);
  };
  float bound = std::isnan(s.schedule_guess) ? top : s.schedule_guess;
  std::size_t offered = 0;
  for (;;) {
    s.chosen.clear();
    offered = 0;
    for (std::size_t hi = 0; hi < heads.size(); ++hi) {
      const auto& h = heads[hi];
      if (h.prefix) h.prefix->clear();
      const std::size_t end = h.size + h.incoming;
      const std::size_t want = std::min(end > h.floor ? end - h.floor : 0, kept);
      if (want == 0 || h.size == 0) continue;
      auto& idx = s.rows;
      if (idx.size() < h.size) idx.resize(h.size);
      std::size_t evictable = 0;
      std::size_t m = kernels::gather_at_most(h.costs, h.size, bound, idx.data(), &evictable);
      offered += std::min(want, evictable);
      if (m > want) m = pool_contenders(h.costs, idx.data(), m, want, s.bound);
      const auto head_of = static_cast<std::uint32_t>(hi);
      const std::size_t from = s.chosen.size();
      for (std::size_t j = 0; j < m; ++j)
        s.chosen.push_back(PoolScratch::Cand{h.costs[idx[j]], h.seqs[idx[j]], head_of});
      if (m > want) {  // ties at the head's want-th cost: its first `want` by (cost, seq)
        const auto first = s.chosen.begin() + static_cast<std::ptrdiff_t>(from);
        std::nth_element(first, first + static_cast<std::ptrdiff_t>(want - 1), s.chosen.end(), less);
        s.chosen.resize(from + want);
      }
    }
    if (s.chosen.size() >= kept || bound == top) break;
    bound = top;  // too few below the guess: every finite row
  }
  (bound == top ? s.rescanned : s.guessed) += 1;
  if (offered < need)
    throw std::logic_error(std::string("kvevict: policy ") + policy + ": the layer must give up " +
                           std::to_string(need) + " more rows but only " + std::to_string(offered) +
                           " are evictable above the heads' floors");
  const std::size_t keep = std::min(kept, s.chosen.size());
  if (keep < s.chosen.size())
    std::nth_element(s.chosen.begin(), s.chosen.begin() + static_cast<std::ptrdiff_t>(keep - 1), s.chosen.end(), less);
  std::sort(s.chosen.begin(), s.chosen.begin() + static_cast<std::ptrdiff_t>(keep), less);
  if (keep > 0) s.schedule_guess = std::min(s.chosen[keep - 1].cost * 1.05f, top);
  for (std::size_t j = 0; j < keep; ++j) {
    if (j < need) ++counts[s.chosen[j].head];
    else schedule.push_back(s.chosen[j].head);
  }
}

/// Victims per head of one layer (counts[h]); see the header comment for the rule. Throws
/// std::logic_error naming `policy` when the finite costs cannot cover what the layer must
/// give up (a policy that marks too many rows as not evictable), before anything changed.
/// With `schedule` (PoolOptions::Frozen::schedule) and a step that must give rows, the next
/// `extra` candidates after the step's own, in the same order, are written to it as their
/// heads' indices (fewer when the heads offer fewer; each head's count and entries together
/// stay within its rows above its floor); else it is left empty. extra = 0 decides exactly
/// as without it.
KVEVICT_DEFER inline void pooled_victim_counts(std::span<const PoolHead> heads, std::size_t total,
                                 std::vector<std::size_t>& counts, PoolScratch& s,
                                 const char* policy, std::size_t extra = 0,
                                 std::vector<std::uint32_t>* schedule = nullptr) {
  counts.assign(heads.size(), 0);
  if (schedule) schedule->clear();
  if (!schedule) extra = 0;
  std::size_t after = 0;
  for (const auto& h : heads) after += h.size + h.incoming;
  std::size_t need = after > total ? after - total : 0;
  bool over_ceiling = false;
  for (const auto& h : heads) over_ceiling |= h.size + h.incoming > h.ceiling;
  if (need == 0 && !over_ceiling) return;
  if (need == 0) extra = 0;  // nothing to schedule: the pool is not full
  if (extra > 0 && !over_ceiling) {  // the long list: one pass over the pool
    pooled_schedule_counts(heads, need, extra, counts, s, policy, *schedule);
    return;
  }
  // The kept prefixes are cold (read once per step, by the reuse or the guessed bound):
  // start their reads for every head at once.
  for (const auto& h : heads)
    if (h.prefix && !h.prefix->rows.empty()) {
      const auto* p = reinterpret_cast<const char*>(h.prefix->rows.data());
      const std::size_t bytes = std::min<std::size_t>(h.prefix->rows.size(), 10) * sizeof(PoolScratch::Cand);
      for (std::size_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o);
    }
  const auto fail = [&](const std::string& what) {
    throw std::logic_error(std::string("kvevict: policy ") + policy + ": " + what);
  };
  // The rows the whole pool gives beyond what the ceilings force: the `left` cheapest of
  // the heads' candidates, kept in a max-heap of that size while the heads are visited (a
  // head's candidates come in order, so its first one that does not enter ends its turn).
  std::size_t forced_total = 0;
  for (const auto& h : heads) {
    const std::size_t end = h.size + h.incoming;
    forced_total += end > h.ceiling ? end - h.ceiling : 0;
  }
  const std::size_t left = need > forced_total ? need - forced_total : 0;
  const std::size_t kept = left + extra;  // the heap's size: the step's rows, then the schedule's
  const auto less = [](const PoolScratch::Cand& a, const PoolScratch::Cand& b) {
    return PoolScratch::before(a, b);
  };
  std::size_t offered = 0;  // candidates of every head above its forced rows
  s.chosen.clear();
  // The heads' wants: their cheapest rows, as many as could matter (forced + need (+ extra),
  // at most limit).
  const auto want_of = [&](const PoolHead& h) {
    const std::size_t end = h.size + h.incoming;
    const std::size_t forced = end > h.ceiling ? end - h.ceiling : 0;
    const std::size_t limit = end > h.floor ? end - h.floor : 0;
    return std::min(limit, forced + need + extra);
  };
  const auto prefix_holds = [](const PoolHead& h, std::size_t want) {
    return h.prefix && h.reuse && (h.prefix->complete || h.prefix->rows.size() >= want);
  };
  // No head above its ceiling: the heads whose kept prefix holds their candidates go first.
  // Their candidates fill the heap, and once it is full its top bounds the rows any later
  // head can add (the top only moves down): a later head gathers only its rows at or below
  // it (the pool bound), or reuses a prefix gathered under a bound at least as high.
  auto& order = s.order;
  order.clear();
  PoolPrefix spare;  // the rows gathered for a head without a kept prefix
  if (!over_ceiling) {
    for (std::size_t hi = 0; hi < heads.size(); ++hi)
      if (prefix_holds(heads[hi], want_of(heads[hi]))) order.push_back(static_cast<std::uint32_t>(hi));
    for (std::size_t hi = 0; hi < heads.size(); ++hi)
      if (!prefix_holds(heads[hi], want_of(heads[hi]))) order.push_back(static_cast<std::uint32_t>(hi));
  } else {
    for (std::size_t hi = 0; hi < heads.size(); ++hi) order.push_back(static_cast<std::uint32_t>(hi));
  }
  for (const std::uint32_t head_of : order) {
    const std::size_t hi = head_of;
    const auto& h = heads[hi];
    const std::size_t end = h.size + h.incoming;
    const std::size_t forced = end > h.ceiling ? end - h.ceiling : 0;
    const std::size_t limit = end > h.floor ? end - h.floor : 0;
    if (forced > limit)
      fail("head " + std::to_string(hi) + " must give " + std::to_string(forced) +
           " rows to its ceiling but only " + std::to_string(limit) + " above its floor");
    const std::size_t want = want_of(h);
    const PoolScratch::Cand* sorted = nullptr;  // the head's first `take` rows, in order
    std::size_t take = 0, evictable = 0;
    std::size_t avail = 0;  // what the head offers above its forced rows: min(want, evictable) - forced
    const bool full = kept > 0 && s.chosen.size() == kept;
    if (prefix_holds(h, want)) {
      evictable = h.prefix->rows.size();  // a lower bound unless complete (then >= want)
      take = std::min(want, evictable);
      avail = take - std::min(take, forced);
      sorted = h.prefix->rows.data();
    } else if (!over_ceiling && full && want > 0) {
      const float bound = s.chosen.front().cost;  // the pool bound
      auto& p = *(h.prefix ? h.prefix : &spare);
      if (h.prefix && h.reuse && p.bounded && bound <= p.below) {
        ++s.bound_reused;  // every row past the prefix costs more than the bound
      } else {
        ++s.bound_gathered;
        auto& idx = s.rows;
        if (idx.size() < h.size) idx.resize(h.size);
        std::size_t finite = 0;
        std::size_t m = h.size == 0 ? 0 : kernels::gather_at_most(h.costs, h.size, bound, idx.data(), &finite);
        const bool all = m <= want;  // every finite row at or below the bound, and no more
        if (!all) m = pool_contenders(h.costs, idx.data(), m, want, s.bound);
        auto& rows = s.head_rows;
        rows.clear();
        for (std::size_t j = 0; j < m; ++j)
          rows.push_back(PoolScratch::Cand{h.costs[idx[j]], h.seqs[idx[j]], head_of});
        const std::size_t keep = std::min(want, m);
        std::partial_sort(rows.begin(), rows.begin() + static_cast<std::ptrdiff_t>(keep), rows.end(), less);
        p.rows.assign(rows.begin(), rows.begin() + static_cast<std::ptrdiff_t>(keep));
        p.complete = keep == finite;
        p.bounded = all;
        p.below = bound;
        p.evictable = finite;
      }
      evictable = p.evictable;
      take = std::min(want, p.rows.size());
      avail = std::min(want, evictable);
      sorted = p.rows.data();
    } else {
      // First a guess at the bound, from the rows the head's last selection kept (its
      // costs have moved since; 5% of margin): every finite row at or below it, gathered
      // without branches, holds the head's `want` cheapest rows when there are at least
      // `want` of them (a row above the guess comes after each of them), or all its finite
      // rows when there are `evictable`. Else one scan keeping the `want` cheapest finite
      // rows in a max-heap, then sorted: most rows cost more than the heap's top and are
      // rejected on the cost alone (also the infinite and NaN ones: !(c <= bound)).
      constexpr float top = std::numeric_limits<float>::max();
      auto& heap = s.head_rows;
      heap.clear();
      bool guessed = false;
      const bool has_guess = h.prefix && !h.prefix->rows.empty() && want > 0;
      if (has_guess) {
        const auto& old = h.prefix->rows;
        const float guess = std::min(old[std::min(want, old.size()) - 1].cost * 1.05f, top);
        auto& idx = s.rows;
        if (idx.size() < h.size) idx.resize(h.size);
        // The dispatched gather and the finite count in one pass over the costs (the
        // arrival indices are read only for the gathered rows that can be among the `want`
        // first: pool_contenders).
        const std::size_t m = kernels::gather_at_most(h.costs, h.size, guess, idx.data(), &evictable);
        if (m >= want || m == evictable) {
          const std::size_t keep = std::min(want, m);
          const std::size_t n = pool_contenders(h.costs, idx.data(), m, keep, s.bound);
          for (std::size_t j = 0; j < n; ++j)
            heap.push_back(PoolScratch::Cand{h.costs[idx[j]], h.seqs[idx[j]], head_of});
          std::partial_sort(heap.begin(), heap.begin() + static_cast<std::ptrdiff_t>(keep), heap.end(), less);
          heap.resize(keep);
          guessed = true;
        }
      }
      if (!has_guess)  // else counted with the guess
        for (std::size_t r = 0; r < h.size; ++r) evictable += h.costs[r] <= top ? 1 : 0;
      std::size_t r = guessed ? h.size : 0;  // guessed: nothing left to scan
      for (; r < h.size && heap.size() < want; ++r) {
        const float c = h.costs[r];
        if (!(c <= top)) continue;  // +infinity or NaN
        PoolScratch::keep_first(heap, want, PoolScratch::Cand{c, h.seqs[r], head_of});
      }
      if (!guessed && want > 0 && heap.size() == want) {
        float bound = heap.front().cost;  // the heap's largest cost
        for (; r < h.size; ++r) {
          const float c = h.costs[r];
          if (!(c <= bound)) continue;
          if (!PoolScratch::keep_first(heap, want, PoolScratch::Cand{c, h.seqs[r], head_of})) continue;
          bound = heap.front().cost;
        }
      }
      if (!guessed) std::sort_heap(heap.begin(), heap.end(), less);
      take = s.head_rows.size();
      avail = take - std::min(take, forced);
      if (h.prefix) {
        h.prefix->rows.assign(s.head_rows.begin(), s.head_rows.begin() + static_cast<std::ptrdiff_t>(take));
        h.prefix->complete = take == evictable;
        h.prefix->bounded = false;
      }
      sorted = s.head_rows.data();
    }
    if (take < forced)
      fail("head " + std::to_string(hi) + " must give " + std::to_string(forced) +
           " rows to its ceiling but has " + std::to_string(evictable) + " evictable");
    counts[hi] = forced;
    offered += avail;
    auto& chosen = s.chosen;
    for (std::size_t j = forced; j < take && kept > 0; ++j) {
      PoolScratch::Cand cand = sorted[j];
      cand.head = head_of;
      if (!PoolScratch::keep_first(chosen, kept, cand)) break;
    }
  }
  if (offered < left)
    fail("the layer must give up " + std::to_string(left) + " more rows but only " +
         std::to_string(offered) + " are evictable above the heads' floors");
  if (extra == 0) {
    for (const auto& c : s.chosen) ++counts[c.head];
    return;
  }
  // The step's rows are the first `left` of the kept ones in order, the schedule the rest.
  std::sort_heap(s.chosen.begin(), s.chosen.end(), less);
  for (std::size_t j = 0; j < s.chosen.size(); ++j) {
    if (j < left) ++counts[s.chosen[j].head];
    else if (schedule != nullptr) schedule->push_back(s.chosen[j].head);  // always set when extra > 0
  }
}

/// PoolOptions::Frozen::schedule, a frozen step: the victims per head (counts[h]) the
/// schedule `list` (head indices, in the pool's order) gives from entry `at`. A head whose
/// rows after the step would pass its ceiling gives what the ceiling forces; then one entry
/// is taken per incoming row left (the pool is full, so the step gives as many rows as it
/// adds), skipping an entry whose head would go below its floor or give its last row.
/// Returns the entry after the last one read, or nothing when the list ran out first.
inline std::optional<std::size_t> pool_schedule_take(std::span<const PoolHead> heads,
                                                     std::span<const std::uint32_t> list, std::size_t at,
                                                     std::vector<std::size_t>& counts) {
  counts.assign(heads.size(), 0);
  std::size_t need = 0;
  for (std::size_t h = 0; h < heads.size(); ++h) {
    const std::size_t end = heads[h].size + heads[h].incoming;
    counts[h] = end > heads[h].ceiling ? end - heads[h].ceiling : 0;
    need += heads[h].incoming - std::min(heads[h].incoming, counts[h]);
  }
  for (; need > 0 && at < list.size(); ++at) {
    const PoolHead& h = heads[list[at]];
    std::size_t& k = counts[list[at]];
    if (k + 1 > h.size || h.size + h.incoming - k - 1 < h.floor) continue;
    ++k;
    --need;
  }
  if (need > 0) return std::nullopt;
  return at;
}

/// Rows to allocate so `rows` fit in a pooled head holding `have` (0: enough already):
/// geometric up to `nominal` (as an unpooled head; the core passes 0 once the head has
/// given up rows, so a shrunken head regrows by chunks), then `chunk` rows of slack.
inline std::size_t pool_grown_rows(std::size_t have, std::size_t rows, std::size_t nominal,
                                   std::size_t chunk) {
  if (have >= rows) return 0;
  if (rows <= nominal) return std::min(std::max<std::size_t>({rows, 16, have * 2}), nominal);
  return rows + chunk;
}

/// The allocation a pooled head of `rows` rows should shrink to, or 0 to keep it: release
/// once more than rows + 2 x chunk are allocated, down to rows + chunk.
inline std::size_t pool_release_rows(std::size_t have, std::size_t rows, std::size_t chunk) {
  return have > rows + 2 * chunk ? rows + chunk : 0;
}

}  // namespace kvevict::detail
