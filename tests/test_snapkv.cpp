// SnapKV: prefill selection against a brute-force loop, GQA grouping, decode overflow.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <kvevict/serialize.hpp>
#include <kvevict/cache.hpp>
#include <kvevict/policies/snapkv.hpp>
#include <random>
#include <set>
#include <vector>

using kvevict::Budget;
using kvevict::Geometry;
using kvevict::KVCache;
using kvevict::policies::Pooling;
using kvevict::policies::SnapKV;

namespace {

struct Prompt {
  std::size_t tokens;
  std::vector<float> keys, values, queries;
};

Prompt random_prompt(const Geometry& g, std::size_t T, std::uint32_t seed, float qscale = 1.5f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0.0f, 1.0f);
  Prompt p{T, {}, {}, {}};
  const auto kv = T * static_cast<std::size_t>(g.n_kv_heads * g.head_dim);
  const auto hq = T * static_cast<std::size_t>(g.n_heads * g.head_dim);
  for (std::size_t i = 0; i < kv; ++i) p.keys.push_back(n(rng));
  for (std::size_t i = 0; i < kv; ++i) p.values.push_back(n(rng));
  for (std::size_t i = 0; i < hq; ++i) p.queries.push_back(qscale * n(rng));
  return p;
}

// Plain loops in double: window queries of the G heads of `kh` attend causally; sum over
// window and group; pool with zero padding counted; top-n (ties: lower index) + window.
struct Brute {
  std::set<std::int64_t> kept;
  double margin;  // gap between the n-th and (n+1)-th pooled score
};
Brute brute_select(const Geometry& g, const Prompt& p, int kh, std::size_t W, std::size_t kernel,
                   Pooling pooling, std::size_t n) {
  const std::size_t T = p.tokens, P = T - W, d = static_cast<std::size_t>(g.head_dim);
  const int G = g.group();
  std::vector<double> raw(P, 0.0);
  for (std::size_t t = P; t < T; ++t)
    for (int gi = 0; gi < G; ++gi) {
      const float* q = &p.queries[(t * g.n_heads + kh * G + gi) * d];
      std::vector<double> logit(t + 1);
      double mx = -1e300;
      for (std::size_t j = 0; j <= t; ++j) {
        const float* k = &p.keys[(j * g.n_kv_heads + kh) * d];
        double s = 0.0;
        for (std::size_t x = 0; x < d; ++x) s += static_cast<double>(q[x]) * k[x];
        logit[j] = s / std::sqrt(static_cast<double>(d));
        mx = std::max(mx, logit[j]);
      }
      double z = 0.0;
      for (double& l : logit) z += (l = std::exp(l - mx));
      for (std::size_t j = 0; j < P; ++j) raw[j] += logit[j] / z;
    }
  std::vector<double> pooled(P);
  const long half = static_cast<long>(kernel / 2);
  for (long i = 0; i < static_cast<long>(P); ++i) {
    double acc = pooling == Pooling::avg ? 0.0 : -1e300;
    for (long j = i - half; j <= i + half; ++j) {
      const double x =
          (j >= 0 && j < static_cast<long>(P)) ? raw[static_cast<std::size_t>(j)] : 0.0;
      if (pooling == Pooling::avg)
        acc += x;
      else if (j >= 0 && j < static_cast<long>(P))
        acc = std::max(acc, x);
    }
    pooled[static_cast<std::size_t>(i)] = pooling == Pooling::avg ? acc / kernel : acc;
  }
  std::vector<std::size_t> idx(P);
  for (std::size_t i = 0; i < P; ++i) idx[i] = i;
  std::stable_sort(idx.begin(), idx.end(),
                   [&](std::size_t a, std::size_t b) { return pooled[a] > pooled[b]; });
  Brute b;
  for (std::size_t i = 0; i < n; ++i) b.kept.insert(static_cast<std::int64_t>(idx[i]));
  for (std::size_t t = P; t < T; ++t) b.kept.insert(static_cast<std::int64_t>(t));
  // Max pooling copies one raw value to neighbours: such exact ties break to the lower
  // index in both implementations. Only distinct values closer than float error matter.
  b.margin = 1.0;
  for (std::size_t i = n; i < P; ++i)
    if (pooled[idx[i]] < pooled[idx[n - 1]])
      b.margin = std::min(b.margin, pooled[idx[n - 1]] - pooled[idx[i]]);
  return b;
}

std::set<std::int64_t> kept_positions(const KVCache<SnapKV>& c, int layer, int kh) {
  auto pos = c.positions(layer, kh);
  return {pos.begin(), pos.end()};
}

}  // namespace

