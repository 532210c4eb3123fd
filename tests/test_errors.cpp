// Bad input at the API boundary: every rejection is a kvevict::Error naming the value and
// what was expected, and leaves the cache exactly as it was: same sizes, rows, positions,
// policy state and the same behaviour on every later operation. Policies that return bad
// victims raise std::logic_error, again with the cache untouched.
#include <catch2/catch.hpp>
#include <limits>
#include <kvevict/bookkeeping.hpp>
#include <typeinfo>

#include "support/test_support.hpp"

using namespace kvevict;
using Catch::Contains;
using kvtest::Rng;

namespace {

const float kNaN = std::numeric_limits<float>::quiet_NaN();
const float kInf = std::numeric_limits<float>::infinity();

struct Log {
  std::vector<std::tuple<int, int, std::int64_t, std::vector<float>>> rows;
};

/// Drives two caches with the same valid operations and requires identical results after
/// each one: rows, positions, evictions (and H2O scores), so hidden state counts too.
template <class Cache>
void same_future(Cache a, Cache b, std::uint64_t seed) {
  Log la, lb;
  auto logger = [](Log& log) {
    return [&log](const EvictedRow<typename Cache::scalar_type>& e) {
      log.rows.emplace_back(e.layer, e.kv_head, e.position,
                            std::vector<float>(e.key.begin(), e.key.end()));
    };
  };
  a.set_eviction_callback(logger(la));
  b.set_eviction_callback(logger(lb));
  const auto& g = a.geometry();
  const auto kv = static_cast<std::size_t>(g.n_kv_heads * g.head_dim);
  const auto qn = static_cast<std::size_t>(g.n_heads * g.head_dim);
  Rng rng(seed);
  auto compare = [&] {
    REQUIRE(kvtest::snapshot(a) == kvtest::snapshot(b));
    REQUIRE(la.rows == lb.rows);
    if constexpr (std::is_same_v<typename Cache::policy_type, policies::H2O>)
      for (int l = 0; l < g.n_layers; ++l)
        for (int h = 0; h < g.n_kv_heads; ++h) {
          const auto& sa = a.policy().scores(l, h);
          const auto& sb = b.policy().scores(l, h);
          const auto n = a.size(l, h);
          REQUIRE(std::vector<float>(sa.begin(), sa.begin() + std::ptrdiff_t(n)) ==
                  std::vector<float>(sb.begin(), sb.begin() + std::ptrdiff_t(n)));
        }
  };
  compare();
  std::int64_t pos = 1'000'000;
  for (int step = 0; step < 30; ++step) {
    for (int l = 0; l < g.n_layers; ++l) {
      const auto k = rng.normals(kv), v = rng.normals(kv), q = rng.normals(qn);
      a.append(l, pos, k, v, q);
      b.append(l, pos, k, v, q);
      attend(a, l, q);
      attend(b, l, q);
    }
    ++pos;
    compare();
  }
  const auto k = rng.normals(5 * kv), v = rng.normals(5 * kv), q = rng.normals(5 * qn);
  a.prefill(0, pos, 5, k, v, q);
  b.prefill(0, pos, 5, k, v, q);
  compare();
  if (a.capacity(0, 0) != Budget::kUnbounded) {
    const auto shrink = Budget::uniform(static_cast<long long>(a.policy().min_capacity()));
    a.set_budget(shrink);
    b.set_budget(shrink);
    compare();
  }
}

/// `bad(cache)` must throw kvevict::Error matching `message`, and change nothing.
template <class Cache, class Bad, class Matcher>
void rejected(Cache& cache, Bad bad, const Matcher& message) {
  const Cache before = cache;
  const auto snap = kvtest::snapshot(cache);
  REQUIRE_THROWS_AS(bad(cache), kvevict::Error);
  REQUIRE_THROWS_WITH(bad(cache), message);
  REQUIRE(kvtest::snapshot(cache) == snap);
  same_future(cache, before, 99);
}

/// An H2O cache with some history: 2 layers, GQA G = 2, budget 6, rows evicted already.
KVCache<policies::H2O> h2o_cache() {
  const Geometry g{2, 4, 2, 4};
  KVCache<policies::H2O> cache(g, Budget::uniform(6), policies::H2O({2, 1}));
  Rng rng(1);
  for (int t = 0; t < 10; ++t)
    for (int l = 0; l < 2; ++l) {
      const auto q = rng.normals(16);
      cache.append(l, 10 * t, rng.normals(8), rng.normals(8));
      attend(cache, l, q);
    }
  return cache;
}

std::vector<float> with(std::vector<float> v, std::size_t i, float x) {
  v[i] = x;
  return v;
}

}  // namespace

