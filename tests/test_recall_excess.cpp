// DecayedAttention's RecallRank::excess: the recall reserve ranked by the long-range spike
// minus the row's mean long-range draw. Brute force (kept rows compared every step), the
// property it exists for (repeated sink-like rows do not capture the reserve), and the
// default left alone.
#include <map>
#include <numeric>
#include <set>

#include <kvevict/policies/decayed_attention.hpp>
#include <kvevict/serialize.hpp>

#include "support/test_support.hpp"

using namespace kvevict;
using DA = policies::DecayedAttention;

namespace {

struct Row {
  std::uint64_t seq;
  double score = 0.0, spike = 0.0, draws = 0.0;
  std::size_t count = 0;
};

// The rule written out: protected sinks and band; of the rest, the `recall` rows with the
// largest positive (spike - draws / count) are kept (ties: newer), leaving one evictable;
// the lowest decayed score of the remainder goes (ties: older).
struct Brute {
  double decay;
  std::size_t sinks, recent, capacity, recall;
  std::map<std::int64_t, Row> rows;
  void step(std::int64_t pos, std::uint64_t seq) {
    if (rows.size() >= capacity) {
      std::vector<std::int64_t> open;
      for (const auto& [p, r] : rows)
        if (!(r.seq < sinks || r.seq + recent >= seq)) open.push_back(p);
      std::vector<std::pair<double, std::int64_t>> ranked;
      for (auto p : open) {
        const Row& r = rows.at(p);
        const double e = r.count ? static_cast<double>(static_cast<float>(r.spike) - static_cast<float>(r.draws) / static_cast<float>(r.count)) : 0.0;
        if (e > 0.0) ranked.push_back({e, p});
      }
      std::sort(ranked.begin(), ranked.end(), [&](auto a, auto b) {
        return a.first != b.first ? a.first > b.first : rows.at(a.second).seq > rows.at(b.second).seq;
      });
      std::set<std::int64_t> kept;
      for (std::size_t i = 0; i < std::min({recall, ranked.size(), open.size() - 1}); ++i)
        kept.insert(ranked[i].second);
      std::int64_t victim = -1;
      for (auto p : open) {
        if (kept.count(p)) continue;
        if (victim < 0 || rows.at(p).score < rows.at(victim).score ||
            (rows.at(p).score == rows.at(victim).score && rows.at(p).seq < rows.at(victim).seq))
          victim = p;
      }
      REQUIRE(victim >= 0);
      rows.erase(victim);
    }
    rows[pos] = {seq};
  }
  void observe(std::int64_t pos, std::uint64_t latest, float x) {
    Row& r = rows.at(pos);
    r.score = static_cast<double>(static_cast<float>(decay) * static_cast<float>(r.score) + x);
    if (latest - r.seq >= recent) {
      r.spike = std::max(r.spike, static_cast<double>(x));
      r.draws = static_cast<double>(static_cast<float>(r.draws) + x);
      ++r.count;
    }
  }
};

}  // namespace

TEST_CASE("DecayedAttention RecallRank::excess agrees with a brute-force rule", "[recall]") {
  for (int G : {1, 2}) {
    const std::size_t cap = 24;
    const DA policy({.sinks = 1, .horizon = 3.0f, .recent_fraction = 0.25f,
                     .recall_fraction = 0.25f, .recall_rank = DA::RecallRank::excess});
    const Geometry g{1, 2 * G, 2, 8};
    KVCache<DA> cache(g, Budget::uniform(cap), policy);
    std::vector<Brute> brute(2, Brute{1.0 - 3.0 / cap, 1, 6, cap, 6, {}});
    kvtest::Rng rng(40 + G);
    for (int t = 0; t < 250; ++t) {
      auto k = rng.normals(16), v = rng.normals(16), q = rng.normals(static_cast<std::size_t>(2 * G * 8), 2.0f);
      cache.append(0, t, k, v, q);
      const auto r = attend(cache, 0, q);
      for (int h = 0; h < 2; ++h) {
        auto& b = brute[static_cast<std::size_t>(h)];
        b.step(t, static_cast<std::uint64_t>(t));
        const auto pos = cache.positions(0, h);
        std::set<std::int64_t> kept(pos.begin(), pos.end()), want;
        for (const auto& [p, row] : b.rows) want.insert(p);
        INFO("step " << t << " head " << h);
        REQUIRE(kept == want);
        const auto& p = r.probs[static_cast<std::size_t>(h)];
        for (std::size_t i = 0; i < pos.size(); ++i) {
          float s = 0.0f;
          for (int gq = 0; gq < G; ++gq) s += p(gq, static_cast<Eigen::Index>(i));
          b.observe(pos[i], static_cast<std::uint64_t>(t), s);
        }
      }
    }
  }
}

