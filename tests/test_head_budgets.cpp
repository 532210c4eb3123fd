// AttentionAgeProfile: the age histogram it accumulates, and allocate() against an exact
// optimum (for profiles whose mass falls with age the greedy allocation is optimal: the
// gain of each further row never grows), the total, the floor and the blend.
#include <kvevict/head_budgets.hpp>
#include <kvevict/policies/full_cache.hpp>

#include "support/test_support.hpp"

using namespace kvevict;

namespace {

// A profile with the given mean mass per age for every head (one step each).
AttentionAgeProfile make_profile(const Geometry& g, const std::vector<std::vector<double>>& m) {
  AttentionAgeProfile p(g, m[0].size());
  for (int l = 0; l < g.n_layers; ++l)
    for (int h = 0; h < g.n_kv_heads; ++h) {
      const auto& mh = m[static_cast<std::size_t>(l * g.n_kv_heads + h)];
      // One row per age, attended from position = max age - 1; every query head alike.
      const auto T = static_cast<std::int64_t>(mh.size());
      std::vector<std::int64_t> pos;
      std::vector<float> probs;
      for (int gq = 0; gq < g.group(); ++gq)
        for (std::int64_t a = 0; a < T; ++a) probs.push_back(static_cast<float>(mh[a]));
      for (std::int64_t a = 0; a < T; ++a) pos.push_back(T - 1 - a);
      p.add(l, h, T - 1, pos, probs);
    }
  return p;
}

// Best total mass over all allocations with every head >= floor and the exact total:
// dynamic programming over heads.
double best_mass(const std::vector<std::vector<double>>& m, long long floor, long long total) {
  const long long NEG = -1;
  std::vector<double> best(static_cast<std::size_t>(total + 1), NEG);
  best[0] = 0.0;
  for (const auto& mh : m) {
    std::vector<double> next(best.size(), NEG);
    for (long long used = 0; used <= total; ++used) {
      if (best[static_cast<std::size_t>(used)] < 0) continue;
      double window = 0.0;
      for (long long c = 1; used + c <= total; ++c) {
        window += c - 1 < static_cast<long long>(mh.size()) ? mh[static_cast<std::size_t>(c - 1)] : 0.0;
        if (c < floor) continue;
        auto& slot = next[static_cast<std::size_t>(used + c)];
        slot = std::max(slot, best[static_cast<std::size_t>(used)] + window);
      }
    }
    best.swap(next);
  }
  return best[static_cast<std::size_t>(total)];
}

double window_mass(const std::vector<std::vector<double>>& m,
                   const std::vector<std::vector<long long>>& rows, int n_kv_heads) {
  double s = 0.0;
  for (std::size_t l = 0; l < rows.size(); ++l)
    for (std::size_t h = 0; h < rows[l].size(); ++h) {
      const auto& mh = m[l * static_cast<std::size_t>(n_kv_heads) + h];
      for (long long a = 0; a < rows[l][h] && a < static_cast<long long>(mh.size()); ++a)
        s += mh[static_cast<std::size_t>(a)];
    }
  return s;
}

}  // namespace

TEST_CASE("AttentionAgeProfile: greedy allocation is optimal for mass falling with age") {
  const Geometry g{2, 4, 2, 8};
  kvtest::Rng rng(3);
  for (int trial = 0; trial < 200; ++trial) {
    const auto T = static_cast<std::size_t>(rng.uniform(4, 40));
    std::vector<std::vector<double>> m(4);
    for (auto& mh : m) {
      // A decreasing profile: sorted random values, some heads steep, some flat.
      for (std::size_t a = 0; a < T; ++a) mh.push_back(static_cast<double>(rng.uniform(0, 1000)) / 1000.0);
      std::sort(mh.rbegin(), mh.rend());
      const double sum = [&] { double s = 0; for (double x : mh) s += x; return s; }();
      for (double& x : mh) x /= sum;
    }
    // Quantise as the float probabilities the profile receives.
    for (auto& mh : m)
      for (double& x : mh) x = static_cast<double>(static_cast<float>(x));
    const auto p = make_profile(g, m);
    const long long floor = rng.uniform(1, 3);
    const long long mean = rng.uniform(floor, static_cast<long long>(T) + 4);
    const auto rows = p.allocate_rows(mean, {.floor = floor});
    long long total = 0;
    for (const auto& l : rows)
      for (long long r : l) {
        total += r;
        REQUIRE(r >= floor);
      }
    REQUIRE(total == 4 * mean);
    REQUIRE(window_mass(m, rows, 2) == Approx(best_mass(m, floor, 4 * mean)).epsilon(1e-9));
  }
}

