// DecayedAttention's RecallRank::excess (the recall reserve ranked by the long-range spike
// minus the row's mean long-range draw) and RecallRank::total (by the sum of the row's
// long-range draws). Brute force (kept rows compared every step, kvtest::RecallBrute), the
// property each exists for, and the default left alone.
#include <map>
#include <numeric>
#include <set>

#include <kvevict/policies/decayed_attention.hpp>
#include <kvevict/serialize.hpp>

#include "support/recall_support.hpp"

using namespace kvevict;
using DA = policies::DecayedAttention;

using kvtest::RecallBrute;

TEST_CASE("DecayedAttention RecallRank::excess and total agree with a brute-force rule", "[recall]") {
  for (DA::RecallRank rank : {DA::RecallRank::excess, DA::RecallRank::total})
  for (int G : {1, 2}) {
    const std::size_t cap = 24;
    const DA policy({.sinks = 1, .horizon = 3.0f, .recent_fraction = 0.25f,
                     .recall_fraction = 0.25f, .recall_rank = rank});
    const Geometry g{1, 2 * G, 2, 8};
    KVCache<DA> cache(g, Budget::uniform(cap), policy);
    std::vector<RecallBrute> brute(2, RecallBrute{rank, 1.0 - 3.0 / cap, 1, 6, cap, 6, {}});
    kvtest::Rng rng(40 + G + 10 * static_cast<int>(rank));
    INFO("rank " << static_cast<int>(rank));
    kvtest::compare_with_brute(cache, brute, G, rng);
  }
}

// Runs one head of 16 rows (1 sink, 6 recent, a 2-row reserve ranked by `rank`) for 400
// steps; attention(t, x) gives row x's probability at step t (negative: a share of what the
// others leave). True iff row 7 is never evicted.
template <class Attention>
bool row7_survives(DA::RecallRank rank, Attention attention) {
  return kvtest::rows_survive(DA({.sinks = 1, .horizon = 3.0f, .recent_fraction = 0.375f,
                                  .recall_fraction = 0.125f, .recall_rank = rank}),
                              {7}, attention);
}

// Repetitive text: two rows (8, 9) act like sinks, drawing 0.3 of every query's attention;
// their decayed score keeps them anyway. One row (the name, 7) draws a little while the
// story is about it, is referred back to once from far away (0.25 at t = 30), then never
// again. With a 2-row reserve, the plain spike ranks the sink-like rows first (0.3 > 0.25)
// and the name fades out of the decayed score; the excess spike of a row that always draws
// the same is zero, so the reserve holds the name.
TEST_CASE("RecallRank::excess keeps a rarely-recalled row against sink-like rows", "[recall]") {
  const auto attention = [](int t, std::int64_t x) {
    if (x == 8 || x == 9) return 0.3f;
    if (x == 7) return t < 30 ? 0.05f : (t == 30 ? 0.25f : 0.0f);
    return -1.0f;
  };
  CHECK(row7_survives(DA::RecallRank::excess, attention));
  CHECK_FALSE(row7_survives(DA::RecallRank::spike, attention));
}

// A repeated token whose copies each draw one large spike (0.3, ten steps after each
// copy) against an old row (the intro, 7) that the story attends while it is new (0.1
// until step 20) and then refers back to every 40 steps (0.2). The recent band (the copies
// too) shares what is left; other old rows draw 0.002 a step. With a 2-row reserve the
// plain spike keeps the two latest copies (0.3 > 0.2) and the intro fades out of the
// decayed score between its recalls; its summed draws outgrow every copy's, so
// RecallRank::total keeps it.
TEST_CASE("RecallRank::total keeps a steadily attended old row against repeated spikes", "[recall]") {
  const auto attention = [](int t, std::int64_t x) {
    if (x == 7) return t < 20 ? 0.1f : (t % 40 == 0 ? 0.2f : 0.0f);
    if (t - x < 6) return -1.0f;
    if (x > 7 && x % 8 == 0) return t - x == 10 ? 0.3f : 0.0f;  // the copies
    return 0.002f;
  };
  CHECK(row7_survives(DA::RecallRank::total, attention));
  CHECK_FALSE(row7_survives(DA::RecallRank::spike, attention));
}

TEST_CASE("RecallRank::excess saves and restores; states of the two ranks do not mix",
          "[recall]") {
  const Geometry g{1, 2, 1, 4};
  const DA excess({.sinks = 1, .horizon = 3.0f, .recent_fraction = 0.25f,
                   .recall_fraction = 0.25f, .recall_rank = DA::RecallRank::excess});
  KVCache<DA> cache(g, Budget::uniform(12), excess);
  kvtest::Rng rng(9);
  const auto bytes =
      kvtest::check_restore_twin(cache, excess, 12, rng, [&](int) { return rng.normals(4); });
  KVCache<DA> spike(g, Budget::uniform(12),
                    DA({.sinks = 1, .horizon = 3.0f, .recent_fraction = 0.25f, .recall_fraction = 0.25f}));
  REQUIRE_THROWS_AS(load_bytes(spike, bytes), Error);
  // RecallRank::total: restores into its twin; its state and excess's do not mix either way.
  const DA total({.sinks = 1, .horizon = 3.0f, .recent_fraction = 0.25f,
                  .recall_fraction = 0.25f, .recall_rank = DA::RecallRank::total});
  KVCache<DA> tcache(g, Budget::uniform(12), total);
  const auto tbytes =
      kvtest::check_restore_twin(tcache, total, 12, rng, [&](int) { return rng.normals(4); });
  KVCache<DA> as_excess(g, Budget::uniform(12), excess);
  REQUIRE_THROWS_AS(load_bytes(as_excess, tbytes), Error);
  KVCache<DA> as_total(g, Budget::uniform(12), total);
  REQUIRE_THROWS_AS(load_bytes(as_total, bytes), Error);
}

TEST_CASE("RecallRank rejects an out-of-range value by number", "[recall]") {
  REQUIRE_THROWS_WITH(DA({.recall_rank = static_cast<DA::RecallRank>(7)}),
                      Catch::Contains("recall_rank = 7"));
  REQUIRE_NOTHROW(DA({.recall_rank = DA::RecallRank::total}));
  CHECK(DA::recommended().config().recall_rank == DA::RecallRank::spike);  // default unchanged
}
