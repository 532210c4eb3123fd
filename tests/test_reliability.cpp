// The bad inputs of issue 17 that the other suites did not generate: sizes that wrap,
// positions at INT64_MAX, moved-from containers, values a 16-bit storage type cannot
// hold, out-of-range probabilities, too few engine cells, saved states that are
// well-formed but impossible, configurations whose protected rows overflow, directories
// given as files, and overlapping calls on one cache. Each rejection must be a
// kvevict::Error naming the value, with the cache (or file) unchanged.
#define KVEVICT_CHECK_CONCURRENCY 1  // the overlapping-call detector, on in this Release test too
#include <atomic>
#include <catch2/catch.hpp>
#include <climits>
#include <cstring>
#include <filesystem>
#include <limits>
#include <thread>
#include <kvevict/serialize.hpp>

#include "support/test_support.hpp"

using namespace kvevict;
using Catch::Contains;
namespace pol = kvevict::policies;
using kvtest::Rng;

namespace {

constexpr std::int64_t kMaxPos = std::numeric_limits<std::int64_t>::max();
constexpr std::size_t kHuge = std::numeric_limits<std::size_t>::max();

/// `bad(cache)` throws kvevict::Error matching `message` and leaves every observable
/// part of the cache, and its saved form (policy state included), as it was.
template <class Cache, class Bad, class Matcher>
void rejected(Cache& cache, Bad bad, const Matcher& message) {
  const auto snap = kvtest::snapshot(cache);
  const auto saved = save_bytes(cache);
  REQUIRE_THROWS_AS(bad(cache), kvevict::Error);
  REQUIRE_THROWS_WITH(bad(cache), message);
  REQUIRE(kvtest::snapshot(cache) == snap);
  REQUIRE(save_bytes(cache) == saved);
}

/// `steps` tokens per layer at positions from, from + 10, ... (gaps, so a test can move a
/// position without colliding with another token's).
template <class Cache>
void drive(Cache& c, Rng& rng, std::int64_t from, int steps) {
  const auto& g = c.geometry();
  const auto kv = static_cast<std::size_t>(g.n_kv_heads * g.head_dim);
  const auto qn = static_cast<std::size_t>(g.n_heads * g.head_dim);
  for (int s = 0; s < steps; ++s)
    for (int l = 0; l < g.n_layers; ++l) {
      const auto q = rng.normals(qn);
      c.append(l, from + 10 * s, rng.normals(kv), rng.normals(kv), q);
      attend(c, l, q);
    }
}

const Geometry kGeo{2, 4, 2, 4};  // G = 2

KVCache<pol::H2O> h2o_cache() {
  KVCache<pol::H2O> c(kGeo, Budget::uniform(6), pol::H2O({2, 1}));
  Rng rng(1);
  drive(c, rng, 0, 10);
  return c;
}

/// A policy built from its Config after `set` adjusted it (no designated initializers:
/// HashEvict's Config has a std::optional member the warnings flag as uninitialised).
template <class P, class Set>
P make(Set set) {
  typename P::Config c;
  set(c);
  return P(c);
}

/// Byte offsets in a save of a cache with this geometry and policy name (serialize.hpp).
struct SaveLayout {
  std::size_t layers = 0;  // first layer's u64 tokens seen, then i64 last position
  std::size_t head0 = 0;   // first head's u64 rows, then rows x (i64 position, u64 seq)
};
SaveLayout layout(const Geometry& g, const std::string& policy) {
  SaveLayout s;
  const auto heads = static_cast<std::size_t>(g.n_layers * g.n_kv_heads);
  s.layers = 8 + 4 + 4 + 4 + 4 + policy.size() + 16 + heads * 8;
  s.head0 = s.layers + static_cast<std::size_t>(g.n_layers) * 16;
  return s;
}
void reseal(std::vector<std::uint8_t>& b) {
  const auto h = kvevict::detail::fnv1a(std::span<const std::uint8_t>(b).first(b.size() - 8));
  std::memcpy(b.data() + b.size() - 8, &h, 8);
}
template <class T>
void poke(std::vector<std::uint8_t>& b, std::size_t at, T x) {
  std::memcpy(b.data() + at, &x, sizeof(T));
  reseal(b);
}
template <class T>
T peek(const std::vector<std::uint8_t>& b, std::size_t at) {
  T x;
  std::memcpy(&x, b.data() + at, sizeof(T));
  return x;
}

/// load_bytes(bytes) into `target` throws kvevict::Error matching `message`, target unchanged.
template <class Cache, class Matcher>
void load_rejected(Cache& target, const std::vector<std::uint8_t>& bytes, const Matcher& message) {
  rejected(
      target, [&](auto& c) { load_bytes(c, bytes); }, message);
}

}  // namespace

// --- sizes and positions that wrap ------------------------------------------------------

