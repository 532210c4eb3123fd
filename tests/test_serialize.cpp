// Save and restore: a restored cache is bit-identical to the saved one and then behaves
// identically (same victims, same scores); every bad input is rejected with
// kvevict::Error and leaves the target cache exactly as it was.
#include <kvevict/serialize.hpp>

#include <cstdio>
#include <filesystem>

#include "support/test_support.hpp"

namespace {

using kvevict::Budget;
using kvevict::Geometry;
using kvevict::KVCache;
namespace pol = kvevict::policies;

const Geometry kGeo{2, 4, 2, 8};

// Drives a cache with a seeded stream: append, and attend for attention policies.
template <class Cache>
void drive(Cache& c, kvtest::Rng& rng, int from, int steps) {
  const auto& g = c.geometry();
  const std::size_t kv = std::size_t(g.n_kv_heads * g.head_dim);
  const std::size_t qn = std::size_t(g.n_heads * g.head_dim);
  for (int t = from; t < from + steps; ++t)
    for (int l = 0; l < g.n_layers; ++l) {
      auto k = rng.normals(kv), v = rng.normals(kv), q = rng.normals(qn);
      c.append(l, 3 * t + 1, k, v, q);
      if constexpr (has(Cache::policy_type::signals, kvevict::Signals::attention))
        kvevict::attend(c, l, q);
    }
}

template <class Cache>
void require_same_rows(const Cache& a, const Cache& b) {
  const auto sa = kvtest::snapshot(a), sb = kvtest::snapshot(b);
  REQUIRE(sa.seen == sb.seen);
  REQUIRE(sa.heads.size() == sb.heads.size());
  for (std::size_t i = 0; i < sa.heads.size(); ++i) {
    INFO("head " << i);
    REQUIRE(sa.heads[i].size == sb.heads[i].size);
    REQUIRE(sa.heads[i].positions == sb.heads[i].positions);
    REQUIRE(sa.heads[i].seqs == sb.heads[i].seqs);
    // Bit-exact: compare the raw storage, not converted values.
    const auto& g = a.geometry();
    const int l = int(i) / g.n_kv_heads, h = int(i) % g.n_kv_heads;
    const auto ka = a.keys(l, h), kb = b.keys(l, h), va = a.values(l, h), vb = b.values(l, h);
    using S = typename Cache::scalar_type;
    REQUIRE(std::memcmp(ka.data(), kb.data(), std::size_t(ka.size()) * sizeof(S)) == 0);
    REQUIRE(std::memcmp(va.data(), vb.data(), std::size_t(va.size()) * sizeof(S)) == 0);
  }
}

// Save after a warm-up, restore into a fresh cache, then run both on the same stream.
template <class S, class Policy>
void round_trip(Policy policy, Budget budget) {
  KVCache<Policy, S> a(kGeo, budget, policy);
  kvtest::Rng rng(17);
  drive(a, rng, 0, 40);
  const auto bytes = kvevict::save_bytes(a);
  KVCache<Policy, S> b(kGeo, budget, policy);
  kvevict::load_bytes(b, bytes);
  require_same_rows(a, b);
  if constexpr (std::is_same_v<Policy, pol::H2O>)
    for (int l = 0; l < kGeo.n_layers; ++l)
      for (int h = 0; h < kGeo.n_kv_heads; ++h)
        REQUIRE(a.policy().scores(l, h) == b.policy().scores(l, h));
  REQUIRE(kvevict::save_bytes(b) == bytes);
  kvtest::Rng ra(23), rb(23);
  for (int step = 0; step < 30; ++step) {
    drive(a, ra, 40 + step, 1);
    drive(b, rb, 40 + step, 1);
    require_same_rows(a, b);
  }
}

// Re-computes the trailing checksum after a deliberate edit, so the structural checks
// (not the checksum) must catch it.
void reseal(std::vector<std::uint8_t>& bytes) {
  const auto h = kvevict::detail::fnv1a(std::span<const std::uint8_t>(bytes).first(bytes.size() - 8));
  std::memcpy(bytes.data() + bytes.size() - 8, &h, 8);
}

template <class Cache>
void require_rejected_unchanged(Cache& target, const std::vector<std::uint8_t>& bytes,
                                const char* fragment) {
  const auto before = kvtest::snapshot(target);
  const auto state_before = kvevict::save_bytes(target);
  try {
    kvevict::load_bytes(target, bytes);
    FAIL("accepted a bad file (" << fragment << ")");
  } catch (const kvevict::Error& e) {
    INFO(e.what());
    CHECK(std::string(e.what()).find(fragment) != std::string::npos);
  }
  REQUIRE(kvtest::snapshot(target) == before);
  REQUIRE(kvevict::save_bytes(target) == state_before);  // policy state too
}

}  // namespace