TEST_CASE("SnapKV keeps exactly what a brute-force loop selects", "[snapkv]") {
  const Geometry g{2, 8, 2, 16};  // GQA: 4 query heads per KV head
  int checked = 0;
  for (std::uint32_t seed = 1; seed <= 12; ++seed) {
    for (Pooling pooling : {Pooling::avg, Pooling::max}) {
      const std::size_t W = 4 + seed % 5, kernel = (seed % 2) ? 5 : 7, T = 90 + 7 * seed;
      const std::vector<long long> caps{static_cast<long long>(W + 10 + seed),
                                        static_cast<long long>(W + 30)};
      KVCache<SnapKV> cache(g, Budget::per_layer(caps), SnapKV({W, kernel, pooling, 0}));
      for (int l = 0; l < g.n_layers; ++l) {
        const Prompt p = random_prompt(g, T, seed * 7 + static_cast<std::uint32_t>(l));
        cache.prefill(l, 0, T, p.keys, p.values, p.queries);
        for (int kh = 0; kh < g.n_kv_heads; ++kh) {
          const std::size_t n = static_cast<std::size_t>(caps[static_cast<std::size_t>(l)]) - W;
          const Brute b = brute_select(g, p, kh, W, kernel, pooling, n);
          if (b.margin < 1e-6) continue;  // float vs double could order a near-tie either way
          ++checked;
          CHECK(kept_positions(cache, l, kh) == b.kept);
          CHECK(cache.size(l, kh) == static_cast<std::size_t>(caps[static_cast<std::size_t>(l)]));
        }
      }
    }
  }
  CHECK(checked >= 80);  // nearly every case is decided, not skipped
}

TEST_CASE("SnapKV selects per KV head from the summed group scores", "[snapkv]") {
  // Two query heads of one group look at different tokens; the KV head keeps the union
  // when the budget allows, which per-query-head selection with repeated K/V would not.
  const Geometry g{1, 2, 1, 4};
  const std::size_t T = 40, W = 2;
  Prompt p{T, std::vector<float>(T * 4, 0.0f), std::vector<float>(T * 4, 0.0f),
           std::vector<float>(T * 8, 0.0f)};
  // key j = e0 for j == 5, e1 for j == 20, zero otherwise; head 0 queries e0, head 1 e1
  p.keys[5 * 4 + 0] = 1.0f;
  p.keys[20 * 4 + 1] = 1.0f;
  for (std::size_t t = T - W; t < T; ++t) {
    p.queries[(t * 2 + 0) * 4 + 0] = 40.0f;
    p.queries[(t * 2 + 1) * 4 + 1] = 40.0f;
  }
  KVCache<SnapKV> cache(g, Budget::uniform(W + 2), SnapKV({W, 1, Pooling::avg, 0}));
  cache.prefill(0, 100, T, p.keys, p.values, p.queries);
  CHECK(kept_positions(cache, 0, 0) == std::set<std::int64_t>{105, 120, 138, 139});
}

TEST_CASE("SnapKV keeps a short prompt whole and reports dropped rows", "[snapkv]") {
  const Geometry g{1, 4, 2, 8};
  const Prompt p = random_prompt(g, 30, 3);
  KVCache<SnapKV> whole(g, Budget::uniform(40), SnapKV({8, 5, Pooling::avg, 0}));
  whole.prefill(0, 0, 30, p.keys, p.values, p.queries);
  CHECK(whole.size(0, 0) == 30);
  CHECK(whole.policy().scores(0, 0)[0] == SnapKV::kUnscored);

  KVCache<SnapKV> part(g, Budget::uniform(12), SnapKV({8, 5, Pooling::avg, 0}));
  std::size_t dropped = 0;
  part.set_eviction_callback([&](const auto&) { ++dropped; });
  part.prefill(0, 0, 30, p.keys, p.values, p.queries);
  CHECK(dropped == 2 * (30 - 12));
  CHECK(part.allocated_rows(0, 0) == 12);
}