TEST_CASE("prefill with a token count whose size product wraps is rejected", "[reliability]") {
  auto cache = h2o_cache();
  for (std::size_t tokens : {std::size_t{1} << 63, kHuge, kHuge / 4 + 1, kHuge / 8 + 1}) {
    INFO("tokens " << tokens);
    rejected(
        cache, [&](auto& c) { c.prefill(0, 1000, tokens, {}, {}, {}); },
        Contains("prefill: keys") && Contains(std::to_string(tokens)));
  }
  IndexCache<pol::H2O> idx(kGeo, Budget::uniform(6), pol::H2O({2, 1}));
  CHECK_THROWS_AS(idx.prefill(0, 0, std::size_t{1} << 63, {}, {}, {}), kvevict::Error);
  CHECK_THROWS_WITH(idx.prefill(0, 0, kHuge, {}, {}, {}), Contains("overflows"));
  CHECK(idx.size(0, 0) == 0);
  CHECK(idx.tokens_seen(0) == 0);
}

TEST_CASE("positions near INT64_MAX: a block may end at it, never pass it", "[reliability]") {
  KVCache<pol::StreamingLLM> cache(kGeo, Budget::uniform(6), pol::StreamingLLM{1});
  Rng rng(2);
  const std::size_t T = 3;
  const auto k = rng.normals(T * 8), v = rng.normals(T * 8);
  rejected(
      cache, [&](auto& c) { c.prefill(0, kMaxPos - 1, T, k, v); },
      Contains("first position " + std::to_string(kMaxPos - 1)) &&
          Contains("passes the largest position"));
  cache.prefill(0, kMaxPos - 2, T, k, v);  // ends exactly at INT64_MAX
  CHECK(cache.positions(0, 0).back() == kMaxPos);
  rejected(
      cache, [&](auto& c) { c.append(0, kMaxPos, rng.normals(8), rng.normals(8)); },
      Contains("expected > " + std::to_string(kMaxPos)));
  // Negative first positions are fine (the unsigned room computation must not overflow).
  cache.prefill(1, std::numeric_limits<std::int64_t>::min(), T, k, v);
  CHECK(cache.positions(1, 0).front() == std::numeric_limits<std::int64_t>::min());

  IndexCache<pol::StreamingLLM> idx(kGeo, Budget::uniform(6), pol::StreamingLLM{1});
  CHECK_THROWS_WITH(idx.prefill(0, kMaxPos, 2, rng.normals(16), {}, {}),
                    Contains("passes the largest position"));
  CHECK(idx.tokens_seen(0) == 0);
}

TEST_CASE("checked arithmetic names the operands", "[reliability]") {
  using kvevict::detail::checked_add;
  using kvevict::detail::checked_mul;
  CHECK(checked_mul(3, 5, "x") == 15);
  CHECK(checked_add(kHuge - 1, 1, "x") == kHuge);
  CHECK_THROWS_WITH(checked_mul(std::size_t{1} << 32, std::size_t{1} << 32, "rows"),
                    Contains("rows = 4294967296 x 4294967296 overflows"));
  CHECK_THROWS_WITH(checked_add(kHuge, 1, "sum"),
                    Contains("sum = " + std::to_string(kHuge) + " + 1"));
  CHECK(kvevict::detail::checked_last_position(kMaxPos, 1, "p") == kMaxPos);
  CHECK_THROWS_AS(kvevict::detail::checked_last_position(kMaxPos, 2, "p"), kvevict::Error);
  CHECK_THROWS_AS(kvevict::detail::checked_last_position(0, 0, "p"), kvevict::Error);
}

TEST_CASE("Geometry has upper bounds: absurd shapes are an Error, not bad_alloc", "[reliability]") {
  CHECK_NOTHROW(Geometry{126, 128, 8, 128}.validate());
  CHECK_THROWS_WITH((Geometry{1 << 17, 4, 2, 8}.validate()), Contains("layers 131072"));
  CHECK_THROWS_WITH((Geometry{1, 4, 2, INT_MAX}.validate()), Contains("head_dim 2147483647"));
  CHECK_THROWS_WITH((Geometry{65536, 65536, 65536, 8}.validate()),
                    Contains("n_layers x n_kv_heads = 65536 x 65536 = 4294967296"));
  CHECK_THROWS_WITH((Geometry{1, 65536, 1, 65536}.validate()),
                    Contains("n_heads x head_dim = 65536 x 65536"));
  using C = KVCache<pol::StreamingLLM>;
  CHECK_THROWS_AS(C(Geometry{65536, 65536, 65536, 65536}, Budget::uniform(8)), kvevict::Error);
  CHECK_THROWS_AS(
      IndexCache<pol::StreamingLLM>(Geometry{65536, 65536, 65536, 65536}, Budget::uniform(8)),
      kvevict::Error);
}

// --- moved-from containers ---------------------------------------------------------------

