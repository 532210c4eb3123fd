// DecayedAttention against a plain re-implementation: same stream, same attention
// probabilities (taken from attend(), which test_attention checks against a naive loop),
// kept positions compared after every step.
#include <map>
#include <set>

#include <kvevict/policies/decayed_attention.hpp>
#include <kvevict/serialize.hpp>

#include "support/test_support.hpp"

using namespace kvevict;

namespace {

struct BruteRow {
  std::uint64_t seq;
  float score;
};

// The rule written out directly: per (layer, head) a map position -> (seq, score).
struct BruteDecayed {
  float decay;
  std::size_t sinks, recent, capacity;
  std::map<std::int64_t, BruteRow> rows;
  void step(std::int64_t pos, std::uint64_t seq) {
    if (rows.size() >= capacity) {
      auto victim = rows.end();
      for (auto it = rows.begin(); it != rows.end(); ++it) {
        const auto s = it->second.seq;
        if (s < sinks || s + recent >= seq) continue;
        if (victim == rows.end() || it->second.score < victim->second.score ||
            (it->second.score == victim->second.score && s < victim->second.seq))
          victim = it;
      }
      REQUIRE(victim != rows.end());
      rows.erase(victim);
    }
    rows[pos] = {seq, 0.0f};
  }
};

void run_policy(const policies::DecayedAttention& policy, float decay, std::size_t sinks,
                std::size_t recent, std::size_t cap, int G, std::uint64_t seed) {
  const Geometry g{2, 2 * G, 2, 16};
  KVCache<policies::DecayedAttention> cache(g, Budget::uniform(static_cast<long long>(cap)),
                                            policy);
  std::vector<BruteDecayed> brute(4, BruteDecayed{decay, sinks, recent, cap, {}});
  kvtest::Rng rng(seed);
  for (int t = 0; t < 300; ++t) {
    for (int l = 0; l < g.n_layers; ++l) {
      auto k = rng.normals(static_cast<std::size_t>(g.n_kv_heads * g.head_dim));
      auto v = rng.normals(static_cast<std::size_t>(g.n_kv_heads * g.head_dim));
      auto q = rng.normals(static_cast<std::size_t>(g.n_heads * g.head_dim), 2.0f);
      cache.append(l, t, k, v, q);
      const auto r = attend(cache, l, q);
      for (int h = 0; h < g.n_kv_heads; ++h) {
        auto& b = brute[static_cast<std::size_t>(l * g.n_kv_heads + h)];
        b.step(t, static_cast<std::uint64_t>(t));
        const auto pos = cache.positions(l, h);
        std::set<std::int64_t> kept(pos.begin(), pos.end()), want;
        for (const auto& [p, row] : b.rows) want.insert(p);
        REQUIRE(kept == want);
        const auto& p = r.probs[static_cast<std::size_t>(h)];
        for (std::size_t i = 0; i < pos.size(); ++i) {
          float s = 0.0f;
          for (int gq = 0; gq < G; ++gq) s += p(gq, static_cast<Eigen::Index>(i));
          auto& row = b.rows.at(pos[i]);
          row.score = decay * row.score + s;
        }
      }
    }
  }
}

void run(float decay, std::size_t sinks, std::size_t recent, std::size_t cap, int G,
         std::uint64_t seed) {
  run_policy(policies::DecayedAttention({.decay = decay, .sinks = sinks, .recent = recent}),
             decay, sinks, recent, cap, G, seed);
}

}  // namespace

TEST_CASE("DecayedAttention scales decay and window with capacity") {
  const auto p = policies::DecayedAttention::recommended();
  // decay = 1 - 3 / C, recent = floor(C / 2), one sink: written out by hand.
  for (std::size_t cap : {8u, 16u, 40u}) {
    CHECK(p.decay_for(cap) == Approx(1.0f - 3.0f / static_cast<float>(cap)));
    CHECK(p.recent_for(cap) == cap / 2);
    run_policy(p, 1.0f - 3.0f / static_cast<float>(cap), 1, cap / 2, cap, 4, 20 + cap);
  }
  // The window never swallows the last evictable slot.
  const policies::DecayedAttention tight({.sinks = 2, .recent_fraction = 0.9f});
  CHECK(tight.recent_for(10) == 7);
  CHECK(tight.decay_for(10) == 0.0f);  // no horizon: the fixed decay
  REQUIRE_THROWS_WITH(policies::DecayedAttention({.horizon = -1.0f}), Catch::Contains("horizon = -1"));
  REQUIRE_THROWS_WITH(policies::DecayedAttention({.recent_fraction = 1.0f}),
                      Catch::Contains("recent_fraction = 1"));
}