TEST_CASE("AttentionAgeProfile: far-looking heads get more rows; blend and floor") {
  const Geometry g{1, 2, 2, 8};
  // Head 0 attends only the newest 2 ages; head 1 spreads evenly over 32.
  std::vector<std::vector<double>> m(2, std::vector<double>(32, 0.0));
  m[0][0] = 0.7;
  m[0][1] = 0.3;
  for (double& x : m[1]) x = 1.0 / 32.0;
  const auto p = make_profile(g, m);
  const auto rows = p.allocate_rows(16, {.floor = 2});
  CHECK(rows[0][0] == 2);
  CHECK(rows[0][1] == 30);
  const auto half = p.allocate_rows(16, {.floor = 2, .uniform_share = 0.5});
  CHECK(half[0][0] == 9);  // (2 + 16) / 2
  CHECK(half[0][1] == 23);
  const auto uni = p.allocate_rows(16, {.floor = 2, .uniform_share = 1.0});
  CHECK(uni[0][0] == 16);
  CHECK(uni[0][1] == 16);
  // An odd blend keeps the total exact.
  const auto third = p.allocate_rows(16, {.floor = 2, .uniform_share = 1.0 / 3.0});
  CHECK(third[0][0] + third[0][1] == 32);
  CHECK(p.mass(0, 1, 5) == Approx(1.0 / 32.0));
  CHECK(p.steps(0, 0) == 1);
}

TEST_CASE("AttentionAgeProfile from attend() on a full cache: mass per step sums to one") {
  const Geometry g{2, 8, 2, 16};
  KVCache<policies::FullCache> cache(g, Budget::unbounded());
  AttentionAgeProfile p(g, 8);  // ages >= 7 pooled in the last bucket
  kvtest::Rng rng(9);
  for (int t = 0; t < 30; ++t)
    for (int l = 0; l < 2; ++l) {
      auto k = rng.normals(32), v = rng.normals(32), q = rng.normals(128);
      cache.append(l, t, k, v, q);
      p.add(cache, l, t, attend(cache, l, q));
    }
  for (int l = 0; l < 2; ++l)
    for (int h = 0; h < 2; ++h) {
      double s = 0.0;
      for (std::size_t a = 0; a < 8; ++a) s += p.mass(l, h, a);
      CHECK(s == Approx(1.0).epsilon(1e-5));
      CHECK(p.steps(l, h) == 30);
    }
  const Budget b = p.allocate(6);
  long long total = 0;
  for (int l = 0; l < 2; ++l)
    for (int h = 0; h < 2; ++h) total += static_cast<long long>(b.capacity(l, h, 2));
  CHECK(total == 24);
}

TEST_CASE("AttentionAgeProfile rejects bad input, naming the value") {
  const Geometry g{1, 2, 1, 4};
  AttentionAgeProfile p(g, 4);
  const std::vector<std::int64_t> pos{0, 1};
  REQUIRE_THROWS_WITH(p.add(1, 0, 1, pos, std::vector<float>{0.5f, 0.5f, 0.5f, 0.5f}),
                      Catch::Contains("layer = 1"));
  REQUIRE_THROWS_WITH(p.add(0, 1, 1, pos, std::vector<float>{0.5f, 0.5f, 0.5f, 0.5f}),
                      Catch::Contains("KV head = 1"));
  REQUIRE_THROWS_WITH(p.add(0, 0, 1, pos, std::vector<float>{0.5f, 0.5f}),
                      Catch::Contains("probs has 2") && Catch::Contains("2 x 2"));
  REQUIRE_THROWS_WITH(p.add(0, 0, 0, pos, std::vector<float>{0.5f, 0.5f, 0.5f, 0.5f}),
                      Catch::Contains("row position 1"));
  REQUIRE_THROWS_WITH(p.add(0, 0, 1, pos, std::vector<float>{0.5f, -0.5f, 0.5f, 0.5f}),
                      Catch::Contains("probability -0.5"));
  REQUIRE_THROWS_WITH(p.allocate(4), Catch::Contains("no calibration steps"));
  p.add(0, 0, 1, pos, std::vector<float>{0.5f, 0.5f, 0.5f, 0.5f});
  REQUIRE_THROWS_WITH(p.allocate(2, {.floor = 3}), Catch::Contains("mean_rows = 2"));
  REQUIRE_THROWS_WITH(p.allocate(4, {.floor = 0}), Catch::Contains("floor = 0"));
  REQUIRE_THROWS_WITH(p.allocate(4, {.uniform_share = 1.5}), Catch::Contains("uniform_share = 1.5"));
  REQUIRE_THROWS_WITH(AttentionAgeProfile(g, 0), Catch::Contains("max_age = 0"));
}
