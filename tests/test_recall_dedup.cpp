// DecayedAttention's RecallDedup: recall-reserve rows with distinct key signatures, so a
// passage repeated many times holds one reserve slot per distinct key rather than one per
// repetition. The signature's invariance under RoPE, a brute-force rule (kept rows compared
// every step, both dedup modes, both RoPE layouts), the case it exists for, save/restore,
// bad settings, and the default left alone.
#include <cmath>
#include <map>
#include <random>
#include <set>

#include <kvevict/policies/decayed_attention.hpp>
#include <kvevict/serialize.hpp>

#include "support/recall_support.hpp"

using namespace kvevict;
using DA = policies::DecayedAttention;
using policies::RopeLayout;
using policies::detail::key_signature;

namespace {

// Rotates key x (pre-RoPE) to position pos, base 10000, the way an engine does.
std::vector<float> rotate(std::vector<float> x, double pos, RopeLayout layout) {
  const std::size_t d = x.size(), pairs = d / 2;
  for (std::size_t j = 0; j < pairs; ++j) {
    const double th = pos * std::pow(10000.0, -2.0 * static_cast<double>(j) / static_cast<double>(d));
    const std::size_t a = layout == RopeLayout::halves ? j : 2 * j;
    const std::size_t b = layout == RopeLayout::halves ? j + pairs : 2 * j + 1;
    const double u = x[a], w = x[b];
    x[a] = static_cast<float>(u * std::cos(th) - w * std::sin(th));
    x[b] = static_cast<float>(u * std::sin(th) + w * std::cos(th));
  }
  return x;
}

struct Row {
  std::uint64_t seq;
  std::uint64_t sig;
  double score = 0.0, spike = 0.0, draws = 0.0;
  std::size_t count = 0;
};

// The rule written out: protected sinks and band; of the rest, walk the rows with a positive
// long-range spike from the largest down (ties: newer) and keep a row unless a row kept
// before it (with protected_rows: or a protected row) has its key signature, until
// min(recall, open - 1) are kept; the lowest decayed score of the remainder goes (ties: older).
struct Brute {
  double decay;
  std::size_t sinks, recent, capacity, recall;
  DA::RecallDedup mode;
  std::map<std::int64_t, Row> rows;
  DA::RecallRank rank = DA::RecallRank::spike;  // the reserve's rank (RecallBrute's rank_of)
  double rank_of(const Row& r) const {
    if (rank == DA::RecallRank::total) return r.draws;
    if (rank == DA::RecallRank::spike) return r.spike;
    return r.count ? static_cast<double>(static_cast<float>(r.spike) -
                                         static_cast<float>(r.draws) / static_cast<float>(r.count))
                   : 0.0;
  }
  void step(std::int64_t pos, std::uint64_t seq, std::uint64_t sig) {
    if (rows.size() >= capacity) {
      std::vector<std::int64_t> open;
      std::set<std::uint64_t> seen;
      for (const auto& [p, r] : rows) {
        if (!(r.seq < sinks || r.seq + recent >= seq)) open.push_back(p);
        else if (mode == DA::RecallDedup::protected_rows) seen.insert(r.sig);
      }
      std::vector<std::int64_t> ranked;
      for (auto p : open)
        if (rank_of(rows.at(p)) > 0.0) ranked.push_back(p);
      std::sort(ranked.begin(), ranked.end(), [&](auto a, auto b) {
        const Row &x = rows.at(a), &y = rows.at(b);
        const double rx = rank_of(x), ry = rank_of(y);
        return rx != ry ? rx > ry : x.seq > y.seq;
      });
      std::set<std::int64_t> kept;
      const std::size_t k = std::min(recall, open.size() - 1);
      for (auto p : ranked) {
        if (kept.size() == k) break;
        if (seen.insert(rows.at(p).sig).second) kept.insert(p);
      }
      rows.erase(kvtest::lowest_open(rows, open, kept));
    }
    rows[pos] = {seq, sig};
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

TEST_CASE("key_signature ignores the RoPE position and separates different keys", "[recall]") {
  kvtest::Rng rng(3);
  for (RopeLayout layout : {RopeLayout::interleaved, RopeLayout::halves}) {
    std::set<std::uint64_t> distinct;
    for (int token = 0; token < 12; ++token) {
      const auto x = rng.normals(8);
      const auto s0 = key_signature(x.data(), 8, layout, 0.1f);
      distinct.insert(s0);
      for (double pos : {1.0, 37.0, 500.0, 4096.0}) {
        const auto r = rotate(x, pos, layout);
        CHECK(key_signature(r.data(), 8, layout, 0.1f) == s0);
      }
    }
    CHECK(distinct.size() == 12);  // 12 random keys, 12 signatures
  }
  // Without RoPE the coordinates count; a scaled key (another norm) differs.
  const std::vector<float> a{1.0f, 2.0f, 3.0f, 4.0f}, b{2.0f, 1.0f, 3.0f, 4.0f},
      c{3.0f, 6.0f, 9.0f, 12.0f};
  CHECK(key_signature(a.data(), 4, RopeLayout::none, 0.1f) != key_signature(b.data(), 4, RopeLayout::none, 0.1f));
  CHECK(key_signature(a.data(), 4, RopeLayout::none, 0.1f) != key_signature(c.data(), 4, RopeLayout::none, 0.1f));
  // Interleaved pairs of b are a's pairs swapped within: the same pair lengths.
  CHECK(key_signature(a.data(), 4, RopeLayout::interleaved, 0.1f) ==
        key_signature(b.data(), 4, RopeLayout::interleaved, 0.1f));
  const std::vector<float> zero(4, 0.0f);
  CHECK(key_signature(zero.data(), 4, RopeLayout::interleaved, 0.1f) == 0);
}

// Runs a two-KV-head cache of `cap` rows (recent a quarter, recall reserve `recall`) for
// `steps` steps against Brute, comparing the kept rows every step. token(t, h, rng) picks
// the pre-RoPE key of head h at step t from `vocab`: how many distinct signatures there
// are, and how often they repeat. Returns the policy's hint counts (DA::hint_counts).
// `skip_every` > 0: every skip_every-th step's attention is not observed (attend with
// observe off), so the next append decides at the append (distinct_victim) instead of
// taking the decision its head's observe took ahead (decide_ahead).
template <class Token>
DA::HintCounts agree_with_brute(DA::RecallDedup mode, RopeLayout layout, int G, std::size_t cap, int steps,
                      std::size_t vocab_size, std::uint64_t seed, Token token, float recall = 0.25f,
                      DA::RecallRank rank = DA::RecallRank::spike, int skip_every = 0) {
  const DA policy({.sinks = 1, .horizon = 3.0f, .recent_fraction = 0.25f, .recall_fraction = recall,
                   .recall_rank = rank, .recall_dedup = mode, .dedup_step = 0.1f, .rope = layout});
  const Geometry g{1, 2 * G, 2, 8};
  KVCache<DA> cache(g, Budget::uniform(static_cast<long long>(cap)), policy);
  const std::size_t quarter = cap / 4;
  const auto reserve = static_cast<std::size_t>(recall * static_cast<float>(cap));
  std::vector<Brute> brute(2, Brute{1.0 - 3.0 / static_cast<double>(cap), 1, quarter, cap,
                                    reserve, mode, {}, rank});
  kvtest::Rng rng(seed);
  std::vector<std::vector<float>> vocab;
  for (std::size_t i = 0; i < vocab_size; ++i) vocab.push_back(rng.normals(8));
  for (int t = 0; t < steps; ++t) {
    std::vector<float> k;
    std::uint64_t sig[2];
    for (int h = 0; h < 2; ++h) {
      const auto& x = vocab[token(t, h, rng)];
      const auto r = rotate(x, t, layout);
      sig[h] = key_signature(r.data(), 8, layout, 0.1f);
      k.insert(k.end(), r.begin(), r.end());
    }
    auto v = rng.normals(16), q = rng.normals(static_cast<std::size_t>(2 * G * 8), 2.0f);
    cache.append(0, t, k, v, q);
    const bool skip = skip_every > 0 && t % skip_every == skip_every - 1;
    const auto res = attend(cache, 0, q, {.observe = !skip});
    for (int h = 0; h < 2; ++h) {
      auto& b = brute[static_cast<std::size_t>(h)];
      b.step(t, static_cast<std::uint64_t>(t), sig[h]);
      INFO("mode " << static_cast<int>(mode) << " layout " << static_cast<int>(layout) << " G "
                   << G << " cap " << cap << " step " << t << " head " << h << " skip " << skip_every);
      if (skip) {
        const auto pos = cache.positions(0, h);
        std::set<std::int64_t> kept(pos.begin(), pos.end()), want;
        for (const auto& [p, row] : b.rows) want.insert(p);
        REQUIRE(kept == want);
      } else {
        kvtest::check_kept_then_observe(cache, res, h, G, b, static_cast<std::uint64_t>(t));
      }
    }
  }
  return cache.policy().hint_counts();
}

// key_signature's rounding is std::llround's, halves and the edges of its exact range
// included (a mismatch would change signatures, hence the reserve's decisions).
TEST_CASE("llround_exact rounds as std::llround", "[recall]") {
  using policies::detail::llround_exact;
  std::vector<double> xs{0.0, -0.0, 0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 0.49999999999999994,
                         -0.49999999999999994, 4503599627370495.5, -4503599627370495.5,
                         4503599627370496.0, -4503599627370497.0, 1e18, -1e18};
  for (double x : {0.5, 1.5, 2.5, 7.5, 1e6 + 0.5, 4503599627370495.5}) {
    xs.push_back(std::nextafter(x, 0.0));
    xs.push_back(std::nextafter(x, 1e300));
    xs.push_back(-std::nextafter(x, 0.0));
    xs.push_back(-std::nextafter(x, 1e300));
  }
  kvtest::Rng rng(17);
  for (int i = 0; i < 20000; ++i) {
    const auto v = rng.normals(1, 40.0f);
    xs.push_back(static_cast<double>(v[0]));
    xs.push_back(static_cast<double>(v[0]) / 0.1);  // as key_signature divides by its step
    xs.push_back(std::round(static_cast<double>(v[0])) + 0.5);
  }
  for (double x : xs) {
    INFO("x = " << x);
    CHECK(llround_exact(x) == std::llround(x));
  }
}

TEST_CASE("DecayedAttention RecallDedup agrees with a brute-force rule", "[recall]") {
  for (DA::RecallDedup mode : {DA::RecallDedup::reserve, DA::RecallDedup::protected_rows})
    for (RopeLayout layout : {RopeLayout::interleaved, RopeLayout::halves})
      for (int G : {1, 2}) {
        // A vocabulary of 6 pre-RoPE keys per head: tokens repeat, so signatures collide.
        agree_with_brute(mode, layout, G, 24, 250, 12,
                         60 + G + 4 * static_cast<int>(mode) + 2 * static_cast<int>(layout),
                         [](int, int h, kvtest::Rng& rng) {
                           return static_cast<std::size_t>(6 * h + rng.uniform(0, 5));
                         });
      }
}

// Very repetitive text (two keys per head against a 10-row reserve: fewer distinct
// signatures than reserve rows on every decision), then text whose vocabulary drifts
// (a new key every other step: the signatures handed out outgrow the rows, so the head's
// signature numbers are renumbered several times; a reserve of half the rows, so that which
// rows it holds decides the victim often), each against the brute-force rule.
TEST_CASE("RecallDedup agrees with brute force on repetitive and drifting text", "[recall]") {
  for (DA::RecallDedup mode : {DA::RecallDedup::reserve, DA::RecallDedup::protected_rows})
    for (int G : {1, 2}) {
      agree_with_brute(mode, RopeLayout::interleaved, G, 40, 300, 4, 80 + G,
                       [](int, int h, kvtest::Rng& rng) {
                         return static_cast<std::size_t>(2 * h + rng.uniform(0, 1));
                       });
      agree_with_brute(mode, RopeLayout::halves, G, 40, 800, 460, 90 + G,
                       [](int t, int h, kvtest::Rng& rng) {
                         if (t % 29 == 0) return static_cast<std::size_t>(h);  // the sink's key
                         return static_cast<std::size_t>(2 + t / 4 + 250 * h + rng.uniform(0, 1));
                       },
                       0.5f);
    }
}

// The one-victim path (DecayedAttention::distinct_victim) takes a lowest open row as held
// by the reserve, without computing it, while a bound on the number of signatures' best
// candidates |B| (the last computed |B|, + 2 per append) stays within the reserve's size.
// Phases of a few repeated keys (|B| below the reserve: the bound holds for a while) alternate
// with bursts of a new key every step (|B| grows by up to 2 per append until the bound
// fails), with reserves from a sixth to a half of the rows, against the brute-force rule.
TEST_CASE("RecallDedup's one-victim path agrees with brute force as |B| grows", "[recall]") {
  for (DA::RecallDedup mode : {DA::RecallDedup::reserve, DA::RecallDedup::protected_rows})
    for (float recall : {0.17f, 0.3f, 0.5f})
      agree_with_brute(mode, RopeLayout::interleaved, 1, 48, 700, 800,
                       110 + static_cast<int>(mode) + static_cast<int>(10 * recall),
                       [](int t, int h, kvtest::Rng& rng) {
                         if ((t / 50) % 2 == 0)
                           return static_cast<std::size_t>(400 * h + rng.uniform(0, 7));
                         return static_cast<std::size_t>(400 * h + 8 + t / 2);
                       },
                       recall);
}

// Keys that do not repeat (a new pre-RoPE key every step, as text without repeats): every
// open row is its signature's only row, |B| exceeds the reserve, and the reserve is ranked
// from the last decision's threshold (keep_distinct's hinted path) on most decisions; runs
// that switch between fresh and repeated keys make the threshold fail (fewer than k allowed
// signatures reach it after a phase of repeats evicts them) and fall back to every
// candidate. Both against the brute-force rule on every step; the counts show both paths ran.
TEST_CASE("RecallDedup on fresh keys agrees with brute force (reserve from the last threshold)",
          "[recall]") {
  DA::HintCounts total;
  std::uint64_t direct_paths = 0;  // hinted or beyond decisions taken at the append
  for (DA::RecallDedup mode : {DA::RecallDedup::reserve, DA::RecallDedup::protected_rows})
    for (RopeLayout layout : {RopeLayout::interleaved, RopeLayout::halves})
      for (int G : {1, 2}) {
        const int salt = 4 * static_cast<int>(mode) + 2 * static_cast<int>(layout) + G;
        const auto fresh = agree_with_brute(mode, layout, G, 64, 500, 1200, 300 + salt,
                                            [](int t, int h, kvtest::Rng&) {
                                              return static_cast<std::size_t>(600 * h + t);
                                            });
        INFO("mode " << static_cast<int>(mode) << " layout " << static_cast<int>(layout));
        CHECK(fresh.hinted + fresh.beyond > 700);  // 2 heads x ~440 full decisions
        // Phases of 60 steps: fresh keys, then 4 keys repeated; the sink's key now and then.
        const auto mixed = agree_with_brute(
            mode, layout, G, 48, 900, 1300, 400 + salt,
            [](int t, int h, kvtest::Rng& rng) {
              if (t % 37 == 0) return static_cast<std::size_t>(650 * h);
              if ((t / 60) % 2 == 1) return static_cast<std::size_t>(650 * h + 1 + rng.uniform(0, 3));
              return static_cast<std::size_t>(650 * h + 5 + t / 2 + rng.uniform(0, 1));
            },
            0.3f);
        CHECK(mixed.hinted + mixed.beyond > 400);
        // Most decisions taken ahead, at the end of the head's observe, and used.
        CHECK(fresh.ahead_taken > 700);
        CHECK(mixed.ahead_taken > 700);
        CHECK(fresh.from_observe > 700);
        // Keys that never repeat: beyond_reserve shows its row outside the reserve from the
        // candidates at the threshold less the repeated numbers, without counting
        // signatures (8-dim keys: a few signatures collide, and those decisions count).
        CHECK(fresh.uncounted > 300);
        // The same keys with every other attention step not observed: half the decisions
        // are taken at the append (distinct_victim from its own gather); the threshold's
        // paths run in both kinds.
        const auto direct = agree_with_brute(mode, layout, G, 64, 500, 1200, 300 + salt,
                                             [](int t, int h, kvtest::Rng&) {
                                               return static_cast<std::size_t>(600 * h + t);
                                             }, 0.25f, DA::RecallRank::spike, 2);
        CHECK(direct.ahead_taken > 300);
        CHECK(direct.from_observe > 300);
        CHECK(direct.hinted + direct.beyond - direct.from_observe > 20);
        direct_paths += direct.hinted + direct.beyond - direct.from_observe;
        total.hinted += fresh.hinted + mixed.hinted;
        total.refused += fresh.refused + mixed.refused;
        total.beyond += fresh.beyond + mixed.beyond;
        total.ahead_taken += fresh.ahead_taken + mixed.ahead_taken;
        total.uncounted += fresh.uncounted + mixed.uncounted + direct.uncounted;
        total.beyond += direct.beyond;
      }
  CHECK(total.refused > 20);
  CHECK(total.hinted > 1000);
  CHECK(total.beyond > 1000);
  CHECK(total.uncounted > 6000);
  CHECK(total.beyond - total.uncounted > 5000);  // the signatures counted (repeated numbers)
  CHECK(total.ahead_taken > 10000);
  CHECK(direct_paths > 300);
}

// beyond_reserve's bound without a count (at least m - repeats allowed signatures reach
// the threshold, Interned::repeats) is exact when every row numbered with a repeated
// number since the last renumbering is a candidate at the threshold: keys that do not
// repeat, except now and then a key of 10-30 steps ago (often still an open candidate),
// in small caches where a renumbering comes every few dozen steps. Many seeds, both
// dedup modes, against the brute-force rule on every step.
TEST_CASE("RecallDedup's uncounted bound agrees with brute force on rare repeats", "[recall]") {
  std::uint64_t uncounted = 0, beyond = 0;
  for (DA::RecallDedup mode : {DA::RecallDedup::reserve, DA::RecallDedup::protected_rows})
    for (std::size_t cap : {16, 24, 40})
      for (float recall : {0.25f, 0.5f})
        for (int seed = 0; seed < 12; ++seed) {
          const auto counts = agree_with_brute(
              mode, RopeLayout::interleaved, 1, cap, 300, 1200,
              700 + 97 * seed + static_cast<int>(cap) + static_cast<int>(10 * recall) +
                  1000 * static_cast<int>(mode),
              [](int t, int h, kvtest::Rng& rng) {
                if (t > 40 && rng.uniform(0, 7) == 0)
                  return static_cast<std::size_t>(600 * h + t - rng.uniform(10, 30));
                return static_cast<std::size_t>(600 * h + t);
              },
              recall);
          uncounted += counts.uncounted;
          beyond += counts.beyond;
        }
  CHECK(uncounted > 1000);
  CHECK(beyond - uncounted > 1000);
}

// RecallDedup with the reserve ranked by RecallRank::excess or total (not a preset, but
// allowed): the one-victim path's shortcuts reason from the spike, so they must not decide
// for these ranks. Repeated, fresh and mixed keys against the brute-force rule (ranked by
// the same rank) on every step.
TEST_CASE("RecallDedup with RecallRank::excess and total agrees with brute force", "[recall]") {
  for (DA::RecallRank rank : {DA::RecallRank::excess, DA::RecallRank::total})
    for (DA::RecallDedup mode : {DA::RecallDedup::reserve, DA::RecallDedup::protected_rows})
      for (int G : {1, 2}) {
        const int salt = 8 * static_cast<int>(rank) + 4 * static_cast<int>(mode) + G;
        INFO("rank " << static_cast<int>(rank));
        agree_with_brute(mode, RopeLayout::interleaved, G, 24, 300, 12, 500 + salt,
                         [](int, int h, kvtest::Rng& rng) {
                           return static_cast<std::size_t>(6 * h + rng.uniform(0, 5));
                         }, 0.25f, rank);
        agree_with_brute(mode, RopeLayout::halves, G, 48, 700, 800, 520 + salt,
                         [](int t, int h, kvtest::Rng& rng) {
                           if ((t / 50) % 2 == 0)
                             return static_cast<std::size_t>(400 * h + rng.uniform(0, 7));
                           return static_cast<std::size_t>(400 * h + 8 + t / 2);
                         }, 0.3f, rank);
        agree_with_brute(mode, RopeLayout::interleaved, G, 64, 500, 1200, 540 + salt,
                         [](int t, int h, kvtest::Rng&) { return static_cast<std::size_t>(600 * h + t); },
                         0.25f, rank);
      }
}

// Equal spikes within a signature (a few keys repeated, attention drawn in a few levels):
// the signature's best candidate is the newer of the rows with its largest spike, whether
// the reserve is ranked from the threshold or from every candidate; against the
// brute-force rule on every step, both dedup modes.
TEST_CASE("RecallDedup breaks equal spikes within a signature by the newer row", "[recall]") {
  for (DA::RecallDedup mode : {DA::RecallDedup::reserve, DA::RecallDedup::protected_rows}) {
    const std::size_t cap = 48;
    const DA policy({.sinks = 1, .horizon = 3.0f, .recent_fraction = 0.25f,
                     .recall_fraction = 0.25f, .recall_dedup = mode, .dedup_step = 0.1f});
    KVCache<DA> cache(Geometry{1, 2, 2, 8}, Budget::uniform(static_cast<long long>(cap)), policy);
    std::vector<Brute> brute(2, Brute{1.0 - 3.0 / static_cast<double>(cap), 1, cap / 4, cap,
                                      cap / 4, mode, {}});
    kvtest::Rng rng(501 + static_cast<int>(mode));
    std::mt19937 pick(13);
    std::vector<std::vector<float>> vocab;
    for (int i = 0; i < 6; ++i) vocab.push_back(rng.normals(8));
    const float levels[] = {0.0f, 0.01f, 0.02f, 0.05f};
    for (int t = 0; t < 1500; ++t) {
      std::vector<float> k;
      std::uint64_t sig[2];
      for (int h = 0; h < 2; ++h) {
        // Three keys per head, one time in four a key of its own.
        const auto x = pick() % 4 == 0 ? rng.normals(8)
                                       : vocab[static_cast<std::size_t>(3 * h) + pick() % 3];
        sig[h] = key_signature(x.data(), 8, RopeLayout::interleaved, 0.1f);
        k.insert(k.end(), x.begin(), x.end());
      }
      cache.append(0, t, k, rng.normals(16));
      for (int h = 0; h < 2; ++h) {
        auto& b = brute[static_cast<std::size_t>(h)];
        b.step(t, static_cast<std::uint64_t>(t), sig[h]);
        const auto pos = cache.positions(0, h);
        std::set<std::int64_t> kept(pos.begin(), pos.end()), want;
        for (const auto& [p, row] : b.rows) want.insert(p);
        INFO("mode " << static_cast<int>(mode) << " step " << t << " head " << h);
        REQUIRE(kept == want);
        std::vector<float> probs(pos.size());
        for (std::size_t i = 0; i < pos.size(); ++i) {
          probs[i] = levels[pick() % 4];
          b.observe(pos[i], static_cast<std::uint64_t>(t), probs[i]);
        }
        cache.observe(0, h, probs);
      }
    }
    CHECK(cache.policy().hint_counts().hinted > 100);
    CHECK(cache.policy().hint_counts().beyond > 100);
  }
}

// The threshold is a hint: a cache whose policy state is restored before every step (the
// restore drops the hint and the bound, so every decision ranks every candidate) keeps
// exactly the rows of one that ranks from the hint, with fresh and repeated keys, equal
// spikes at the threshold, budget changes (a smaller capacity evicts several rows at once;
// a larger one grows k past what reached the old threshold) and restores of the hinted
// cache itself.
TEST_CASE("RecallDedup's reserve from the last threshold keeps what ranking every candidate keeps",
          "[recall]") {
  for (DA::RecallDedup mode : {DA::RecallDedup::reserve, DA::RecallDedup::protected_rows}) {
    const Geometry g{1, 4, 2, 8};
    const DA policy({.sinks = 1, .horizon = 3.0f, .recent_fraction = 0.25f,
                     .recall_fraction = 0.3f, .recall_dedup = mode, .dedup_step = 0.1f});
    KVCache<DA> a(g, Budget::uniform(64), policy);
    KVCache<DA> b(g, Budget::uniform(64), policy);
    kvtest::Rng rng(77 + static_cast<int>(mode));
    std::mt19937 pick(11);
    std::uniform_real_distribution<float> u(0.0f, 1.0f);
    std::vector<std::vector<float>> vocab;
    for (int i = 0; i < 5; ++i) vocab.push_back(rng.normals(16));
    const float levels[] = {0.0f, 0.01f, 0.02f, 0.05f, 0.3f};
    for (int t = 0; t < 1200; ++t) {
      if (t % 173 == 0) load_bytes(a, save_bytes(a));  // the hinted cache restored now and then
      load_bytes(b, save_bytes(b));                    // drops the hint before every decision
      if (t == 200 || t == 400 || t == 700 || t == 950) {
        const Budget nb = Budget::uniform(t == 200 ? 40 : t == 400 ? 96 : t == 700 ? 48 : 72);
        a.set_budget(nb);
        b.set_budget(nb);
        load_bytes(b, save_bytes(b));
      }
      // Fresh keys, with phases of a few repeated ones (every fourth block of 50 steps).
      const auto k = (t / 50) % 4 == 3 ? vocab[static_cast<std::size_t>(rng.uniform(0, 4))]
                                       : rng.normals(16);
      const auto v = rng.normals(16);
      a.append(0, t, k, v);
      b.append(0, t, k, v);
      for (int h = 0; h < 2; ++h) {
        INFO("mode " << static_cast<int>(mode) << " step " << t << " head " << h);
        // Continuous draws (distinct spikes), then a few levels (equal spikes at the threshold).
        kvtest::same_rows_then_observe(a, b, h, 2, [&] {
          const float w = u(pick);
          return t < 600 ? 0.3f * w * w * w * w : levels[pick() % 5];
        });
      }
    }
    INFO("mode " << static_cast<int>(mode));
    CHECK(a.policy().hint_counts().hinted > 300);
    CHECK(a.policy().hint_counts().beyond > 300);
    CHECK(a.policy().hint_counts().refused > 0);
    CHECK(a.policy().hint_counts().ahead_taken > 300);
    // b's decisions are all taken at its appends, from no threshold: the decisions its
    // observes take ahead (which may use the threshold the append's decision left) are
    // dropped by the restore before they are used.
    CHECK(b.policy().hint_counts().ahead_taken == 0);
    CHECK(b.policy().hint_counts().hinted + b.policy().hint_counts().beyond <=
          b.policy().hint_counts().ahead);
  }
}

// Repetitive text: a passage of period 5 repeats after the name (row 3); the passage's
// first token draws 0.4 of the attention of the query 6 tokens on (a sentence
// boundary acting like a sink for the next sentence), so each repetition of it gets a
// long-range spike of 0.4, more than the name's 0.3 (drawn once, from 8 tokens on; almost
// nothing otherwise). With a 2-row reserve, the plain spike fills the reserve with boundary
// repetitions and the name fades out of the decayed score; with distinct signatures the
// boundary holds one slot (reserve) or none, its latest copy being recent (protected_rows).
TEST_CASE("RecallDedup keeps the name against a repeated boundary", "[recall]") {
  const Geometry g{1, 1, 1, 4};
  auto survives = [&](const DA& policy) {
    KVCache<DA> cache(g, Budget::uniform(16), policy);
    kvtest::Rng rng(5);
    std::vector<std::vector<float>> passage;
    for (int i = 0; i < 5; ++i) passage.push_back(rng.normals(4));
    const auto name = rng.normals(4), other = rng.normals(4);
    const std::vector<float> q(4, 0.0f);
    std::vector<float> probs;
    for (int t = 0; t < 300; ++t) {
      const auto& x = t == 3 ? name : t < 5 ? other : passage[static_cast<std::size_t>(t % 5)];
      const auto k = rotate(x, t, RopeLayout::interleaved);
      cache.append(0, t, k, k, q);
      const auto pos = cache.positions(0, 0);
      if (t > 3 && std::find(pos.begin(), pos.end(), 3) == pos.end()) return false;
      kvtest::chosen_then_rest(pos, probs, [&](std::int64_t x) {
        if (x == 3) return t == 11 ? 0.3f : 0.001f;                      // the name: drawn once
        if (x >= 5 && x % 5 == 0 && t - x == 6) return 0.4f;  // a boundary, one period on
        return -1.0f;
      });
      cache.observe(0, 0, probs);
    }
    return true;
  };
  auto name_survives = [&](DA::RecallDedup mode) {
    return survives(DA({.sinks = 1, .horizon = 3.0f, .recent_fraction = 0.375f,
                        .recall_fraction = 0.125f, .recall_dedup = mode,
                        .rope = RopeLayout::interleaved}));
  };
  // The two presets: recommended() (no dedup) loses the name, recall() keeps it.
  CHECK_FALSE(survives(DA::recommended()));
  CHECK(survives(DA::recall()));
  CHECK(DA::recall(RopeLayout::halves).config().rope == RopeLayout::halves);
  CHECK_FALSE(name_survives(DA::RecallDedup::none));
  CHECK(name_survives(DA::RecallDedup::reserve));
  CHECK(name_survives(DA::RecallDedup::protected_rows));
}

TEST_CASE("RecallDedup saves and restores; a state without signatures does not load",
          "[recall]") {
  const Geometry g{1, 2, 1, 4};
  const DA dedup({.sinks = 1, .horizon = 3.0f, .recent_fraction = 0.25f,
                  .recall_fraction = 0.25f, .recall_dedup = DA::RecallDedup::protected_rows});
  KVCache<DA> cache(g, Budget::uniform(12), dedup);
  kvtest::Rng rng(9);
  std::vector<std::vector<float>> vocab;
  for (int i = 0; i < 3; ++i) vocab.push_back(rng.normals(4));
  const auto bytes = kvtest::check_restore_twin(cache, dedup, 12, rng, [&](int t) {
    return rotate(vocab[static_cast<std::size_t>(rng.uniform(0, 2))], t, RopeLayout::interleaved);
  });
  KVCache<DA> plain(g, Budget::uniform(12),
                    DA({.sinks = 1, .horizon = 3.0f, .recent_fraction = 0.25f, .recall_fraction = 0.25f}));
  REQUIRE_THROWS_AS(load_bytes(plain, bytes), Error);
}

// recall_dedup without a reserve (recall_fraction 0) has nothing to deduplicate: the policy
// keeps what the same settings without recall_dedup keep, on every step and every head (the
// one-victim path read signature columns that only a reserve binds: found by the policy_ops
// fuzzer in CI, fuzz/corpus/policy_ops/dedup_without_reserve).
TEST_CASE("RecallDedup without a recall reserve keeps what no dedup keeps", "[recall]") {
  const Geometry g{1, 4, 2, 4};  // G = 2
  for (DA::RecallDedup mode : {DA::RecallDedup::reserve, DA::RecallDedup::protected_rows}) {
    KVCache<DA> plain(g, Budget::uniform(10), DA({.sinks = 1, .recent_fraction = 0.25f}));
    KVCache<DA> dedup(g, Budget::uniform(10),
                      DA({.sinks = 1, .recent_fraction = 0.25f, .recall_dedup = mode}));
    kvtest::Rng rng(21 + static_cast<int>(mode));
    for (int t = 0; t < 80; ++t) {
      const auto k = rng.normals(8), v = rng.normals(8), q = rng.normals(16);
      plain.append(0, t, k, v, q);
      dedup.append(0, t, k, v, q);
      for (int h = 0; h < 2; ++h)
        kvtest::same_rows_then_observe(plain, dedup, h, 2, [&] {
          return static_cast<float>(rng.uniform(0, 1000)) / 1000.0f;
        });
    }
  }
}

TEST_CASE("RecallDedup rejects bad settings by value", "[recall]") {
  REQUIRE_THROWS_WITH(DA({.recall_dedup = static_cast<DA::RecallDedup>(9)}),
                      Catch::Contains("recall_dedup = 9"));
  REQUIRE_THROWS_WITH(DA({.dedup_step = 0.0f}), Catch::Contains("dedup_step = 0"));
  REQUIRE_THROWS_WITH(DA({.rope = static_cast<RopeLayout>(5)}), Catch::Contains("rope = 5"));
  // An odd head_dim cannot be split into RoPE pairs.
  REQUIRE_THROWS_WITH(KVCache<DA>(Geometry{1, 1, 1, 5}, Budget::uniform(8),
                                  DA({.recall_fraction = 0.25f,
                                      .recall_dedup = DA::RecallDedup::reserve})),
                      Catch::Contains("head_dim, got 5"));
  CHECK(DA::recommended().config().recall_dedup == DA::RecallDedup::none);  // default unchanged
}