TEST_CASE("DecayedAttention agrees with a brute-force re-implementation") {
  for (int G : {1, 4}) {
    run(0.0f, 0, 0, 24, G, 11);    // TOVA
    run(0.0f, 4, 8, 24, G, 12);
    run(0.9f, 4, 4, 32, G, 13);
    run(1.0f, 2, 6, 20, G, 14);    // H2O-like accumulation
  }
}

TEST_CASE("DecayedAttention with decay 1 and no sinks decides exactly as H2O") {
  const Geometry g{1, 4, 2, 8};
  KVCache<policies::DecayedAttention> a(g, Budget::uniform(16),
                                        policies::DecayedAttention({.decay = 1.0f, .recent = 5}));
  KVCache<policies::H2O> b(g, Budget::uniform(16), policies::H2O({.recent = 5}));
  kvtest::Rng rng(5);
  for (int t = 0; t < 200; ++t) {
    auto k = rng.normals(16), v = rng.normals(16), q = rng.normals(32, 3.0f);
    a.append(0, t, k, v, q);
    b.append(0, t, k, v, q);
    attend(a, 0, q);
    attend(b, 0, q);
    for (int h = 0; h < 2; ++h) {
      auto pa = a.positions(0, h), pb = b.positions(0, h);
      REQUIRE(std::set<std::int64_t>(pa.begin(), pa.end()) ==
              std::set<std::int64_t>(pb.begin(), pb.end()));
    }
  }
}

TEST_CASE("DecayedAttention rejects a decay outside [0, 1]") {
  REQUIRE_THROWS_WITH(policies::DecayedAttention({.decay = 1.5f}),
                      Catch::Contains("decay = 1.5") && Catch::Contains("[0, 1]"));
  REQUIRE_THROWS_WITH(policies::DecayedAttention({.decay = -0.1f}), Catch::Contains("decay"));
}

TEST_CASE("DecayedAttention state survives save/restore: the restored cache decides identically") {
  const Geometry g{2, 4, 2, 8};
  const auto policy = policies::DecayedAttention::recommended();
  KVCache<policies::DecayedAttention> a(g, Budget::uniform(16), policy);
  kvtest::Rng rng(77);
  auto step = [&](auto& cache, int t, const std::vector<float>& k, const std::vector<float>& v,
                  const std::vector<float>& q, int l) {
    cache.append(l, t, k, v, q);
    attend(cache, l, q);
  };
  std::vector<std::vector<float>> ks, vs, qs;
  for (int i = 0; i < 200; ++i) {
    ks.push_back(rng.normals(16));
    vs.push_back(rng.normals(16));
    qs.push_back(rng.normals(32, 2.0f));
  }
  for (int t = 0; t < 100; ++t)
    for (int l = 0; l < 2; ++l) step(a, t, ks[t], vs[t], qs[t], l);
  KVCache<policies::DecayedAttention> b(g, Budget::uniform(16), policy);
  load_bytes(b, save_bytes(a));
  for (int t = 100; t < 200; ++t)
    for (int l = 0; l < 2; ++l) {
      step(a, t, ks[t], vs[t], qs[t], l);
      step(b, t, ks[t], vs[t], qs[t], l);
      for (int h = 0; h < 2; ++h) {
        auto pa = a.positions(l, h), pb = b.positions(l, h);
        REQUIRE(std::vector<std::int64_t>(pa.begin(), pa.end()) ==
                std::vector<std::int64_t>(pb.begin(), pb.end()));
        REQUIRE(a.policy().scores(l, h) == b.policy().scores(l, h));
      }
    }
  // A restore into a differently configured policy is refused.
  KVCache<policies::DecayedAttention> c(g, Budget::uniform(16),
                                        policies::DecayedAttention({.decay = 0.5f, .sinks = 1}));
  REQUIRE_THROWS_WITH(load_bytes(c, save_bytes(a)), Catch::Contains("DecayedAttention state"));
}
