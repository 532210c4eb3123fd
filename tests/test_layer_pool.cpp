// Pooled budgets (Budget::pooled(), layer_pool.hpp, AdaKV-style): the cross-head split of
// a layer's evictions against a brute-force transcription of its rule; on real caches the
// layer total is never exceeded, protected rows are never evicted, kept rows stay bit-exact,
// storage follows each head's share, the per-step split equals the brute-force rule over the
// policy's own costs, PagedCache keeps KVCache's rows, and bad input is a kvevict::Error.
#include <limits>
#include <type_traits>

#include <kvevict/paged_cache.hpp>
#include <kvevict/serialize.hpp>

#include "support/test_support.hpp"

namespace {

using kvevict::Budget;
using kvevict::Geometry;
using kvevict::KVCache;
using kvevict::PoolOptions;
namespace pol = kvevict::policies;
namespace kd = kvevict::detail;

// The rule, transcribed independently: sort every evictable row of the layer by (cost,
// seq, head); each head first gives what its ceiling forces (its cheapest rows), then rows
// are taken in the global order, skipping heads at their floor, until the layer fits.
// With `schedule` (PoolOptions::Frozen::schedule) and rows to give, the walk goes on for
// `extra` more rows under the same floors, and writes their heads there in that order.
std::vector<std::size_t> brute_counts(const std::vector<std::vector<float>>& costs,
                                      const std::vector<std::vector<std::uint64_t>>& seqs,
                                      const std::vector<std::size_t>& floor,
                                      const std::vector<std::size_t>& ceiling,
                                      const std::vector<std::size_t>& incoming, std::size_t total,
                                      std::size_t extra = 0, std::vector<std::size_t>* schedule = nullptr) {
  const std::size_t H = costs.size();
  std::vector<std::size_t> k(H, 0);
  struct Row {
    float c;
    std::uint64_t s;
    std::size_t h;
  };
  std::vector<Row> all;
  std::size_t after = 0;
  for (std::size_t h = 0; h < H; ++h) {
    after += costs[h].size() + incoming[h];
    for (std::size_t r = 0; r < costs[h].size(); ++r)
      if (std::isfinite(costs[h][r])) all.push_back({costs[h][r], seqs[h][r], h});
  }
  std::sort(all.begin(), all.end(), [](const Row& a, const Row& b) {
    return std::tie(a.c, a.s, a.h) < std::tie(b.c, b.s, b.h);
  });
  std::vector<std::vector<bool>> taken(H);
  std::vector<std::size_t> idx(all.size());
  for (std::size_t h = 0; h < H; ++h) {
    const std::size_t end = costs[h].size() + incoming[h];
    const std::size_t forced = end > ceiling[h] ? end - ceiling[h] : 0;
    for (std::size_t i = 0; i < all.size() && k[h] < forced; ++i)
      if (all[i].h == h) {
        all[i].c = -std::numeric_limits<float>::infinity();  // marks it taken
        ++k[h];
      }
  }
  std::size_t have = 0;
  for (std::size_t x : k) have += x;
  std::size_t need = after > total ? after - total : 0;
  if (schedule) schedule->clear();
  if (need == 0 || !schedule) extra = 0;
  std::vector<std::size_t> given = k;  // the step's rows and the schedule's, per head
  std::size_t listed = 0;               // the schedule's: `extra` after the step's rows
  for (std::size_t i = 0; i < all.size() && (have < need || listed < extra); ++i) {
    const Row& r = all[i];
    if (r.c == -std::numeric_limits<float>::infinity()) continue;
    const std::size_t end = costs[r.h].size() + incoming[r.h];
    const std::size_t limit = end > floor[r.h] ? end - floor[r.h] : 0;
    if (given[r.h] >= limit) continue;
    ++given[r.h];
    if (have < need) {
      ++k[r.h];
      ++have;
    } else {
      if (schedule) schedule->push_back(r.h);
      ++listed;
    }
  }
  return k;
}

TEST_CASE("pooled_victim_counts equals the brute-force rule on small layers", "[pool]") {
  kvtest::Rng rng(16);
  kd::PoolScratch scratch;
  int checked = 0, uneven = 0;
  // Prefixes kept from the previous trial's costs: a rescanned head (reuse false) takes
  // only a guess at its bound from them, right or wrong.
  std::vector<kd::PoolPrefix> stale(5);
  for (int trial = 0; trial < 3000; ++trial) {
    const std::size_t H = std::size_t(rng.uniform(1, 5));
    std::vector<std::size_t> incoming(H);
    for (auto& x : incoming) x = std::size_t(rng.uniform(0, 1));
    std::vector<std::vector<float>> costs(H);
    std::vector<std::vector<std::uint64_t>> seqs(H);
    std::vector<std::size_t> floor(H), ceiling(H);
    std::size_t rows = 0;
    for (std::size_t h = 0; h < H; ++h) {
      const std::size_t n = std::size_t(rng.uniform(0, 9));
      // Few distinct costs and shared seqs, so ties on cost and on seq are common.
      std::vector<std::uint64_t> pool(20);
      for (std::size_t i = 0; i < pool.size(); ++i) pool[i] = i;
      std::shuffle(pool.begin(), pool.end(), rng.engine());
      for (std::size_t r = 0; r < n; ++r) {
        const float c = rng.chance(0.2) ? std::numeric_limits<float>::infinity()
                                        : float(rng.uniform(0, 4)) * 0.25f;
        costs[h].push_back(c);
        seqs[h].push_back(pool[r]);
      }
      floor[h] = std::size_t(rng.uniform(0, 3));
      rows += n;
    }
    std::size_t adds = 0;
    for (std::size_t x : incoming) adds += x;
    const std::size_t total = rows + adds - std::size_t(rng.uniform(0, 4)) + 2;
    for (std::size_t h = 0; h < H; ++h) ceiling[h] = std::size_t(rng.uniform(3, 14));
    std::vector<kd::PoolHead> heads;
    for (std::size_t h = 0; h < H; ++h)
      heads.push_back({costs[h].size(), incoming[h], floor[h], ceiling[h], costs[h].data(), seqs[h].data()});
    // The selection's counts for a pool total, or true when it refused.
    const auto refused = [&](std::size_t pool_total, std::vector<std::size_t>& out) {
      try {
        kd::pooled_victim_counts(heads, pool_total, out, scratch, "Test");
      } catch (const std::logic_error&) {
        return true;
      }
      return false;
    };
    std::vector<std::size_t> counts;
    const bool threw = refused(total, counts);
    const auto want = brute_counts(costs, seqs, floor, ceiling, incoming, total);
    // When the rule cannot be met the function refuses; otherwise the counts must match
    // and leave every head within its bounds and the layer within its total.
    std::size_t after = 0, evictable_ok = 1;
    for (std::size_t h = 0; h < H; ++h) after += costs[h].size() + incoming[h] - want[h];
    for (std::size_t h = 0; h < H; ++h)
      evictable_ok &= costs[h].size() + incoming[h] - want[h] <= ceiling[h];
    const bool feasible = after <= total && evictable_ok;
    INFO("trial " << trial);
    REQUIRE(threw == !feasible);
    // Again from kept prefixes (the model-scope reuse): first stored by a selection of
    // another total (so of another length, maybe too short), then reused for this one.
    std::vector<kd::PoolPrefix> prefixes(H);
    for (std::size_t h = 0; h < H; ++h) heads[h].prefix = &prefixes[h];
    std::vector<std::size_t> counts2;
    refused(total + 3 - std::size_t(rng.uniform(0, 6)), counts2);
    for (auto& h : heads) h.reuse = true;
    const bool threw2 = refused(total, counts2);
    REQUIRE(threw2 == threw);
    // Rescanned with another trial's prefixes (the guessed bound), then stored for the next.
    for (std::size_t h = 0; h < H; ++h) {
      heads[h].prefix = &stale[h];
      heads[h].reuse = false;
      if (rng.chance(0.3))  // a guess far below or above every cost
        for (auto& c : stale[h].rows) c.cost = rng.chance(0.5) ? -1.0f : 100.0f;
    }
    std::vector<std::size_t> counts3;
    const bool threw3 = refused(total, counts3);
    REQUIRE(threw3 == threw);
    if (threw) continue;
    REQUIRE(counts == want);
    REQUIRE(counts2 == want);
    REQUIRE(counts3 == want);
    ++checked;
    uneven += std::adjacent_find(counts.begin(), counts.end(), std::not_equal_to<>()) != counts.end();
  }
  REQUIRE(checked > 1000);
  REQUIRE(uneven > 100);  // the split really moves between heads
}
// The model-scope flow of pooled_victim_counts: a pool of heads, selection after
// selection; between two, some heads change (new costs and rows: reuse false) and the rest
// keep their costs and their kept prefixes (reuse true). Heads whose prefix holds their
// candidates go first; the others gather only their rows at or below the filled heap's top
// (or reuse a prefix gathered under a bound as high). Every selection must equal the
// brute-force rule. A changed head's costs are drawn at `level` + [0, spread) (`level`
// drawn in [0, level_max] per step when > 0: the changed heads land above or below the
// others, so the pool bound at a head's turn rises and falls between selections): in
// runs with ties `tie_step` times [0, tie_steps], else [0, 10^6] / `divisor`. Returns the
// selections checked.
struct SelectionsInARow {
  std::uint64_t seed;
  int runs;
  long long heads_max, rows_max, give_max;
  double ties_share, inf_share;
  long long tie_steps;
  float tie_step, divisor;
  long long level_max;
};
std::size_t selections_in_a_row(const SelectionsInARow& cfg, kd::PoolScratch& scratch) {
  kvtest::Rng rng(cfg.seed);
  std::size_t checked = 0;
  for (int run = 0; run < cfg.runs; ++run) {
    const std::size_t H = std::size_t(rng.uniform(2, cfg.heads_max));
    const bool ties = rng.chance(cfg.ties_share);
    std::vector<std::vector<float>> costs(H);
    std::vector<std::vector<std::uint64_t>> seqs(H);
    std::vector<std::size_t> floor(H), ceiling(H, 1000), incoming(H);
    std::vector<kd::PoolPrefix> prefixes(H);
    std::uint64_t next_seq = 0;
    float level = 0.0f;
    const auto new_level = [&] {
      if (cfg.level_max > 0) level = float(rng.uniform(0, cfg.level_max));
    };
    const auto refill = [&](std::size_t h) {
      const std::size_t n = std::size_t(rng.uniform(0, cfg.rows_max));
      costs[h].clear();
      seqs[h].clear();
      for (std::size_t r = 0; r < n; ++r) {
        const float c = rng.chance(cfg.inf_share) ? std::numeric_limits<float>::infinity()
                        : ties ? level + float(rng.uniform(0, cfg.tie_steps)) * cfg.tie_step
                               : level + float(rng.uniform(0, 1000000)) / cfg.divisor;
        costs[h].push_back(c);
        // Shared arrival indices across heads (a model pool's layers), some equal.
        seqs[h].push_back(rng.chance(0.2) ? std::uint64_t(rng.uniform(0, 5)) : next_seq++);
      }
    };
    for (std::size_t h = 0; h < H; ++h) {
      new_level();
      refill(h);
      floor[h] = std::size_t(rng.uniform(0, 4));
    }
    // Per head: its kept prefix was stored for its current costs (by a selection that
    // visited every head: one with rows to give).
    std::vector<bool> fresh(H, false);
    for (int step = 0; step < 30; ++step) {
      if (step > 0) {
        new_level();  // this step's changed heads
        for (std::size_t h = 0; h < H; ++h)
          if (rng.chance(0.3)) {
            refill(h);
            fresh[h] = false;
          }
      }
      std::size_t rows = 0;
      for (std::size_t h = 0; h < H; ++h) {
        incoming[h] = rng.chance(0.3) ? 1 : 0;
        rows += costs[h].size() + incoming[h];
      }
      const std::size_t total =
          rows > std::size_t(cfg.give_max) ? rows - std::size_t(rng.uniform(0, cfg.give_max)) : rows;
      std::vector<kd::PoolHead> heads;
      for (std::size_t h = 0; h < H; ++h)
        heads.push_back({costs[h].size(), incoming[h], floor[h], ceiling[h], costs[h].data(), seqs[h].data(),
                         &prefixes[h], bool(fresh[h])});
      std::vector<std::size_t> counts;
      bool threw = false;
      try {
        kd::pooled_victim_counts(heads, total, counts, scratch, "Test");
      } catch (const std::logic_error&) {
        threw = true;
      }
      const auto want = brute_counts(costs, seqs, floor, ceiling, incoming, total);
      std::size_t after = 0;
      for (std::size_t h = 0; h < H; ++h) after += costs[h].size() + incoming[h] - want[h];
      INFO("run " << run << " step " << step);
      REQUIRE(threw == (after > total));
      if (threw) {
        for (auto& p : prefixes) p.clear();  // a refused selection may leave them half-written
        continue;
      }
      REQUIRE(counts == want);
      if (total < rows) fresh.assign(H, true);  // else it returned before visiting a head
      ++checked;
    }
  }
  return checked;
}
TEST_CASE("pooled_victim_counts under the pool bound: selections in a row, kept prefixes, brute force", "[pool]") {
  // Two draws, each with how many bounded gathers and reuses it must reach.
  struct Draw {
    SelectionsInARow cfg;
    std::size_t gathered, reused;
  };
  const Draw draws[] = {
      // Split9's: one cost range for every head, 2-24 heads, up to 12 rows to give.
      {{43, 120, 24, 40, 12, 0.5, 0.15, 6, 0.5f, 1000.0f, 0}, 2000, 500},
      // The changed heads' costs drawn around a level that moves from step to step (up or
      // down), up to 40 rows to give: the pool bound at a head's turn rises past its kept
      // bounded prefix's `below` (which must then be gathered again) and falls below it.
      {{44, 150, 12, 30, 40, 0.3, 0.1, 4, 1.0f, 10000.0f, 200}, 1000, 300},
  };
  for (const Draw& d : draws) {
    kd::PoolScratch scratch;
    INFO("seed " << d.cfg.seed);
    REQUIRE(selections_in_a_row(d.cfg, scratch) > 2000);
    // The bounded paths ran: heads gathered under the pool bound, and prefixes reused on it.
    REQUIRE(scratch.bound_gathered > d.gathered);
    REQUIRE(scratch.bound_reused > d.reused);
  }
}
TEST_CASE("pooled_victim_counts: the pool bound rising past a kept bounded prefix", "[pool]") {
  // A head whose kept prefix was gathered under a low pool bound (every finite row at or
  // below `below`, fewer than it wants) keeps its costs; the next selection's bound at its
  // turn is higher (another head's costs rose). Its rows between the two bounds must be
  // found again (gathered, not the prefix reused), as the brute-force rule takes them.
  kd::PoolScratch scratch;
  std::vector<std::vector<float>> costs = {{1, 2, 3, 10, 11}, {5, 6, 7}};
  std::vector<std::vector<std::uint64_t>> seqs = {{0, 1, 2, 3, 4}, {5, 6, 7}};
  const std::vector<std::size_t> floor(2, 0), ceiling(2, 1000), incoming(2, 0);
  std::vector<kd::PoolPrefix> prefixes(2);
  const auto select = [&](std::size_t total, std::vector<bool> reuse) {
    std::vector<kd::PoolHead> heads;
    for (std::size_t h = 0; h < 2; ++h)
      heads.push_back({costs[h].size(), incoming[h], floor[h], ceiling[h], costs[h].data(), seqs[h].data(),
                       &prefixes[h], bool(reuse[h])});
    std::vector<std::size_t> counts;
    kd::pooled_victim_counts(heads, total, counts, scratch, "Test");
    REQUIRE(counts == brute_counts(costs, seqs, floor, ceiling, incoming, total));
    return counts;
  };
  // Head 0 fills the heap with {1, 2}: head 1 gathers under the bound 2 (none of its rows).
  CHECK(select(6, {false, false}) == std::vector<std::size_t>{2, 0});
  REQUIRE(prefixes[1].bounded);
  REQUIRE(prefixes[1].below == 2.0f);
  REQUIRE(prefixes[1].rows.empty());
  const std::size_t reused = scratch.bound_reused, gathered = scratch.bound_gathered;
  // Head 0's costs rise: the heap's top at head 1's turn is 9, above its prefix's bound.
  costs[0] = {8, 9, 10, 11, 12};
  CHECK(select(6, {false, true}) == std::vector<std::size_t>{0, 2});
  CHECK(scratch.bound_reused == reused);
  CHECK(scratch.bound_gathered == gathered + 1);
  REQUIRE(prefixes[1].below == 9.0f);
  // Unchanged again: both heads' kept prefixes hold their candidates.
  CHECK(select(6, {true, true}) == std::vector<std::size_t>{0, 2});
}
TEST_CASE("pool_schedule_take equals its rule written out, and pooled_victim_counts' schedule the walk's", "[pool]") {
  kvtest::Rng rng(40);
  int took = 0, skipped = 0, ran_out = 0, forced_seen = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    const std::size_t H = std::size_t(rng.uniform(1, 6));
    std::vector<kd::PoolHead> heads(H);
    for (auto& h : heads) {
      h.size = std::size_t(rng.uniform(0, 6));
      h.incoming = std::size_t(rng.uniform(0, 1));
      h.floor = std::size_t(rng.uniform(0, 4));
      h.ceiling = std::size_t(rng.uniform(2, 8));
    }
    std::vector<std::uint32_t> list(std::size_t(rng.uniform(0, 12)));
    for (auto& x : list) x = std::uint32_t(rng.uniform(0, long(H) - 1));
    const std::size_t at = std::size_t(rng.uniform(0, long(list.size())));
    std::vector<std::size_t> counts;
    const auto got = kd::pool_schedule_take(heads, list, at, counts);
    // Written out: ceilings first, then one entry per incoming row not forced out, in
    // order, skipping a head that would end below its floor or with no row of its own left.
    std::vector<std::size_t> k(H, 0);
    std::size_t need = 0;
    for (std::size_t h = 0; h < H; ++h) {
      const std::size_t end = heads[h].size + heads[h].incoming;
      if (end > heads[h].ceiling) {
        k[h] = end - heads[h].ceiling;
        ++forced_seen;
      }
      if (heads[h].incoming == 1 && k[h] == 0) ++need;
    }
    std::size_t j = at;
    for (; need > 0 && j < list.size(); ++j) {
      const std::size_t h = list[j];
      const bool can = k[h] < heads[h].size && heads[h].size + heads[h].incoming >= k[h] + 1 + heads[h].floor;
      skipped += !can;
      if (!can) continue;
      ++k[h];
      --need;
      ++took;
    }
    INFO("trial " << trial);
    if (need > 0) {
      REQUIRE_FALSE(got.has_value());
      ++ran_out;
      continue;
    }
    REQUIRE(got.has_value());
    REQUIRE(*got == j);
    REQUIRE(counts == k);
  }
  REQUIRE(took > 1000);
  REQUIRE(skipped > 100);
  REQUIRE(ran_out > 100);
  REQUIRE(forced_seen > 100);
  // pooled_victim_counts with a schedule: the step's counts are unchanged, and the schedule
  // is the brute-force walk's continuation.
  kd::PoolScratch scratch;
  int scheduled = 0;
  for (int trial = 0; trial < 2000; ++trial) {
    const std::size_t H = std::size_t(rng.uniform(1, 5));
    std::vector<std::size_t> incoming(H), floor(H), ceiling(H);
    std::vector<std::vector<float>> costs(H);
    std::vector<std::vector<std::uint64_t>> seqs(H);
    std::size_t rows = 0;
    for (std::size_t h = 0; h < H; ++h) {
      incoming[h] = std::size_t(rng.uniform(0, 1));
      const std::size_t n = std::size_t(rng.uniform(0, 12));
      for (std::size_t r = 0; r < n; ++r) {
        costs[h].push_back(rng.chance(0.2) ? std::numeric_limits<float>::infinity() : float(rng.uniform(0, 5)) * 0.25f);
        seqs[h].push_back(std::uint64_t(rng.uniform(0, 30)));
      }
      floor[h] = std::size_t(rng.uniform(0, 3));
      ceiling[h] = std::size_t(rng.uniform(8, 20));
      rows += n + incoming[h];
    }
    const std::size_t total = rows > 3 ? rows - std::size_t(rng.uniform(0, 3)) : rows;
    const std::size_t extra = std::size_t(rng.uniform(0, 10));
    std::vector<kd::PoolHead> heads;
    for (std::size_t h = 0; h < H; ++h)
      heads.push_back({costs[h].size(), incoming[h], floor[h], ceiling[h], costs[h].data(), seqs[h].data()});
    std::vector<std::size_t> counts, plain;
    std::vector<std::uint32_t> schedule{99};
    try {
      kd::pooled_victim_counts(heads, total, counts, scratch, "Test", extra, &schedule);
    } catch (const std::logic_error&) {
      continue;
    }
    kd::pooled_victim_counts(heads, total, plain, scratch, "Test");
    std::vector<std::size_t> want_schedule;
    const auto want = brute_counts(costs, seqs, floor, ceiling, incoming, total, extra, &want_schedule);
    INFO("trial " << trial);
    REQUIRE(counts == want);
    REQUIRE(plain == want);
    REQUIRE(std::vector<std::size_t>(schedule.begin(), schedule.end()) == want_schedule);
    scheduled += schedule.size() > 1;
  }
  REQUIRE(scheduled > 300);
  // pooled_schedule_counts (the long list) ran both with its guessed bound holding and
  // with every finite row gathered.
  INFO("guessed " << scratch.guessed << ", rescanned " << scratch.rescanned);
  REQUIRE(scratch.guessed > 100);
  REQUIRE(scratch.rescanned > 100);
}
TEST_CASE("pool_contenders keeps every row that can be among the first k, and no more", "[pool]") {
  kvtest::Rng rng(38);
  std::vector<float> scratch;
  int trimmed = 0;
  for (int trial = 0; trial < 2000; ++trial) {
    const std::size_t rows = std::size_t(rng.uniform(1, 60));
    std::vector<float> costs(rows);
    std::vector<std::uint64_t> seqs(rows);
    for (std::size_t r = 0; r < rows; ++r) {
      costs[r] = float(rng.uniform(0, 6)) * 0.5f - (rng.chance(0.1) ? 0.0f : 0.25f);  // many ties
      if (rng.chance(0.05)) costs[r] = -0.0f;
      seqs[r] = r;
    }
    std::shuffle(seqs.begin(), seqs.end(), rng.engine());
    std::vector<std::uint32_t> idx;  // a gathered subset, in row order
    for (std::size_t r = 0; r < rows; ++r)
      if (rng.chance(0.7)) idx.push_back(std::uint32_t(r));
    const std::size_t m = idx.size(), keep = std::size_t(rng.uniform(0, long(m) + 2));
    const auto order = [&](std::uint32_t a, std::uint32_t b) {
      return costs[a] != costs[b] ? costs[a] < costs[b] : seqs[a] < seqs[b];
    };
    std::vector<std::uint32_t> all = idx;
    std::sort(all.begin(), all.end(), order);
    const std::size_t want = std::min(keep, m);
    std::vector<std::uint32_t> got = idx;
    const std::size_t n = kd::pool_contenders(costs.data(), got.data(), m, keep, scratch);
    INFO("trial " << trial << " m " << m << " keep " << keep);
    REQUIRE(n >= want);
    REQUIRE(n <= m);
    // Exactly the rows at or below the keep-th cost (every row when keep >= m, none at 0).
    const float kth = want == 0 ? -1.0f : costs[all[want - 1]];
    std::size_t expected = 0;
    for (std::uint32_t r : idx) expected += keep >= m || (want > 0 && costs[r] <= kth) ? 1 : 0;
    REQUIRE(n == expected);
    std::vector<std::uint32_t> front(got.begin(), got.begin() + long(n));
    std::sort(front.begin(), front.end(), order);
    REQUIRE(std::vector<std::uint32_t>(front.begin(), front.begin() + long(want)) ==
            std::vector<std::uint32_t>(all.begin(), all.begin() + long(want)));
    trimmed += n < m;
  }
  REQUIRE(trimmed > 500);  // the cut really drops rows
}
TEST_CASE("share-scaled pool costs: finite costs scaled, reserve and protected rows kept", "[pool]") {
  constexpr float inf = std::numeric_limits<float>::infinity(), top = std::numeric_limits<float>::max();
  std::vector<float> c{0.5f, 2.0f, inf, top, std::nanf(""), 0.0f, top / 2};
  kd::scale_pool_costs(c, 4, 16, 0.5);  // (4 / 16)^(1/2) = 1/2
  REQUIRE(c[0] == 0.25f);
  REQUIRE(c[1] == 1.0f);
  REQUIRE(c[2] == inf);
  REQUIRE(c[3] == top);
  REQUIRE(std::isnan(c[4]));
  REQUIRE(c[5] == 0.0f);
  REQUIRE(c[6] == top / 4);
  std::vector<float> big{top / 2, 1.0f};
  kd::scale_pool_costs(big, 64, 16, 1.0);  // x4: clamped below FLT_MAX, still before the reserve
  REQUIRE(big[0] < top);
  REQUIRE(big[0] == std::nextafter(top, 0.0f));
  REQUIRE(big[1] == 4.0f);
  std::vector<float> same{0.3f, 0.7f};
  kd::scale_pool_costs(same, 3, 16, 0.0);
  REQUIRE(same == std::vector<float>{0.3f, 0.7f});
}