TEST_CASE("append rejects bad input and leaves the cache as it was", "[errors][append]") {
  auto cache = h2o_cache();
  const std::vector<float> k(8, 0.5f), v(8, 0.25f), q(16, 0.1f);
  REQUIRE(cache.size(0, 0) == 6);

  SECTION("layer out of range") {
    rejected(
        cache, [&](auto& c) { c.append(-1, 1000, k, v); },
        Contains("layer = -1") && Contains("expected 0 <= layer < 2"));
    rejected(
        cache, [&](auto& c) { c.append(2, 1000, k, v); }, Contains("layer = 2"));
  }
  SECTION("mismatched dimensions") {
    rejected(
        cache, [&](auto& c) { c.append(0, 1000, std::vector<float>(7), v); },
        Contains("keys has 7 floats, expected 8") && Contains("n_kv_heads x head_dim"));
    rejected(
        cache, [&](auto& c) { c.append(0, 1000, k, std::vector<float>(9)); },
        Contains("values has 9 floats, expected 8"));
    rejected(
        cache, [&](auto& c) { c.append(0, 1000, k, v, std::vector<float>(5)); },
        Contains("queries has 5 floats, expected 16"));
  }
  SECTION("NaN and Inf") {
    rejected(
        cache, [&](auto& c) { c.append(0, 1000, with(k, 3, kNaN), v); },
        Contains("keys[3] = nan") && Contains("expected a finite value"));
    rejected(
        cache, [&](auto& c) { c.append(1, 1000, k, with(v, 5, kInf)); },
        Contains("values[5] = inf") && Contains("expected a finite value"));
    rejected(
        cache, [&](auto& c) { c.append(0, 1000, k, v, with(q, 15, -kInf)); },
        Contains("queries[15] = -inf"));
  }
  SECTION("positions must increase") {
    rejected(
        cache, [&](auto& c) { c.append(0, 90, k, v); },
        Contains("position = 90 in layer 0, expected > 90"));
    rejected(
        cache, [&](auto& c) { c.append(1, -4, k, v); },
        Contains("position = -4 in layer 1, expected > 90"));
  }
}

TEST_CASE("prefill rejects bad input without a half-appended block", "[errors][prefill]") {
  auto cache = h2o_cache();
  const std::size_t T = 3;
  const std::vector<float> k(T * 8, 0.5f), v(T * 8, 0.25f), q(T * 16, 0.1f);
  rejected(
      cache, [&](auto& c) { c.prefill(0, 1000, 0, {}, {}, {}); },
      Contains("tokens = 0, expected > 0"));
  rejected(
      cache, [&](auto& c) { c.prefill(0, 1000, T, std::vector<float>(23), v, q); },
      Contains("keys has 23 floats, expected 24") && Contains("3 tokens x n_kv_heads"));
  rejected(
      cache, [&](auto& c) { c.prefill(0, 1000, T, k, std::vector<float>(25), q); },
      Contains("values has 25 floats, expected 24"));
  rejected(
      cache, [&](auto& c) { c.prefill(0, 1000, T, k, v, std::vector<float>(47)); },
      Contains("queries has 47 floats, expected 48"));
  // H2O observes the prompt's attention: prefill needs the queries.
  rejected(
      cache, [&](auto& c) { c.prefill(0, 1000, T, k, v); },
      Contains("policy H2O needs queries (48 floats), got none"));
  // A bad value in the last token must not leave the first two appended.
  rejected(
      cache, [&](auto& c) { c.prefill(1, 1000, T, k, with(v, 23, kNaN), q); },
      Contains("values[23] = nan"));
  rejected(
      cache, [&](auto& c) { c.prefill(1, 1000, T, k, v, with(q, 40, kInf)); },
      Contains("queries[40] = inf"));
  rejected(
      cache, [&](auto& c) { c.prefill(0, 50, T, k, v, q); },
      Contains("position = 50 in layer 0, expected > 90"));
  rejected(
      cache, [&](auto& c) { c.prefill(5, 1000, T, k, v, q); }, Contains("layer = 5"));
}

