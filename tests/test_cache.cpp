// KVCache invariants under long random operation sequences, for every baseline: size
// within capacity, promised sinks/window present, unique positions, bit-exact rows, every
// evicted row reported exactly once and kept ∪ evicted = appended; plus storage that
// follows the budget and side data that follows its row.
#include <catch2/catch.hpp>

#include "support/test_support.hpp"

using namespace kvevict;
using kvtest::Ledger;
using kvtest::random_budget;
using kvtest::random_geometry;
using kvtest::Rng;
using kvtest::str;

namespace {

/// What a policy promises about protected rows, in arrival order (seq).
struct Promise {
  std::size_t sinks = 0;
  std::size_t recent = 0;       ///< the last `recent` tokens are always kept
  bool rest_is_window = false;  ///< StreamingLLM: non-sink rows are exactly the newest ones
  bool keeps_all = false;       ///< FullCache / Oracle
};

template <class Cache>
std::string promise_violation(const Cache& cache, const Promise& pr) {
  const auto& g = cache.geometry();
  std::ostringstream err;
  for (int l = 0; l < g.n_layers; ++l) {
    const std::uint64_t seen = cache.tokens_seen(l);
    for (int h = 0; h < g.n_kv_heads; ++h) {
      err << "layer " << l << " head " << h << " seen " << seen << ": ";
      auto s = cache.seqs(l, h);
      std::vector<std::uint64_t> seqs(s.begin(), s.end());
      std::sort(seqs.begin(), seqs.end());
      auto has = [&](std::uint64_t q) { return std::binary_search(seqs.begin(), seqs.end(), q); };
      if (pr.keeps_all) {
        if (seqs.size() != seen) return str(err << "kept " << seqs.size() << " rows");
        err.str("");
        continue;
      }
      for (std::uint64_t q = 0; q < std::min<std::uint64_t>(pr.sinks, seen); ++q)
        if (!has(q)) return str(err << "sink " << q << " missing");
      for (std::uint64_t q = seen - std::min<std::uint64_t>(pr.recent, seen); q < seen; ++q)
        if (!has(q)) return str(err << "recent token " << q << " missing");
      if (pr.rest_is_window) {
        // The non-sink rows are the newest tokens, contiguous up to the last one.
        std::uint64_t expect = seen;
        for (auto it = seqs.rbegin(); it != seqs.rend() && *it >= pr.sinks; ++it)
          if (*it != --expect) return str(err << "window has a hole at " << expect);
      }
      err.str("");
    }
  }
  return "";
}

template <class Cache>
void check_promise(const Cache& cache, const Promise& pr) {
  const std::string v = promise_violation(cache, pr);
  INFO(v);
  REQUIRE(v.empty());
}

/// Runs `steps` random operations (appends with and without attention, prefills,
/// set_budget shrinks and grows) and checks every invariant after each one.
template <class Policy, class Scalar = float>
void run_sequence(std::uint64_t seed, Policy policy, const Promise& promise, bool bounded,
                  int steps) {
  Rng rng(seed);
  const Geometry g = random_geometry(rng);
  const std::size_t lo = policy.min_capacity();
  const std::size_t hi = lo + 24;
  INFO("seed " << seed << " geometry L" << g.n_layers << " H" << g.n_heads << " Hkv" << g.n_kv_heads
               << " d" << g.head_dim);
  std::vector<std::size_t> caps;
  const Budget budget = bounded ? random_budget(rng, g, lo, hi, &caps) : Budget::unbounded();
  KVCache<Policy, Scalar> cache(g, budget, policy);
  Ledger ledger;
  cache.set_eviction_callback(ledger.template callback<Scalar>());
  const auto d = static_cast<std::size_t>(g.head_dim);
  const std::size_t kv = static_cast<std::size_t>(g.n_kv_heads) * d;
  const std::size_t qn = static_cast<std::size_t>(g.n_heads) * d;
  std::vector<std::int64_t> next_pos(static_cast<std::size_t>(g.n_layers));
  for (auto& p : next_pos) p = rng.uniform(-5, 5);
  constexpr bool needs_queries = Policy::signals != Signals::none;
  int shrinks = 0, grows = 0, prefills = 0;

  for (int step = 0; step < steps; ++step) {
    INFO("step " << step);
    const int layer = static_cast<int>(rng.uniform(0, g.n_layers - 1));
    auto& pos = next_pos[static_cast<std::size_t>(layer)];
    const auto op = rng.uniform(0, 99);
    if (op < 72) {
      const auto k = rng.normals(kv), v = rng.normals(kv), q = rng.normals(qn);
      ledger.record(g, layer, pos, cache.tokens_seen(layer), k, v);
      cache.append(layer, pos, k, v,
                   rng.chance(0.5) ? std::span<const float>(q) : std::span<const float>());
      if (rng.chance(0.8)) attend(cache, layer, q);
      pos += rng.uniform(1, 3);
    } else if (op < 86) {
      const std::size_t t =
          static_cast<std::size_t>(rng.uniform(1, static_cast<long long>(hi) + 8));
      const auto k = rng.normals(t * kv), v = rng.normals(t * kv), q = rng.normals(t * qn);
      for (std::size_t i = 0; i < t; ++i)
        ledger.record(g, layer, pos + static_cast<std::int64_t>(i), cache.tokens_seen(layer) + i,
                      std::span<const float>(k).subspan(i * kv, kv),
                      std::span<const float>(v).subspan(i * kv, kv));
      const bool with_q = needs_queries || rng.chance(0.5);
      cache.prefill(layer, pos, t, k, v,
                    with_q ? std::span<const float>(q) : std::span<const float>());
      pos += static_cast<std::int64_t>(t) + rng.uniform(0, 2);
      ++prefills;
    } else if (bounded) {
      std::vector<std::size_t> before;
      for (int l = 0; l < g.n_layers; ++l)
        for (int h = 0; h < g.n_kv_heads; ++h) before.push_back(cache.size(l, h));
      std::vector<std::size_t> alloc_before;
      for (int l = 0; l < g.n_layers; ++l)
        for (int h = 0; h < g.n_kv_heads; ++h) alloc_before.push_back(cache.allocated_rows(l, h));
      cache.set_budget(random_budget(rng, g, lo, hi, &caps));
      bool ok = true;
      for (int l = 0; l < g.n_layers; ++l)
        for (int h = 0; h < g.n_kv_heads; ++h) {
          const std::size_t i = static_cast<std::size_t>(l * g.n_kv_heads + h);
          ok = ok && cache.capacity(l, h) == caps[i];
          ok = ok && cache.size(l, h) == std::min(before[i], caps[i]);
          if (caps[i] < alloc_before[i]) {
            ok = ok && cache.allocated_rows(l, h) <= caps[i];  // storage really released
            ++shrinks;
          } else {
            ++grows;
          }
        }
      REQUIRE(ok);
    }
    // Unbounded caches grow without limit, so check them every few steps (and at the end).
    if (bounded || step % 10 == 0 || step == steps - 1) {
      kvtest::check_against_ledger(cache, ledger, true);
      check_promise(cache, promise);
    }
  }
  if (bounded) {
    CHECK(shrinks > 0);
    CHECK(grows > 0);
    CHECK(!ledger.evicted.empty());
  } else {
    CHECK(ledger.evicted.empty());
  }
  CHECK(prefills > 0);
}

constexpr int kSteps = 300;
const std::uint64_t kSeeds[] = {11, 12, 13, 14, 15, 16};

}  // namespace