// A GQA layer whose KV heads look at different distances: head 0's queries spread
// attention over every row, head 1's fall on the newest rows only. Probabilities are made
// up per step (no model): what matters is that they differ by head.
std::vector<float> made_up_probs(const Geometry& g, int h, std::size_t n, std::span<const std::uint64_t> seqs,
                                 std::uint64_t now, kvtest::Rng& rng) {
  std::vector<float> p(std::size_t(g.group()) * n, 0.0f);
  for (int q = 0; q < g.group(); ++q) {
    float* row = p.data() + std::size_t(q) * n;
    float sum = 0.0f;
    for (std::size_t r = 0; r < n; ++r) {
      const double age = double(now - seqs[r]);
      const double w = h % 2 == 0 ? 0.5 + std::abs(rng.normal()) : std::exp(-age / 2.0) * (1.0 + 0.1 * rng.normal());
      row[r] = float(std::max(w, 1e-6));
      sum += row[r];
    }
    for (std::size_t r = 0; r < n; ++r) row[r] /= sum;
  }
  return p;
}

// A copy of the policy that decides from scratch: DecayedAttention's decisions taken ahead
// in observe are dropped (on_budget with the same shape clears them and the kept
// protection; the decay and spikes stay), so the reference does not reuse them.
template <class Policy>
void forget_ahead(Policy& p, const kvevict::CacheShape& shape) {
  if constexpr (std::is_same_v<Policy, pol::DecayedAttention>) p.on_budget(shape);
  else (void)p, (void)shape;
}