// Repetitive text: two rows (8, 9) act like sinks, drawing 0.3 of every query's attention;
// their decayed score keeps them anyway. One row (the name, 7) draws a little while the
// story is about it, is referred back to once from far away (0.25 at t = 30), then never
// again. With a 2-row reserve, the plain spike ranks the sink-like rows first (0.3 > 0.25)
// and the name fades out of the decayed score; the excess spike of a row that always draws
// the same is zero, so the reserve holds the name.
TEST_CASE("RecallRank::excess keeps a rarely-recalled row against sink-like rows", "[recall]") {
  const Geometry g{1, 1, 1, 4};
  auto name_survives = [&](DA::RecallRank rank) {
    KVCache<DA> cache(g, Budget::uniform(16),
                      DA({.sinks = 1, .horizon = 3.0f, .recent_fraction = 0.375f,
                          .recall_fraction = 0.125f, .recall_rank = rank}));
    const std::vector<float> kv(4, 0.5f), q(4, 0.0f);
    std::vector<float> probs;
    for (int t = 0; t < 400; ++t) {
      cache.append(0, t, kv, kv, q);
      const auto pos = cache.positions(0, 0);
      const bool has_name = std::find(pos.begin(), pos.end(), 7) != pos.end();
      if (t > 7 && !has_name) return false;
      probs.assign(pos.size(), 0.0f);
      float used = 0.0f;
      std::size_t special = 0;
      for (std::size_t i = 0; i < pos.size(); ++i) {
        if (pos[i] == 8 || pos[i] == 9) probs[i] = 0.3f;
        else if (pos[i] == 7) probs[i] = t < 30 ? 0.05f : (t == 30 ? 0.25f : 0.0f);
        else continue;
        used += probs[i];
        ++special;
      }
      for (std::size_t i = 0; i < pos.size(); ++i)
        if (pos[i] < 7 || pos[i] > 9)
          probs[i] = (1.0f - used) / static_cast<float>(pos.size() - special);
      cache.observe(0, 0, probs);
    }
    return true;
  };
  CHECK(name_survives(DA::RecallRank::excess));
  CHECK_FALSE(name_survives(DA::RecallRank::spike));
}

TEST_CASE("RecallRank::excess saves and restores; states of the two ranks do not mix",
          "[recall]") {
  const Geometry g{1, 2, 1, 4};
  const DA excess({.sinks = 1, .horizon = 3.0f, .recent_fraction = 0.25f,
                   .recall_fraction = 0.25f, .recall_rank = DA::RecallRank::excess});
  KVCache<DA> cache(g, Budget::uniform(12), excess);
  kvtest::Rng rng(9);
  for (int t = 0; t < 40; ++t) {
    auto k = rng.normals(4), v = rng.normals(4), q = rng.normals(8);
    cache.append(0, t, k, v, q);
    attend(cache, 0, q);
  }
  const auto bytes = save_bytes(cache);
  KVCache<DA> restored(g, Budget::uniform(12), excess);
  load_bytes(restored, bytes);
  KVCache<DA> twin = cache;
  for (int t = 40; t < 80; ++t) {
    auto k = rng.normals(4), v = rng.normals(4), q = rng.normals(8);
    twin.append(0, t, k, v, q);
    restored.append(0, t, k, v, q);
    attend(twin, 0, q);
    attend(restored, 0, q);
    const auto a = twin.positions(0, 0), b = restored.positions(0, 0);
    REQUIRE(std::vector<std::int64_t>(a.begin(), a.end()) == std::vector<std::int64_t>(b.begin(), b.end()));
  }
  KVCache<DA> spike(g, Budget::uniform(12),
                    DA({.sinks = 1, .horizon = 3.0f, .recent_fraction = 0.25f, .recall_fraction = 0.25f}));
  REQUIRE_THROWS_AS(load_bytes(spike, bytes), Error);
}

TEST_CASE("RecallRank rejects an out-of-range value by number", "[recall]") {
  REQUIRE_THROWS_WITH(DA({.recall_rank = static_cast<DA::RecallRank>(7)}),
                      Catch::Contains("recall_rank = 7"));
  CHECK(DA::recommended().config().recall_rank == DA::RecallRank::spike);  // default unchanged
}