TEST_CASE("FullCache: random sequences keep every row", "[cache][invariants]") {
  for (auto seed : {11, 12, 13})
    run_sequence(seed, policies::FullCache{}, Promise{0, 0, false, true}, false, kSteps);
}

TEST_CASE("Oracle: random sequences keep every row", "[cache][invariants]") {
  for (auto seed : {14, 15, 16})
    run_sequence(seed, policies::Oracle{5}, Promise{0, 0, false, true}, false, kSteps);
}

TEST_CASE("StreamingLLM: random sequences keep sinks and the newest window",
          "[cache][invariants]") {
  for (auto seed : kSeeds) {
    const std::size_t sinks = seed % 3 == 0 ? 0 : static_cast<std::size_t>(seed % 5);
    run_sequence(seed, policies::StreamingLLM{sinks}, Promise{sinks, 1, true, false}, true, kSteps);
  }
}

TEST_CASE("H2O: random sequences keep sinks and the recent window", "[cache][invariants]") {
  for (auto seed : kSeeds) {
    const policies::H2O::Config c{static_cast<std::size_t>(seed % 4),
                                  static_cast<std::size_t>(seed % 3)};
    run_sequence(seed, policies::H2O(c), Promise{c.sinks, c.recent}, true, kSteps);
  }
}

TEST_CASE("KNorm: random sequences keep sinks and the recent window", "[cache][invariants]") {
  for (auto seed : kSeeds) {
    const policies::KNorm::Config c{static_cast<std::size_t>(seed % 3),
                                    static_cast<std::size_t>(seed % 4)};
    run_sequence(seed, policies::KNorm(c), Promise{c.sinks, c.recent}, true, kSteps);
  }
}