TEST_CASE("a moved-from KVCache is valid and empty; every layer call is an Error",
          "[reliability]") {
  auto cache = h2o_cache();
  const auto snap = kvtest::snapshot(cache);
  KVCache<pol::H2O> moved(std::move(cache));
  CHECK(kvtest::snapshot(moved) == snap);
  const std::vector<float> k(8, 0.5f), q(16, 0.1f);
  const auto gone = Contains("it was moved from");
  // NOLINTBEGIN(bugprone-use-after-move): using a moved-from cache is the point.
  CHECK(cache.geometry().n_layers == 0);
  CHECK(cache.allocated_bytes() == 0);
  CHECK_THROWS_WITH(cache.size(0, 0), gone);
  CHECK_THROWS_WITH(cache.tokens_seen(0), gone);
  CHECK_THROWS_WITH(cache.keys(0, 0), gone);
  CHECK_THROWS_WITH(cache.append(0, 1000, k, k), gone);
  CHECK_THROWS_WITH(cache.prefill(0, 1000, 1, k, k, q), gone);
  CHECK_THROWS_WITH(cache.observe(0, 0, std::vector<float>(2, 0.5f)), gone);
  CHECK_THROWS_WITH(attend(cache, 0, q), Contains("attend: this cache has no layers") && gone);
  {  // the workspace overload too (both used to divide by the moved-from group of 0 heads)
    AttendWorkspace ws;
    std::vector<float> out(16);
    CHECK_THROWS_WITH(attend(cache, 0, q, out, ws), Contains("attend: this cache has no layers") && gone);
  }
  CHECK(cache.geometry().group() == 0);
  CHECK_THROWS_WITH(cache.set_budget(Budget::uniform(6)), gone);
  CHECK_THROWS_WITH(save_bytes(cache), gone);
  CHECK_THROWS_WITH(load_bytes(cache, save_bytes(moved)), gone);
  CHECK_THROWS_AS(cache.size(0, 0), kvevict::Error);
  // Move assignment leaves the source empty too, and assigning revives a moved-from cache.
  KVCache<pol::H2O> other = h2o_cache();
  other = std::move(moved);
  CHECK_THROWS_WITH(moved.size(0, 0), gone);
  cache = h2o_cache();
  CHECK(cache.size(0, 0) == 6);
  Rng rng(3);
  drive(cache, rng, 100, 3);
  // NOLINTEND(bugprone-use-after-move)
}

TEST_CASE("a moved-from IndexCache is valid and empty", "[reliability]") {
  IndexCache<pol::StreamingLLM> idx(kGeo, Budget::uniform(4), pol::StreamingLLM{1});
  IndexCache<pol::StreamingLLM> moved(std::move(idx));
  CHECK(moved.cells_per_head() == 5);
  const auto gone = Contains("it was moved from");
  CHECK(idx.geometry().n_layers == 0);  // NOLINT(bugprone-use-after-move)
  CHECK_THROWS_WITH(idx.size(0, 0), gone);
  CHECK_THROWS_WITH(idx.append(0, 0, std::vector<float>(8, 1.0f), {}), gone);
  CHECK_THROWS_WITH(idx.observe(0, 0, {}), gone);
  CHECK_THROWS_WITH(idx.prefill(0, 0, 1, std::vector<float>(8, 1.0f), {}, {}), gone);
  IndexCache<pol::StreamingLLM> other(kGeo, Budget::uniform(4), pol::StreamingLLM{1});
  other = std::move(moved);
  CHECK_THROWS_WITH(moved.size(1, 1), gone);
  CHECK(other.size(1, 1) == 0);
}

// --- storage type range -----------------------------------------------------------------

TEMPLATE_TEST_CASE("storage_limit is where the storage type's conversion overflows",
                   "[reliability]", Eigen::half, Eigen::bfloat16) {
  const float lim = kvevict::detail::storage_limit<TestType>();
  const float below = std::nextafter(lim, 0.0f);
  CHECK(std::isinf(static_cast<float>(static_cast<TestType>(lim))));
  CHECK(std::isinf(static_cast<float>(static_cast<TestType>(-lim))));
  CHECK(std::isfinite(static_cast<float>(static_cast<TestType>(below))));
  CHECK(std::isfinite(static_cast<float>(static_cast<TestType>(-below))));
  CHECK(std::isinf(kvevict::detail::storage_limit<float>()));
}

TEMPLATE_TEST_CASE("16-bit caches reject finite floats their storage cannot hold", "[reliability]",
                   Eigen::half, Eigen::bfloat16) {
  using S = TestType;
  KVCache<pol::H2O, S> cache(kGeo, Budget::uniform(6), pol::H2O({2, 1}));
  Rng rng(4);
  drive(cache, rng, 0, 8);
  const float lim = kvevict::detail::storage_limit<S>();
  const float big = std::is_same_v<S, Eigen::half> ? 70000.0f : std::numeric_limits<float>::max();
  std::vector<float> k(8, 0.5f), v(8, 0.25f), q(16, 0.1f);
  auto with = [](std::vector<float> x, std::size_t i, float val) {
    x[i] = val;
    return x;
  };
  const std::string name = std::is_same_v<S, Eigen::half> ? "Eigen::half" : "Eigen::bfloat16";
  rejected(
      cache, [&](auto& c) { c.append(0, 1000, with(k, 3, big), v, q); },
      Contains("append: keys[3] = ") && Contains("does not fit " + name));
  rejected(
      cache, [&](auto& c) { c.append(1, 1000, k, with(v, 7, -lim), q); },
      Contains("append: values[7]") && Contains(name));
  rejected(
      cache,
      [&](auto& c) {
        c.prefill(0, 1000, 2, with(std::vector<float>(16, 0.5f), 9, big),
                  std::vector<float>(16, 0.5f), std::vector<float>(32, 0.1f));
      },
      Contains("prefill: keys[9]") && Contains(name));
  // The largest value below the limit is stored, finite.
  const float ok = std::nextafter(lim, 0.0f);
  cache.append(0, 1000, with(k, 0, ok), with(v, 0, -ok), q);
  for (int h = 0; h < 2; ++h)
    for (Eigen::Index i = 0; i < cache.keys(0, h).size(); ++i)
      REQUIRE(std::isfinite(static_cast<float>(cache.keys(0, h).data()[i])));
  attend(cache, 0, q);  // no NaN probabilities from an infinite key

  IndexCache<pol::StreamingLLM, S> idx(kGeo, Budget::uniform(4), pol::StreamingLLM{1});
  CHECK_THROWS_WITH(idx.append(0, 0, with(k, 1, big), {}), Contains("keys[1]") && Contains(name));
  CHECK_THROWS_WITH(idx.append(0, 0, k, {}, {}, {}, with(v, 2, -big)), Contains("values[2]"));
  CHECK(idx.tokens_seen(0) == 0);
}

