// Synthetic workloads of kvevict-eval: determinism, shapes, and that each generator
// produces the attention pattern it documents (measured with the full softmax).
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <kvevict/attention_core.hpp>
#include <numeric>
#include <vector>

#include "workloads.hpp"

using namespace kvevict::eval;

namespace {

SyntheticConfig small() {
  SyntheticConfig c;
  c.layers = 1;
  c.n_heads = 8;
  c.n_kv_heads = 2;
  c.head_dim = 128;
  c.prompt = 128;
  c.steps = 384;
  return c;
}

// Full-cache probabilities of query head h at token t over tokens 0..t.
std::vector<float> probs(const Workload& w, int layer, std::size_t t, int h) {
  const auto& g = w.geometry;
  const int kh = h / g.group();
  const std::size_t d = static_cast<std::size_t>(g.head_dim);
  std::vector<float> keys((t + 1) * d);
  for (std::size_t s = 0; s <= t; ++s)
    std::copy_n(w.k(layer, s) + static_cast<std::size_t>(kh) * d, d,
                keys.begin() + static_cast<std::ptrdiff_t>(s * d));
  std::vector<float> p(t + 1);
  kvevict::detail::group_probabilities(
      keys.data(), t + 1, d, w.q(layer, t) + static_cast<std::size_t>(h) * d, 1, p.data());
  return p;
}

// Mean attention paid to token index `i` by the queries of the last 64 tokens.
template <class F>
double mean_mass(const Workload& w, F&& select) {
  double m = 0.0;
  int n = 0;
  for (std::size_t t = w.tokens - 64; t < w.tokens; t += 4)
    for (int h = 0; h < w.geometry.n_heads; ++h) {
      const auto p = probs(w, 0, t, h);
      for (std::size_t i = 0; i < p.size(); ++i)
        if (select(i, t)) m += p[i];
      ++n;
    }
  return m / n;
}

}  // namespace

TEST_CASE("synthetic workloads are deterministic in their seed, with Llama-like defaults") {
  const SyntheticConfig def;
  CHECK(def.head_dim == 128);
  CHECK(def.n_kv_heads == 8);
  CHECK(def.n_heads / def.n_kv_heads == 4);
  auto c = small();
  const auto a = make_synthetic("mixed", c);
  const auto b = make_synthetic("mixed", c);
  CHECK(a.layers[0].k == b.layers[0].k);
  CHECK(a.layers[0].q == b.layers[0].q);
  c.seed = 2;
  const auto other = make_synthetic("mixed", c);
  CHECK(a.layers[0].k != other.layers[0].k);
  CHECK(a.tokens == c.prompt + c.steps);
  CHECK(a.layers[0].q.size() == a.tokens * 8 * 128);
  CHECK(a.layers[0].v.size() == a.tokens * 2 * 128);
  for (const auto& name : synthetic_workload_names()) CHECK_NOTHROW(make_synthetic(name, c));
}

TEST_CASE("bad synthetic parameters are rejected with a clear message") {
  auto c = small();
  CHECK_THROWS_WITH(make_synthetic("nope", c),
                    Catch::Contains("unknown synthetic workload 'nope'"));
  c.head_dim = 40;
  CHECK_THROWS_WITH(make_synthetic("mixed", c), Catch::Contains("head_dim = 40"));
  c = small();
  c.prompt = 4;
  CHECK_THROWS_WITH(make_synthetic("mixed", c), Catch::Contains("prompt = 4"));
  c = small();
  c.n_heads = 6;
  c.n_kv_heads = 4;
  CHECK_THROWS_AS(make_synthetic("mixed", c), kvevict::Error);
}

TEST_CASE("sinks: token 0 draws far more attention than an average token") {
  const auto w = make_synthetic("sinks", small());
  const double sink = mean_mass(w, [](std::size_t i, std::size_t) { return i == 0; });
  const double rest = mean_mass(w, [](std::size_t i, std::size_t) { return i >= 4; });
  const double per_token = rest / static_cast<double>(w.tokens - 32);
  CHECK(sink > 0.2);
  CHECK(sink > 50 * per_token);
}