// Drives a pooled KVCache and checks, every step: the heads' new sizes equal the brute-force
// split over the policy's own costs (computed on a copy of the policy, with the view the
// container builds: nominal or share capacity, incoming token or not), the pool's total and
// every floor hold, storage stays within the documented slack, protected rows (sinks and
// the policy's recent band at the smallest capacity it can see) are never evicted; at the
// end kept rows are bit-exact and every appended row is kept or evicted exactly once.
// With o.rebalance_every = R > 1, step k of the pool (counted here) keeps the split when
// k % R != 0, the pool is full and every stepping head holds a row within its floor and
// ceiling: each stepping head then keeps its rows and gives up exactly the row its
// policy's choose_victims picks (need 1) on a copy of the policy; other steps are checked
// against the brute-force split as with R = 1.
// With `exponent_after` >= 0, set_budget at token 200 keeps the budget B but sets
// PoolOptions::share_exponent to it (the heads' rows unchanged: a cost factor kept for the
// old exponent must not be served for the new one).
template <class Policy>
void drive_and_check(Policy policy, std::size_t B, PoolOptions o, std::size_t sinks,
                     std::size_t recent, bool expect_uneven, double exponent_after = -1.0) {
  const Geometry g{2, 8, 4, 8};  // GQA: 2 query heads per KV head
  const Budget budget = Budget::uniform(static_cast<long long>(B)).pooled(o);
  KVCache<Policy> cache(g, budget, policy);
  REQUIRE(cache.pooled());
  const bool model = o.scope == PoolOptions::Scope::model;
  const std::size_t hkv = std::size_t(g.n_kv_heads), heads = hkv * std::size_t(g.n_layers);
  const std::size_t width = model ? heads : hkv;
  const std::size_t total = B * width;
  // rebalance_fraction f > 0: every floor(f x total / Hkv) steps (at least 1); below
  // rebalance_min steps, every step.
  const std::size_t every_f = std::max<std::size_t>(1, std::size_t(o.rebalance_fraction * double(total) / double(hkv)));
  const std::size_t every = o.rebalance_fraction > 0.0 ? (every_f < o.rebalance_min ? 1 : every_f)
                                                       : o.rebalance_every;
  REQUIRE(cache.layer_total(0) == total);
  const std::size_t floor = std::max(cache.policy().min_capacity(),
                                     std::size_t(std::ceil(o.floor_fraction * double(B))));
  for (int h = 0; h < g.n_kv_heads; ++h) REQUIRE(cache.max_rows(0, h) == total - (width - 1) * floor);
  kvtest::Ledger ledger;
  std::uint64_t now = 0;
  int stepping = 0;
  std::size_t bad_evictions = 0;
  auto record = ledger.callback<float>();
  std::vector<std::vector<std::uint64_t>> evicted(heads);  // this append's, per flat head
  cache.set_eviction_callback([&](const kvevict::EvictedRow<float>& e) {
    record(e);
    evicted[std::size_t(e.layer) * hkv + std::size_t(e.kv_head)].push_back(e.seq);
    // The evicted row's layer has seen `arrived` tokens: its incoming one is that index.
    const std::uint64_t arrived = e.layer < stepping ? now + 1 : now;
    if (e.seq < sinks || e.seq + recent >= arrived) ++bad_evictions;
  });
  kvtest::Rng rng(7);
  const std::size_t kv = hkv * std::size_t(g.head_dim);
  const std::size_t chunk_slack = 2 * kd::pool_chunk(B) * width;
  std::size_t max_head = 0, min_head = total, cross_layer = 0;
  std::vector<std::uint64_t> pool_steps(model ? 1 : std::size_t(g.n_layers), 0);
  std::size_t frozen_steps = 0, split_steps = 0;
  // Frozen::schedule: each pool's schedule (its heads, pool-relative) and read position.
  const bool scheduled = o.frozen == PoolOptions::Frozen::schedule && every > 1;
  std::vector<std::vector<std::size_t>> schedule(pool_steps.size());
  std::vector<std::size_t> read(pool_steps.size(), 0);
  std::size_t ran_out = 0, moved_frozen = 0, multi_named = 0;
  for (std::uint64_t t = 0; t < 400; ++t) {
    now = t;
    if (t == 200 && exponent_after >= 0.0) {
      o.share_exponent = exponent_after;
      cache.set_budget(Budget::uniform(static_cast<long long>(B)).pooled(o));
    }
    for (int l = 0; l < g.n_layers; ++l) {
      stepping = l;
      auto k = rng.normals(kv), v = rng.normals(kv);
      ledger.record(g, l, std::int64_t(t), t, k, v);
      // The split this step must make, from the policy's own costs on a copy (brute force).
      const std::size_t first = model ? 0 : std::size_t(l) * hkv;
      std::vector<std::vector<float>> costs(width);
      std::vector<std::vector<std::uint64_t>> seqs(width);
      std::vector<std::size_t> floors, ceilings, before, incoming;
      Policy copy = cache.policy();
      // The view the container builds for (hl, h) (nominal or share capacity).
      const auto view_of = [&](int hl, int h) {
        const auto s = cache.seqs(hl, h);
        kvevict::HeadView<float> view;
        view.layer = hl;
        view.kv_head = h;
        view.head_dim = g.head_dim;
        view.group = g.group();
        view.size = s.size();
        view.capacity = o.capacity == PoolOptions::Capacity::share ? std::max(floor, s.size()) : B;
        view.positions = cache.positions(hl, h).data();
        view.seqs = s.data();
        view.incoming_seq = hl < l ? t + 1 : t;
        return view;
      };
      for (std::size_t j = 0; j < width; ++j) {
        const int hl = int((first + j) / hkv), h = int((first + j) % hkv);
        const auto s = cache.seqs(hl, h);
        seqs[j].assign(s.begin(), s.end());
        const kvevict::HeadView<float> view = view_of(hl, h);
        if (!s.empty()) copy.eviction_costs(view, costs[j]);
        if (o.share_exponent > 0.0 && !s.empty()) {
          // Share-scaled costs, written out: finite costs below FLT_MAX times (n / B)^e.
          const auto f = float(std::pow(double(s.size()) / double(B), o.share_exponent));
          for (float& c : costs[j])
            if (c < std::numeric_limits<float>::max())
              c = std::min(c * f, std::nextafter(std::numeric_limits<float>::max(), 0.0f));
        }
        floors.push_back(floor);
        ceilings.push_back(cache.max_rows(hl, h));
        before.push_back(s.size());
        incoming.push_back(hl == l ? 1 : 0);
      }
      // The amortised split: is this step one that keeps it?
      auto& pool_step = pool_steps[model ? 0 : std::size_t(l)];
      std::size_t held = 0;
      bool frozen = every > 1 && pool_step % every != 0;
      for (std::size_t j = 0; j < width; ++j) {
        held += before[j];
        if (incoming[j] == 1 && (before[j] == 0 || before[j] < floors[j] || before[j] > ceilings[j]))
          frozen = false;
      }
      frozen = frozen && held == total;
      ++pool_step;
      const std::size_t p = model ? 0 : std::size_t(l);
      std::vector<std::size_t> want;
      if (scheduled && frozen) {
        // The schedule's counts: a stepping head over its ceiling gives what it forces,
        // then one entry per incoming row left, skipping heads that would fall below their
        // floor or give their last row; running out means a re-split.
        want.assign(width, 0);
        std::size_t need = 0;
        for (std::size_t j = 0; j < width; ++j) {
          if (before[j] + incoming[j] > ceilings[j]) want[j] = before[j] + incoming[j] - ceilings[j];
          else need += incoming[j];
        }
        std::size_t at = read[p];
        for (; need > 0 && at < schedule[p].size(); ++at) {
          const std::size_t j = schedule[p][at];
          if (want[j] + 1 > before[j] || before[j] + incoming[j] < want[j] + 1 + floors[j]) continue;
          ++want[j];
          --need;
        }
        if (need > 0) {
          frozen = false;
          ++ran_out;
        } else {
          read[p] = at;
        }
      }
      if (!frozen || !scheduled) {
        const std::size_t extra = scheduled ? std::min(total, (every - 1) * hkv) : 0;
        want = brute_counts(costs, seqs, floors, ceilings, incoming, total, extra,
                            scheduled ? &schedule[p] : nullptr);
        read[p] = 0;
      }
      std::vector<std::int64_t> victim(width, -1);  // frozen: the seq each stepping head gives
      // Frozen::schedule, frozen: the seqs each named head gives, by its choose_victims.
      std::vector<std::vector<std::uint64_t>> gives(width);
      if (frozen && scheduled) {
        ++frozen_steps;
        Policy fresh = cache.policy();
        forget_ahead(fresh, cache.shape());  // decided from scratch, not from observe's
        for (std::size_t j = 0; j < width; ++j) {
          if (want[j] == 0) continue;
          const int hl = int((first + j) / hkv), h = int((first + j) % hkv);
          const auto s = cache.seqs(hl, h);
          kvevict::HeadView<float> view = view_of(hl, h);
          if (hl == l) {
            view.incoming_position = std::int64_t(t);
            view.incoming_key = k.data() + std::size_t(h) * std::size_t(g.head_dim);
          }
          view.need = want[j];
          std::vector<std::uint32_t> out;
          fresh.choose_victims(view, out);
          REQUIRE(out.size() == want[j]);
          multi_named += want[j] > 1;
          for (std::uint32_t r : out) gives[j].push_back(s[r]);
          std::sort(gives[j].begin(), gives[j].end());
        }
        // Rows moved between heads: a head gave other than its incoming rows.
        for (std::size_t j = 0; j < width; ++j) moved_frozen += want[j] != incoming[j];
      } else if (frozen) {
        ++frozen_steps;
        Policy fresh = cache.policy();  // the cache's policy as this append finds it
        forget_ahead(fresh, cache.shape());
        for (std::size_t j = 0; j < width; ++j) {
          want[j] = incoming[j];
          if (incoming[j] == 0) continue;
          const int h = int((first + j) % hkv);
          const auto s = cache.seqs(l, h);
          kvevict::HeadView<float> view = view_of(l, h);
          view.incoming_position = std::int64_t(t);
          view.incoming_key = k.data() + std::size_t(h) * std::size_t(g.head_dim);
          view.need = 1;
          std::vector<std::uint32_t> out;
          fresh.choose_victims(view, out);
          REQUIRE(out.size() == 1);
          victim[j] = std::int64_t(s[out[0]]);
        }
      } else {
        std::size_t need = 0;
        for (std::size_t x : want) need += x;
        split_steps += need > 0;
      }
      for (auto& e : evicted) e.clear();
      cache.append(l, std::int64_t(t), k, v);
      std::size_t rows = 0, alloc = 0;
      for (std::size_t j = 0; j < width; ++j) {
        const int hl = int((first + j) / hkv), h = int((first + j) % hkv);
        const std::size_t n = cache.size(hl, h);
        REQUIRE(n == before[j] + incoming[j] - want[j]);
        if (frozen && scheduled) {
          auto gone = evicted[first + j];
          std::sort(gone.begin(), gone.end());
          REQUIRE(gone == gives[j]);
        } else if (frozen) {
          const auto& gone = evicted[first + j];
          if (victim[j] < 0) REQUIRE(gone.empty());
          else REQUIRE(gone == std::vector<std::uint64_t>{std::uint64_t(victim[j])});
        }
        cross_layer += hl != l && want[j] > 0;
        rows += n;
        alloc += cache.allocated_rows(hl, h);
        if (t > 3 * B) {
          max_head = std::max(max_head, n);
          min_head = std::min(min_head, n);
          REQUIRE(n >= floor);
        }
      }
      REQUIRE(rows <= total);
      REQUIRE(alloc <= total + chunk_slack);
      for (int h = 0; h < g.n_kv_heads; ++h) {
        const auto probs = made_up_probs(g, h + l, cache.size(l, h), cache.seqs(l, h), t, rng);
        cache.observe(l, h, probs);
      }
    }
  }
  REQUIRE(bad_evictions == 0);
  kvtest::check_against_ledger(cache, ledger, true);  // kept rows bit-exact, each row once
  if (model) REQUIRE(cross_layer > 0);  // a step took rows from another layer
  REQUIRE(split_steps > 0);
  if (every > 1) REQUIRE(frozen_steps > 0);
  else REQUIRE(frozen_steps == 0);
  if (scheduled) REQUIRE(moved_frozen > 0);  // frozen steps moved rows between heads
  if (scheduled) REQUIRE(multi_named > 0);   // a named head gave several rows (evict_lowest_masked's 2-4)
  // DecayedAttention with the amortised split, share capacity: frozen steps' decisions on
  // pooled heads were taken ahead in observe (costed_ 2), and equal the from-scratch ones.
  if constexpr (std::is_same_v<Policy, pol::DecayedAttention>)
    if (every > 1 && o.capacity == PoolOptions::Capacity::share) REQUIRE(cache.policy().pooled_ahead_taken() > 20);
  (void)ran_out;
  if (expect_uneven) {
    REQUIRE(max_head > B + B / 4);  // the far-looking heads took rows from the local ones
    REQUIRE(min_head < B);
  }
}

