// Reference attention (attend) against a naive triple loop in double precision: GQA with
// G = 1, 4, 8 and head dims 64 and 128; the probabilities a policy receives are the ones
// the naive loop computes; options, empty heads, evicted caches and double storage.
#include <catch2/catch.hpp>

#include "support/test_support.hpp"

using namespace kvevict;
using kvtest::Rng;

namespace {

/// Records every AttentionView it is handed (a policy that asks for attention).
struct AttentionSpy {
  static constexpr Signals signals = Signals::attention;
  static constexpr const char* name() { return "AttentionSpy"; }
  std::size_t min_capacity() const { return 1; }
  void bind(const CacheShape&) {}
  template <class S>
  void choose_victims(const HeadView<S>& v, std::vector<std::uint32_t>& out) {
    for (std::size_t i = 0; i < v.need; ++i) out.push_back(static_cast<std::uint32_t>(i));
  }
  template <class S>
  void on_append(const HeadView<S>&, std::size_t) {}
  void on_move(int, int, std::size_t, std::size_t) {}
  void observe(const AttentionView& a) {
    seen.push_back(
        {a.layer, a.kv_head, a.group, std::vector<float>(a.probs, a.probs + a.group * a.size)});
  }
  struct Seen {
    int layer, kv_head, group;
    std::vector<float> probs;
  };
  std::vector<Seen> seen;
};
static_assert(EvictionPolicy<AttentionSpy>);

/// Naive attention of one step: out[h][j] = sum_i p[h][i] v[i][j], with query head h
/// reading KV head h / G. Plain loops over heads, rows and dims, in double.
struct Naive {
  std::vector<std::vector<double>> probs;  // per query head, over the KV head's rows
  std::vector<std::vector<double>> out;    // per query head, d
};

template <class Cache>
Naive naive_attention(const Cache& cache, int layer, const std::vector<float>& q, double scale) {
  const auto& g = cache.geometry();
  const int d = g.head_dim, G = g.group();
  Naive n;
  for (int h = 0; h < g.n_heads; ++h) {
    const int kh = h / G;
    const auto k = cache.keys(layer, kh);
    const auto v = cache.values(layer, kh);
    const auto rows = static_cast<int>(k.rows());
    std::vector<double> s(static_cast<std::size_t>(rows));
    double m = -INFINITY;
    for (int i = 0; i < rows; ++i) {
      double dot = 0;
      for (int j = 0; j < d; ++j) dot += double(q[std::size_t(h * d + j)]) * double(k(i, j));
      s[std::size_t(i)] = dot * scale;
      m = std::max(m, s[std::size_t(i)]);
    }
    double z = 0;
    for (auto& x : s) z += (x = std::exp(x - m));
    for (auto& x : s) x /= z;
    std::vector<double> o(std::size_t(d), 0.0);
    for (int i = 0; i < rows; ++i)
      for (int j = 0; j < d; ++j) o[std::size_t(j)] += s[std::size_t(i)] * double(v(i, j));
    n.probs.push_back(std::move(s));
    n.out.push_back(std::move(o));
  }
  return n;
}

/// Largest |a - b| over the step's output and probabilities.
template <class Result>
std::pair<double, double> max_errors(const Result& r, const Naive& n, int G) {
  double eo = 0, ep = 0;
  for (std::size_t h = 0; h < n.out.size(); ++h) {
    for (std::size_t j = 0; j < n.out[h].size(); ++j)
      eo = std::max(eo, std::abs(double(r.out(Eigen::Index(h), Eigen::Index(j))) - n.out[h][j]));
    const auto& p = r.probs[h / std::size_t(G)];
    for (std::size_t i = 0; i < n.probs[h].size(); ++i)
      ep = std::max(ep, std::abs(double(p(Eigen::Index(h % std::size_t(G)), Eigen::Index(i))) -
                                 n.probs[h][i]));
  }
  return {eo, ep};
}

}  // namespace

