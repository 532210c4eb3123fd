// llama2c_signature_count: how many of a model's keys change RecallDedup signature with the
// stop-41 definition (policies::detail::key_signature: IEEE roots of double sums of squares)
// against the one before it (std::hypot, squares in index order;
// tests/support/key_signature_before41.hpp). Streams sampled from the model (temperature 1,
// seeds 1..S) are run through the full cache; every stored (post-RoPE) key of every layer and
// KV head is signed both ways, at each RoPE layout and several steps.
//   llama2c_signature_count [MODEL_DIR] [STREAMS]
#include <cmath>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <kvevict/policies/common.hpp>
#include <kvevict/policies/full_cache.hpp>

#include "../../tests/support/key_signature_before41.hpp"
#include "llama2c.hpp"

using namespace kvevict;
using namespace kvevict::llama2c;
using policies::RopeLayout;

int main(int argc, char** argv) {
  const std::string dir = argc > 1 ? argv[1] : KVEVICT_LLAMA2C_DEFAULT_MODEL_DIR;
  const int streams = argc > 2 ? std::stoi(argv[2]) : 20;
  auto model = std::make_shared<const Model>(Model::load(dir + "/stories260K.bin"));
  const Config& c = model->config();
  const auto d = static_cast<std::size_t>(c.head_dim());
  const RopeLayout layouts[] = {RopeLayout::interleaved, RopeLayout::halves, RopeLayout::none};
  const float steps[] = {0.1f, 0.05f, 0.3f};
  std::size_t keys = 0, signed_ = 0, differ = 0;
  for (int s = 1; s <= streams; ++s) {
    Transformer<policies::FullCache> tf(model, Budget::unbounded());
    std::mt19937_64 rng(static_cast<std::uint64_t>(s));
    int token = c.bos_token;
    for (int pos = 0; pos < c.seq_len; ++pos) {
      const auto logits = tf.forward(token, pos);
      std::vector<double> p(logits.size());
      double mx = -INFINITY, sum = 0.0;
      for (float x : logits) mx = std::max(mx, static_cast<double>(x));
      for (std::size_t i = 0; i < p.size(); ++i) sum += p[i] = std::exp(static_cast<double>(logits[i]) - mx);
      std::discrete_distribution<int> pick(p.begin(), p.end());
      token = pick(rng);
    }
    for (int l = 0; l < c.n_layers; ++l)
      for (int h = 0; h < c.n_kv_heads; ++h) {
        const auto k = tf.cache().keys(l, h);
        const std::size_t rows = k.size() / d;
        keys += rows;
        for (std::size_t r = 0; r < rows; ++r)
          for (RopeLayout rope : layouts)
            for (float step : steps) {
              const float* x = k.data() + r * d;
              ++signed_;
              differ += policies::detail::key_signature(x, d, rope, step) !=
                        kvtest::key_signature_before41(x, d, rope, step);
            }
      }
  }
  std::printf("model %s: %d streams of %d tokens, %d layers x %d KV heads, head_dim %zu\n",
              dir.c_str(), streams, c.seq_len, c.n_layers, c.n_kv_heads, d);
  std::printf("keys %zu, signatures compared %zu (3 layouts x steps 0.1 0.05 0.3), changed %zu\n",
              keys, signed_, differ);
  return differ == 0 ? 0 : 1;
}