TEST_CASE("pooled DecayedAttention: total, floors, protection, bit-exact rows, brute-force split", "[pool]") {
  using Cap = PoolOptions::Capacity;
  using Scope = PoolOptions::Scope;
  const auto rec = pol::DecayedAttention::recommended();
  SECTION("recommended(), nominal capacity") { drive_and_check(rec, 32, {}, 1, rec.recent_for(32), true); }
  SECTION("recommended(), floor 1/2") {
    drive_and_check(rec, 32, {.floor_fraction = 0.5}, 1, rec.recent_for(32), true);
  }
  SECTION("recommended(), share capacity, floor 1/4") {
    drive_and_check(rec, 32, {.floor_fraction = 0.25, .capacity = Cap::share}, 1, rec.recent_for(8), true);
  }
  SECTION("recommended(), share capacity, model scope") {
    drive_and_check(rec, 32, {.floor_fraction = 0.25, .capacity = Cap::share, .scope = Scope::model}, 1,
                    rec.recent_for(8), true);
  }
  SECTION("recommended(), share capacity, share-scaled costs, per layer") {
    drive_and_check(rec, 32, {.floor_fraction = 0.25, .capacity = Cap::share, .share_exponent = 0.5}, 1,
                    rec.recent_for(8), true);
  }
  SECTION("recommended(), share capacity, share-scaled costs, model scope") {
    drive_and_check(rec, 32,
                    {.floor_fraction = 0.25, .capacity = Cap::share, .scope = Scope::model, .share_exponent = 0.5},
                    1, rec.recent_for(8), true);
  }
  SECTION("recommended(), share capacity, model scope, share exponent 0.5 then 1 (set_budget at token 200)") {
    drive_and_check(rec, 32,
                    {.floor_fraction = 0.25, .capacity = Cap::share, .scope = Scope::model, .share_exponent = 0.5},
                    1, rec.recent_for(8), true, 1.0);
  }
  SECTION("H2O, share-scaled costs, model scope") {
    drive_and_check(pol::H2O({.recent = 4, .sinks = 1}), 16, {.scope = Scope::model, .share_exponent = 1.0}, 1, 4,
                    true);
  }
  SECTION("H2O") { drive_and_check(pol::H2O({.recent = 4, .sinks = 1}), 16, {.floor_fraction = 0.25}, 1, 4, true); }
  SECTION("H2O, model scope") {
    drive_and_check(pol::H2O({.recent = 4, .sinks = 1}), 16, {.scope = Scope::model}, 1, 4, true);
  }
  // The amortised split (PoolOptions::rebalance_every).
  SECTION("recommended(), share capacity, share-scaled costs, model scope, re-split every 8") {
    drive_and_check(rec, 32,
                    {.floor_fraction = 0.25, .capacity = Cap::share, .scope = Scope::model, .share_exponent = 0.5,
                     .rebalance_every = 8},
                    1, rec.recent_for(8), true);
  }
  SECTION("recommended(), share capacity, per layer, re-split every 3") {
    drive_and_check(rec, 32, {.floor_fraction = 0.25, .capacity = Cap::share, .rebalance_every = 3}, 1,
                    rec.recent_for(8), true);
  }
  SECTION("recommended(), nominal capacity, floor 1/2, re-split every 5") {
    drive_and_check(rec, 32, {.floor_fraction = 0.5, .rebalance_every = 5}, 1, rec.recent_for(32), true);
  }
  SECTION("H2O, model scope, re-split every 16") {
    drive_and_check(pol::H2O({.recent = 4, .sinks = 1}), 16,
                    {.floor_fraction = 0.25, .scope = Scope::model, .rebalance_every = 16}, 1, 4, true);
  }
  // The eviction schedule (PoolOptions::Frozen::schedule).
  using Frozen = PoolOptions::Frozen;
  SECTION("recommended(), share capacity, share-scaled costs, model scope, schedule every 8") {
    drive_and_check(rec, 32,
                    {.floor_fraction = 0.25, .capacity = Cap::share, .scope = Scope::model, .share_exponent = 0.5,
                     .rebalance_every = 8, .frozen = Frozen::schedule},
                    1, rec.recent_for(8), true);
  }
  SECTION("recommended(), share capacity, model scope, schedule every 32") {
    drive_and_check(rec, 32,
                    {.floor_fraction = 0.25, .capacity = Cap::share, .scope = Scope::model, .share_exponent = 0.5,
                     .rebalance_every = 32, .frozen = Frozen::schedule},
                    1, rec.recent_for(8), true);
  }
  SECTION("recommended(), share capacity, per layer, schedule every 3") {
    drive_and_check(rec, 32,
                    {.floor_fraction = 0.25, .capacity = Cap::share, .rebalance_every = 3, .frozen = Frozen::schedule},
                    1, rec.recent_for(8), true);
  }
  SECTION("recommended(), nominal capacity, floor 1/2, schedule every 5") {
    drive_and_check(rec, 32, {.floor_fraction = 0.5, .rebalance_every = 5, .frozen = Frozen::schedule}, 1,
                    rec.recent_for(32), true);
  }
  SECTION("recommended(), share capacity, model scope, schedule every 1/16 of the pool (every 4)") {
    drive_and_check(rec, 32,
                    {.floor_fraction = 0.25, .capacity = Cap::share, .scope = Scope::model, .share_exponent = 0.5,
                     .frozen = Frozen::schedule, .rebalance_fraction = 1.0 / 16},
                    1, rec.recent_for(8), true);
  }
  SECTION("recommended(), share capacity, per layer, schedule every 1/8 of the pool (every 4)") {
    drive_and_check(rec, 32,
                    {.floor_fraction = 0.25, .capacity = Cap::share, .frozen = Frozen::schedule,
                     .rebalance_fraction = 1.0 / 8},
                    1, rec.recent_for(8), true);
  }
  // PoolOptions::rebalance_min: the fraction's interval (4 here) below it re-splits on every
  // step; at or above it, unchanged.
  SECTION("recommended(), model scope, schedule 1/16 (every 4), min 5: every step") {
    drive_and_check(rec, 32,
                    {.floor_fraction = 0.25, .capacity = Cap::share, .scope = Scope::model, .share_exponent = 0.5,
                     .frozen = Frozen::schedule, .rebalance_fraction = 1.0 / 16, .rebalance_min = 5},
                    1, rec.recent_for(8), true);
  }
  SECTION("recommended(), per layer, schedule 1/8 (every 4), min 4: every 4") {
    drive_and_check(rec, 32,
                    {.floor_fraction = 0.25, .capacity = Cap::share, .frozen = Frozen::schedule,
                     .rebalance_fraction = 1.0 / 8, .rebalance_min = 4},
                    1, rec.recent_for(8), true);
  }
  SECTION("H2O, model scope, schedule every 16") {
    drive_and_check(pol::H2O({.recent = 4, .sinks = 1}), 16,
                    {.floor_fraction = 0.25, .scope = Scope::model, .rebalance_every = 16, .frozen = Frozen::schedule},
                    1, 4, true);
  }
  // PoolOptions::recommended() (whole cache, schedule 1/20, every step below 9): on this
  // geometry's 8 heads the interval is floor(total / 80), so 32 rows (total 256, interval 3)
  // re-split on every step and 128 rows (total 1024, interval 12) follow the schedule.
  SECTION("PoolOptions::recommended(), 32 rows: every step") {
    drive_and_check(rec, 32, PoolOptions::recommended(), 1, rec.recent_for(8), true);
  }
  SECTION("PoolOptions::recommended(), 128 rows: the schedule every 12") {
    drive_and_check(rec, 128, PoolOptions::recommended(), 1, rec.recent_for(32), true);
  }
  SECTION("PoolOptions::recommended() per layer, 128 rows (total 512, interval 6): every step") {
    PoolOptions o = PoolOptions::recommended();
    o.scope = Scope::layer;
    drive_and_check(rec, 128, o, 1, rec.recent_for(32), true);
  }
}

