// BuzzBeehive against a brute-force re-implementation of the reference rebuild
// (BuzzKVCacheWithAccumulation: index arithmetic on one arrival-ordered list per head),
// and the properties the paper and the issue state.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <kvevict/attention.hpp>
#include <kvevict/cache.hpp>
#include <kvevict/policies/buzz.hpp>
#include <kvevict/serialize.hpp>
#include <random>
#include <vector>

#include "support/test_support.hpp"

using kvevict::Budget;
using kvevict::Geometry;
using kvevict::KVCache;
using kvevict::policies::BuzzBeehive;

namespace {

std::uint64_t mix(std::uint64_t x) { return kvtest::splitmix(x); }

// Synthetic "probability" of query head g at step t for token seq: a multiple of 1/4, so
// float sums are exact in any order and ties (first wins) happen often.
float prob(std::uint64_t salt, std::uint64_t t, std::uint64_t seq, int kh, int g) {
  // Quarters in [0, 0.75]: probabilities (observe rejects values above 1), and sums of
  // them stay exact in float, so the reference comparison stays exact.
  return static_cast<float>(mix(salt ^ mix(t * 1000003u + seq) ^ mix(kh * 131u + g)) % 4) / 4.0f;
}

// The reference algorithm on one head, in the container's timing: the rebuild runs when
// the next token arrives, with that token counted in the window.
struct RefHead {
  struct Row {
    std::uint64_t seq;
    float score;
  };
  std::vector<Row> rows;                               // arrival order, as the reference's tensor
  std::size_t cur = 0;                                 // reference: cur_sample_size
  std::vector<std::pair<std::size_t, unsigned>> gens;  // log-n: (rows, level), oldest first
  std::size_t rebuilds = 0;
};

struct RefBuzz {
  BuzzBeehive::Config c;
  std::size_t f() const { return (c.stride + 1) / 2; }

  // Thins rows [lo, hi) of `in` to every f-th, appending survivors to `out`.
  static std::size_t thin(const std::vector<RefHead::Row>& in, std::size_t lo, std::size_t hi,
                          std::size_t f, std::vector<RefHead::Row>& out) {
    std::size_t k = 0;
    for (std::size_t i = lo; i < hi; i += f, ++k) out.push_back({in[i].seq, 0.0f});
    return k;
  }

  void step(RefHead& h, std::uint64_t seq) {
    const std::size_t S = c.sinks, W = c.window;
    if (h.rows.size() + 1 > S + W + c.threshold + (c.log_n ? h.cur : 0)) rebuild(h);
    h.rows.push_back({seq, 0.0f});
  }

