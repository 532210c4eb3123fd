// XKV (arXiv 2412.05896): greedy allocation against an exact DP, retention, pooling,
// memory after compression, profiles, PyramidKV/uniform baselines, prefill paths.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdio>
#include <kvevict/policies/xkv.hpp>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

using kvevict::Geometry;
using namespace kvevict::policies;

namespace {

using Scores = std::vector<std::vector<std::vector<float>>>;  // [layer][head][token]

Scores random_scores(std::mt19937& rng, int L, int H, bool quantised) {
  std::uniform_int_distribution<int> len(0, 7);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  Scores s(static_cast<std::size_t>(L));
  for (auto& layer : s) {
    const int n = len(rng);
    layer.assign(static_cast<std::size_t>(H), {});
    for (auto& head : layer)
      for (int j = 0; j < n; ++j) {
        float x = u(rng);
        if (quantised) x = std::round(x * 4.0f) / 4.0f;  // many exact ties
        head.push_back(x * x);
      }
  }
  return s;
}

// R_l(n) recomputed from raw scores: per head sort, top-n sum, over the layer's total.
double direct_retention(const std::vector<std::vector<float>>& layer, long long n) {
  double kept = 0.0, total = 0.0;
  for (auto head : layer) {
    std::sort(head.begin(), head.end(), std::greater<>());
    for (std::size_t j = 0; j < head.size(); ++j) {
      total += head[j];
      if (static_cast<long long>(j) < n) kept += head[j];
    }
  }
  return total > 0.0 ? kept / total : 1.0;
}

XkvLayerAllocator make_allocator(const Scores& s, long long min_tokens) {
  const int L = static_cast<int>(s.size()), H = static_cast<int>(s[0].size());
  XkvLayerAllocator::Config c;
  c.min_tokens = min_tokens;
  XkvLayerAllocator a(Geometry{L, H, H, 4}, c);
  for (int l = 0; l < L; ++l) a.set_layer_scores(l, s[static_cast<std::size_t>(l)]);
  return a;
}

// Exact DP: best[t] = max sum of R over the layers so far using exactly t tokens, each
// layer n in [min, max(min, len)].
std::vector<double> dp_best(const Scores& s, long long min_tokens) {
  const double neg = -std::numeric_limits<double>::infinity();
  std::vector<double> best{0.0};
  for (const auto& layer : s) {
    const long long hi = std::max<long long>(min_tokens, static_cast<long long>(layer[0].size()));
    std::vector<double> next(best.size() + static_cast<std::size_t>(hi), neg);
    for (std::size_t t = 0; t < best.size(); ++t) {
      if (best[t] == neg) continue;
      for (long long n = min_tokens; n <= hi; ++n) {
        const double v = best[t] + direct_retention(layer, n);
        auto& slot = next[t + static_cast<std::size_t>(n)];
        slot = std::max(slot, v);
      }
    }
    best = std::move(next);
  }
  return best;
}

}  // namespace

TEST_CASE("pooling equals a plain reference loop (zero padding counted)", "[xkv]") {
  std::mt19937 rng(42);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  for (std::size_t n : {1u, 2u, 3u, 6u, 7u, 13u, 100u})
    for (std::size_t kernel : {1u, 3u, 5u, 7u, 9u}) {
      std::vector<float> in(n);
      for (auto& x : in) x = u(rng);
      std::vector<float> avg, mx;
      pool1d(in, kernel, Pooling::avg, avg);
      pool1d(in, kernel, Pooling::max, mx);
      REQUIRE(avg.size() == n);
      const long half = static_cast<long>(kernel / 2);
      for (long i = 0; i < static_cast<long>(n); ++i) {
        double s = 0.0;
        float m = -1.0f;
        for (long j = i - half; j <= i + half; ++j) {
          const bool inside = j >= 0 && j < static_cast<long>(n);
          s += inside ? in[static_cast<std::size_t>(j)] : 0.0;  // padding counts as zero
          if (inside) m = std::max(m, in[static_cast<std::size_t>(j)]);
        }
        CHECK(avg[static_cast<std::size_t>(i)] ==
              Approx(s / static_cast<double>(kernel)).epsilon(1e-6));
        CHECK(mx[static_cast<std::size_t>(i)] == m);
      }
    }
  // the edge is damped: a constant input pools to less at the ends
  std::vector<float> ones(10, 1.0f), out;
  pool1d(ones, 7, Pooling::avg, out);
  CHECK(out[0] == Approx(4.0 / 7.0));
  CHECK(out[5] == Approx(1.0));
}