TEST_CASE("PoolOptions::recommended() is the setting the stories260K tables chose", "[pool]") {
  // The fields docs/quality.md's tables ran (headline_main.cpp's kPoolScaled with the
  // schedule, f = 1/20, m = 9); a change here must come with new tables.
  constexpr PoolOptions o = PoolOptions::recommended();
  STATIC_REQUIRE(o.scope == PoolOptions::Scope::model);
  STATIC_REQUIRE(o.capacity == PoolOptions::Capacity::share);
  STATIC_REQUIRE(o.frozen == PoolOptions::Frozen::schedule);
  CHECK(o.floor_fraction == 0.25);
  CHECK(o.share_exponent == 0.5);
  CHECK(o.rebalance_fraction == 1.0 / 20);
  CHECK(o.rebalance_min == 9);
  CHECK(o.rebalance_every == 1);
  // Accepted by Budget::pooled as is.
  CHECK_NOTHROW(Budget::uniform(16).pooled(o));
}

TEST_CASE("pooled budget without eviction costs keeps the nominal capacities", "[pool]") {
  // StreamingLLM has no comparable cost: the pooled budget is the uniform one.
  const Geometry g{1, 4, 2, 4};
  KVCache<pol::StreamingLLM> a(g, Budget::uniform(8).pooled(), pol::StreamingLLM{.sinks = 1});
  KVCache<pol::StreamingLLM> b(g, Budget::uniform(8), pol::StreamingLLM{.sinks = 1});
  REQUIRE_FALSE(a.pooled());
  kvtest::Rng rng(3);
  for (int t = 0; t < 40; ++t) {
    auto k = rng.normals(8), v = rng.normals(8);
    a.append(0, t, k, v);
    b.append(0, t, k, v);
  }
  for (int h = 0; h < 2; ++h) {
    const auto pa = a.positions(0, h), pb = b.positions(0, h);
    REQUIRE(std::equal(pa.begin(), pa.end(), pb.begin(), pb.end()));
  }
}