// An append's (a prefill's) keys, values and queries are value-checked in one interleaved
// pass (kernels::abs_below) at the bench's shape, where that pass reads them in rounds;
// a bad value anywhere is still named as the one-by-one checks name it: the first bad
// array in argument order (keys, values, queries), its first bad index.
TEMPLATE_TEST_CASE("append and prefill name the first bad input in argument order", "[reliability]",
                   float, Eigen::half) {
  using S = TestType;
  const Geometry g{1, 32, 8, 128};
  KVCache<pol::StreamingLLM, S> cache(g, Budget::uniform(16), pol::StreamingLLM{1});
  Rng rng(6);
  drive(cache, rng, 0, 20);
  const std::size_t kv = 8 * 128, qn = 32 * 128;
  const auto k = rng.normals(kv), v = rng.normals(kv), q = rng.normals(qn);
  auto with = [](std::vector<float> x, std::size_t i, float val) {
    x[i] = val;
    return x;
  };
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const auto append = [&](std::vector<float> kk, std::vector<float> vv, std::vector<float> qq) {
    return [=](auto& c) { c.append(0, 1000, kk, vv, qq); };
  };
  rejected(cache, append(with(k, 1000, nan), with(v, 5, inf), with(q, 4000, nan)),
           Contains("append: keys[1000] = nan"));
  rejected(cache, append(k, with(with(v, 1023, -inf), 1022, nan), with(q, 0, nan)),
           Contains("append: values[1022] = nan"));
  // each array alone, bad at its end (the fused pass must read all of each)
  rejected(cache, append(with(k, kv - 1, -inf), v, q), Contains("append: keys[1023] = -inf"));
  rejected(cache, append(k, with(v, kv - 1, nan), q), Contains("append: values[1023] = nan"));
  rejected(cache, append(k, v, with(q, qn - 1, inf)), Contains("append: queries[4095] = inf"));
  rejected(cache, append(k, v, with(with(q, 2049, -inf), 3000, nan)), Contains("append: queries[2049] = -inf"));
  if constexpr (std::is_same_v<S, Eigen::half>) {  // finite, but no fp16 can hold it
    rejected(cache, append(k, with(v, 777, 70000.0f), with(q, 1, nan)),
             Contains("append: values[777] = 70000") && Contains("does not fit Eigen::half"));
    // a query of that size is fine: queries are only checked finite
    cache.append(0, 1000, k, v, with(q, 5, 70000.0f));
  } else {
    cache.append(0, 1000, with(k, 0, std::numeric_limits<float>::max()), v, q);
  }
  const auto block = [&](std::size_t tokens) { return rng.normals(tokens * kv); };
  const auto kb = block(3), vb = block(3), qb = rng.normals(3 * qn);
  rejected(
      cache, [&](auto& c) { c.prefill(0, 2000, 3, kb, with(vb, 2 * kv + 9, nan), with(qb, 0, inf)); },
      Contains("prefill: values[2057] = nan"));
  rejected(
      cache, [&](auto& c) { c.prefill(0, 2000, 3, kb, with(vb, 3 * kv - 1, inf), qb); },
      Contains("prefill: values[3071] = inf"));
  rejected(
      cache, [&](auto& c) { c.prefill(0, 2000, 3, kb, vb, with(qb, 3 * qn - 1, -inf)); },
      Contains("prefill: queries[12287] = -inf"));
  cache.prefill(0, 2000, 3, kb, vb, qb);
  CHECK(cache.tokens_seen(0) == 24);
}

// --- probabilities ----------------------------------------------------------------------