TEST_CASE("recency: the last few tokens draw more attention than far ones") {
  const auto w = make_synthetic("recency", small());
  const double near = mean_mass(w, [](std::size_t i, std::size_t t) { return i + 4 > t; }) / 4;
  const double far =
      mean_mass(w, [](std::size_t i, std::size_t t) { return i >= 4 && i + 256 < t; }) /
      static_cast<double>(w.tokens - 64 - 256);
  CHECK(near > 10 * far);
  // Without the recency component, near and far tokens are alike.
  const auto s = make_synthetic("sinks", small());
  const double near_s = mean_mass(s, [](std::size_t i, std::size_t t) { return i + 4 > t; }) / 4;
  const double far_s =
      mean_mass(s, [](std::size_t i, std::size_t t) { return i >= 4 && i + 256 < t; }) /
      static_cast<double>(s.tokens - 64 - 256);
  CHECK(near_s < 3 * far_s);
}

TEST_CASE("heavy: a few tokens hold much of the attention, for every late query") {
  auto top_share = [](const Workload& w) {
    // Accumulated attention per token over late queries; share of the top 2%.
    std::vector<double> acc(w.tokens, 0.0);
    for (std::size_t t = w.tokens - 64; t < w.tokens; t += 4)
      for (int h = 0; h < w.geometry.n_heads; ++h) {
        const auto p = probs(w, 0, t, h);
        for (std::size_t i = 4; i < p.size(); ++i) acc[i] += p[i];
      }
    const double total = std::accumulate(acc.begin(), acc.end(), 0.0);
    std::sort(acc.begin(), acc.end(), std::greater<>());
    return std::accumulate(acc.begin(), acc.begin() + static_cast<std::ptrdiff_t>(w.tokens / 50),
                           0.0) /
           total;
  };
  const double heavy = top_share(make_synthetic("heavy", small()));
  const double plain = top_share(make_synthetic("sinks", small()));
  INFO("top-2% share: heavy " << heavy << ", without heavy hitters " << plain);
  CHECK(heavy > 0.2);
  CHECK(heavy > 3 * plain);
}

TEST_CASE("needle: planted in the prompt, probed late, and the probe's attention peaks on it") {
  const auto c = small();
  const auto w = make_synthetic("needle", c);
  REQUIRE(w.needles.size() == static_cast<std::size_t>(c.n_kv_heads * c.needles_per_head));
  for (const auto& n : w.needles) {
    CHECK(n.needle >= 4);
    CHECK(n.needle < c.prompt);
    CHECK(n.probe >= w.tokens - c.steps / 4);
    std::vector<double> sum(n.probe + 1, 0.0);
    for (int g = 0; g < w.geometry.group(); ++g) {
      const auto p = probs(w, n.layer, n.probe, n.kv_head * w.geometry.group() + g);
      for (std::size_t i = 0; i < p.size(); ++i) sum[i] += p[i];
    }
    CHECK(static_cast<std::size_t>(std::max_element(sum.begin(), sum.end()) - sum.begin()) ==
          n.needle);
    // Before its probe, the needle is an ordinary token for a query that does not ask.
    const auto before = probs(w, n.layer, n.probe - 1, n.kv_head * w.geometry.group());
    CHECK(before[n.needle] < 0.05);
  }
  // Needles only where documented: the "mixed" workload's retrieval heads (role 2 of 4).
  const auto m = make_synthetic("mixed", c);
  for (const auto& n : m.needles) CHECK((n.layer * c.n_kv_heads + n.kv_head) % 4 == 2);
  CHECK(make_synthetic("heavy", c).needles.empty());
}

TEST_CASE("drift: keys of nearby tokens share a topic, far ones mostly do not") {
  auto adjacency = [](const Workload& w, std::size_t lag) {
    const std::size_t d = static_cast<std::size_t>(w.geometry.head_dim), lo = d / 16 + d / 4;
    double s = 0.0;
    int n = 0;
    for (std::size_t t = 8; t + lag < w.tokens; t += 3) {
      const float* a = w.k(0, t);
      const float* b = w.k(0, t + lag);
      double dot = 0.0;
      for (std::size_t i = lo; i < d; ++i) dot += double(a[i]) * b[i];
      s += dot;
      ++n;
    }
    return s / n;
  };
  const auto w = make_synthetic("drift", small());
  CHECK(adjacency(w, 1) > 3.0 * std::max(adjacency(w, 200), 1.0));
  const auto s = make_synthetic("sinks", small());
  CHECK(std::abs(adjacency(s, 1)) < 5.0);
}