TEST_CASE("Random: random sequences keep sinks and the recent window", "[cache][invariants]") {
  for (auto seed : kSeeds) {
    const policies::Random::Config c{seed * 7, static_cast<std::size_t>(seed % 3),
                                     static_cast<std::size_t>(seed % 5)};
    run_sequence(seed, policies::Random(c), Promise{c.sinks, c.recent}, true, kSteps);
  }
}

TEST_CASE("Invariants hold with double storage", "[cache][invariants]") {
  run_sequence<policies::H2O, double>(21, policies::H2O({3, 1}), Promise{1, 3}, true, kSteps);
  run_sequence<policies::StreamingLLM, double>(22, policies::StreamingLLM{2},
                                               Promise{2, 1, true, false}, true, kSteps);
}

// --- storage follows the budget --------------------------------------------------------

TEST_CASE("Capacity follows the budget: allocation stays within it and shrinks with it",
          "[cache][storage]") {
  const Geometry g{2, 4, 2, 8};
  KVCache<policies::StreamingLLM> cache(g, Budget::uniform(64), policies::StreamingLLM{4});
  Rng rng(5);
  const std::size_t kv = 2 * 8;
  std::size_t max_alloc = 0;
  for (int t = 0; t < 200; ++t) {
    for (int l = 0; l < 2; ++l) cache.append(l, t, rng.normals(kv), rng.normals(kv));
    for (int l = 0; l < 2; ++l)
      for (int h = 0; h < 2; ++h) {
        REQUIRE(cache.allocated_rows(l, h) <= 64);
        max_alloc = std::max(max_alloc, cache.allocated_rows(l, h));
      }
  }
  REQUIRE(max_alloc == 64);
  const std::size_t bytes_full = cache.allocated_bytes();
  // At least K and V of 8 floats per row, 4 heads of 64 rows.
  REQUIRE(bytes_full >= 4 * 64 * 2 * 8 * sizeof(float));

  cache.set_budget(Budget::uniform(8));
  for (int l = 0; l < 2; ++l)
    for (int h = 0; h < 2; ++h) {
      REQUIRE(cache.size(l, h) == 8);
      REQUIRE(cache.allocated_rows(l, h) <= 8);
    }
  REQUIRE(cache.allocated_bytes() <= bytes_full / 8);

  // Per-layer shrink releases only the layer that shrank.
  cache.set_budget(Budget::per_layer({32, 8}));
  for (int t = 200; t < 260; ++t)
    for (int l = 0; l < 2; ++l) cache.append(l, t, rng.normals(kv), rng.normals(kv));
  REQUIRE(cache.allocated_rows(0, 0) == 32);
  REQUIRE(cache.allocated_rows(1, 0) <= 8);
  cache.set_budget(Budget::per_head({{32, 6}, {8, 8}}));
  REQUIRE(cache.allocated_rows(0, 0) == 32);
  REQUIRE(cache.allocated_rows(0, 1) <= 6);
  REQUIRE(cache.size(0, 1) == 6);
}

TEST_CASE("Unbounded caches allocate geometrically, not per token", "[cache][storage]") {
  const Geometry g{1, 1, 1, 4};
  KVCache<policies::FullCache> cache(g, Budget::unbounded());
  Rng rng(6);
  for (int t = 0; t < 1000; ++t) cache.append(0, t, rng.normals(4), rng.normals(4));
  REQUIRE(cache.size(0, 0) == 1000);
  REQUIRE(cache.allocated_rows(0, 0) >= 1000);
  REQUIRE(cache.allocated_rows(0, 0) < 2000);
}

// --- views ------------------------------------------------------------------------------

TEST_CASE("Views are contiguous row-major matrices with positions beside them", "[cache][views]") {
  const Geometry g{1, 2, 2, 3};
  KVCache<policies::StreamingLLM> cache(g, Budget::uniform(4), policies::StreamingLLM{1});
  for (int t = 0; t < 6; ++t) {
    std::vector<float> k, v;
    for (int h = 0; h < 2; ++h)
      for (int j = 0; j < 3; ++j) {
        k.push_back(float(100 * t + 10 * h + j));
        v.push_back(-float(100 * t + 10 * h + j));
      }
    cache.append(0, 10 * t, k, v);
  }
  // Token 0 is the sink; tokens 1 and 2 left through swap-remove; 3, 4, 5 are the window.
  for (int h = 0; h < 2; ++h) {
    const auto k = cache.keys(0, h);
    const auto v = cache.values(0, h);
    const auto p = cache.positions(0, h);
    REQUIRE(k.rows() == 4);
    REQUIRE(k.cols() == 3);
    REQUIRE(k.outerStride() == 3);
    REQUIRE(kvtest::sorted_positions(cache, 0, h) == std::vector<std::int64_t>{0, 30, 40, 50});
    for (Eigen::Index r = 0; r < 4; ++r) {
      const float t = float(p[static_cast<std::size_t>(r)] / 10);
      for (int j = 0; j < 3; ++j) {
        REQUIRE(k(r, j) == 100 * t + 10 * h + j);
        REQUIRE(v(r, j) == -(100 * t + 10 * h + j));
        REQUIRE(k.data()[r * 3 + j] == k(r, j));
      }
    }
  }
  REQUIRE(cache.tokens_seen(0) == 6);
}