TEST_CASE("observe rejects what is not a probability", "[reliability]") {
  auto cache = h2o_cache();
  const float slack = kvevict::detail::kProbabilitySlack;
  auto probs = [](float at4) {
    std::vector<float> p(12, 1.0f / 6);  // G = 2 x 6 rows
    p[4] = at4;
    return p;
  };
  for (float bad :
       {-1e-6f, -1.0f, 1.0f + 2 * slack, 2.0f, 3e38f, std::numeric_limits<float>::quiet_NaN(),
        std::numeric_limits<float>::infinity()}) {
    INFO("probability " << bad);
    rejected(
        cache, [&](auto& c) { c.observe(0, 1, probs(bad)); },
        Contains("observe: probs[4] = ") && Contains("expected a probability in [0, 1]"));
  }
  // Exactly 0, -0, 1 and rounding just above 1 are accepted.
  for (float fine : {0.0f, -0.0f, 1.0f, 1.0f + slack})
    CHECK_NOTHROW(cache.observe(0, 1, probs(fine)));
  IndexCache<pol::H2O> idx(kGeo, Budget::uniform(6), pol::H2O({2, 1}));
  idx.append(0, 0, std::vector<float>(8, 1.0f), {});
  CHECK_THROWS_WITH(idx.observe(0, 0, std::vector<float>{0.5f, -0.5f}),
                    Contains("probs[1] = -0.5"));
}

namespace {
/// Sets the last score of the last column (the float before the checksum) to `x`.
std::vector<std::uint8_t> with_last_score(std::vector<std::uint8_t> b, float x) {
  poke(b, b.size() - 12, x);
  return b;
}

/// Scores at the largest float stay finite under the largest accepted probabilities,
/// and the cache's own save loads again (issue 17: 3e38 + 3e38 made an H2O score inf).
template <class Policy>
void scores_stay_finite(Policy policy) {
  KVCache<Policy> cache(kGeo, Budget::uniform(8), policy);
  Rng rng(5);
  drive(cache, rng, 0, 12);
  KVCache<Policy> big = cache;
  load_bytes(big, with_last_score(save_bytes(cache), std::numeric_limits<float>::max()));
  const std::size_t n = big.size(1, 1);
  const std::vector<float> top(2 * n, 1.0f + kvevict::detail::kProbabilitySlack);
  for (int s = 0; s < 100; ++s) big.observe(1, 1, top);
  for (float x : big.policy().scores(1, 1)) REQUIRE(std::isfinite(x));
  KVCache<Policy> again = cache;
  REQUIRE_NOTHROW(load_bytes(again, save_bytes(big)));
}
}  // namespace

TEST_CASE("H2O, DecayedAttention and BUZZ scores cannot reach infinity", "[reliability]") {
  scores_stay_finite(pol::H2O({2, 1}));
  scores_stay_finite(pol::DecayedAttention({.decay = 0.9f, .sinks = 1, .recent = 1}));
  scores_stay_finite(pol::BuzzBeehive({.sinks = 1, .window = 2, .threshold = 3, .stride = 3}));
}

// --- engine cells -----------------------------------------------------------------------

TEST_CASE("IndexCache needs a cell per row", "[reliability]") {
  using Idx = IndexCache<pol::StreamingLLM>;
  CHECK_THROWS_WITH(Idx(kGeo, Budget::uniform(8), pol::StreamingLLM{1}, 7),
                    Contains("cells_per_head = 7, expected >= the largest capacity 8"));
  CHECK_THROWS_WITH(Idx(kGeo, Budget::per_layer({4, 9}), pol::StreamingLLM{1}, 5),
                    Contains("largest capacity 9"));
  CHECK(Idx(kGeo, Budget::uniform(8), pol::StreamingLLM{1}, 8).cells_per_head() == 8);
  CHECK(Idx(kGeo, Budget::uniform(8), pol::StreamingLLM{1}).cells_per_head() == 9);
  // Unbounded: appends beyond the cells are rejected, cells handed out stay below the limit.
  IndexCache<pol::FullCache> idx(kGeo, Budget::unbounded(), pol::FullCache{}, 3);
  std::vector<float> mem(3 * 8);  // the engine's cells: [cell][kv head][d]
  const CellRows<float> rows{mem.data(), 8, 4};
  for (int t = 0; t < 3; ++t)
    for (auto d : idx.append(0, t, std::vector<float>(8, float(t)), rows)) REQUIRE(d.cell < 3);
  CHECK_THROWS_WITH(idx.append(0, 3, std::vector<float>(8, 1.0f), rows),
                    Contains("would hold 4 rows, expected <= cells_per_head = 3"));
  CHECK(idx.size(0, 0) == 3);
  CHECK(idx.tokens_seen(0) == 3);
  CHECK_THROWS_WITH(idx.prefill(1, 0, 4, std::vector<float>(32, 1.0f), {}, {}),
                    Contains("prefill: layer 1 KV head 0 would hold 4 rows"));
  CHECK(idx.tokens_seen(1) == 0);
}

// --- saved states -----------------------------------------------------------------------