TEST_CASE("pooled PagedCache keeps exactly KVCache's rows", "[pool]") {
  const Geometry g{2, 4, 2, 8};
  // Layer scope, and model scope (steps evict rows of the other layer).
  const auto scope = GENERATE(PoolOptions::Scope::layer, PoolOptions::Scope::model);
  const std::size_t every = GENERATE(1, 4);  // and the amortised split
  const auto frozen = GENERATE(PoolOptions::Frozen::own, PoolOptions::Frozen::schedule);
  const auto budget = Budget::uniform(16).pooled(
      {.capacity = PoolOptions::Capacity::share, .scope = scope, .rebalance_every = every, .frozen = frozen});
  const auto policy = pol::DecayedAttention::recommended();
  kvevict::BlockPool<float> pool(1024, 4, g.head_dim);
  KVCache<pol::DecayedAttention> cache(g, budget, policy);
  kvevict::PagedCache<pol::DecayedAttention> paged(g, budget, pool, 0, policy);
  kvtest::Rng rng(11);
  const std::size_t kv = std::size_t(g.n_kv_heads * g.head_dim), qn = std::size_t(g.n_heads * g.head_dim);
  bool moved = false;
  for (int t = 0; t < 120; ++t)
    for (int l = 0; l < g.n_layers; ++l) {
      auto k = rng.normals(kv, 1.0f + float(t % 3)), v = rng.normals(kv), q = rng.normals(qn, 2.0f);
      cache.append(l, t, k, v, q);
      paged.append(l, t, k, v, q);
      for (int hl = 0; hl < g.n_layers; ++hl)
        for (int h = 0; h < g.n_kv_heads; ++h) {
          const auto pc = cache.positions(hl, h), pp = paged.positions(hl, h);
          REQUIRE(std::equal(pc.begin(), pc.end(), pp.begin(), pp.end()));
          moved |= pc.size() != 16;
        }
      const auto att = kvevict::attend(cache, l, q);
      for (int h = 0; h < g.n_kv_heads; ++h) {
        const auto& p = att.probs[std::size_t(h)];
        paged.observe(l, h, std::span<const float>(p.data(), std::size_t(p.size())));
      }
    }
  REQUIRE(moved);
}

TEST_CASE("pooled set_budget: a smaller pool evicts across heads, back to uniform caps each head", "[pool]") {
  const Geometry g{1, 4, 2, 4};
  KVCache<pol::DecayedAttention> c(g, Budget::uniform(24), pol::DecayedAttention::recommended());
  kvtest::Rng rng(5);
  for (int t = 0; t < 60; ++t) {
    auto k = rng.normals(8), v = rng.normals(8);
    c.append(0, t, k, v);
    for (int h = 0; h < 2; ++h) {
      const auto probs = made_up_probs(g, h, c.size(0, h), c.seqs(0, h), std::uint64_t(t), rng);
      c.observe(0, h, probs);
    }
  }
  c.set_budget(Budget::uniform(16).pooled());
  REQUIRE(c.pooled());
  REQUIRE(c.size(0, 0) + c.size(0, 1) <= 32);
  REQUIRE(c.allocated_rows(0, 0) + c.allocated_rows(0, 1) <= 32 + 4 * kd::pool_chunk(16));
  for (int t = 60; t < 120; ++t) {
    auto k = rng.normals(8), v = rng.normals(8);
    c.append(0, t, k, v);
    REQUIRE(c.size(0, 0) + c.size(0, 1) <= 32);
    for (int h = 0; h < 2; ++h) {
      const auto probs = made_up_probs(g, h, c.size(0, h), c.seqs(0, h), std::uint64_t(t), rng);
      c.observe(0, h, probs);
    }
  }
  REQUIRE(c.size(0, 0) != c.size(0, 1));
  c.set_budget(Budget::uniform(12));
  REQUIRE_FALSE(c.pooled());
  REQUIRE(c.size(0, 0) <= 12);
  REQUIRE(c.size(0, 1) <= 12);
  REQUIRE(c.allocated_rows(0, 0) <= 12);
}

TEST_CASE("amortised split: set_budget restarts the pool's steps, so the next step re-splits", "[pool]") {
  // A pool that re-splits only every 2^20 steps keeps its split once full; after set_budget
  // its next step is step 0 and decides as an every-step pool in the same state does.
  const Geometry g{2, 4, 2, 4};
  const auto options = [](std::size_t every) {
    return PoolOptions{.floor_fraction = 0.25, .capacity = PoolOptions::Capacity::share,
                       .scope = PoolOptions::Scope::model, .rebalance_every = every};
  };
  const Budget rare = Budget::uniform(12).pooled(options(std::size_t{1} << 20));
  const Budget every_step = Budget::uniform(12).pooled(options(1));
  KVCache<pol::DecayedAttention> a(g, rare, pol::DecayedAttention::recommended());
  kvtest::Rng rng(9);
  std::size_t moved = 0, kept = 0;
  for (int t = 0; t < 120; ++t)
    for (int l = 0; l < g.n_layers; ++l) {
      auto k = rng.normals(8), v = rng.normals(8);
      if (t > 40 && t % 5 == 0) {
        KVCache<pol::DecayedAttention> reset = a, reference = a;
        reset.set_budget(rare);
        reference.set_budget(every_step);
        reset.append(l, t, k, v);
        reference.append(l, t, k, v);
        bool same_split = true;
        for (int hl = 0; hl < g.n_layers; ++hl)
          for (int h = 0; h < g.n_kv_heads; ++h) {
            const auto pr = reset.positions(hl, h), pf = reference.positions(hl, h);
            REQUIRE(std::equal(pr.begin(), pr.end(), pf.begin(), pf.end()));
            same_split &= reset.size(hl, h) == a.size(hl, h);
          }
        moved += !same_split;
      }
      std::vector<std::size_t> sizes;
      for (int h = 0; h < g.n_kv_heads; ++h) sizes.push_back(a.size(l, h));
      a.append(l, t, k, v);
      if (t > 40) {  // full: the split stays
        for (int h = 0; h < g.n_kv_heads; ++h) REQUIRE(a.size(l, h) == sizes[std::size_t(h)]);
        ++kept;
      }
      for (int h = 0; h < g.n_kv_heads; ++h) {
        const auto probs = made_up_probs(g, h + 2 * l, a.size(l, h), a.seqs(l, h), std::uint64_t(t), rng);
        a.observe(l, h, probs);
      }
    }
  REQUIRE(kept > 0);
  REQUIRE(moved > 0);  // the re-split after set_budget moved rows between heads
}

TEST_CASE("amortised split: a head below its floor grows on every step, frozen or not", "[pool]") {
  // A floor-0 pool lets the local heads shrink far; a floor-3/4 pool set on top of it (same
  // total, so still full; re-split only every 2^20 steps) must still give each of them a
  // row per step until it reaches its floor: the frozen split cannot hold there, so those
  // steps re-split.
  const Geometry g{1, 4, 4, 4};
  const auto opts = [](double floor, std::size_t every) {
    return PoolOptions{.floor_fraction = floor, .capacity = PoolOptions::Capacity::share, .rebalance_every = every};
  };
  KVCache<pol::DecayedAttention> c(g, Budget::uniform(24).pooled(opts(0.0, 1)), pol::DecayedAttention::recommended());
  kvtest::Rng rng(5);
  const auto step = [&](int t) {
    auto k = rng.normals(16), v = rng.normals(16);
    c.append(0, t, k, v);
    for (int h = 0; h < 4; ++h) {
      const auto probs = made_up_probs(g, h, c.size(0, h), c.seqs(0, h), std::uint64_t(t), rng);
      c.observe(0, h, probs);
    }
  };
  const auto rows = [&] {
    std::size_t n = 0;
    for (int h = 0; h < 4; ++h) n += c.size(0, h);
    return n;
  };
  int t = 0;
  for (; t < 100; ++t) step(t);
  REQUIRE(rows() == 96);
  REQUIRE(std::min(c.size(0, 1), c.size(0, 3)) < 16);
  c.set_budget(Budget::uniform(24).pooled(opts(0.75, std::size_t{1} << 20)));
  REQUIRE(rows() == 96);  // still full: no step below may keep its split while a head is below 18
  std::size_t grew = 0;
  for (int end = t + 40; t < end; ++t) {
    std::size_t before[4];
    for (int h = 0; h < 4; ++h) before[h] = c.size(0, h);
    step(t);
    REQUIRE(rows() <= 96);
    for (int h = 0; h < 4; ++h)
      if (before[h] < 18) {
        REQUIRE(c.size(0, h) == before[h] + 1);
        ++grew;
      }
  }
  REQUIRE(grew > 2);  // steps after the first (the re-split of step 0) grew them too
}

TEST_CASE("amortised split: a pool that never re-splits once full decides as the uniform budget", "[pool]") {
  // Every head fills to B together; from then on every step keeps the split (k % 2^20 != 0)
  // and each head gives one row by its own choice at capacity B: the uniform budget's steps.
  const Geometry g{3, 4, 2, 4};
  const auto scope = GENERATE(PoolOptions::Scope::layer, PoolOptions::Scope::model);
  const Budget rare = Budget::uniform(16).pooled(
      {.floor_fraction = 0.25, .capacity = PoolOptions::Capacity::share, .scope = scope,
       .share_exponent = 0.5, .rebalance_every = std::size_t{1} << 20});
  KVCache<pol::DecayedAttention> a(g, rare, pol::DecayedAttention::recommended());
  KVCache<pol::DecayedAttention> u(g, Budget::uniform(16), pol::DecayedAttention::recommended());
  kvtest::Rng rng(13);
  for (int t = 0; t < 150; ++t)
    for (int l = 0; l < g.n_layers; ++l) {
      auto k = rng.normals(8), v = rng.normals(8);
      a.append(l, t, k, v);
      u.append(l, t, k, v);
      for (int h = 0; h < g.n_kv_heads; ++h) {
        const auto pa = a.positions(l, h), pu = u.positions(l, h);
        REQUIRE(std::equal(pa.begin(), pa.end(), pu.begin(), pu.end()));
        const auto probs = made_up_probs(g, h + l, u.size(l, h), u.seqs(l, h), std::uint64_t(t), rng);
        a.observe(l, h, probs);
        u.observe(l, h, probs);
      }
    }
}