  void rebuild(RefHead& h) {
    const std::size_t S = c.sinks, W = c.window, s = c.stride;
    const std::size_t n = h.rows.size();
    const std::size_t other_end = n - (W - 1);  // window = last W-1 rows + the incoming one
    std::vector<RefHead::Row> out(h.rows.begin(), h.rows.begin() + static_cast<long>(S));
    for (auto& r : out) r.score = 0.0f;
    std::size_t kept_old = 0;
    if (!c.log_n) {
      kept_old = thin(h.rows, S, S + h.cur, f(), out);
    } else {
      // Generations as (count, level); carry f equal levels into one of the next.
      std::vector<std::vector<RefHead::Row>> g;
      std::size_t at = S;
      for (auto& [cnt, lvl] : h.gens) {
        g.emplace_back(h.rows.begin() + static_cast<long>(at),
                       h.rows.begin() + static_cast<long>(at + cnt));
        at += cnt;
      }
      std::vector<unsigned> lv;
      for (auto& x : h.gens) lv.push_back(x.second);
      for (unsigned level = 0;; ++level) {
        std::size_t first = 0, count = 0;
        for (std::size_t i = 0; i < lv.size(); ++i)
          if (lv[i] == level && count++ == 0) first = i;
        if (count >= f()) {
          std::vector<RefHead::Row> merged;
          for (std::size_t i = first; i < first + f(); ++i)
            merged.insert(merged.end(), g[i].begin(), g[i].end());
          std::vector<RefHead::Row> th;
          thin(merged, 0, merged.size(), f(), th);
          g.erase(g.begin() + static_cast<long>(first) + 1,
                  g.begin() + static_cast<long>(first + f()));
          lv.erase(lv.begin() + static_cast<long>(first) + 1,
                   lv.begin() + static_cast<long>(first + f()));
          g[first] = th;
          lv[first] = level + 1;
        }
        unsigned top = 0;
        for (unsigned x : lv) top = std::max(top, x);
        if (top <= level) break;
      }
      h.gens.clear();
      for (std::size_t i = 0; i < g.size(); ++i) {
        for (auto r : g[i]) out.push_back({r.seq, 0.0f});
        h.gens.push_back({g[i].size(), lv[i]});
        kept_old += g[i].size();
      }
    }
    // Chunks of s newly evicted tokens, argmax score, the first on ties.
    std::size_t kept_new = 0;
    for (std::size_t lo = S + h.cur; lo < other_end; lo += s) {
      const std::size_t hi = std::min(other_end, lo + s);
      std::size_t best = lo;
      for (std::size_t i = lo + 1; i < hi; ++i)
        if (h.rows[i].score > h.rows[best].score) best = i;
      out.push_back(h.rows[best]);
      ++kept_new;
    }
    if (c.log_n && kept_new > 0) h.gens.push_back({kept_new, 0});
    out.insert(out.end(), h.rows.begin() + static_cast<long>(other_end), h.rows.end());
    h.rows = std::move(out);
    h.cur = kept_old + kept_new;
    ++h.rebuilds;
  }
};

Geometry geometry(int group, int kv_heads = 2, int dim = 4) {
  return Geometry{1, group * kv_heads, kv_heads, dim};
}

std::vector<float> random_vec(std::mt19937& rng, std::size_t n) {
  std::normal_distribution<float> d;
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// Runs the library and the brute force side by side; after every step each head must
// hold the same seqs with the same scores, and always its sinks and window.
void agree(const BuzzBeehive::Config& c, const Budget& budget, int group, std::size_t steps,
           std::uint64_t salt) {
  const Geometry g = geometry(group);
  KVCache<BuzzBeehive> cache(g, budget, BuzzBeehive(c));
  RefBuzz ref{c};
  std::vector<RefHead> heads(static_cast<std::size_t>(g.n_kv_heads));
  std::mt19937 rng(static_cast<unsigned>(salt));
  const std::size_t kv = static_cast<std::size_t>(g.n_kv_heads * g.head_dim);
  for (std::uint64_t t = 0; t < steps; ++t) {
    const auto k = random_vec(rng, kv), v = random_vec(rng, kv);
    cache.append(0, static_cast<std::int64_t>(t), k, v);
    for (int kh = 0; kh < g.n_kv_heads; ++kh) {
      auto& rh = heads[static_cast<std::size_t>(kh)];
      ref.step(rh, t);
      const auto seqs = cache.seqs(0, kh);
      std::vector<float> probs(static_cast<std::size_t>(group) * seqs.size());
      for (int j = 0; j < group; ++j)
        for (std::size_t r = 0; r < seqs.size(); ++r)
          probs[static_cast<std::size_t>(j) * seqs.size() + r] = prob(salt, t, seqs[r], kh, j);
      cache.observe(0, kh, probs);
      for (auto& row : rh.rows) {
        float sum = 0.0f;
        for (int j = 0; j < group; ++j) sum += prob(salt, t, row.seq, kh, j);
        row.score += sum;
      }
      // Compare kept seqs and their scores.
      const auto& sc = cache.policy().scores(0, kh);
      std::vector<std::pair<std::uint64_t, float>> lib;
      for (std::size_t r = 0; r < seqs.size(); ++r) lib.push_back({seqs[r], sc[r]});
      std::sort(lib.begin(), lib.end());
      std::vector<std::pair<std::uint64_t, float>> want;
      for (auto& row : rh.rows) want.push_back({row.seq, row.score});
      INFO("step " << t << " kv head " << kh << " group " << group);
      REQUIRE(lib == want);
      REQUIRE(cache.policy().rebuilds(0, kh) == rh.rebuilds);
      // Sinks and the window (this token and the W-1 before it) are always kept.
      const std::size_t W =
          c.budget_mode ? BuzzBeehive::window_for_budget(cache.capacity(0, kh), c.sinks).window
                        : c.window;
      for (std::uint64_t q = 0; q < std::min<std::uint64_t>(c.sinks, t + 1); ++q)
        REQUIRE(std::binary_search(lib.begin(), lib.end(), std::make_pair(q, -1e30f),
                                   [](auto& a, auto& b) { return a.first < b.first; }));
      for (std::uint64_t q = t + 1 > W ? t + 1 - W : 0; q <= t; ++q)
        REQUIRE(std::binary_search(lib.begin(), lib.end(), std::make_pair(q, -1e30f),
                                   [](auto& a, auto& b) { return a.first < b.first; }));
    }
  }
  REQUIRE(heads[0].rebuilds > 3);  // the stream was long enough to exercise rebuilds
}

}  // namespace

TEST_CASE("BUZZ keeps the reference's rows and scores after every step (bounded form)") {
  for (int group : {1, 4, 8}) {
    SECTION("defaults, unbounded budget, G = " + std::to_string(group)) {
      agree(BuzzBeehive::Config{}, Budget::unbounded(), group, 2600, 11u + group);
    }
    SECTION("defaults, budget S + W + T, G = " + std::to_string(group)) {
      agree(BuzzBeehive::Config{}, Budget::uniform(564), group, 2600, 23u + group);
    }
    SECTION("small shapes, strides 3..6, G = " + std::to_string(group)) {
      for (std::size_t s : {3u, 4u, 5u, 6u}) {
        BuzzBeehive::Config c;
        c.sinks = 2 + s % 3;
        c.window = 3 + s;
        c.threshold = 10 + 3 * s;
        c.stride = s;
        agree(c, Budget::unbounded(), group, 3000, 37u * s + group);
      }
    }
  }
}

TEST_CASE("BUZZ budget mode is the bounded form with W and T derived from the capacity") {
  REQUIRE(BuzzBeehive::window_for_budget(564, 4).window == 160);
  REQUIRE(BuzzBeehive::window_for_budget(564, 4).threshold == 400);
  for (std::size_t cap : {7u, 8u, 40u, 128u, 300u, 1024u}) {
    const auto sp = BuzzBeehive::window_for_budget(cap, 4);
    INFO("capacity " << cap);
    REQUIRE(4 + sp.window + sp.threshold == cap);
    REQUIRE(sp.window >= 1);
    REQUIRE(sp.threshold >= 2);
  }
  for (int group : {1, 4}) {
    BuzzBeehive::Config c;
    c.budget_mode = true;
    // The brute force follows the derived explicit shape; the library derives it itself.
    const std::size_t cap = 96;
    const auto sp = BuzzBeehive::window_for_budget(cap, c.sinks);
    BuzzBeehive::Config ref = c;
    ref.budget_mode = false;
    ref.window = sp.window;
    ref.threshold = sp.threshold;
    const Geometry g = geometry(group);
    KVCache<BuzzBeehive> lib(g, Budget::uniform(static_cast<long long>(cap)), BuzzBeehive(c));
    KVCache<BuzzBeehive> exp(g, Budget::unbounded(), BuzzBeehive(ref));
    std::mt19937 rng(5);
    std::size_t peak = 0;
    for (std::uint64_t t = 0; t < 3000; ++t) {
      const auto k = random_vec(rng, 8), v = random_vec(rng, 8);
      lib.append(0, static_cast<std::int64_t>(t), k, v);
      exp.append(0, static_cast<std::int64_t>(t), k, v);
      for (int kh = 0; kh < 2; ++kh) {
        for (auto* cache : {&lib, &exp}) {
          const auto seqs = cache->seqs(0, kh);
          std::vector<float> p(static_cast<std::size_t>(group) * seqs.size());
          for (int j = 0; j < group; ++j)
            for (std::size_t r = 0; r < seqs.size(); ++r)
              p[static_cast<std::size_t>(j) * seqs.size() + r] = prob(3, t, seqs[r], kh, j);
          cache->observe(0, kh, p);
        }
        auto a = std::vector<std::uint64_t>(lib.seqs(0, kh).begin(), lib.seqs(0, kh).end());
        auto b = std::vector<std::uint64_t>(exp.seqs(0, kh).begin(), exp.seqs(0, kh).end());
        std::sort(a.begin(), a.end());
        std::sort(b.begin(), b.end());
        REQUIRE(a == b);
        peak = std::max(peak, a.size());
      }
    }
    REQUIRE(peak == cap);  // the bounded form peaks exactly at the budget
  }
}

TEST_CASE("BUZZ with the reference defaults swings between 257 and 564 rows") {
  // Sizes do not depend on scores, so real attention is not needed here.
  KVCache<BuzzBeehive> cache(geometry(1, 1), Budget::unbounded());
  std::vector<float> k(4, 0.5f), v(4, 0.25f);
  std::vector<std::size_t> size;
  std::vector<std::uint64_t> rebuild_at;
  std::size_t last = 0;
  for (std::int64_t t = 0; t < 10000; ++t) {
    cache.append(0, t, k, v);
    size.push_back(cache.size(0, 0));
    if (cache.policy().rebuilds(0, 0) != last) {
      last = cache.policy().rebuilds(0, 0);
      rebuild_at.push_back(static_cast<std::uint64_t>(t));
    }
  }
  // The first rebuild at token 564 (the 565th) leaves 245 rows; then 255, then 257 on.
  REQUIRE(rebuild_at.front() == 564);
  REQUIRE(size[564] == 245);
  REQUIRE(rebuild_at.size() > 20);
  const std::size_t settled = rebuild_at[3];
  const auto [lo, hi] = std::minmax_element(size.begin() + static_cast<long>(settled), size.end());
  CHECK(*lo == 257);
  CHECK(*hi == 564);
  for (std::size_t i = 4; i < rebuild_at.size(); ++i) {
    INFO("rebuild " << i);
    CHECK(rebuild_at[i] - rebuild_at[i - 1] == 308);  // 307 appends of growth + the rebuild
  }
  REQUIRE(*std::max_element(size.begin(), size.end()) == 564);
}

TEST_CASE("BUZZ log-n form agrees with its brute force and grows O(log n)") {
  for (int group : {1, 4, 8}) {
    SECTION("small shapes, G = " + std::to_string(group)) {
      for (std::size_t s : {3u, 5u, 7u}) {
        BuzzBeehive::Config c;
        c.sinks = 3;
        c.window = 5;
        c.threshold = 2 * s + 1;
        c.stride = s;
        c.log_n = true;
        agree(c, Budget::unbounded(), group, 4000, 91u * s + group);
      }
    }
  }
  SECTION("growth over 2^17 tokens against the bound m ((f - 1)(log_f R + 1) + 1)") {
    BuzzBeehive::Config c;
    c.log_n = true;
    KVCache<BuzzBeehive> cache(geometry(1, 1), Budget::unbounded(), BuzzBeehive(c));
    KVCache<BuzzBeehive> bounded(geometry(1, 1), Budget::unbounded());
    std::vector<float> k(4, 0.5f), v(4, 0.25f);
    const std::size_t f = cache.policy().thin_stride();
    const std::size_t m = (c.threshold + 1 + c.stride - 1) / c.stride;  // rows per generation
    std::size_t at_8k = 0, peak = 0;
    for (std::int64_t t = 0; t < (1 << 17); ++t) {
      cache.append(0, t, k, v);
      bounded.append(0, t, k, v);
      const std::size_t samples = cache.policy().samples(0, 0);
      const double r = std::max<double>(1.0, static_cast<double>(cache.policy().rebuilds(0, 0)));
      const double levels = std::floor(std::log(r) / std::log(static_cast<double>(f)) + 1e-9) + 1;
      INFO("token " << t << " samples " << samples);
      REQUIRE(static_cast<double>(samples) <= static_cast<double>(m) * ((f - 1) * levels + 1));
      REQUIRE(cache.size(0, 0) <= c.sinks + c.window + c.threshold + samples);
      REQUIRE(bounded.size(0, 0) <= 564);
      peak = std::max(peak, cache.size(0, 0));
      if (t == (1 << 13)) at_8k = peak;
      // Generations stay ordered by level, oldest (most thinned) first.
      const auto& gens = cache.policy().generations(0, 0);
      for (std::size_t i = 1; i < gens.size(); ++i) REQUIRE(gens[i - 1].level >= gens[i].level);
    }
    // It keeps growing (the far past is not dropped) but by a bounded amount per
    // f-fold length: 16x more tokens add at most log_f(16) + 1 levels of m(f-1) rows.
    CHECK(peak > at_8k);
    const double extra_levels = std::ceil(std::log(16.0) / std::log(static_cast<double>(f))) + 1;
    CHECK(static_cast<double>(peak - at_8k) <= extra_levels * static_cast<double>(m * (f - 1)));
  }
}

TEST_CASE("BUZZ end to end with the reference attention: bounded, sinks and window kept") {
  const Geometry g{2, 8, 2, 16};
  BuzzBeehive::Config c;
  c.window = 24;
  c.threshold = 60;
  KVCache<BuzzBeehive> cache(g, Budget::unbounded(), BuzzBeehive(c));
  std::size_t evicted = 0;
  cache.set_eviction_callback([&](const auto&) { ++evicted; });
  std::mt19937 rng(9);
  const std::size_t kv = 2 * 16, q = 8 * 16;
  for (std::int64_t t = 0; t < 1500; ++t)
    for (int l = 0; l < 2; ++l) {
      const auto k = random_vec(rng, kv), v = random_vec(rng, kv), qs = random_vec(rng, q);
      cache.append(l, t, k, v);
      const auto res = kvevict::attend(cache, l, qs);
      for (int kh = 0; kh < 2; ++kh) {
        REQUIRE(cache.size(l, kh) <= c.sinks + c.window + c.threshold);
        const auto seqs = cache.seqs(l, kh);
        std::vector<std::uint64_t> s(seqs.begin(), seqs.end());
        std::sort(s.begin(), s.end());
        for (std::uint64_t j = 0; j < std::min<std::uint64_t>(c.sinks, t + 1); ++j)
          REQUIRE(s[j] == j);
        const auto tail = std::min<std::size_t>(c.window, s.size());
        for (std::size_t j = 0; j < tail; ++j)
          REQUIRE(s[s.size() - 1 - j] == static_cast<std::uint64_t>(t) - j);
        // Scores are probabilities summed over G = 4 heads: total mass grows by 4 a step
        // and resets only lower it.
        const auto& sc = cache.policy().scores(l, kh);
        double total = 0;
        for (float x : sc) total += x;
        REQUIRE(total <= 4.0 * static_cast<double>(t + 1) + 1e-3);
        REQUIRE(total >= 4.0 - 1e-3);
      }
    }
  std::size_t live = 0;
  for (int l = 0; l < 2; ++l)
    for (int kh = 0; kh < 2; ++kh) live += cache.size(l, kh);
  REQUIRE(evicted + live == 2u * 2u * 1500u);  // nothing leaves unseen
}

TEST_CASE("BUZZ shrinks to a smaller budget through set_budget") {
  BuzzBeehive::Config c;
  c.budget_mode = true;
  KVCache<BuzzBeehive> cache(geometry(4), Budget::uniform(564), BuzzBeehive(c));
  std::vector<float> k(8, 0.5f), v(8, 0.25f);
  std::int64_t pos = 0;
  for (; pos < 2000; ++pos) cache.append(0, pos, k, v);
  for (long long cap : {300LL, 40LL, 7LL}) {
    cache.set_budget(Budget::uniform(cap));
    for (int kh = 0; kh < 2; ++kh) {
      REQUIRE(cache.size(0, kh) <= static_cast<std::size_t>(cap));
      auto s = std::vector<std::uint64_t>(cache.seqs(0, kh).begin(), cache.seqs(0, kh).end());
      std::sort(s.begin(), s.end());
      for (std::uint64_t j = 0; j < 4; ++j) REQUIRE(s[j] == j);
    }
    for (std::int64_t t = 0; t < 500; ++t) {
      cache.append(0, pos++, k, v);
      REQUIRE(cache.size(0, 0) <= static_cast<std::size_t>(cap));
    }
  }
}

TEST_CASE("BUZZ rejects configurations and budgets it cannot serve") {
  BuzzBeehive::Config c;
  c.stride = 2;
  REQUIRE_THROWS_AS(BuzzBeehive(c), kvevict::Error);
  c = {};
  c.window = 0;
  REQUIRE_THROWS_AS(BuzzBeehive(c), kvevict::Error);
  c = {};
  c.threshold = 1;
  REQUIRE_THROWS_AS(BuzzBeehive(c), kvevict::Error);
  REQUIRE_THROWS_AS(BuzzBeehive::window_for_budget(6, 4), kvevict::Error);
  c = {};
  c.budget_mode = true;
  c.log_n = true;
  REQUIRE_THROWS_AS(BuzzBeehive(c), kvevict::Error);
  c = {};
  c.budget_mode = true;
  REQUIRE_THROWS_AS(KVCache<BuzzBeehive>(geometry(1), Budget::unbounded(), BuzzBeehive(c)),
                    kvevict::Error);
  REQUIRE_THROWS_AS(KVCache<BuzzBeehive>(geometry(1), Budget::uniform(6), BuzzBeehive(c)),
                    kvevict::Error);
  REQUIRE_NOTHROW(KVCache<BuzzBeehive>(geometry(1), Budget::uniform(7), BuzzBeehive(c)));
  // Explicit shape under a smaller budget: the threshold is capped at C - S - W >= 2.
  REQUIRE_THROWS_AS(KVCache<BuzzBeehive>(geometry(1), Budget::uniform(165), BuzzBeehive()),
                    kvevict::Error);
  KVCache<BuzzBeehive> capped(geometry(1), Budget::uniform(200), BuzzBeehive());
  std::vector<float> k(8, 0.5f), v(8, 0.25f);
  for (std::int64_t t = 0; t < 3000; ++t) {
    capped.append(0, t, k, v);
    REQUIRE(capped.size(0, 0) <= 200);
  }
  REQUIRE(capped.policy().rebuilds(0, 0) > 10);
}

TEST_CASE("BUZZ resumes identically after save and restore") {
  for (bool log_n : {false, true}) {
    BuzzBeehive::Config c;
    c.window = 20;
    c.threshold = 40;
    c.log_n = log_n;
    const Geometry g{1, 8, 2, 8};
    KVCache<BuzzBeehive> a(g, Budget::unbounded(), BuzzBeehive(c));
    std::mt19937 rng(17);
    auto step = [&](KVCache<BuzzBeehive>& cache, std::int64_t t, const std::vector<float>& k,
                    const std::vector<float>& v, const std::vector<float>& q) {
      cache.append(0, t, k, v);
      kvevict::attend(cache, 0, q);
    };
    std::int64_t t = 0;
    for (; t < 1000; ++t) step(a, t, random_vec(rng, 16), random_vec(rng, 16), random_vec(rng, 64));
    KVCache<BuzzBeehive> b(g, Budget::unbounded(), BuzzBeehive(c));
    kvevict::load_bytes(b, kvevict::save_bytes(a));
    for (; t < 3000; ++t) {
      const auto k = random_vec(rng, 16), v = random_vec(rng, 16), q = random_vec(rng, 64);
      step(a, t, k, v, q);
      step(b, t, k, v, q);
      for (int kh = 0; kh < 2; ++kh) {
        REQUIRE(std::vector<std::uint64_t>(a.seqs(0, kh).begin(), a.seqs(0, kh).end()) ==
                std::vector<std::uint64_t>(b.seqs(0, kh).begin(), b.seqs(0, kh).end()));
        REQUIRE(a.policy().scores(0, kh) == b.policy().scores(0, kh));
      }
    }
    REQUIRE(a.policy().rebuilds(0, 0) > 20);
    // A cache with another shape refuses the state.
    c.stride = 7;
    KVCache<BuzzBeehive> other(g, Budget::unbounded(), BuzzBeehive(c));
    REQUIRE_THROWS_AS(kvevict::load_bytes(other, kvevict::save_bytes(a)), kvevict::Error);
  }
}
