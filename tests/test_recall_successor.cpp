// DecayedAttention's recall_successor (the recall reserve keeps each row it ranks in
// together with the row that arrived next). Brute force (kept rows compared every step,
// spike and total ranks, G 1 and 2, kvtest::RecallBrute), the case it exists for,
// save/restore, bad settings.
#include <map>
#include <set>

#include <kvevict/policies/decayed_attention.hpp>
#include <kvevict/serialize.hpp>

#include "support/recall_support.hpp"

using namespace kvevict;
using DA = policies::DecayedAttention;

namespace {
// One head of 16 rows, 1 sink, 6 recent, a 2-row reserve (kvtest::rows_survive).
template <class Attention>
bool rows_survive(bool successor, const std::set<std::int64_t>& watch, Attention attention) {
  return kvtest::rows_survive(DA({.sinks = 1, .horizon = 3.0f, .recent_fraction = 0.375f,
                                  .recall_fraction = 0.125f, .recall_successor = successor}),
                              watch, attention);
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
      std::vector<kvtest::RecallBrute> brute(2, kvtest::RecallBrute{rank, 1.0 - 3.0 / cap, 1, 6, cap, 6, {}, true});
      kvtest::Rng rng(70 + G + 10 * static_cast<int>(rank));
      INFO("rank " << static_cast<int>(rank) << " G " << G);
      kvtest::compare_with_brute(cache, brute, G, rng);
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