TEST_CASE("greedy budget mode equals the exact DP optimum", "[xkv]") {
  std::mt19937 rng(7);
  int instances = 0;
  for (int it = 0; it < 600; ++it) {
    const int L = 1 + static_cast<int>(rng() % 5), H = 1 + static_cast<int>(rng() % 3);
    const long long min_tokens = 1 + static_cast<long long>(rng() % 2);
    const Scores s = random_scores(rng, L, H, it % 3 == 0);
    const auto a = make_allocator(s, min_tokens);
    const auto best = dp_best(s, min_tokens);
    const long long lo = min_tokens * L, hi = static_cast<long long>(best.size()) - 1;
    for (long long N = lo; N <= hi + 2; ++N) {
      const Allocation alloc = a.allocate(N);
      // never zero, never more than asked; stops short only when all candidates are taken
      for (long long n : alloc.tokens) REQUIRE(n >= min_tokens);
      REQUIRE(alloc.total() == std::min(N, hi));
      double r = 0.0;
      for (int l = 0; l < L; ++l)
        r += direct_retention(s[static_cast<std::size_t>(l)],
                              alloc.tokens[static_cast<std::size_t>(l)]);
      REQUIRE(r == Approx(best[static_cast<std::size_t>(alloc.total())]).margin(1e-9));
      ++instances;
    }
  }
  CHECK(instances > 2000);
}

TEST_CASE("greedy target mode equals the exact DP minimum total", "[xkv]") {
  std::mt19937 rng(11);
  std::uniform_real_distribution<double> u(0.05, 0.999);
  for (int it = 0; it < 1500; ++it) {
    const int L = 1 + static_cast<int>(rng() % 5), H = 1 + static_cast<int>(rng() % 3);
    const long long min_tokens = 1 + static_cast<long long>(rng() % 2);
    const Scores s = random_scores(rng, L, H, it % 3 == 0);
    const auto a = make_allocator(s, min_tokens);
    const auto best = dp_best(s, min_tokens);
    const double target = u(rng);
    const Allocation alloc = a.allocate_for_retention(target);
    // smallest t whose best mean R reaches the target
    long long want = -1;
    for (std::size_t t = 0; t < best.size(); ++t)
      if (best[t] >= target * L) {
        want = static_cast<long long>(t);
        break;
      }
    if (want < 0) want = static_cast<long long>(best.size()) - 1;  // unreachable: take all
    REQUIRE(alloc.total() == want);
    CHECK(alloc.mean_retention * L == Approx(best[static_cast<std::size_t>(want)]).margin(1e-9));
  }
}

TEST_CASE("mean R of an allocation equals a direct recomputation", "[xkv]") {
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  const int L = 12, H = 4;
  Scores s(L, std::vector<std::vector<float>>(H));
  for (int l = 0; l < L; ++l)
    for (auto& head : s[static_cast<std::size_t>(l)])
      for (int j = 0; j < 300; ++j) head.push_back(std::pow(u(rng), 1.0f + static_cast<float>(l)));
  const auto a = make_allocator(s, 1);
  for (long long N : {12LL, 100LL, 1000LL, 3599LL}) {
    const Allocation alloc = a.allocate(N);
    double r = 0.0;
    for (int l = 0; l < L; ++l) {
      const double d = direct_retention(s[static_cast<std::size_t>(l)],
                                        alloc.tokens[static_cast<std::size_t>(l)]);
      CHECK(a.retention(l, alloc.tokens[static_cast<std::size_t>(l)]) == Approx(d).epsilon(1e-9));
      r += d;
    }
    CHECK(alloc.mean_retention == Approx(r / L).epsilon(1e-9));
  }
  // sparse (deep, high exponent) layers need fewer tokens for the same R: they get fewer
  const Allocation alloc = a.allocate(1200);
  CHECK(alloc.tokens.front() > alloc.tokens.back());
}

