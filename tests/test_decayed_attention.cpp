// DecayedAttention against a plain re-implementation: same stream, same attention
// probabilities (taken from attend(), which test_attention checks against a naive loop),
// kept positions compared after every step.
#include <algorithm>
#include <cstring>
#include <limits>
#include <map>
#include <set>

#include <kvevict/policies/decayed_attention.hpp>
#include <kvevict/serialize.hpp>

#include "support/recall_support.hpp"
#include "support/test_support.hpp"

using namespace kvevict;

namespace {

struct BruteRow {
  std::uint64_t seq;
  float score;
  float spike = 0.0f;  // largest attention drawn while older than the recent band
};

// The rule written out directly: per (layer, head) a map position -> (seq, score, spike).
// With recall > 0, the `recall` unprotected rows with the largest non-zero spike (ties:
// newer first) are kept, leaving one row evictable.
struct BruteDecayed {
  float decay;
  std::size_t sinks, recent, capacity, recall = 0;
  std::map<std::int64_t, BruteRow> rows;
  void step(std::int64_t pos, std::uint64_t seq) {
    if (rows.size() >= capacity) {
      std::vector<std::map<std::int64_t, BruteRow>::iterator> open;
      for (auto it = rows.begin(); it != rows.end(); ++it) {
        const auto s = it->second.seq;
        if (!(s < sinks || s + recent >= seq)) open.push_back(it);
      }
      std::vector<std::map<std::int64_t, BruteRow>::iterator> spiked;
      for (auto it : open)
        if (it->second.spike > 0.0f) spiked.push_back(it);
      std::sort(spiked.begin(), spiked.end(), [](auto a, auto b) {
        return a->second.spike != b->second.spike ? a->second.spike > b->second.spike
                                                  : a->second.seq > b->second.seq;
      });
      const std::size_t k = std::min({recall, spiked.size(), open.size() - 1});
      std::set<std::int64_t> reserved;
      for (std::size_t i = 0; i < k; ++i) reserved.insert(spiked[i]->first);
      auto victim = rows.end();
      for (auto it : open) {
        if (reserved.count(it->first)) continue;
        const auto s = it->second.seq;
        if (victim == rows.end() || it->second.score < victim->second.score ||
            (it->second.score == victim->second.score && s < victim->second.seq))
          victim = it;
      }
      REQUIRE(victim != rows.end());
      rows.erase(victim);
    }
    rows[pos] = {seq, 0.0f};
  }
  // After attention at step `latest`: decay the score, raise the long-range spike.
  void observe(std::int64_t pos, std::uint64_t latest, float attention) {
    auto& row = rows.at(pos);
    row.score = decay * row.score + attention;
    if (latest - row.seq >= recent) row.spike = std::max(row.spike, attention);
  }
};

void run_policy(const policies::DecayedAttention& policy, float decay, std::size_t sinks,
                std::size_t recent, std::size_t cap, int G, std::uint64_t seed,
                std::size_t recall = 0) {
  const Geometry g{2, 2 * G, 2, 16};
  KVCache<policies::DecayedAttention> cache(g, Budget::uniform(static_cast<long long>(cap)),
                                            policy);
  std::vector<BruteDecayed> brute(4, BruteDecayed{decay, sinks, recent, cap, recall, {}});
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
          b.observe(pos[i], static_cast<std::uint64_t>(t), s);
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
  // decay = 1 - 3 / C, recent = floor(3C / 8), recall = floor(C / 8), one sink: written
  // out by hand.
  for (std::size_t cap : {8u, 16u, 40u}) {
    CHECK(p.decay_for(cap) == Approx(1.0f - 3.0f / static_cast<float>(cap)));
    CHECK(p.recent_for(cap) == 3 * cap / 8);
    CHECK(p.recall_for(cap) == cap / 8);
    run_policy(p, 1.0f - 3.0f / static_cast<float>(cap), 1, 3 * cap / 8, cap, 4, 20 + cap,
               cap / 8);
  }
  CHECK(p.recall_for(Budget::kUnbounded) == 0);
  // The window never swallows the last evictable slot.
  const policies::DecayedAttention tight({.sinks = 2, .recent_fraction = 0.9f});
  CHECK(tight.recent_for(10) == 7);
  CHECK(tight.decay_for(10) == 0.0f);  // no horizon: the fixed decay
  REQUIRE_THROWS_WITH(policies::DecayedAttention({.horizon = -1.0f}), Catch::Contains("horizon = -1"));
  REQUIRE_THROWS_WITH(policies::DecayedAttention({.recent_fraction = 1.0f}),
                      Catch::Contains("recent_fraction = 1"));
  REQUIRE_THROWS_WITH(policies::DecayedAttention({.recall_fraction = 1.0f}),
                      Catch::Contains("recall_fraction = 1") && Catch::Contains("[0, 1)"));
  REQUIRE_THROWS_WITH(policies::DecayedAttention({.recall_fraction = -0.5f}),
                      Catch::Contains("recall_fraction = -0.5"));
}

TEST_CASE("DecayedAttention agrees with a brute-force re-implementation") {
  for (int G : {1, 4}) {
    run(0.0f, 0, 0, 24, G, 11);    // TOVA
    run(0.0f, 4, 8, 24, G, 12);
    run(0.9f, 4, 4, 32, G, 13);
    run(1.0f, 2, 6, 20, G, 14);    // H2O-like accumulation
    // With a recall reserve of 1, 3 and 8 rows (8 leaves room only for the window).
    run_policy(policies::DecayedAttention({.decay = 0.5f, .sinks = 1, .recent = 4,
                                           .recall_fraction = 0.05f}),
               0.5f, 1, 4, 24, G, 15, 1);
    run_policy(policies::DecayedAttention({.decay = 0.0f, .recent = 6, .recall_fraction = 0.1f}),
               0.0f, 0, 6, 32, G, 16, 3);
    run_policy(policies::DecayedAttention({.decay = 0.8f, .sinks = 2, .recent = 8,
                                           .recall_fraction = 0.5f}),
               0.8f, 2, 8, 16, G, 17, 8);
  }
}

// The property the reserve exists for: a row that was attended from far away (a name
// referred back to) survives a long stretch in which nothing attends it, while without the
// reserve its decayed score fades and it is evicted within a few steps. Attention drawn
// while the row is still recent does not count.
TEST_CASE("DecayedAttention's recall reserve keeps a row referred back to from far away") {
  const Geometry g{1, 1, 1, 4};
  // Capacity 16: one sink, a 6-row recent band, a 2-row reserve, decay 1 - 3/16.
  // The planted row is position 40; it draws `share` of the attention during [from, to]
  // and nothing afterwards; the other rows share the rest uniformly.
  auto survives = [&](float recall, float share, int from, int to) {
    KVCache<policies::DecayedAttention> cache(
        g, Budget::uniform(16),
        policies::DecayedAttention({.sinks = 1, .horizon = 3.0f, .recent_fraction = 0.375f,
                                    .recall_fraction = recall}));
    const std::vector<float> kv(4, 0.5f), q(4, 0.0f);
    std::vector<float> probs;
    for (int t = 0; t < 300; ++t) {
      cache.append(0, t, kv, kv, q);
      const auto pos = cache.positions(0, 0);
      const auto planted = std::find(pos.begin(), pos.end(), 40);
      if (t > 40 && planted == pos.end()) return false;
      const bool on = planted != pos.end() && t >= from && t <= to;
      const std::size_t others = pos.size() - (planted != pos.end() ? 1 : 0);
      const float rest = (on ? 1.0f - share : 1.0f) / static_cast<float>(others);
      probs.assign(pos.size(), rest);
      if (planted != pos.end()) probs[static_cast<std::size_t>(planted - pos.begin())] = on ? share : 0.0f;
      cache.observe(0, 0, probs);
    }
    return true;
  };
  // Attended at ages 0..30 (beyond the band from age 6), then ignored for 230 steps.
  CHECK(survives(0.125f, 0.3f, 40, 70));
  CHECK_FALSE(survives(0.0f, 0.3f, 40, 70));  // no reserve: the decayed score fades
  // Attended strongly, but only while inside the recent band (ages 0..5): not a recall.
  CHECK_FALSE(survives(0.125f, 0.9f, 40, 45));
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

// Scores and spikes drawn from a handful of values, so equal scores (the oldest goes) and
// equal spikes (the newest is kept) happen every step: the SIMD argmin + tie check and the
// packed top-k of the reserve must follow the brute-force tie rules exactly.
namespace {

// One step of a one-layer, one-KV-head cache (head dim 4, G query heads) against the
// brute-force rule: append, compare the kept rows, then observe the probabilities that
// `draw()` returns for each (query head, row) on both.
template <class Draw>
void step_against_brute(KVCache<policies::DecayedAttention>& cache, BruteDecayed& brute,
                        kvtest::Rng& rng, int t, int G, Draw&& draw) {
  cache.append(0, t, rng.normals(4), rng.normals(4));
  brute.step(t, static_cast<std::uint64_t>(t));
  const auto pos = cache.positions(0, 0);
  std::set<std::int64_t> kept(pos.begin(), pos.end()), want;
  for (const auto& [p, row] : brute.rows) want.insert(p);
  REQUIRE(kept == want);
  std::vector<float> probs(static_cast<std::size_t>(G) * pos.size());
  for (auto& x : probs) x = draw();
  cache.observe(0, 0, probs);
  for (std::size_t i = 0; i < pos.size(); ++i) {
    float s = 0.0f;
    for (int gq = 0; gq < G; ++gq) s += probs[static_cast<std::size_t>(gq) * pos.size() + i];
    brute.observe(pos[i], static_cast<std::uint64_t>(t), s);
  }
}

}  // namespace

TEST_CASE("DecayedAttention breaks score and spike ties exactly as the brute-force rule") {
  struct Setup {
    float decay;
    std::size_t sinks, recent, cap;
    float recall;
  };
  for (const Setup& c : {Setup{1.0f, 0, 2, 40, 0.0f}, Setup{0.0f, 2, 3, 70, 0.0f},
                         Setup{0.5f, 1, 4, 90, 0.1f}, Setup{0.0f, 0, 5, 130, 0.3f},
                         Setup{1.0f, 3, 0, 65, 0.5f}}) {
    const int G = 3;
    const Geometry g{1, G, 1, 4};
    const policies::DecayedAttention policy(
        {.decay = c.decay, .sinks = c.sinks, .recent = c.recent, .recall_fraction = c.recall});
    const std::size_t recall = policy.recall_for(c.cap);
    KVCache<policies::DecayedAttention> cache(g, Budget::uniform(static_cast<long long>(c.cap)),
                                              policy);
    BruteDecayed brute{c.decay, c.sinks, c.recent, c.cap, recall, {}};
    kvtest::Rng rng(900 + c.cap);
    std::mt19937 pick(c.cap);
    const float levels[] = {0.0f, 0.125f, 0.25f, 0.5f};
    for (int t = 0; t < 600; ++t)
      step_against_brute(cache, brute, rng, t, G, [&] { return levels[pick() % 4]; });
  }
}

// A reserve of 32 rows among ~150 open rows with continuous attention: the ranked candidates
// outnumber k by a few rows on most steps (the threshold is then found in a small sorted
// buffer) and, after the steps where every row draws strongly, by far more than 32 (the
// library's top-k select). Both against the brute-force rule, on every step.
TEST_CASE("DecayedAttention's reserve threshold agrees with brute force, few or many over k") {
  const int G = 2;
  const Geometry g{1, G, 1, 4};
  const std::size_t cap = 256, recent = 96, sinks = 1;
  const policies::DecayedAttention policy(
      {.decay = 0.9f, .sinks = sinks, .recent = recent, .recall_fraction = 0.125f});
  const std::size_t recall = policy.recall_for(cap);
  REQUIRE(recall == 32);
  KVCache<policies::DecayedAttention> cache(g, Budget::uniform(static_cast<long long>(cap)),
                                            policy);
  BruteDecayed brute{0.9f, sinks, recent, cap, recall, {}};
  kvtest::Rng rng(31337);
  std::mt19937 pick(5);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  for (int t = 0; t < 900; ++t) {
    const bool strong = t % 97 == 96;  // every row draws strongly: many cross the threshold
    step_against_brute(cache, brute, rng, t, G, [&] {
      const float w = u(pick);
      return strong ? 0.2f + 0.3f * w : 0.25f * w * w * w * w;
    });
  }
}

// The recall reserve ranks only the rows at or above its last threshold when at least k of
// them still reach it (spikes never decrease). That threshold is a hint: a cache whose
// policy state is restored before every step (the restore drops the hint, so every
// decision ranks all candidates) must keep exactly the same rows, also across budget
// changes (a smaller capacity evicts reserve rows at once; a larger one grows k).
TEST_CASE("DecayedAttention's incremental reserve keeps what a full re-ranking keeps") {
  const Geometry g{1, 4, 2, 8};
  const auto policy = policies::DecayedAttention::recommended();
  KVCache<policies::DecayedAttention> a(g, Budget::uniform(64), policy);
  KVCache<policies::DecayedAttention> b(g, Budget::uniform(64), policy);
  kvtest::Rng rng(4242);
  std::mt19937 pick(7);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  const float levels[] = {0.0f, 0.01f, 0.02f, 0.05f, 0.3f};
  for (int t = 0; t < 900; ++t) {
    if (t == 150 || t == 300 || t == 600) {
      const Budget nb = Budget::uniform(t == 150 ? 40 : t == 300 ? 96 : 48);
      a.set_budget(nb);
      b.set_budget(nb);
    }
    const auto k = rng.normals(16), v = rng.normals(16);
    load_bytes(b, save_bytes(b));  // drops the reserve's threshold hint
    a.append(0, t, k, v);
    b.append(0, t, k, v);
    for (int h = 0; h < 2; ++h) {
      // Continuous draws first (distinct spikes: after the budget grows, fewer rows than
      // the larger reserve reach the old threshold), then a few levels (many equal spikes
      // at the threshold).
      kvtest::same_rows_then_observe(a, b, h, 2, [&] {
        const float w = u(pick);
        return t < 450 ? 0.3f * w * w * w * w : levels[pick() % 5];
      });
    }
  }
}

// The decision kernels (kernels/masked_victim.hpp) at every level this CPU has, against the
// calls they replace: open_gather against protect_outside + gather_open (same bits, same
// candidates in the same order), decay_spike_gather against the observe rule written out
// then those two, lowest_masked_seq against a plain loop over the open rows
// (lowest score, then lowest seq; NaN never). Sizes 1-300 and a few past 512 (tails of every
// length), permuted arrival indices, scores from a few levels (ties, +-0, +inf, NaN).
TEST_CASE("open_gather, decay_spike_gather and lowest_masked_seq agree with the kernels they replace, every level") {
  using kernels::Isa;
  kvtest::Rng rng(777);
  const float levels[] = {0.0f, -0.0f, 0.25f, 0.5f, 1.0f, std::numeric_limits<float>::infinity(),
                          std::numeric_limits<float>::quiet_NaN()};
  std::vector<std::size_t> sizes;
  for (std::size_t n = 1; n <= 300; ++n) sizes.push_back(n);
  for (std::size_t n : {511, 512, 513, 640, 1000}) sizes.push_back(n);
  std::size_t compared = 0, ties = 0;
  for (std::size_t n : sizes) {
    std::vector<std::uint64_t> seqs(n);
    for (std::size_t i = 0; i < n; ++i) seqs[i] = 1000 + i;
    std::shuffle(seqs.begin(), seqs.end(), rng.engine());
    std::vector<float> s(n), spike(n);
    const bool few = rng.chance(0.5);  // few levels: many ties
    for (std::size_t i = 0; i < n; ++i) {
      s[i] = few ? levels[rng.uniform(0, 6)] : static_cast<float>(rng.uniform(0, 1000)) / 256.0f;
      spike[i] = rng.chance(0.4) ? 0.0f : few ? levels[rng.uniform(0, 6)] : rng.normal();
    }
    const std::uint64_t lo = 1000 + static_cast<std::uint64_t>(rng.uniform(0, 3));
    const std::uint64_t hi = 1000 + static_cast<std::uint64_t>(rng.uniform(0, static_cast<long long>(n) + 2));
    const float floor = rng.chance(0.5) ? 0.0f : 0.3f;
    const std::size_t words = (n + 63) / 64;
    std::vector<std::uint64_t> want_bits(words);
    std::vector<float> want_vals(n);
    std::vector<std::uint32_t> want_idx(n);
    kernels::protect_outside(seqs.data(), n, lo, hi, want_bits.data());
    const std::size_t want_n = kernels::gather_open(spike.data(), n, want_bits.data(), floor,
                                                    want_vals.data(), want_idx.data());
    // The reference victim: a plain loop over the open rows (some closed at random too).
    std::vector<std::uint64_t> prot = want_bits;
    for (std::size_t i = 0; i < n; ++i)
      if (rng.chance(0.2)) prot[i / 64] |= std::uint64_t{1} << (i % 64);
    std::size_t want_victim = kernels::npos;
    for (std::size_t i = 0; i < n; ++i) {
      if ((prot[i / 64] >> (i % 64)) & 1u || std::isnan(s[i])) continue;
      if (want_victim == kernels::npos || s[i] < s[want_victim] ||
          (s[i] == s[want_victim] && seqs[i] < seqs[want_victim]))
        want_victim = i;
    }
    // decay_spike_gather's reference: the observe rule written out, then protect_outside +
    // gather_open over the raised spikes.
    std::vector<float> x(n);
    for (std::size_t i = 0; i < n; ++i)
      x[i] = few ? levels[rng.uniform(0, 6)] : static_cast<float>(rng.uniform(0, 1000)) / 997.0f;
    const float decay = few ? 0.5f : 1.0f - 3.0f / static_cast<float>(n + 7);
    const std::uint64_t latest = 1000 + n + static_cast<std::uint64_t>(rng.uniform(0, 2));
    const std::uint64_t band = static_cast<std::uint64_t>(rng.uniform(0, static_cast<long long>(n) + 2));
    std::vector<float> want_sc = s, want_sp = spike;
    for (std::size_t i = 0; i < n; ++i) {
      volatile float prod = decay * want_sc[i];  // never contracted with the add
      want_sc[i] = prod + x[i];
      if (latest - seqs[i] >= band && want_sp[i] < x[i]) want_sp[i] = x[i];
    }
    std::vector<std::uint64_t> want_ds_bits(words);
    std::vector<float> want_ds_vals(n);
    std::vector<std::uint32_t> want_ds_idx(n);
    kernels::protect_outside(seqs.data(), n, lo, hi, want_ds_bits.data());
    const std::size_t want_ds_n = kernels::gather_open(want_sp.data(), n, want_ds_bits.data(),
                                                       floor, want_ds_vals.data(),
                                                       want_ds_idx.data());
    std::size_t want_all = kernels::npos;  // no protection (null bits)
    for (std::size_t i = 0; i < n; ++i)
      if (!std::isnan(s[i]) && (want_all == kernels::npos || s[i] < s[want_all] ||
                                (s[i] == s[want_all] && seqs[i] < seqs[want_all])))
        want_all = i;
    for (Isa isa : {Isa::scalar, Isa::avx2, Isa::avx512}) {
      if (!kernels::isa_supported(isa)) continue;
      INFO("n " << n << " level " << kernels::isa_name(isa));
      std::vector<std::uint64_t> bits(words, 0x5555);
      std::vector<float> vals(n, -1.0f);
      std::vector<std::uint32_t> idx(n, 7);
      const std::size_t got = kernels::open_gather(isa, seqs.data(), spike.data(), n, lo, hi,
                                                   floor, bits.data(), vals.data(), idx.data());
      REQUIRE(bits == want_bits);
      REQUIRE(got == want_n);
      for (std::size_t i = 0; i < got; ++i) {
        REQUIRE(idx[i] == want_idx[i]);
        REQUIRE(std::memcmp(&vals[i], &want_vals[i], sizeof(float)) == 0);
      }
      REQUIRE(kernels::lowest_masked_seq(isa, s.data(), seqs.data(), n, prot.data()) == want_victim);
      REQUIRE(kernels::lowest_masked_seq(isa, s.data(), seqs.data(), n, nullptr) == want_all);
      // decay_spike_gather: the decayed scores and raised spikes bit for bit as the rule
      // written out (a multiply, then an add), then open_gather's bits and candidates over
      // the raised spikes.
      std::vector<float> sc = s, sp = spike;
      std::fill(bits.begin(), bits.end(), 0x5555);
      std::fill(vals.begin(), vals.end(), -1.0f);
      const std::size_t got_ds =
          kernels::decay_spike_gather(isa, sc.data(), sp.data(), x.data(), seqs.data(), n, decay,
                                      latest, band, lo, hi, floor, bits.data(), vals.data(),
                                      idx.data());
      REQUIRE(std::memcmp(sc.data(), want_sc.data(), n * sizeof(float)) == 0);
      REQUIRE(std::memcmp(sp.data(), want_sp.data(), n * sizeof(float)) == 0);
      REQUIRE(bits == want_ds_bits);
      REQUIRE(got_ds == want_ds_n);
      for (std::size_t i = 0; i < got_ds; ++i) {
        REQUIRE(idx[i] == want_ds_idx[i]);
        REQUIRE(std::memcmp(&vals[i], &want_ds_vals[i], sizeof(float)) == 0);
      }
      ++compared;
    }
    if (want_victim != kernels::npos)
      for (std::size_t i = 0; i < n; ++i)
        ties += i != want_victim && !((prot[i / 64] >> (i % 64)) & 1u) && s[i] == s[want_victim];
  }
  REQUIRE(compared >= sizes.size());
  REQUIRE(ties > 100);  // the seq tie rule decided often
}
