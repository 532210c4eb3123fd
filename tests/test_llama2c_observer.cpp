// The llama2c engine's optional attention observer (Transformer::set_attention_observer):
// it reports each layer's probabilities over the live rows, they sum to 1 and equal the
// softmax of the reported queries against the cached keys, and setting it changes nothing.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "../examples/llama2c/llama2c.hpp"
#include "kvevict/policies/full_cache.hpp"
#include "kvevict/policies/streaming_llm.hpp"

namespace {

using namespace kvevict;
using namespace kvevict::llama2c;

// A random version-0 checkpoint: dim 16, 4 heads over 2 KV heads (head dim 4), 2 layers.
std::shared_ptr<const Model> tiny_model(std::uint32_t seed) {
  const std::int32_t h[7] = {16, 24, 2, 4, 2, 32, 40};
  Config c;
  c.dim = h[0];
  c.hidden_dim = h[1];
  c.n_layers = h[2];
  c.n_heads = h[3];
  c.n_kv_heads = h[4];
  c.vocab_size = h[5];
  c.seq_len = h[6];
  std::vector<float> w(static_cast<std::size_t>(expected_floats(c)));
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0.0f, 0.5f);
  for (auto& x : w) x = n(rng);
  std::vector<char> bytes(sizeof h + w.size() * sizeof(float));
  std::memcpy(bytes.data(), h, sizeof h);
  std::memcpy(bytes.data() + sizeof h, w.data(), w.size() * sizeof(float));
  return std::make_shared<const Model>(Model::parse(std::move(bytes), "tiny"));
}

template <class Policy>
void check_observer(Transformer<Policy>& tf, int steps, std::size_t expect_rows_max) {
  const Config& c = tf.model().config();
  const int hd = c.head_dim(), G = c.n_heads / c.n_kv_heads;
  int calls = 0, expect_layer = 0;
  double worst_sum = 0.0, worst_prob = 0.0;
  tf.set_attention_observer([&](int layer, std::span<const float> q, const AttentionResult& att) {
    CHECK(layer == expect_layer);
    expect_layer = (expect_layer + 1) % c.n_layers;
    ++calls;
    REQUIRE(q.size() == static_cast<std::size_t>(c.n_heads * hd));
    REQUIRE(att.probs.size() == static_cast<std::size_t>(c.n_kv_heads));
    for (int kh = 0; kh < c.n_kv_heads; ++kh) {
      const auto& p = att.probs[static_cast<std::size_t>(kh)];
      const auto k = tf.cache().keys(layer, kh);
      REQUIRE(static_cast<std::size_t>(p.cols()) == tf.cache().positions(layer, kh).size());
      CHECK(static_cast<std::size_t>(p.cols()) <= expect_rows_max);
      for (int g = 0; g < G; ++g) {
        const float* qh = q.data() + static_cast<std::size_t>((kh * G + g) * hd);
        std::vector<double> s(static_cast<std::size_t>(k.rows()));
        double m = -1e300, z = 0.0;
        for (Eigen::Index r = 0; r < k.rows(); ++r) {
          double dot = 0.0;
          for (int i = 0; i < hd; ++i) dot += static_cast<double>(qh[i]) * k(r, i);
          s[static_cast<std::size_t>(r)] = dot / std::sqrt(static_cast<double>(hd));
          m = std::max(m, s[static_cast<std::size_t>(r)]);
        }
        for (double& x : s) z += x = std::exp(x - m);
        worst_sum = std::max(worst_sum, std::abs(p.row(g).sum() - 1.0));
        for (Eigen::Index r = 0; r < k.rows(); ++r)
          worst_prob = std::max(worst_prob, std::abs(p(g, r) - s[static_cast<std::size_t>(r)] / z));
      }
    }
  });
  std::mt19937 rng(5);
  for (int pos = 0; pos < steps; ++pos)
    tf.forward(static_cast<int>(rng() % static_cast<unsigned>(c.vocab_size)), pos);
  CHECK(calls == steps * c.n_layers);
  CHECK(worst_sum < 1e-5);
  CHECK(worst_prob < 1e-5);
}

}  // namespace

TEST_CASE("attention observer reports probabilities that sum to 1 and match q.k", "[llama2c]") {
  const auto model = tiny_model(11);
  SECTION("full cache: every position") {
    Transformer<policies::FullCache> tf(model, Budget::unbounded());
    check_observer(tf, 30, 30);
  }
  SECTION("evicting cache: only the live rows") {
    Transformer<policies::StreamingLLM> tf(model, Budget::uniform(8),
                                           policies::StreamingLLM{.sinks = 1});
    check_observer(tf, 30, 8);
  }
}

TEST_CASE("setting an attention observer leaves the logits unchanged", "[llama2c]") {
  const auto model = tiny_model(12);
  Transformer<policies::StreamingLLM> plain(model, Budget::uniform(6), policies::StreamingLLM{});
  Transformer<policies::StreamingLLM> seen(model, Budget::uniform(6), policies::StreamingLLM{});
  int calls = 0;
  seen.set_attention_observer(
      [&](int, std::span<const float>, const AttentionResult&) { ++calls; });
  bool same = true;
  for (int pos = 0; pos < 20; ++pos) {
    const auto a = plain.forward(pos % 32, pos);
    const std::vector<float> av(a.begin(), a.end());
    const auto b = seen.forward(pos % 32, pos);
    same = same && std::equal(av.begin(), av.end(), b.begin());
  }
  CHECK(same);
  CHECK(calls == 20 * 2);
}