TEST_CASE("pooled budgets: bad input is a kvevict::Error, save refuses", "[pool]") {
  using kvevict::Error;
  REQUIRE_THROWS_AS(Budget::unbounded().pooled(), Error);
  REQUIRE_THROWS_WITH(Budget::uniform(8).pooled({.floor_fraction = 1.5}), Catch::Contains("floor_fraction = 1.5"));
  REQUIRE_THROWS_AS(Budget::uniform(8).pooled({.floor_fraction = std::nan("")}), Error);
  REQUIRE_THROWS_WITH(Budget::uniform(8).pooled({.share_exponent = -0.5}), Catch::Contains("share_exponent = -0.5"));
  REQUIRE_THROWS_WITH(Budget::uniform(8).pooled({.share_exponent = 9.0}), Catch::Contains("expected in [0, 8]"));
  REQUIRE_THROWS_AS(Budget::uniform(8).pooled({.share_exponent = std::nan("")}), Error);
  REQUIRE_THROWS_WITH(Budget::uniform(8).pooled({.rebalance_every = 0}), Catch::Contains("rebalance_every = 0"));
  REQUIRE_THROWS_WITH(Budget::uniform(8).pooled({.rebalance_every = (std::size_t{1} << 20) + 1}),
                      Catch::Contains("rebalance_every = 1048577"));
  REQUIRE_NOTHROW(Budget::uniform(8).pooled({.rebalance_every = std::size_t{1} << 20}));
  REQUIRE_THROWS_WITH(Budget::uniform(8).pooled({.frozen = PoolOptions::Frozen(7)}), Catch::Contains("frozen = 7"));
  REQUIRE_THROWS_WITH(Budget::uniform(8).pooled({.rebalance_fraction = 1.5}),
                      Catch::Contains("rebalance_fraction = 1.5"));
  REQUIRE_THROWS_AS(Budget::uniform(8).pooled({.rebalance_fraction = -0.1}), Error);
  REQUIRE_THROWS_AS(Budget::uniform(8).pooled({.rebalance_fraction = std::nan("")}), Error);
  REQUIRE_THROWS_WITH(Budget::uniform(8).pooled({.rebalance_min = (std::size_t{1} << 20) + 1}),
                      Catch::Contains("rebalance_min = 1048577"));
  REQUIRE_NOTHROW(Budget::uniform(8).pooled({.rebalance_min = std::size_t{1} << 20}));
  const Geometry g{1, 2, 2, 4};
  KVCache<pol::H2O> c(g, Budget::uniform(8).pooled(), pol::H2O({.recent = 2}));
  REQUIRE_THROWS_WITH(kvevict::save_bytes(c), Catch::Contains("pooled"));
  KVCache<pol::H2O> plain(g, Budget::uniform(8), pol::H2O({.recent = 2}));
  const auto bytes = kvevict::save_bytes(plain);
  REQUIRE_THROWS_WITH(kvevict::load_bytes(c, bytes), Catch::Contains("pooled"));
  // A budget below the policy's protected rows is still refused per head.
  REQUIRE_THROWS_AS(KVCache<pol::H2O>(g, Budget::uniform(2).pooled(), pol::H2O({.recent = 2})), Error);
  // IndexCache sizes its cells for the largest share a head can take.
  kvevict::IndexCache<pol::H2O> ic(g, Budget::uniform(8).pooled(), pol::H2O({.recent = 2}));
  REQUIRE(ic.cells_per_head() == ic.max_rows(0, 0) + 1);
  REQUIRE(ic.max_rows(0, 0) == 16 - 3);
  // ... but refuses a model-scope pool (its engine locates only the appended layer's rows).
  REQUIRE_THROWS_WITH(kvevict::IndexCache<pol::H2O>(g, Budget::uniform(8).pooled({.scope = PoolOptions::Scope::model}),
                                                    pol::H2O({.recent = 2})),
                      Catch::Contains("scope model"));

}

}  // namespace

namespace {

// A profile where KV head h of layer l puts a share of its attention on the sink (position
// 0) and the rest at age a(l, h): head typing must rank by the mass beyond the window,
// never counting the sink.
kvevict::AttentionAgeProfile synthetic_profile(const Geometry& g, const std::vector<std::size_t>& age,
                                               float sink_share) {
  kvevict::AttentionAgeProfile p(g, 64);
  for (int l = 0; l < g.n_layers; ++l)
    for (int h = 0; h < g.n_kv_heads; ++h) {
      const std::size_t a = age[std::size_t(l * g.n_kv_heads + h)];
      const std::int64_t q = 60;
      const std::vector<std::int64_t> pos{0, q - std::int64_t(a)};
      std::vector<float> probs;
      for (int k = 0; k < g.group(); ++k) {
        probs.push_back(sink_share);
        probs.push_back(1.0f - sink_share);
      }
      p.add(l, h, q, pos, probs);
    }
  return p;
}

}  // namespace

TEST_CASE("head typing: far-looking heads keep the long cache, the sink is not far mass, totals hold", "[pool]") {
  const Geometry g{2, 4, 2, 4};
  // Ages: layer 0 heads 2 and 30; layer 1 heads 40 and 1. Every head also draws 0.6 on
  // the sink (position 0, age 60): counted as far, it would make every head alike.
  const auto p = synthetic_profile(g, {2, 30, 40, 1}, 0.6f);
  const auto rows = p.type_heads_rows(16, {.retrieval_fraction = 0.5, .stream_fraction = 0.25});
  REQUIRE(rows == std::vector<std::vector<long long>>{{4, 28}, {28, 4}});
  REQUIRE(p.mass_beyond_window(0, 0, 4) == Approx(0.0));
  REQUIRE(p.mass_beyond_window(0, 1, 4) == Approx(0.4));
  // Totals are exact with a remainder: 3 of 4 heads retrieval.
  const auto r3 = p.type_heads_rows(10, {.retrieval_fraction = 0.75, .stream_fraction = 0.5});
  long long total = 0;
  for (const auto& l : r3)
    for (long long x : l) total += x;
  REQUIRE(total == 40);
  REQUIRE(r3[1][1] == 5);  // the one local head keeps sink + window
  REQUIRE_THROWS_AS(p.type_heads(16, {.retrieval_fraction = 0.0}), kvevict::Error);
  REQUIRE_THROWS_AS(p.type_heads(16, {.stream_fraction = 1.5}), kvevict::Error);
  // per_layer allocation keeps each layer's total; the global one moves rows across layers.
  const auto pl = p.allocate_rows(16, {.floor = 4, .per_layer = true});
  REQUIRE(pl[0][0] + pl[0][1] == 32);
  REQUIRE(pl[1][0] + pl[1][1] == 32);
}

// The two-pass path: the same policy with its pooled_victims hook hidden, so the core
// calls choose_victims (a second protection pass) after eviction_costs.
template <class P>
struct TwoPass : P {
  explicit TwoPass(const P& p) : P(p) {}
  template <class S>
  void pooled_victims(const kvevict::HeadView<S>&, std::vector<std::uint32_t>&) = delete;
};
static_assert(kd::HasPooledVictims<pol::DecayedAttention> && kd::HasPooledVictims<pol::H2O>);
static_assert(!kd::HasPooledVictims<TwoPass<pol::DecayedAttention>>);

// Runs the single-pass cache (pooled_victims) and the two-pass one on the same random
// stream and requires identical rows after every append and every budget change. Small
// budgets, so a head often gives several rows at once and the recall reserve is often
// bounded by what must stay evictable (the case where the kept protection cannot be reused).
template <class Policy>
std::size_t compare_passes(const Policy& policy, std::size_t B, PoolOptions o, std::uint64_t seed) {
  const Geometry g{2, 8, 4, 8};
  const Budget budget = Budget::uniform(static_cast<long long>(B)).pooled(o);
  KVCache<Policy> one(g, budget, policy);
  KVCache<TwoPass<Policy>> two(g, budget, TwoPass<Policy>(policy));
  REQUIRE(one.pooled());
  REQUIRE(two.pooled());
  kvtest::Rng rng(seed);
  const std::size_t kv = std::size_t(g.n_kv_heads * g.head_dim);
  std::size_t multi = 0;  // (head, step) pairs that gave two or more rows at once
  std::size_t shrinks = 0;
  const auto same = [&](const char* when, std::uint64_t t) {
    for (int l = 0; l < g.n_layers; ++l)
      for (int h = 0; h < g.n_kv_heads; ++h) {
        const auto a = one.seqs(l, h), b = two.seqs(l, h);
        INFO(when << " t " << t << " layer " << l << " head " << h);
        REQUIRE(std::equal(a.begin(), a.end(), b.begin(), b.end()));
      }
  };
  for (std::uint64_t t = 0; t < 110; ++t) {
    for (int l = 0; l < g.n_layers; ++l) {
      std::vector<std::size_t> before;
      for (int h = 0; h < g.n_kv_heads; ++h) before.push_back(one.size(l, h));
      // Repeated keys now and then, so RecallDedup's signatures collide.
      auto k = rng.chance(0.3) ? std::vector<float>(kv, 0.5f) : rng.normals(kv);
      auto v = rng.normals(kv);
      one.append(l, std::int64_t(t), k, v);
      two.append(l, std::int64_t(t), k, v);
      same("append", t);
      for (int h = 0; h < g.n_kv_heads; ++h) multi += before[std::size_t(h)] + 1 >= one.size(l, h) + 2;
      for (int h = 0; h < g.n_kv_heads; ++h) {
        const auto probs = made_up_probs(g, h + int(t % 3), one.size(l, h), one.seqs(l, h), t, rng);
        one.observe(l, h, probs);
        two.observe(l, h, probs);
      }
    }
    if (t == 60 || t == 85) {  // a smaller pool, then the original: many rows per head at once
      // (A pooled shrink used to refuse with std::logic_error when the recall reserve
      // protected too much: neither path may refuse now.)
      const Budget b = t == 60 ? Budget::uniform(static_cast<long long>(B * 5 / 6)).pooled(o) : budget;
      bool threw_one = false, threw_two = false;
      try {
        one.set_budget(b);
      } catch (const std::logic_error&) {
        threw_one = true;
      }
      try {
        two.set_budget(b);
      } catch (const std::logic_error&) {
        threw_two = true;
      }
      REQUIRE_FALSE(threw_one);
      REQUIRE_FALSE(threw_two);
      shrinks += t == 60;
      same("set_budget", t);
    }
  }
  REQUIRE(shrinks == 1);
  return multi;
}