TEMPLATE_TEST_CASE("save/restore is bit-exact and resumes identically", "[serialize]", float,
                   Eigen::half, Eigen::bfloat16) {
  using S = TestType;
  SECTION("StreamingLLM") { round_trip<S>(pol::StreamingLLM{2}, Budget::uniform(9)); }
  SECTION("H2O") { round_trip<S>(pol::H2O(pol::H2O::Config{3, 1}), Budget::per_layer({8, 12})); }
  SECTION("KNorm") { round_trip<S>(pol::KNorm(pol::KNorm::Config{1, 1}), Budget::uniform(7)); }
  SECTION("Random") {
    round_trip<S>(pol::Random(pol::Random::Config{99, 1, 2}), Budget::per_head({{5, 9}, {7, 6}}));
  }
  SECTION("FullCache") { round_trip<S>(pol::FullCache{}, Budget::unbounded()); }
}

TEST_CASE("save/restore through a file", "[serialize]") {
  const auto path = (std::filesystem::temp_directory_path() / "kvevict_test_serialize.bin").string();
  KVCache<pol::H2O> a(kGeo, Budget::uniform(10), pol::H2O(pol::H2O::Config{2, 1}));
  kvtest::Rng rng(5);
  drive(a, rng, 0, 25);
  kvevict::save(a, path);
  KVCache<pol::H2O> b(kGeo, Budget::uniform(10), pol::H2O(pol::H2O::Config{2, 1}));
  kvevict::load(b, path);
  require_same_rows(a, b);
  std::remove(path.c_str());
  CHECK_THROWS_AS(kvevict::load(b, path), kvevict::Error);
}