TEST_CASE("Callback sees prefill overflow rows and rows a set_budget shrink evicts",
          "[cache][callback]") {
  const Geometry g{1, 1, 1, 2};
  KVCache<policies::StreamingLLM> cache(g, Budget::uniform(5), policies::StreamingLLM{2});
  std::vector<std::int64_t> evicted;
  cache.set_eviction_callback([&](const EvictedRow<float>& e) {
    // CHECK, not REQUIRE: the callback runs inside noexcept eviction.
    evicted.push_back(e.position);
    CHECK(e.key.size() == 2);
    CHECK(e.key[0] == float(e.position));
    CHECK(e.value[1] == -float(e.position));
    CHECK(e.seq == static_cast<std::uint64_t>(e.position));
  });
  std::vector<float> k, v;
  for (int t = 0; t < 9; ++t) {
    k.insert(k.end(), {float(t), 0.5f});
    v.insert(v.end(), {0.25f, -float(t)});
  }
  cache.prefill(0, 0, 9, k, v);
  std::sort(evicted.begin(), evicted.end());
  REQUIRE(evicted == std::vector<std::int64_t>{2, 3, 4, 5});
  REQUIRE(kvtest::sorted_positions(cache, 0, 0) == std::vector<std::int64_t>{0, 1, 6, 7, 8});
  evicted.clear();
  cache.set_budget(Budget::uniform(3));
  std::sort(evicted.begin(), evicted.end());
  REQUIRE(evicted == std::vector<std::int64_t>{6, 7});
  REQUIRE(kvtest::sorted_positions(cache, 0, 0) == std::vector<std::int64_t>{0, 1, 8});
}

// --- the relocation hook ------------------------------------------------------------------

namespace {
/// Stores each row's position as side data and checks, at every decision, that the side
/// column still matches the rows after all the swap-removes; evicts pseudo-random rows.
struct SideDataChecker {
  static constexpr Signals signals = Signals::none;
  static constexpr const char* name() { return "SideDataChecker"; }
  std::size_t min_capacity() const { return 1; }
  void bind(const CacheShape& s) { col.bind(s); }
  template <class S>
  void choose_victims(const HeadView<S>& v, std::vector<std::uint32_t>& out) {
    const auto& c = col.of(v.layer, v.kv_head);
    for (std::size_t r = 0; r < v.size; ++r) mismatches += c[r] != v.positions[r];
    ++decisions;
    std::vector<std::uint32_t> rows(v.size);
    for (std::uint32_t r = 0; r < v.size; ++r) rows[r] = r;
    std::shuffle(rows.begin(), rows.end(), rng);
    out.assign(rows.begin(), rows.begin() + static_cast<std::ptrdiff_t>(v.need));
  }
  template <class S>
  void on_append(const HeadView<S>& v, std::size_t row) {
    col.set(v.layer, v.kv_head, row, v.positions[row]);
  }
  void on_move(int l, int h, std::size_t from, std::size_t to) { col.move(l, h, from, to); }
  policies::detail::RowColumn<std::int64_t> col;
  std::mt19937 rng{3};
  int mismatches = 0;
  int decisions = 0;
};
static_assert(EvictionPolicy<SideDataChecker>);
}  // namespace

TEST_CASE("Per-row side data follows its row through every swap-remove", "[cache][relocation]") {
  const Geometry g{2, 4, 2, 2};
  KVCache<SideDataChecker> cache(g, Budget::uniform(20));
  Rng rng(8);
  for (int t = 0; t < 400; ++t) {
    const int l = t % 2;
    cache.append(l, t, rng.normals(4), rng.normals(4));
    if (t % 50 == 49) cache.set_budget(Budget::uniform(rng.uniform(2, 30)));
  }
  REQUIRE(cache.policy().decisions > 300);
  REQUIRE(cache.policy().mismatches == 0);
}