TEST_CASE("allocator boundaries: minimum per layer, bad totals and targets, short prompts",
          "[xkv]") {
  // layer 1 has almost no mass: the reference would give it zero and crash
  Scores s{{{5.0f, 4.0f, 3.0f, 2.0f}}, {{1e-9f, 0.0f, 0.0f, 0.0f}}, {{}}};
  const auto a = make_allocator(s, 1);
  const Allocation alloc = a.allocate(5);
  CHECK(alloc.tokens == std::vector<long long>{3, 1, 1});
  CHECK(a.retention(2, 1) == 1.0);  // nothing to select: keeps it all
  CHECK_THROWS_WITH(a.allocate(2), Catch::Contains("expected >= 3"));
  CHECK_THROWS_WITH(a.allocate_for_retention(0.0), Catch::Contains("expected in (0, 1]"));
  CHECK_THROWS_WITH(a.allocate_for_retention(1.5), Catch::Contains("target = 1.5"));
  XkvLayerAllocator fresh(Geometry{2, 2, 2, 4});
  CHECK_THROWS_WITH(fresh.allocate(10), Catch::Contains("no statistics"));
  CHECK_THROWS_WITH(fresh.set_layer_scores(0, {{1.0f}, {1.0f, 2.0f}}),
                    Catch::Contains("expected 1 like head 0"));
  CHECK_THROWS_WITH(fresh.set_layer_scores(0, {{-1.0f}, {1.0f}}), Catch::Contains(">= 0"));
  XkvLayerAllocator::Config zero;
  zero.min_tokens = 0;
  CHECK_THROWS_AS(XkvLayerAllocator(Geometry{2, 2, 2, 4}, zero), kvevict::Error);
}

TEST_CASE("PyramidKV and uniform budgets keep the total exactly", "[xkv]") {
  for (int L : {1, 2, 7, 32, 80})
    for (long long per : {1LL, 3LL, 64LL, 500LL}) {
      const long long total = L * per + (L > 1 ? L / 2 : 0);
      const auto p = pyramid_budgets(L, total);
      const auto u = uniform_budgets(L, total);
      CHECK(std::accumulate(p.begin(), p.end(), 0LL) == total);
      CHECK(std::accumulate(u.begin(), u.end(), 0LL) == total);
      CHECK(std::is_sorted(p.rbegin(), p.rend()));  // non-increasing with depth
      for (long long v : p) CHECK(v >= 1);
    }
  // the reference's shape: beta 20 on B = 100 spans about 195 .. 5
  const auto p = pyramid_budgets(32, 3200);
  CHECK(p.front() > 180);
  CHECK(p.back() < 20);
  // clipped to the prompt's candidates, the decay flattens
  const auto c = pyramid_budgets(32, 3200, 150);
  CHECK(c.front() <= 150);
  CHECK(std::accumulate(c.begin(), c.end(), 0LL) == 3200);
  CHECK_THROWS_AS(pyramid_budgets(4, 3), kvevict::Error);
}