TEST_CASE("attend matches a naive loop for GQA G = 1, 4, 8 and head dims 64, 128", "[attention]") {
  for (const int G : {1, 4, 8})
    for (const int d : {64, 128}) {
      INFO("G " << G << " d " << d);
      const int hkv = 2;
      const Geometry g{2, G * hkv, hkv, d};
      KVCache<AttentionSpy> cache(g, Budget::unbounded());
      Rng rng(std::uint64_t(G * 1000 + d));
      const std::size_t kv = std::size_t(hkv * d), qn = std::size_t(G * hkv * d);
      for (int t = 0; t < 40; ++t) {
        cache.append(0, t, rng.normals(kv), rng.normals(kv));
        cache.append(1, t, rng.normals(kv), rng.normals(kv));
      }
      const auto q = rng.normals(qn, 1.5f);
      const auto r = attend(cache, 1, q);
      REQUIRE(r.out.rows() == g.n_heads);
      REQUIRE(r.out.cols() == d);
      REQUIRE(r.probs.size() == std::size_t(hkv));
      const auto n = naive_attention(cache, 1, q, 1.0 / std::sqrt(double(d)));
      const auto [eo, ep] = max_errors(r, n, G);
      CHECK(eo < 1e-5);
      CHECK(ep < 1e-6);

      // The policy receives exactly these probabilities, one view per KV head, in row order.
      const auto& seen = cache.policy().seen;
      REQUIRE(seen.size() == std::size_t(hkv));
      for (int kh = 0; kh < hkv; ++kh) {
        const auto& s = seen[std::size_t(kh)];
        REQUIRE(s.layer == 1);
        REQUIRE(s.kv_head == kh);
        REQUIRE(s.group == G);
        REQUIRE(s.probs.size() == std::size_t(G * 40));
        double worst = 0;
        for (int gq = 0; gq < G; ++gq)
          for (int i = 0; i < 40; ++i) {
            const float got = s.probs[std::size_t(gq * 40 + i)];
            REQUIRE(got == r.probs[std::size_t(kh)](gq, i));
            worst = std::max(
                worst, std::abs(double(got) - n.probs[std::size_t(kh * G + gq)][std::size_t(i)]));
          }
        CHECK(worst < 1e-6);
        for (int gq = 0; gq < G; ++gq)
          CHECK(r.probs[std::size_t(kh)].row(gq).sum() == Approx(1.0f).margin(1e-5));
      }
    }
}

TEST_CASE("attend honours a custom scale and observe = false", "[attention]") {
  const Geometry g{1, 4, 2, 16};
  KVCache<AttentionSpy> cache(g, Budget::unbounded());
  Rng rng(9);
  for (int t = 0; t < 12; ++t) cache.append(0, t, rng.normals(32), rng.normals(32));
  const auto q = rng.normals(64);
  const auto r = attend(cache, 0, q, AttendOptions{false, 0.3f});
  REQUIRE(cache.policy().seen.empty());
  const auto [eo, ep] = max_errors(r, naive_attention(cache, 0, q, 0.3), 2);
  CHECK(eo < 1e-5);
  CHECK(ep < 1e-6);
}

TEST_CASE("attend over an empty layer yields zeros and observes nothing", "[attention]") {
  const Geometry g{2, 4, 2, 8};
  KVCache<AttentionSpy> cache(g, Budget::unbounded());
  cache.append(0, 0, std::vector<float>(16, 1.0f), std::vector<float>(16, 1.0f));
  const auto r = attend(cache, 1, std::vector<float>(32, 1.0f));
  REQUIRE(r.out.isZero());
  REQUIRE(r.probs[0].cols() == 0);
  REQUIRE(cache.policy().seen.empty());
}

TEST_CASE("attend after evictions reads only the kept rows", "[attention]") {
  const Geometry g{1, 8, 2, 64};
  KVCache<policies::H2O> cache(g, Budget::uniform(24), policies::H2O({4, 2}));
  Rng rng(10);
  std::vector<float> q;
  for (int t = 0; t < 100; ++t) {
    cache.append(0, t, rng.normals(128), rng.normals(128));
    q = rng.normals(512);
    const auto r = attend(cache, 0, q);
    if (t % 17 == 0) {
      const auto [eo, ep] = max_errors(r, naive_attention(cache, 0, q, 1.0 / 8.0), 4);
      CHECK(eo < 1e-5);
      CHECK(ep < 1e-6);
    }
  }
  REQUIRE(cache.size(0, 0) == 24);
}