TEST_CASE("set_budget rejects bad budgets and leaves the cache as it was", "[errors][budget]") {
  auto cache = h2o_cache();
  rejected(
      cache,
      [](auto& c) {
        c.set_budget(Budget::per_layer({6, 6, 6}));
      },
      Contains("per-layer vector has 3 entries, expected 2"));
  rejected(
      cache,
      [](auto& c) {
        c.set_budget(Budget::per_head({{6, 6}}));
      },
      Contains("per-head table has 1 rows, expected 2"));
  rejected(
      cache,
      [](auto& c) {
        c.set_budget(Budget::per_head({{6, 6}, {6}}));
      },
      Contains("per-head table row 1 has 1 entries, expected 2"));
  // H2O({recent 2, sinks 1}) protects 3 rows and needs one more to evict.
  rejected(
      cache, [](auto& c) { c.set_budget(Budget::uniform(3)); },
      Contains("= 3 tokens, expected >= 4") && Contains("H2O protects 3 rows"));
  rejected(
      cache,
      [](auto& c) {
        c.set_budget(Budget::per_layer({6, 2}));
      },
      Contains("budget for layer 1 KV head 0 = 2 tokens, expected >= 4"));
  rejected(
      cache,
      [](auto& c) {
        c.set_budget(Budget::per_head({{6, 6}, {6, 1}}));
      },
      Contains("budget for layer 1 KV head 1 = 1 tokens"));
}

TEST_CASE("Budgets reject zero, negative and malformed counts", "[errors][budget]") {
  CHECK_THROWS_AS(Budget::uniform(0), kvevict::Error);
  CHECK_THROWS_WITH(Budget::uniform(0), Contains("budget = 0 tokens, expected > 0"));
  CHECK_THROWS_WITH(Budget::uniform(-3), Contains("budget = -3 tokens, expected > 0"));
  CHECK_THROWS_WITH(Budget::per_layer({4, 0}), Contains("budget for layer 1 = 0 tokens"));
  CHECK_THROWS_WITH(Budget::per_layer({}), Contains("per-layer vector is empty"));
  CHECK_THROWS_WITH(Budget::per_head({{1, -2}}), Contains("layer 0 KV head 1 = -2 tokens"));
  CHECK_THROWS_WITH(Budget::per_head({}), Contains("per-head table is empty"));
  CHECK_THROWS_WITH(Budget::ratio(0.0, 100), Contains("ratio = 0, expected in (0, 1]"));
  CHECK_THROWS_WITH(Budget::ratio(1.5, 100), Contains("ratio = 1.5"));
  CHECK_THROWS_WITH(Budget::ratio(double(kNaN), 100), Contains("ratio = nan"));
  CHECK_THROWS_WITH(Budget::ratio(0.5, 0), Contains("context length = 0, expected > 0"));
}

TEST_CASE("Construction rejects bad geometry and budgets", "[errors][construct]") {
  using SLLM = KVCache<policies::StreamingLLM>;
  CHECK_THROWS_WITH(SLLM({0, 4, 2, 8}, Budget::uniform(8)), Contains("n_layers = 0, expected > 0"));
  CHECK_THROWS_WITH(SLLM({1, 4, 3, 8}, Budget::uniform(8)),
                    Contains("n_heads = 4 is not a multiple of n_kv_heads = 3"));
  CHECK_THROWS_WITH(SLLM({1, 4, 2, -1}, Budget::uniform(8)), Contains("head_dim = -1"));
  CHECK_THROWS_WITH(SLLM({1, 4, 0, 8}, Budget::uniform(8)), Contains("n_kv_heads = 0"));
  CHECK_THROWS_WITH(SLLM({2, 4, 2, 8}, Budget::per_layer({8})),
                    Contains("per-layer vector has 1 entries, expected 2"));
  CHECK_THROWS_WITH(
      SLLM({1, 4, 2, 8}, Budget::uniform(4), policies::StreamingLLM{4}),
      Contains("= 4 tokens, expected >= 5") && Contains("StreamingLLM protects 4 rows"));
  CHECK_THROWS_AS(SLLM({1, 4, 2, 8}, Budget::uniform(4), policies::StreamingLLM{4}),
                  kvevict::Error);
}