TEST_CASE("bad save files are rejected and leave the target untouched", "[serialize]") {
  using Cache = KVCache<pol::H2O>;
  const pol::H2O policy(pol::H2O::Config{2, 1});
  Cache source(kGeo, Budget::uniform(10), policy);
  kvtest::Rng rng(31);
  drive(source, rng, 0, 20);
  const auto good = kvevict::save_bytes(source);
  Cache target(kGeo, Budget::uniform(10), policy);
  kvtest::Rng rt(32);
  drive(target, rt, 0, 13);  // a non-empty target with its own rows and scores

  SECTION("truncated anywhere") {
    for (std::size_t n = 0; n < good.size(); n += (n < 64 ? 1 : 37))
      require_rejected_unchanged(target, std::vector<std::uint8_t>(good.begin(), good.begin() + std::ptrdiff_t(n)), "saved state");
  }
  SECTION("any corrupted byte") {
    for (std::size_t i = 0; i < good.size(); i += (i < 64 ? 1 : 29)) {
      auto bad = good;
      bad[i] ^= 0x5a;
      require_rejected_unchanged(target, bad, "saved state");
    }
  }
  SECTION("trailing garbage") {
    auto bad = good;
    bad.insert(bad.end() - 8, {1, 2, 3});
    reseal(bad);
    require_rejected_unchanged(target, bad, "trailing");
  }
  SECTION("wrong version") {
    auto bad = good;
    bad[8] = 2;
    reseal(bad);
    require_rejected_unchanged(target, bad, "version 2");
  }
  SECTION("wrong magic") {
    auto bad = good;
    bad[0] = 'X';
    require_rejected_unchanged(target, bad, "magic");
  }
  SECTION("wrong geometry") {
    Cache other(Geometry{2, 4, 1, 8}, Budget::uniform(10), policy);
    require_rejected_unchanged(target, kvevict::save_bytes(other), "geometry");
  }
  SECTION("wrong budget") {
    Cache other(kGeo, Budget::uniform(11), policy);
    require_rejected_unchanged(target, kvevict::save_bytes(other), "capacity");
  }
  SECTION("wrong policy") {
    KVCache<pol::KNorm> other(kGeo, Budget::uniform(10), pol::KNorm{});
    require_rejected_unchanged(target, kvevict::save_bytes(other), "policy KNorm");
  }
  SECTION("wrong policy configuration") {
    Cache other(kGeo, Budget::uniform(10), pol::H2O(pol::H2O::Config{3, 1}));
    require_rejected_unchanged(target, kvevict::save_bytes(other), "recent = 3");
  }
  SECTION("wrong scalar type") {
    KVCache<pol::H2O, Eigen::half> other(kGeo, Budget::uniform(10), policy);
    require_rejected_unchanged(target, kvevict::save_bytes(other), "Eigen::half");
  }
  SECTION("structurally invalid rows behind a valid checksum") {
    // Header: magic 8, version 4, tag 4, size 4, name (4 + 3 "H2O"), geometry 16, capacities
    // 4 x 8, layers 2 x 16; then head 0: u64 rows, rows x (i64 position, u64 seq).
    const std::size_t head0 = 8 + 4 + 4 + 4 + 4 + 3 + 16 + 4 * 8 + 2 * 16;
    std::uint64_t rows;
    std::memcpy(&rows, good.data() + head0, 8);
    REQUIRE(rows == 10);
    auto dup = good;  // row 1 repeats row 0's position and seq
    std::memcpy(dup.data() + head0 + 8 + 16, dup.data() + head0 + 8, 16);
    reseal(dup);
    require_rejected_unchanged(target, dup, "repeats");
    auto big = good;  // more rows than the capacity
    const std::uint64_t many = 11;
    std::memcpy(big.data() + head0, &many, 8);
    reseal(big);
    require_rejected_unchanged(target, big, "rows");
    auto future = good;  // a seq beyond the tokens the layer has seen
    const std::uint64_t seq = 1u << 20;
    std::memcpy(future.data() + head0 + 8 + 8, &seq, 8);
    reseal(future);
    require_rejected_unchanged(target, future, "seq");
  }
  SECTION("invalid policy state behind a valid checksum") {
    // The last score of the last column is the float just before the checksum.
    auto nan = good;
    const float bad_score = std::numeric_limits<float>::quiet_NaN();
    std::memcpy(nan.data() + nan.size() - 8 - 4, &bad_score, 4);
    reseal(nan);
    require_rejected_unchanged(target, nan, "invalid value");
  }
}

TEST_CASE("Random's generators survive a restore", "[serialize]") {
  // Without the saved generator state a restored Random would draw from a fresh stream.
  using Cache = KVCache<pol::Random>;
  const pol::Random policy(pol::Random::Config{7, 0, 0});
  Cache a(kGeo, Budget::uniform(6), policy);
  kvtest::Rng rng(3);
  drive(a, rng, 0, 30);
  Cache b(kGeo, Budget::uniform(6), policy);
  kvevict::load_bytes(b, kvevict::save_bytes(a));
  Cache fresh_rng(kGeo, Budget::uniform(6), policy);
  kvevict::load_bytes(fresh_rng, kvevict::save_bytes(a));
  fresh_rng.policy().bind(fresh_rng.shape());  // reseeds: the state a naive restore would have
  kvtest::Rng r1(4), r2(4), r3(4);
  bool diverged = false;
  for (int s = 0; s < 20; ++s) {
    drive(a, r1, 30 + s, 1);
    drive(b, r2, 30 + s, 1);
    drive(fresh_rng, r3, 30 + s, 1);
    require_same_rows(a, b);
    diverged = diverged || kvtest::snapshot(a) != kvtest::snapshot(fresh_rng);
  }
  REQUIRE(diverged);
}