TEST_CASE("H2O's scores are the naive group-summed attention, accumulated", "[attention]") {
  // Unbounded, so every row stays and its score is the sum over all steps it lived.
  const Geometry g{1, 4, 1, 64};
  KVCache<policies::H2O> cache(g, Budget::unbounded(), policies::H2O({4, 0}));
  Rng rng(11);
  std::vector<double> expect;
  for (int t = 0; t < 30; ++t) {
    cache.append(0, t, rng.normals(64), rng.normals(64));
    expect.push_back(0.0);
    const auto q = rng.normals(256);
    attend(cache, 0, q);
    const auto n = naive_attention(cache, 0, q, 1.0 / 8.0);
    for (std::size_t i = 0; i < expect.size(); ++i)
      for (int h = 0; h < 4; ++h) expect[i] += n.probs[std::size_t(h)][i];
  }
  const auto& sc = cache.policy().scores(0, 0);
  for (std::size_t i = 0; i < expect.size(); ++i) CHECK(sc[i] == Approx(expect[i]).epsilon(1e-5));
}

TEST_CASE("Prefill hands policies the causal attention of every prompt token", "[attention]") {
  const int G = 4, d = 64, T = 20;
  const Geometry g{1, G, 1, d};
  KVCache<policies::H2O> cache(g, Budget::unbounded(), policies::H2O({4, 0}));
  Rng rng(12);
  const auto k = rng.normals(std::size_t(T * d)), v = rng.normals(std::size_t(T * d));
  const auto q = rng.normals(std::size_t(T * G * d));
  cache.prefill(0, 0, std::size_t(T), k, v, q);
  std::vector<double> expect(std::size_t(T), 0.0);
  for (int t = 0; t < T; ++t) {
    const auto p = kvtest::naive_probs(k.data(), std::size_t(t + 1), std::size_t(d),
                                       q.data() + std::size_t(t * G * d), G, 1.0 / 8.0);
    for (int gq = 0; gq < G; ++gq)
      for (int i = 0; i <= t; ++i) expect[std::size_t(i)] += p[std::size_t(gq)][std::size_t(i)];
  }
  const auto& sc = cache.policy().scores(0, 0);
  for (int i = 0; i < T; ++i)
    CHECK(sc[std::size_t(i)] == Approx(expect[std::size_t(i)]).epsilon(1e-5));
}

TEST_CASE("attend over double storage matches the naive loop", "[attention]") {
  const Geometry g{1, 8, 1, 128};
  KVCache<policies::FullCache, double> cache(g, Budget::unbounded());
  Rng rng(13);
  for (int t = 0; t < 25; ++t) cache.append(0, t, rng.normals(128), rng.normals(128));
  const auto q = rng.normals(1024);
  const auto r = attend(cache, 0, q);
  const auto [eo, ep] = max_errors(r, naive_attention(cache, 0, q, 1.0 / std::sqrt(128.0)), 8);
  CHECK(eo < 1e-5);
  CHECK(ep < 1e-6);
}

TEST_CASE("Softmax stays finite for large logits", "[attention]") {
  const Geometry g{1, 1, 1, 4};
  KVCache<policies::FullCache> cache(g, Budget::unbounded());
  cache.append(0, 0, std::vector<float>{1000, 0, 0, 0}, std::vector<float>{1, 0, 0, 0});
  cache.append(0, 1, std::vector<float>{999, 0, 0, 0}, std::vector<float>{0, 1, 0, 0});
  const auto r = attend(cache, 0, std::vector<float>{2, 0, 0, 0});
  // Logits 1000 and 999 after the 1/2 scale: p = 1 / (1 + e^-1), no overflow.
  const double p0 = 1.0 / (1.0 + std::exp(-1.0));
  CHECK(r.probs[0](0, 0) == Approx(p0).margin(1e-6));
  CHECK(r.out(0, 0) == Approx(p0).margin(1e-6));
  CHECK(r.out(0, 1) == Approx(1 - p0).margin(1e-6));
}