TEST_CASE("FullCache and Oracle refuse a bounded budget, also through set_budget",
          "[errors][budget]") {
  const Geometry g{1, 2, 1, 4};
  CHECK_THROWS_WITH(KVCache<policies::FullCache>(g, Budget::uniform(8)),
                    Contains("FullCache: budget of 8 tokens, expected Budget::unbounded()"));
  CHECK_THROWS_WITH(KVCache<policies::Oracle>(g, Budget::uniform(8)),
                    Contains("Oracle: cache budget of 8 tokens"));
  CHECK_THROWS_WITH(KVCache<policies::Oracle>(g, Budget::unbounded(), policies::Oracle{0}),
                    Contains("Oracle: rows = 0, expected > 0"));
  KVCache<policies::FullCache> full(g, Budget::unbounded());
  KVCache<policies::Oracle> oracle(g, Budget::unbounded(), policies::Oracle{2});
  Rng rng(2);
  for (int t = 0; t < 5; ++t) {
    const auto k = rng.normals(4), v = rng.normals(4);
    full.append(0, t, k, v);
    oracle.append(0, t, k, v);
  }
  // Both with the cache below and above the new budget: neither may be accepted.
  rejected(
      full, [](auto& c) { c.set_budget(Budget::uniform(3)); },
      Contains("FullCache: budget of 3 tokens"));
  rejected(
      full, [](auto& c) { c.set_budget(Budget::uniform(30)); },
      Contains("FullCache: budget of 30 tokens"));
  rejected(
      oracle, [](auto& c) { c.set_budget(Budget::per_layer({30})); },
      Contains("Oracle: cache budget of 30 tokens"));
}

TEST_CASE("attend and observe reject bad input without touching the policy's scores",
          "[errors][attention]") {
  auto cache = h2o_cache();
  const std::vector<float> q(16, 0.1f);
  rejected(
      cache, [&](auto& c) { attend(c, 2, q); },
      Contains("attend: layer = 2, expected 0 <= layer < 2"));
  rejected(
      cache, [&](auto& c) { attend(c, 0, std::vector<float>(12)); },
      Contains("attend: queries has 12 floats, expected 16"));
  rejected(
      cache, [&](auto& c) { attend(c, 0, with(q, 7, kNaN)); },
      Contains("attend: queries[7] = nan"));
  const std::vector<float> p(12, 1.0f / 6);  // G = 2 x 6 rows
  rejected(
      cache, [&](auto& c) { c.observe(0, 0, std::vector<float>(11)); },
      Contains("observe: probs has 11 floats, expected 12 (group 2 x size 6)"));
  rejected(
      cache, [&](auto& c) { c.observe(0, 2, p); },
      Contains("kv_head = 2, expected 0 <= kv_head < 2"));
  rejected(
      cache, [&](auto& c) { c.observe(0, 1, with(p, 4, kInf)); },
      Contains("observe: probs[4] = inf"));
}

