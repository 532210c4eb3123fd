#pragma once
// Writes a docs/traces.md trace (safetensors: layers.<l>.q [T, H, d], layers.<l>.k and
// layers.<l>.v [T, Hkv, d], post-RoPE, F32) of a token stream run through any model the
// engine reads, for the offline path: kvevict-eval --trace FILE.
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "../eval/safetensors.hpp"
#include "kvevict/policies/full_cache.hpp"
#include "llama2c.hpp"

namespace kvevict::llama2c {

/// Runs `tokens` through `model` with the full cache and writes the trace to `path`, with
/// metadata prompt_tokens = `prompt` (the first `prompt` tokens are prefilled on replay).
/// Memory: layers x T x (H + 2 Hkv) x head_dim floats.
inline void dump_trace(const std::shared_ptr<const Model>& model, std::span<const int> tokens,
                       std::size_t prompt, const std::string& path) {
  const Config& c = model->config();
  kvevict::detail::require(!tokens.empty() && prompt < tokens.size(), "dump_trace: prompt = ",
                           prompt, ", expected < ", tokens.size(), " tokens");
  const std::size_t T = tokens.size(), L = static_cast<std::size_t>(c.n_layers);
  const std::size_t H = static_cast<std::size_t>(c.n_heads),
                    K = static_cast<std::size_t>(c.n_kv_heads),
                    d = static_cast<std::size_t>(c.head_dim());
  std::vector<std::vector<float>> q(L, std::vector<float>(T * H * d));
  Transformer<policies::FullCache> tf(model, Budget::unbounded());
  std::size_t t = 0;
  tf.set_attention_observer([&](int layer, std::span<const float> queries, const AttentionResult&) {
    std::copy(queries.begin(), queries.end(), q[static_cast<std::size_t>(layer)].begin() +
                                                  static_cast<std::ptrdiff_t>(t * H * d));
  });
  for (; t < T; ++t) tf.forward(tokens[t], static_cast<int>(t));
  std::vector<eval::TensorToWrite> out;
  for (std::size_t l = 0; l < L; ++l) {
    std::vector<float> k(T * K * d), v(T * K * d);
    for (std::size_t h = 0; h < K; ++h) {
      const auto keys = tf.cache().keys(static_cast<int>(l), static_cast<int>(h));
      const auto vals = tf.cache().values(static_cast<int>(l), static_cast<int>(h));
      const auto pos = tf.cache().positions(static_cast<int>(l), static_cast<int>(h));
      for (std::size_t r = 0; r < pos.size(); ++r) {
        const auto p = static_cast<std::size_t>(pos[r]);
        std::copy_n(keys.data() + r * d, d, k.data() + (p * K + h) * d);
        std::copy_n(vals.data() + r * d, d, v.data() + (p * K + h) * d);
      }
    }
    const std::string pre = "layers." + std::to_string(l) + ".";
    out.push_back({pre + "q", eval::DType::f32, {T, H, d}, std::move(q[l])});
    out.push_back({pre + "k", eval::DType::f32, {T, K, d}, std::move(k)});
    out.push_back({pre + "v", eval::DType::f32, {T, K, d}, std::move(v)});
  }
  eval::write_safetensors(path, out, {{"prompt_tokens", std::to_string(prompt)}});
}

}  // namespace kvevict::llama2c