TEST_CASE("profiles round-trip and reject malformed, truncated or mismatched files", "[xkv]") {
  Profile p;
  p.window = 8;
  p.samples = 3;
  p.tokens = {120, 7, 33, 1};
  const Profile q = Profile::from_text(p.to_text());
  CHECK(q.tokens == p.tokens);
  CHECK(q.window == 8);
  CHECK(q.samples == 3);

  const std::string path = "kvevict_test_xkv_profile.txt";
  p.save(path);
  CHECK(Profile::load(path).tokens == p.tokens);

  const std::string good = p.to_text();
  auto bad = [&](std::string text, const char* why) {
    CHECK_THROWS_WITH(Profile::from_text(text), Catch::Contains(why));
  };
  bad("", "truncated");
  bad("hello 1\n", "expected 'kvevict-xkv-profile'");
  bad("kvevict-xkv-profile 2\nlayers 1\n", "version 2, expected 1");
  bad("kvevict-xkv-profile 1\nlayers x\n", "expected an integer");
  bad("kvevict-xkv-profile 1\nlayers 4\nwindow 8\nsamples 3\ntokens 1 2 3\nend\n",
      "3 budgets, expected 4");
  bad("kvevict-xkv-profile 1\nlayers 2\nwindow 8\nsamples 3\ntokens 1 -5\nend\n",
      "budget of layer 1 = -5, expected > 0");
  bad("kvevict-xkv-profile 1\nlayers 2\nwindow 8\nsamples 3\ntokens 1 0\nend\n",
      "budget of layer 1 = 0");
  bad("kvevict-xkv-profile 1\nlayers 2\nwindow 8\nsamples 3\ntokens 1 2 3\nend\n",
      "more than 2 budgets");
  bad("kvevict-xkv-profile 1\nlayers 2\nwindow 8\nsamples 3\ntokens 1 2x\nend\n",
      "'2x', expected an integer");
  bad(good.substr(0, good.size() - 4), "truncated");  // "end" missing
  bad(good + "tokens 5\n", "content after 'end'");
  // a file cut mid-way through the token list
  bad(good.substr(0, good.find("33")), "2 budgets, expected 4");

  std::FILE* f = std::fopen(path.c_str(), "w");
  std::fputs("kvevict-xkv-profile 1\nlayers 2\n", f);
  std::fclose(f);
  CHECK_THROWS_WITH(Profile::load(path), Catch::Contains("truncated") && Catch::Contains(path));
  std::remove(path.c_str());
  CHECK_THROWS_WITH(Profile::load("/nonexistent/dir/p.txt"), Catch::Contains("cannot open"));

  // mismatched with the model
  CHECK_THROWS_WITH(p.validate(Geometry{5, 2, 2, 4}), Catch::Contains("4 layers, expected 5"));
  CHECK_THROWS_WITH(CalibratedXkvPrefill<>(Geometry{5, 2, 2, 4}, p),
                    Catch::Contains("4 layers, expected 5"));
}

TEST_CASE("calibrator averages allocations, rounded, never below one", "[xkv]") {
  CHECK(Calibrator::samples_wanted(25) == 3);
  CHECK(Calibrator::samples_wanted(10) == 1);
  Calibrator c(3, 8);
  c.add(Allocation{{10, 1, 4}, 0.0});
  c.add(Allocation{{13, 1, 1}, 0.0});
  const Profile p = c.profile();
  CHECK(p.samples == 2);
  CHECK(p.tokens == std::vector<long long>{12, 1, 3});  // 11.5 -> 12, 2.5 -> 3 (llround)
  CHECK_THROWS_AS(c.add(Allocation{{1, 2}, 0.0}), kvevict::Error);
}

namespace {
struct LayerPrompt {
  std::vector<float> k, v, q;
};
std::vector<LayerPrompt> random_model_prompt(const Geometry& g, std::size_t T, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<LayerPrompt> out(static_cast<std::size_t>(g.n_layers));
  for (int l = 0; l < g.n_layers; ++l) {
    auto& p = out[static_cast<std::size_t>(l)];
    const float sharp = 0.5f + 0.5f * static_cast<float>(l);  // deeper layers attend sharper
    for (std::size_t i = 0; i < T * static_cast<std::size_t>(g.n_kv_heads * g.head_dim); ++i) {
      p.k.push_back(n(rng));
      p.v.push_back(n(rng));
    }
    for (std::size_t i = 0; i < T * static_cast<std::size_t>(g.n_heads * g.head_dim); ++i)
      p.q.push_back(sharp * n(rng));
  }
  return out;
}
}  // namespace

