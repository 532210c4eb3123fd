// DecayedAttention's recall_successor (the recall reserve keeps each row it ranks in
// together with the row that arrived next). Brute force (kept rows compared every step,
// spike and total ranks, G 1 and 2), the case it exists for, save/restore, bad settings.
#include <map>
#include <set>

#include <kvevict/policies/decayed_attention.hpp>
#include <kvevict/serialize.hpp>

#include "support/recall_support.hpp"

using namespace kvevict;
using DA = policies::DecayedAttention;

namespace {

struct Row {
  std::uint64_t seq;
  double score = 0.0, spike = 0.0, draws = 0.0;
};

// The rule written out: protected sinks and band; of the rest, walk the rows with a
// positive rank (spike, or with RecallRank::total the sum of long-range draws) from the
// largest down (ties: newer), keeping each open row and then the open row that arrived
// right after it, until `recall` rows (at most open - 1) are kept; the lowest decayed score
// of the remainder goes (ties: older).
struct Brute {
  DA::RecallRank rank;
  double decay;
  std::size_t sinks, recent, capacity, recall;
  std::map<std::int64_t, Row> rows;
  void step(std::int64_t pos, std::uint64_t seq) {
    if (rows.size() >= capacity) {
      std::set<std::int64_t> open;
      for (const auto& [p, r] : rows)
        if (!(r.seq < sinks || r.seq + recent >= seq)) open.insert(p);
      std::vector<std::pair<double, std::int64_t>> ranked;
      for (auto p : open) {
        const Row& r = rows.at(p);
        const double e = rank == DA::RecallRank::total ? r.draws : r.spike;
        if (e > 0.0) ranked.push_back({e, p});
      }
      std::sort(ranked.begin(), ranked.end(), [&](auto a, auto b) {
        return a.first != b.first ? a.first > b.first : rows.at(a.second).seq > rows.at(b.second).seq;
      });
      const std::size_t limit = std::min(recall, open.size() - 1);
      std::set<std::int64_t> kept;
      for (const auto& [e, p] : ranked) {
        if (kept.size() == limit) break;
        kept.insert(p);
        if (kept.size() == limit) break;
        if (open.count(p + 1)) kept.insert(p + 1);  // positions are arrival indices here
      }
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
    }
  }
};

// One head of 16 rows (1 sink, 6 recent, a 2-row reserve); attention(t, x) gives row x's
// probability at step t (negative: a share of what the others leave). True iff every row
// of `watch` is held after it arrived, for 400 steps.
template <class Attention>
bool rows_survive(bool successor, std::set<std::int64_t> watch, Attention attention) {
  KVCache<DA> cache(Geometry{1, 1, 1, 4}, Budget::uniform(16),
                    DA({.sinks = 1, .horizon = 3.0f, .recent_fraction = 0.375f,
                        .recall_fraction = 0.125f, .recall_successor = successor}));
  const std::vector<float> kv(4, 0.5f), q(4, 0.0f);
  std::vector<float> probs;
  for (int t = 0; t < 400; ++t) {
    cache.append(0, t, kv, kv, q);
    const auto pos = cache.positions(0, 0);
    for (std::int64_t w : watch)
      if (t > w && std::find(pos.begin(), pos.end(), w) == pos.end()) return false;
    kvtest::chosen_then_rest(pos, probs, [&](std::int64_t x) { return attention(t, x); });
    cache.observe(0, 0, probs);
  }
  return true;
}

}  // namespace

TEST_CASE("DecayedAttention recall_successor agrees with a brute-force rule", "[recall]") {
  for (DA::RecallRank rank : {DA::RecallRank::spike, DA::RecallRank::total})
    for (int G : {1, 2}) {
      const std::size_t cap = 24;
      const DA policy({.sinks = 1, .horizon = 3.0f, .recent_fraction = 0.25f,
                       .recall_fraction = 0.25f, .recall_rank = rank, .recall_successor = true});
      const Geometry g{1, 2 * G, 2, 8};
      KVCache<DA> cache(g, Budget::uniform(cap), policy);
      std::vector<Brute> brute(2, Brute{rank, 1.0 - 3.0 / cap, 1, 6, cap, 6, {}});
      kvtest::Rng rng(70 + G + 10 * static_cast<int>(rank));
      INFO("rank " << static_cast<int>(rank) << " G " << G);
      for (int t = 0; t < 250; ++t) {
        auto k = rng.normals(16), v = rng.normals(16),
             q = rng.normals(static_cast<std::size_t>(2 * G * 8), 2.0f);
        cache.append(0, t, k, v, q);
        const auto r = attend(cache, 0, q);
        for (int h = 0; h < 2; ++h) {
          auto& b = brute[static_cast<std::size_t>(h)];
          b.step(t, static_cast<std::uint64_t>(t));
          INFO("step " << t << " head " << h);
          kvtest::check_kept_then_observe(cache, r, h, G, b, static_cast<std::uint64_t>(t));
        }
      }
    }
}

// The name is two tokens, 7 and 8, attended a little (0.05) while the story is about it.
// The story refers back to its first token (7: 0.3 at step 14, then every 40 steps, as a
// head matching the name's start would); nothing far away attends its second (8), which an
// induction head needs at the cue. Copies of a repeated token (every 8th
// position) each draw one spike of 0.2 ten steps after they arrive. With a 2-row reserve
// the plain spike keeps 7 and the latest copy, and 8 fades out of the decayed score; with
// recall_successor the reserve holds 7 and 8.
TEST_CASE("recall_successor keeps the row after a recalled row", "[recall]") {
  const auto attention = [](int t, std::int64_t x) {
    if (x == 7 && (t == 14 || t % 40 == 0)) return 0.3f;
    if (x == 7 || x == 8) return t < 20 ? 0.05f : 0.0f;
    if (t - x < 6) return -1.0f;
    if (x > 8 && x % 8 == 0) return t - x == 10 ? 0.2f : 0.0f;
    return 0.002f;
  };
  CHECK(rows_survive(true, {7, 8}, attention));
  CHECK(rows_survive(false, {7}, attention));
  CHECK_FALSE(rows_survive(false, {8}, attention));
}

TEST_CASE("recall_successor saves and restores", "[recall]") {
  const Geometry g{1, 2, 1, 4};
  const DA pol({.sinks = 1, .horizon = 3.0f, .recent_fraction = 0.25f, .recall_fraction = 0.25f,
                .recall_successor = true});
  KVCache<DA> cache(g, Budget::uniform(12), pol);
  kvtest::Rng rng(11);
  kvtest::check_restore_twin(cache, pol, 12, rng, [&](int) { return rng.normals(4); });
}

TEST_CASE("recall_successor with recall_dedup is rejected, naming the value", "[recall]") {
  REQUIRE_THROWS_WITH(DA({.recall_fraction = 0.125f,
                          .recall_dedup = DA::RecallDedup::reserve,
                          .recall_successor = true}),
                      Catch::Contains("recall_dedup = 1"));
  REQUIRE_NOTHROW(DA({.recall_fraction = 0.125f, .recall_successor = true}));
  CHECK_FALSE(DA::recommended().config().recall_successor);  // default unchanged
}