TEST_CASE("pooled_victims (one protection pass) decides exactly as the two-pass path", "[pool]") {
  using Cap = PoolOptions::Capacity;
  using Scope = PoolOptions::Scope;
  using DA = pol::DecayedAttention;
  const auto cap = GENERATE(Cap::nominal, Cap::share);
  const auto scope = GENERATE(Scope::layer, Scope::model);
  const PoolOptions o{.floor_fraction = 0.25, .capacity = cap, .scope = scope};
  std::size_t multi = 0;
  multi += compare_passes(DA::recommended(), 12, o, 1);
  multi += compare_passes(DA::recommended(), 24, o, 2);
  // A large reserve, so it is often bounded by the rows that must stay evictable.
  multi += compare_passes(DA({.sinks = 1, .horizon = 2.0f, .recent_fraction = 0.25f, .recall_fraction = 0.5f}),
                          12, o, 3);
  multi += compare_passes(DA({.sinks = 1, .horizon = 3.0f, .recent_fraction = 0.25f, .recall_fraction = 0.4f,
                              .recall_rank = DA::RecallRank::excess}),
                          16, o, 4);
  multi += compare_passes(DA({.sinks = 1, .horizon = 3.0f, .recent_fraction = 0.25f, .recall_fraction = 0.4f,
                              .recall_dedup = DA::RecallDedup::reserve, .rope = pol::RopeLayout::none}),
                          16, o, 5);
  multi += compare_passes(DA({.sinks = 1, .horizon = 3.0f, .recent_fraction = 0.25f, .recall_fraction = 0.4f,
                              .recall_dedup = DA::RecallDedup::protected_rows, .rope = pol::RopeLayout::none}),
                          16, o, 6);
  multi += compare_passes(pol::H2O({.recent = 3, .sinks = 1}), 12, o, 7);
  REQUIRE(multi > 20);  // heads gave several rows in one decode step
}

// pooled_victims called directly, for any need (the container only asks a head for rows its
// costs marked finite; here need may pass them): the victims equal choose_victims' on a copy
// of the policy, or both refuse.
TEST_CASE("pooled_victims equals choose_victims for every need, reserve bounded or not", "[pool]") {
  using DA = pol::DecayedAttention;
  const Geometry g{1, 4, 2, 8};
  kvtest::Rng rng(21);
  std::size_t compared = 0, recomputed_reserve = 0, reserved = 0;
  for (const auto dedup : {DA::RecallDedup::none, DA::RecallDedup::reserve}) {
    const DA policy({.sinks = 1, .horizon = 3.0f, .recent_fraction = 0.25f, .recall_fraction = 0.5f,
                     .recall_dedup = dedup, .rope = pol::RopeLayout::none});
    KVCache<DA> cache(g, Budget::uniform(40), policy);
    for (std::uint64_t t = 0; t < 40; ++t) {
      auto k = rng.chance(0.3) ? std::vector<float>(16, 0.5f) : rng.normals(16);
      cache.append(0, std::int64_t(t), k, rng.normals(16));
      for (int h = 0; h < 2; ++h)
        cache.observe(0, h, made_up_probs(g, h + int(t % 2), cache.size(0, h), cache.seqs(0, h), t, rng));
    }
    for (int h = 0; h < 2; ++h)
      for (std::size_t capacity = 12; capacity <= 40; capacity += 4)
        for (std::size_t need = 1; need <= 36; ++need) {
          const auto s = cache.seqs(0, h);
          const auto p = cache.positions(0, h);
          kvevict::HeadView<float> view;
          view.layer = 0;
          view.kv_head = h;
          view.head_dim = g.head_dim;
          view.group = g.group();
          view.size = s.size();
          view.capacity = capacity;
          view.positions = p.data();
          view.seqs = s.data();
          view.incoming_seq = 40;
          DA one = cache.policy(), two = cache.policy();
          std::vector<float> costs;
          one.eviction_costs(view, costs);
          // Open rows: neither protected (+infinity) nor in the reserve (FLT_MAX, evicted
          // by a pool only after every open row).
          const auto finite = std::size_t(std::count_if(
              costs.begin(), costs.end(), [](float c) { return c < std::numeric_limits<float>::max(); }));
          reserved += std::size_t(std::count(costs.begin(), costs.end(), std::numeric_limits<float>::max()));
          // +infinity exactly for the sink (seq 0) and the recent band (arrived at or after
          // incoming - recent), written out from the seqs.
          const std::size_t recent = one.recent_for(capacity);
          std::size_t wrong_protection = 0;
          for (std::size_t r = 0; r < costs.size(); ++r)
            wrong_protection += (costs[r] == std::numeric_limits<float>::infinity()) != (s[r] < 1 || s[r] + recent >= 40);
          REQUIRE(wrong_protection == 0);
          view.need = need;
          std::vector<std::uint32_t> a, b;
          bool threw_a = false, threw_b = false;
          try {
            one.pooled_victims(view, a);
          } catch (const std::logic_error&) {
            threw_a = true;
          }
          try {
            two.choose_victims(view, b);
          } catch (const std::logic_error&) {
            threw_b = true;
          }
          INFO("dedup " << int(dedup) << " head " << h << " capacity " << capacity << " need " << need);
          REQUIRE(threw_a == threw_b);
          std::sort(a.begin(), a.end());
          std::sort(b.begin(), b.end());
          REQUIRE(a == b);
          ++compared;
          recomputed_reserve += !threw_b && need > finite;
        }
  }
  REQUIRE(compared > 500);
  REQUIRE(recomputed_reserve > 20);  // needs past the reused protection's open rows
  REQUIRE(reserved > 100);           // reserve rows carry the highest finite cost
}

TEST_CASE("pooled set_budget: a large shrink evicts reserve rows too, never a logic_error", "[pool]") {
  // Issue #16/#17: the costs pass marked the recall reserve +infinity as if one row were
  // needed, so a pool shrinking by more than its unreserved rows threw std::logic_error.
  using Cap = PoolOptions::Capacity;
  using Scope = PoolOptions::Scope;
  const auto cap = GENERATE(Cap::nominal, Cap::share);
  const auto scope = GENERATE(Scope::layer, Scope::model);
  const auto to = GENERATE(8, 4, 3, 2);
  const Geometry g{2, 4, 2, 4};
  PoolOptions o;
  o.scope = scope;
  o.capacity = cap;
  KVCache<pol::DecayedAttention> c(g, Budget::uniform(12).pooled(o), pol::DecayedAttention::recommended());
  kvtest::Rng rng(11);
  const auto step = [&](int t) {
    for (int l = 0; l < g.n_layers; ++l) {
      auto k = rng.normals(8), v = rng.normals(8);
      c.append(l, t, k, v);
      for (int h = 0; h < g.n_kv_heads; ++h) {
        const auto probs = made_up_probs(g, h + l, c.size(l, h), c.seqs(l, h), std::uint64_t(t), rng);
        c.observe(l, h, probs);
      }
    }
  };
  for (int t = 0; t < 80; ++t) step(t);
  INFO("to " << to);
  c.set_budget(Budget::uniform(to).pooled(o));
  std::size_t all = 0;
  for (int l = 0; l < g.n_layers; ++l) {
    std::size_t layer = 0;
    for (int h = 0; h < g.n_kv_heads; ++h) layer += c.size(l, h);
    if (scope == Scope::layer) REQUIRE(layer <= std::size_t(2 * to));
    all += layer;
  }
  REQUIRE(all <= std::size_t(4 * to));
  for (int t = 80; t < 120; ++t) step(t);
}

// evict_lowest_masked (policies/common.hpp), written out: the `need` open rows (bit clear)
// with the lowest (score, seq). Scores drawn from a few values so ties are common, rows
// protected at random; need 1 to 8 (1: the masked argmin, 2-4: lowest_masked_seq4 in one
// pass, more: the general path). Also: too few open rows is a logic_error.
TEST_CASE("evict_lowest_masked picks the need lowest open (score, seq), ties included", "[pool]") {
  kvtest::Rng rng(42);
  std::size_t compared = 0, few = 0, refused = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    const std::size_t n = 1 + std::size_t(std::size_t(rng.uniform(0, (long long)(200) - 1)));
    std::vector<float> sc(n);
    std::vector<std::uint64_t> seqs(n);
    for (std::size_t r = 0; r < n; ++r) {
      sc[r] = float(std::size_t(rng.uniform(0, (long long)(trial % 3 == 0 ? 3 : 40) - 1))) * 0.25f;
      seqs[r] = r;
    }
    for (std::size_t r = n; r > 1; --r) std::swap(seqs[r - 1], seqs[std::size_t(std::size_t(rng.uniform(0, (long long)(r) - 1)))]);  // arrival order shuffled
    std::vector<std::uint64_t> bits((n + 63) / 64, 0);
    const double p = trial % 4 == 0 ? 0.9 : 0.3;
    for (std::size_t r = 0; r < n; ++r)
      if (rng.chance(p)) bits[r >> 6] |= std::uint64_t{1} << (r & 63);
    for (std::size_t r = n; r < bits.size() * 64; ++r) bits[r >> 6] |= std::uint64_t{1} << (r & 63);
    std::vector<std::pair<std::pair<float, std::uint64_t>, std::uint32_t>> open;
    for (std::size_t r = 0; r < n; ++r)
      if (((bits[r >> 6] >> (r & 63)) & 1u) == 0) open.push_back({{sc[r], seqs[r]}, std::uint32_t(r)});
    std::sort(open.begin(), open.end());
    kvevict::HeadView<float> view;
    view.size = n;
    view.seqs = seqs.data();
    view.need = 1 + std::size_t(std::size_t(rng.uniform(0, (long long)(8) - 1)));
    std::vector<std::uint32_t> out;
    if (open.size() < view.need) {
      REQUIRE_THROWS_AS(pol::detail::evict_lowest_masked(view, sc.data(), bits.data(), out, "Test"), std::logic_error);
      ++refused;
      continue;
    }
    pol::detail::evict_lowest_masked(view, sc.data(), bits.data(), out, "Test");
    std::vector<std::uint32_t> want;
    for (std::size_t i = 0; i < view.need; ++i) want.push_back(open[i].second);
    std::sort(out.begin(), out.end());
    std::sort(want.begin(), want.end());
    REQUIRE(out == want);
    ++compared;
    few += view.need >= 2 && view.need <= 4;
  }
  REQUIRE(compared > 2000);
  REQUIRE(few > 500);
  REQUIRE(refused > 50);
}