TEST_CASE("SnapKV decode: the reserve absorbs decoded tokens, then the least important go",
          "[snapkv]") {
  const Geometry g{1, 2, 1, 8};
  const std::size_t W = 4, T = 60;
  const Prompt p = random_prompt(g, T, 9);
  const Prompt dec = random_prompt(g, 20, 10);
  const std::size_t kv = static_cast<std::size_t>(g.head_dim);

  KVCache<SnapKV> reserved(g, Budget::uniform(W + 6 + 5), SnapKV({W, 5, Pooling::avg, 5}));
  reserved.prefill(0, 0, T, p.keys, p.values, p.queries);
  CHECK(reserved.size(0, 0) == W + 6);
  std::size_t evicted = 0;
  reserved.set_eviction_callback([&](const auto&) { ++evicted; });
  for (std::size_t i = 0; i < 5; ++i)
    reserved.append(0, static_cast<std::int64_t>(T + i),
                    std::span<const float>(dec.keys.data() + i * kv, kv),
                    std::span<const float>(dec.values.data() + i * kv, kv));
  CHECK(evicted == 0);
  CHECK(reserved.size(0, 0) == W + 11);

  // Full cache: each decoded token evicts the lowest-scored prompt row, never the window.
  KVCache<SnapKV> full(g, Budget::uniform(W + 6), SnapKV({W, 5, Pooling::avg, 0}));
  full.prefill(0, 0, T, p.keys, p.values, p.queries);
  std::vector<std::int64_t> gone;
  full.set_eviction_callback([&](const auto& e) { gone.push_back(e.position); });
  for (std::size_t i = 0; i < 12; ++i) {
    const auto sc = full.policy().scores(0, 0);
    const auto pos = full.positions(0, 0);
    std::int64_t expect = -1;
    float best = SnapKV::kUnscored;
    for (std::size_t r = 0; r < sc.size(); ++r)
      if (sc[r] < best) best = sc[r], expect = pos[r];
    if (expect < 0) {  // no scored row left: the oldest unprotected goes
      std::vector<std::int64_t> ps(pos.begin(), pos.end());
      std::sort(ps.begin(), ps.end());
      expect = ps[0];
    }
    full.append(0, static_cast<std::int64_t>(T + i),
                std::span<const float>(dec.keys.data() + i * kv, kv),
                std::span<const float>(dec.values.data() + i * kv, kv));
    REQUIRE(gone.size() == i + 1);
    CHECK(gone.back() == expect);
    CHECK(full.size(0, 0) == W + 6);
  }
  // the last W arrivals are all present
  const auto pos = full.positions(0, 0);
  for (std::size_t i = 12 - W; i < 12; ++i)
    CHECK(std::find(pos.begin(), pos.end(), static_cast<std::int64_t>(T + i)) != pos.end());
}

TEST_CASE("SnapKV rejects budgets below window + 1 and prompts without queries", "[snapkv]") {
  const Geometry g{1, 2, 1, 8};
  CHECK_THROWS_AS(KVCache<SnapKV>(g, Budget::uniform(8), SnapKV({8, 5, Pooling::avg, 0})),
                  kvevict::Error);
  CHECK_THROWS_AS(SnapKV({8, 4, Pooling::avg, 0}), kvevict::Error);  // even kernel
  KVCache<SnapKV> c(g, Budget::uniform(20), SnapKV({8, 5, Pooling::avg, 0}));
  const Prompt p = random_prompt(g, 30, 1);
  CHECK_THROWS_AS(c.prefill(0, 0, 30, p.keys, p.values), kvevict::Error);
}

TEST_CASE("SnapKV prefill scores survive save/restore: decoding evicts identically") {
  const kvevict::Geometry g{2, 4, 2, 16};
  const kvevict::policies::SnapKV policy({.window = 8, .kernel = 5});
  const std::size_t T = 120, d = 16;
  std::mt19937_64 gen(9);
  std::normal_distribution<float> n01;
  auto normals = [&](std::size_t n) {
    std::vector<float> v(n);
    for (auto& x : v) x = n01(gen);
    return v;
  };
  const auto k = normals(T * 2 * d), v = normals(T * 2 * d), q = normals(T * 4 * d);
  kvevict::KVCache<kvevict::policies::SnapKV> a(g, kvevict::Budget::uniform(40), policy);
  for (int l = 0; l < 2; ++l) a.prefill(l, 0, T, k, v, q);
  kvevict::KVCache<kvevict::policies::SnapKV> b(g, kvevict::Budget::uniform(40), policy);
  kvevict::load_bytes(b, kvevict::save_bytes(a));
  for (int t = static_cast<int>(T); t < static_cast<int>(T) + 60; ++t)
    for (int l = 0; l < 2; ++l) {
      const auto kt = normals(2 * d), vt = normals(2 * d);
      a.append(l, t, kt, vt);
      b.append(l, t, kt, vt);
      for (int h = 0; h < 2; ++h) {
        const auto pa = a.positions(l, h), pb = b.positions(l, h);
        REQUIRE(std::vector<std::int64_t>(pa.begin(), pa.end()) ==
                std::vector<std::int64_t>(pb.begin(), pb.end()));
      }
    }
  kvevict::KVCache<kvevict::policies::SnapKV> c(g, kvevict::Budget::uniform(40),
                                                kvevict::policies::SnapKV({.window = 4}));
  REQUIRE_THROWS_WITH(kvevict::load_bytes(c, kvevict::save_bytes(a)),
                      Catch::Contains("SnapKV state"));
}