TEST_CASE("load_bytes validates every field a saved state carries", "[reliability][serialize]") {
  auto cache = h2o_cache();
  const auto good = save_bytes(cache);
  const SaveLayout at = layout(kGeo, "H2O");
  KVCache<pol::H2O> target(kGeo, Budget::uniform(6), pol::H2O({2, 1}));
  Rng rng(6);
  drive(target, rng, 500, 3);
  const std::size_t rows = peek<std::uint64_t>(good, at.head0);
  REQUIRE(rows == 6);
  const std::size_t keys0 = at.head0 + 8 + rows * 16;  // first K element of head 0 (float)
  const std::size_t vals0 = keys0 + rows * 4 * 4;

  SECTION("NaN and Inf rows") {
    auto bad = good;
    poke(bad, keys0 + 4 * 5, std::numeric_limits<float>::quiet_NaN());
    load_rejected(target, bad, Contains("head 0 key element 5 = nan") && Contains("finite"));
    bad = good;
    poke(bad, vals0, -std::numeric_limits<float>::infinity());
    load_rejected(target, bad, Contains("head 0 value element 0 = -inf"));
  }
  SECTION("positions that do not increase with arrival order") {
    auto bad = good;  // swap the positions of rows 0 and 1 of head 0 (seqs stay)
    const auto p0 = peek<std::int64_t>(good, at.head0 + 8);
    const auto p1 = peek<std::int64_t>(good, at.head0 + 8 + 16);
    poke(bad, at.head0 + 8, p1);
    poke(bad, at.head0 + 8 + 16, p0);
    load_rejected(target, bad, Contains("in different KV heads") || Contains("arrival order"));
  }
  SECTION("positions out of arrival order in a single-KV-head layer") {
    const Geometry g1{1, 2, 1, 4};
    KVCache<pol::StreamingLLM> one(g1, Budget::uniform(6), pol::StreamingLLM{1});
    for (int t = 0; t < 4; ++t)
      one.append(0, 10 * t, std::vector<float>(4, float(t)), std::vector<float>(4, float(t)));
    auto b = save_bytes(one);
    poke(b, layout(g1, "StreamingLLM").head0 + 8 + 16, std::int64_t{25});  // seq 1: 10 -> 25
    KVCache<pol::StreamingLLM> t1(g1, Budget::uniform(6), pol::StreamingLLM{1});
    load_rejected(t1, b,
                  Contains("seq 1 at position 25 and seq 2 at position 20") &&
                      Contains("expected positions to increase with arrival order"));
  }
  SECTION("one token at two positions in different KV heads") {
    const std::size_t head1 = at.head0 + 8 + rows * 16 + 2 * rows * 4 * 4;
    REQUIRE(peek<std::uint64_t>(good, head1) == rows);
    // Find head 1's row with the same seq as head 0's row 0 and move its position by -1
    // when that keeps it unique (rows of a head are distinct tokens).
    const auto seq0 = peek<std::uint64_t>(good, at.head0 + 8 + 8);
    const auto pos0 = peek<std::int64_t>(good, at.head0 + 8);
    bool found = false;
    for (std::size_t r = 0; r < rows; ++r)
      if (peek<std::uint64_t>(good, head1 + 8 + r * 16 + 8) == seq0) {
        auto bad = good;
        poke(bad, head1 + 8 + r * 16, pos0 - 1);
        load_rejected(target, bad, Contains("in different KV heads") || Contains("arrival order"));
        found = true;
      }
    if (!found) SUCCEED("head 1 no longer holds that token");
  }
  SECTION("tokens seen at the counter's end") {
    auto bad = good;
    poke(bad, at.layers, std::numeric_limits<std::uint64_t>::max());
    load_rejected(target, bad, Contains("has seen 18446744073709551615 tokens, expected <= "));
    bad = good;
    poke(bad, at.layers, kvevict::detail::kMaxTokensSeen + 1);
    load_rejected(target, bad, Contains("tokens, expected <= 4611686018427387904"));
  }
  SECTION("counters that disagree with the rows") {
    auto bad = good;  // the layer's last position moved beyond its newest row
    const auto last = peek<std::int64_t>(good, at.layers + 8);
    poke(bad, at.layers + 8, last + 5);
    load_rejected(target, bad, Contains("arrival order"));
    bad = good;  // fewer tokens seen than the rows' arrival indices need
    poke(bad, at.layers, std::uint64_t{7});
    load_rejected(target, bad, Contains("seq"));
    bad = good;  // a layer that saw nothing cannot have a last position
    KVCache<pol::H2O> empty(kGeo, Budget::uniform(6), pol::H2O({2, 1}));
    auto e = save_bytes(empty);
    poke(e, at.layers + 8, std::int64_t{42});
    load_rejected(target, e, Contains("has seen no tokens but its last position is 42"));
  }
  SECTION("the unmodified save still loads") {
    load_bytes(target, good);
    REQUIRE(save_bytes(target) == good);
  }
}