TEST_CASE("Accessors reject a layer or head out of range", "[errors][views]") {
  const auto cache = h2o_cache();
  CHECK_THROWS_WITH(cache.size(2, 0), Contains("layer = 2, expected 0 <= layer < 2"));
  CHECK_THROWS_WITH(cache.keys(0, -1), Contains("kv_head = -1, expected 0 <= kv_head < 2"));
  CHECK_THROWS_WITH(cache.values(-1, 0), Contains("layer = -1"));
  CHECK_THROWS_WITH(cache.positions(0, 2), Contains("kv_head = 2"));
  CHECK_THROWS_WITH(cache.seqs(3, 0), Contains("layer = 3"));
  CHECK_THROWS_WITH(cache.capacity(0, 5), Contains("kv_head = 5"));
  CHECK_THROWS_WITH(cache.allocated_rows(9, 0), Contains("layer = 9"));
  CHECK_THROWS_WITH(cache.tokens_seen(2), Contains("layer = 2"));
  CHECK_THROWS_AS(cache.size(2, 0), kvevict::Error);
}

namespace {
/// Declares Signals::query; evicts the oldest rows.
struct QueryNeeder {
  static constexpr Signals signals = Signals::query;
  static constexpr const char* name() { return "QueryNeeder"; }
  std::size_t min_capacity() const { return 1; }
  void bind(const CacheShape&) {}
  template <class S>
  void choose_victims(const HeadView<S>& v, std::vector<std::uint32_t>& out) {
    // Queries come with every append; a set_budget shrink has none (documented in HeadView).
    REQUIRE((v.queries != nullptr) == (v.incoming_key != nullptr));
    std::vector<std::pair<std::uint64_t, std::uint32_t>> c;
    for (std::uint32_t r = 0; r < v.size; ++r) c.push_back({v.seqs[r], r});
    std::sort(c.begin(), c.end());
    for (std::size_t i = 0; i < v.need; ++i) out.push_back(c[i].second);
  }
  template <class S>
  void on_append(const HeadView<S>&, std::size_t) {}
  void on_move(int, int, std::size_t, std::size_t) {}
};
}  // namespace

TEST_CASE("A policy that needs queries gets them or the call is rejected", "[errors][append]") {
  const Geometry g{1, 4, 2, 4};
  KVCache<QueryNeeder> cache(g, Budget::uniform(3));
  Rng rng(3);
  for (int t = 0; t < 5; ++t) cache.append(0, t, rng.normals(8), rng.normals(8), rng.normals(16));
  rejected(
      cache, [&](auto& c) { c.append(0, 10, rng.normals(8), rng.normals(8)); },
      Contains("append: policy QueryNeeder needs queries (16 floats), got none"));
  rejected(
      cache, [&](auto& c) { c.prefill(0, 10, 2, rng.normals(16), rng.normals(16)); },
      Contains("prefill: policy QueryNeeder needs queries (32 floats), got none"));
}

TEST_CASE("A Random cache keeps its generator state through rejected calls", "[errors]") {
  // The strong guarantee covers hidden policy state: later random choices must be the same.
  const Geometry g{2, 2, 2, 3};
  KVCache<policies::Random> cache(g, Budget::uniform(4), policies::Random({5, 1, 1}));
  Rng rng(4);
  for (int t = 0; t < 12; ++t)
    for (int l = 0; l < 2; ++l) cache.append(l, t, rng.normals(6), rng.normals(6));
  rejected(
      cache, [&](auto& c) { c.append(1, 20, with(rng.normals(6), 2, kNaN), rng.normals(6)); },
      Contains("keys[2] = nan"));
  rejected(
      cache,
      [](auto& c) {
        c.set_budget(Budget::per_layer({4, 2}));
      },
      Contains("expected >= 3"));
}

// --- policies that return bad victims ---------------------------------------------------