TEST_CASE("memory after compression equals the sum of the budgets; peak of both paths", "[xkv]") {
  const Geometry g{4, 8, 2, 16};
  const std::size_t T = 256, W = 8;
  const auto prompt = random_model_prompt(g, T, 5);
  const long long total = 4 * 40;

  DeferredXkvPrefill<> deferred(g);
  for (int l = 0; l < g.n_layers; ++l) {
    const auto& p = prompt[static_cast<std::size_t>(l)];
    deferred.add_layer(l, 0, T, p.k, p.v, p.q);
  }
  auto cache = deferred.finish(total);
  const Allocation& a = deferred.allocation();
  REQUIRE(a.total() == total);
  std::size_t rows = 0, allocated = 0;
  for (int l = 0; l < g.n_layers; ++l)
    for (int kh = 0; kh < g.n_kv_heads; ++kh) {
      const auto cap = static_cast<std::size_t>(a.tokens[static_cast<std::size_t>(l)]) + W;
      CHECK(cache.size(l, kh) == cap);
      CHECK(cache.allocated_rows(l, kh) == cap);
      rows += cache.size(l, kh);
      allocated += cache.allocated_rows(l, kh);
    }
  const std::size_t budget_rows =
      static_cast<std::size_t>(g.n_kv_heads) *
      static_cast<std::size_t>(total + g.n_layers * static_cast<long long>(W));
  CHECK(rows == budget_rows);
  CHECK(allocated == budget_rows);
  const std::size_t row_bytes =
      2 * 16 * sizeof(float) + sizeof(std::int64_t) + sizeof(std::uint64_t);
  CHECK(cache.allocated_bytes() == budget_rows * row_bytes);

  // deferred peak holds every layer's uncompressed K/V at once
  const std::size_t full_kv = static_cast<std::size_t>(g.n_layers) * T * 2 * 2 * 16 * sizeof(float);
  CHECK(deferred.peak_bytes() >= full_kv);

  // calibrated path with the same budgets: the same rows, a fraction of the peak
  Profile profile;
  profile.window = W;
  profile.tokens = a.tokens;
  CalibratedXkvPrefill<> calibrated(g, Profile::from_text(profile.to_text()));
  for (int l = 0; l < g.n_layers; ++l) {
    const auto& p = prompt[static_cast<std::size_t>(l)];
    calibrated.prefill_layer(l, 0, T, p.k, p.v, p.q);
  }
  for (int l = 0; l < g.n_layers; ++l)
    for (int kh = 0; kh < g.n_kv_heads; ++kh) {
      auto x = cache.positions(l, kh), y = calibrated.cache().positions(l, kh);
      std::vector<std::int64_t> xs(x.begin(), x.end()), ys(y.begin(), y.end());
      std::sort(xs.begin(), xs.end());
      std::sort(ys.begin(), ys.end());
      CHECK(xs == ys);
    }
  CHECK(calibrated.peak_bytes() ==
        calibrated.cache().allocated_bytes() + T * 2 * 2 * 16 * sizeof(float));
  CHECK(calibrated.peak_bytes() < deferred.peak_bytes() / 2);

  // target mode through the same path
  DeferredXkvPrefill<> by_target(g);
  for (int l = 0; l < g.n_layers; ++l) {
    const auto& p = prompt[static_cast<std::size_t>(l)];
    by_target.add_layer(l, 0, T, p.k, p.v, p.q);
  }
  auto c2 = by_target.finish_for_retention(0.8);
  CHECK(by_target.allocation().mean_retention >= 0.8);
  CHECK(c2.size(0, 0) == static_cast<std::size_t>(by_target.allocation().tokens[0]) + W);
}

TEST_CASE("observed statistics: the allocator scores layers as SnapKV does", "[xkv]") {
  // observe_layer and SnapKV's prefill scores come from the same computation: the sum of
  // a layer's scores over heads equals the allocator's total mass (R at full = 1).
  const Geometry g{1, 4, 2, 8};
  const std::size_t T = 64;
  const auto prompt = random_model_prompt(g, T, 8);
  XkvLayerAllocator a(g);
  a.observe_layer(0, T, prompt[0].k, prompt[0].q);
  CHECK(a.candidates(0) == static_cast<long long>(T - 8));
  CHECK(a.retention(0, a.candidates(0)) == Approx(1.0));
  CHECK(a.retention(0, 10) < a.retention(0, 20));
  CHECK_THROWS_AS(a.observe_layer(0, T, prompt[0].k, std::span<const float>(prompt[0].q).first(8)),
                  kvevict::Error);
}