TEST_CASE("every policy's configuration travels with a save and is checked on load",
          "[reliability][serialize]") {
  auto check = [](auto saved_policy, auto target_policy, const char* message) {
    using P = decltype(saved_policy);
    KVCache<P> a(kGeo, Budget::uniform(16), saved_policy);
    Rng rng(7);
    for (int t = 0; t < 20; ++t)
      for (int l = 0; l < 2; ++l) a.append(l, t, rng.normals(8), rng.normals(8), rng.normals(16));
    KVCache<P> same(kGeo, Budget::uniform(16), saved_policy);
    REQUIRE_NOTHROW(load_bytes(same, save_bytes(a)));
    REQUIRE(save_bytes(same) == save_bytes(a));
    KVCache<P> other(kGeo, Budget::uniform(16), target_policy);
    load_rejected(other, save_bytes(a), Contains(message));
  };
  check(pol::StreamingLLM{4}, pol::StreamingLLM{8}, "saved with sinks = 4, expected sinks = 8");
  check(pol::KNorm({1, 2}), pol::KNorm({1, 3}), "saved with recent = 2, expected recent = 3");
  using HE = pol::HashEvictSimHash<pol::HashMode::key>;
  check(make<HE>([](auto& c) { c.bits = 16; }), make<HE>([](auto& c) { c.bits = 32; }),
        "saved with bits = 16, expected bits = 32");
  check(make<HE>([](auto& c) { c.seed = 1; }), make<HE>([](auto& c) { c.seed = 2; }),
        "saved with seed = 1, expected seed = 2");
  using HQ = pol::HashEvictSimHash<pol::HashMode::query>;
  check(make<HQ>([](auto& c) { c.combine = pol::QueryCombine::sum; }),
        make<HQ>([](auto& c) { c.combine = pol::QueryCombine::mean; }),
        "saved with combine = 0, expected combine = 1");
  // Oracle and FullCache need unbounded budgets.
  KVCache<pol::Oracle> o(kGeo, Budget::unbounded(), pol::Oracle{4});
  o.append(0, 0, std::vector<float>(8, 1.0f), std::vector<float>(8, 1.0f));
  KVCache<pol::Oracle> o2(kGeo, Budget::unbounded(), pol::Oracle{5});
  load_rejected(o2, save_bytes(o), Contains("saved with rows = 4, expected rows = 5"));
}

// --- configurations whose sizes overflow --------------------------------------------------

TEST_CASE("policy configurations that overflow are a kvevict::Error naming the value",
          "[reliability]") {
  const auto b = Budget::uniform(8);
  const std::string huge = std::to_string(kHuge);
  CHECK_THROWS_WITH(KVCache<pol::H2O>(kGeo, b, pol::H2O({kHuge, 0})),
                    Contains("H2O: sinks = 0, recent = " + huge) && Contains("overflow"));
  CHECK_THROWS_AS(KVCache<pol::H2O>(kGeo, Budget::unbounded(), pol::H2O({kHuge, 0})),
                  kvevict::Error);
  CHECK_THROWS_WITH(KVCache<pol::StreamingLLM>(kGeo, b, pol::StreamingLLM{kHuge}),
                    Contains("StreamingLLM: sinks = " + huge));
  CHECK_THROWS_AS(KVCache<pol::StreamingLLM>(kGeo, Budget::unbounded(), pol::StreamingLLM{kHuge}),
                  kvevict::Error);
  CHECK_THROWS_WITH(KVCache<pol::KNorm>(kGeo, b, pol::KNorm({kHuge / 2 + 1, kHuge / 2})),
                    Contains("KNorm: sinks = "));
  CHECK_THROWS_WITH(KVCache<pol::Random>(kGeo, b, pol::Random({0, 1, kHuge})),
                    Contains("Random: sinks = 1, recent = " + huge));
  CHECK_THROWS_WITH(
      KVCache<pol::DecayedAttention>(kGeo, b, pol::DecayedAttention({.sinks = kHuge, .recent = 1})),
      Contains("DecayedAttention: sinks = " + huge));
  CHECK_THROWS_WITH(
      KVCache<pol::SnapKV>(kGeo, b, pol::SnapKV({.window = 8, .decode_reserve = kHuge})),
      Contains("SnapKV: window = 8, decode_reserve = " + huge));
  CHECK_THROWS_WITH(pol::BuzzBeehive({.sinks = kHuge - 2, .window = 1, .threshold = 2}),
                    Contains("BuzzBeehive: sinks = "));
  CHECK_THROWS_WITH(pol::BuzzBeehive({.sinks = kHuge - 1, .budget_mode = true}),
                    Contains("BuzzBeehive: sinks = "));
  using HE = pol::HashEvictSimHash<pol::HashMode::key>;
  CHECK_THROWS_WITH(make<HE>([](auto& c) {
                      c.sinks = kHuge;
                      c.recent = 1;
                    }),
                    Contains("sinks = " + huge));
  // bits x ensemble used to overflow int (UB) and skip the <= 256 check.
  CHECK_THROWS_WITH(make<HE>([](auto& c) {
                      c.bits = 256;
                      c.ensemble = INT_MAX / 128;
                    }),
                    Contains("ensemble x bits = 16777215 x 256 = 4294967040, expected <= 256"));
  CHECK_THROWS_WITH(make<HE>([](auto& c) {
                      c.bits = 16;
                      c.ensemble = INT_MAX;
                    }),
                    Contains("expected <= 256"));
  // group x code width must fit the uint16 scores, computed without int overflow.
  CHECK_THROWS_WITH(KVCache<HE>(Geometry{1, 65536, 1, 8}, Budget::uniform(32),
                                make<HE>([](auto& c) { c.bits = 256; })),
                    Contains("group = 65536 with 256-bit codes"));
}