namespace {
enum class Rogue { honest, out_of_range, repeated, too_few, too_many, only_head_1 };

/// Evicts the oldest rows honestly, or misbehaves in the way `mode` says.
struct RoguePolicy {
  static constexpr Signals signals = Signals::none;
  static constexpr const char* name() { return "RoguePolicy"; }
  std::size_t min_capacity() const { return 1; }
  void bind(const CacheShape&) {}
  template <class S>
  void choose_victims(const HeadView<S>& v, std::vector<std::uint32_t>& out) {
    std::vector<std::pair<std::uint64_t, std::uint32_t>> c;
    for (std::uint32_t r = 0; r < v.size; ++r) c.push_back({v.seqs[r], r});
    std::sort(c.begin(), c.end());
    for (std::size_t i = 0; i < v.need; ++i) out.push_back(c[i].second);
    const bool bad = mode != Rogue::only_head_1 || v.kv_head == 1;
    if (!bad) return;
    switch (mode) {
      case Rogue::honest:
        break;
      case Rogue::out_of_range:
        out.back() = static_cast<std::uint32_t>(v.size);
        break;
      case Rogue::repeated:
        out.push_back(out.front());
        break;
      case Rogue::too_few:
        out.pop_back();
        break;
      case Rogue::too_many:
        for (std::uint32_t r = 0; r <= v.size; ++r) out.push_back(r);
        break;
      case Rogue::only_head_1:
        out.push_back(out.front());
        break;
    }
  }
  template <class S>
  void on_append(const HeadView<S>&, std::size_t) {}
  void on_move(int, int, std::size_t, std::size_t) {}
  Rogue mode = Rogue::honest;
};

template <class F>
void require_logic_error(F f, const std::string& fragment) {
  try {
    f();
    FAIL("no exception");
  } catch (const kvevict::Error& e) {
    FAIL("kvevict::Error (a caller's mistake) where a policy bug was expected: " << e.what());
  } catch (const std::logic_error& e) {
    REQUIRE_THAT(e.what(), Contains("RoguePolicy") && Contains(fragment));
  }
}
}  // namespace

TEST_CASE("Bad victims raise std::logic_error and leave the cache unchanged", "[errors][policy]") {
  const Geometry g{1, 4, 2, 2};
  KVCache<RoguePolicy> cache(g, Budget::uniform(5));
  Rng rng(6);
  for (int t = 0; t < 8; ++t) cache.append(0, t, rng.normals(4), rng.normals(4));
  const auto k = rng.normals(4), v = rng.normals(4);
  for (const auto& [mode, fragment] :
       {std::pair{Rogue::out_of_range, std::string("out of range or repeated")},
        std::pair{Rogue::repeated, std::string("out of range or repeated")},
        std::pair{Rogue::too_few, std::string("returned 0 victims, expected between 1 and 5")},
        std::pair{Rogue::too_many, std::string("returned 7 victims, expected between 1 and 5")},
        std::pair{Rogue::only_head_1, std::string("out of range or repeated")}}) {
    INFO("mode " << int(mode));
    const auto before = cache;
    const auto snap = kvtest::snapshot(cache);
    cache.policy().mode = mode;
    require_logic_error([&] { cache.append(0, 100, k, v); }, fragment);
    REQUIRE(kvtest::snapshot(cache) == snap);
    // Shrinking by 3 rows: the same misbehaviour through set_budget.
    const std::string shrink_fragment =
        mode == Rogue::too_few    ? "returned 2 victims, expected between 3 and 5"
        : mode == Rogue::too_many ? "returned 9 victims, expected between 3 and 5"
                                  : fragment;
    require_logic_error([&] { cache.set_budget(Budget::uniform(2)); }, shrink_fragment);
    REQUIRE(kvtest::snapshot(cache) == snap);
    cache.policy().mode = Rogue::honest;
    same_future(cache, before, 7);
  }
}

// The finiteness check is a branch-free bit test (bookkeeping.hpp): check it at the
// boundaries of the float format and at every position of a vector-width block.
TEST_CASE("check_finite accepts every finite float and names the first non-finite one") {
  using L = std::numeric_limits<float>;
  const std::vector<float> fine{L::max(), -L::max(), L::min(), L::denorm_min(), -0.0f, 0.0f, 1.0f};
  REQUIRE_NOTHROW(kvevict::detail::check_finite(fine, "x"));
  for (float bad : {L::infinity(), -L::infinity(), L::quiet_NaN(), -L::quiet_NaN()})
    for (std::size_t at : {0u, 1u, 7u, 8u, 15u, 16u, 33u}) {
      std::vector<float> v(34, 0.5f);
      v[at] = bad;
      REQUIRE_THROWS_WITH(kvevict::detail::check_finite(v, "x"),
                          Catch::Contains("x[" + std::to_string(at) + "]") &&
                              Catch::Contains("expected a finite value"));
    }
}