TEST_CASE("BUZZ log_n: S + W + T + old samples cannot wrap the row limit", "[reliability]") {
  // The row limit adds a head's old samples (at most its capacity) to S + W + T: a
  // threshold that fits alone but not with the capacity is refused, at construction and
  // on set_budget, instead of wrapping to a limit of a few rows once samples exist.
  const auto cfg = [](std::size_t threshold) {
    return pol::BuzzBeehive({.sinks = 0, .window = 1, .threshold = threshold, .stride = 3, .log_n = true});
  };
  const Geometry g{1, 1, 1, 4};
  CHECK_THROWS_WITH(KVCache<pol::BuzzBeehive>(g, Budget::uniform(8), cfg(kHuge - 3)),
                    Contains("BuzzBeehive log_n") && Contains(std::to_string(kHuge - 2) + " + 8 overflows"));
  // Just fits: the head keeps its 8 rows after many rebuilds (a wrapped limit would drop
  // it to one row).
  KVCache<pol::BuzzBeehive> c(g, Budget::uniform(8), cfg(kHuge - 10));
  Rng rng(5);
  drive(c, rng, 0, 40);
  CHECK(c.policy().rebuilds(0, 0) > 0);
  CHECK(c.policy().samples(0, 0) > 0);
  CHECK(c.size(0, 0) == 8);
  rejected(c, [](auto& x) { x.set_budget(Budget::uniform(16)); },
           Contains("BuzzBeehive log_n") && Contains(" + 16 overflows"));
  // Unbounded: no capacity to check; the limit is S + W + T while no samples exist.
  KVCache<pol::BuzzBeehive> u(g, Budget::unbounded(), cfg(kHuge - 3));
  drive(u, rng, 0, 5);
  CHECK(u.size(0, 0) == 5);
}

TEST_CASE("Protection::is_protected cannot wrap for recent near 2^64", "[reliability]") {
  const pol::detail::Protection all{0, kHuge}, half{0, (std::size_t{1} << 63) + 1};
  CHECK(all.is_protected(5, 10));  // 5 + (2^64 - 1) used to wrap to 4 < 10
  CHECK(all.is_protected(0, ~std::uint64_t{0}));
  CHECK(half.is_protected(std::uint64_t{1} << 63, ~std::uint64_t{0}));
  CHECK(half.is_protected(1, (std::uint64_t{1} << 63) + 2));
  CHECK_FALSE(half.is_protected(0, (std::uint64_t{1} << 63) + 2));
  // The ordinary rule is unchanged: sinks by arrival, the `recent` before the incoming.
  const pol::detail::Protection p{1, 2};
  CHECK(p.is_protected(0, 10));
  CHECK(p.is_protected(8, 10));
  CHECK(p.is_protected(9, 10));
  CHECK_FALSE(p.is_protected(7, 10));
  CHECK_FALSE(p.is_protected(1, 10));
}

// --- files ------------------------------------------------------------------------------

TEST_CASE("a directory given as a file is named in the error", "[reliability]") {
  const auto dir = std::filesystem::temp_directory_path();
  auto cache = h2o_cache();
  rejected(
      cache, [&](auto& c) { load(c, dir.string()); },
      Contains("'" + dir.string() + "': is a directory, expected a file"));
  rejected(
      cache, [&](auto& c) { load(c, (dir / "kvevict-no-such-file").string()); },
      Contains("kvevict-no-such-file': cannot open"));
  CHECK_THROWS_WITH(pol::Profile::load(dir.string()), Contains("is a directory"));
}

// --- the thread-safety contract ---------------------------------------------------------

TEST_CASE("overlapping calls that change one cache are rejected when checking is on",
          "[reliability][threads]") {
  // Thread A appends to layer 0 and is held inside the call by its eviction callback;
  // thread B's append to layer 1 (and observe, prefill, set_budget, load) must throw.
  auto cache = h2o_cache();
  std::atomic<int> stage{0};
  cache.set_eviction_callback([&](const EvictedRow<float>&) {
    if (stage.load() != 0) return;
    stage.store(1);
    while (stage.load() != 2) std::this_thread::yield();
  });
  const std::vector<float> k(8, 0.5f), q(16, 0.1f);
  std::thread a([&] { cache.append(0, 1000, k, k, q); });
  while (stage.load() != 1) std::this_thread::yield();
  const auto busy = Contains("another call is changing this cache");
  CHECK_THROWS_WITH(cache.append(1, 1000, k, k, q), busy);
  CHECK_THROWS_WITH(cache.observe(1, 0, std::vector<float>(12, 0.1f)), busy);
  CHECK_THROWS_WITH(cache.prefill(1, 1000, 1, k, k, q), busy);
  CHECK_THROWS_WITH(cache.set_budget(Budget::uniform(7)), busy);
  CHECK_THROWS_WITH(load_bytes(cache, save_bytes(h2o_cache())), busy);
  CHECK(cache.tokens_seen(1) == 10);  // reads are allowed alongside
  stage.store(2);
  a.join();
  CHECK(cache.tokens_seen(0) == 11);
  CHECK_NOTHROW(cache.append(1, 1000, k, k, q));  // the cache is usable again
}
