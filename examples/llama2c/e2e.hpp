#pragma once
// The end-to-end streaming protocol (StreamingLLM's perplexity protocol; llama.cpp's
// --kl-divergence reports the same figures): sample a token stream with the full cache,
// then feed it one token at a time under a policy and budget and compare, position by
// position, the policy's next-token distribution with the full cache's.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "kvevict/metrics.hpp"
#include "kvevict/policies/expected_attention.hpp"
#include "kvevict/policies/full_cache.hpp"
#include "kvevict/policies/xkv.hpp"
#include "llama2c.hpp"

namespace kvevict::llama2c {

/// The model's RoPE layout as policies that un-rotate queries (ExpectedAttention) name it.
inline policies::RopeLayout rope_layout(const Config& c) {
  return c.rope == RopeStyle::half ? policies::RopeLayout::halves
                                   : policies::RopeLayout::interleaved;
}

/// `e` with the model's RoPE layout and base (rope_theta). A llama2.c model's are
/// ExpectedAttention's defaults (interleaved, 10000): the policy comes back unchanged.
/// rope_scaling is not modelled (the policy averages the unscaled rotation).
inline policies::ExpectedAttention with_model_rope(const policies::ExpectedAttention& e,
                                                   const Config& c) {
  auto k = e.config();
  k.rope = rope_layout(c);
  k.rope_base = static_cast<float>(c.rope_theta);
  return policies::ExpectedAttention(k);
}

/// Sets a policy registry's knobs (examples/common/policy_registry.hpp: `rope`,
/// `rope_base`) to the model's RoPE, as with_model_rope does for one policy.
template <class Knobs>
void set_model_rope(Knobs& k, const Config& c) {
  k.rope = rope_layout(c);
  k.rope_base = static_cast<float>(c.rope_theta);
}

/// A token stream and the full cache's logits after each of its tokens:
/// full_logits[t * vocab .. +vocab) predicts tokens[t + 1].
/// Compact form (SampleOptions::keep_logits = false): full_logits is empty and
/// full_hidden holds the full cache's final hidden state per token (dim floats instead of
/// vocab: 32x less for a 128K vocabulary at dim 4096); logits(t) recomputes them through
/// the model's classifier, the same product as the forward pass, bit-identical.
struct Stream {
  std::vector<int> tokens;
  std::vector<float> full_logits;
  int vocab = 0;
  std::vector<float> full_hidden;      ///< compact: tokens x dim
  std::shared_ptr<const Model> model;  ///< compact: whose classifier recomputes the logits

  [[nodiscard]] std::size_t size() const { return tokens.size(); }
  [[nodiscard]] bool compact() const { return full_logits.empty() && model != nullptr; }
  /// The full cache's logits after token t; in the compact form the span is valid until
  /// the next call on this stream.
  [[nodiscard]] std::span<const float> logits(std::size_t t) const {
    if (!compact())
      return {full_logits.data() + t * static_cast<std::size_t>(vocab),
              static_cast<std::size_t>(vocab)};
    const auto dim = static_cast<std::size_t>(model->config().dim);
    hidden_ = Eigen::Map<const Eigen::VectorXf>(full_hidden.data() + t * dim,
                                                static_cast<Eigen::Index>(dim));
    model->classify(logits_, hidden_, scratch_);
    return {logits_.data(), static_cast<std::size_t>(logits_.size())};
  }
  /// Floats the stream holds per token for the comparison (vocab, or dim when compact).
  [[nodiscard]] std::size_t floats_per_token() const {
    return compact() ? static_cast<std::size_t>(model->config().dim)
                     : static_cast<std::size_t>(vocab);
  }

 private:
  mutable Eigen::VectorXf hidden_, logits_;
  mutable std::vector<float> scratch_;
};

struct SampleOptions {
  int tokens = 512;          ///< stream length T, including the first token
  float temperature = 1.0f;  ///< 0 = greedy
  std::uint64_t seed = 0;
  int first_token = -1;  ///< -1: the model's bos_token (llama2.c: Tokenizer::kBos = 1)
  float top_p = 1.0f;  ///< nucleus sampling as llama2.c's run.c (1 = off)
  /// false: the stream keeps the final hidden states instead of the logits (Stream's
  /// compact form: dim instead of vocab floats per token; logits recomputed on use).
  bool keep_logits = true;
};

namespace detail {
// Uniform in [0, 1) from 53 random bits: the same draw on every platform, unlike
// std::uniform_real_distribution.
inline double uniform01(std::mt19937_64& rng) {
  return static_cast<double>(rng() >> 11) * (1.0 / 9007199254740992.0);
}

// A progress bar on stderr for long streams (T > 512) when stderr is a terminal:
// "\r[#####.....] <what> t/T tokens", every 64 tokens, cleared at the end. Nothing for
// short streams or redirected stderr.
inline void progress(const char* what, std::size_t t, std::size_t T) {
  static const bool tty = ::isatty(2) == 1;
  if (!tty || T <= 512) return;
  if (t + 1 == T) {
    fmt::print(stderr, "\r{:<100}\r", "");
  } else if (t % 64 == 0) {
    constexpr std::size_t kWidth = 20;
    const std::size_t fill = t * kWidth / T;
    fmt::print(stderr, "\r[{}{}] {:.60} {}/{} tokens", std::string(fill, '#'),
               std::string(kWidth - fill, '.'), what, t, T);
  }
}

inline int sample(std::span<const float> logits, float temperature, std::mt19937_64& rng,
                  float top_p = 1.0f) {
  if (temperature == 0.0f) return static_cast<int>(metrics::argmax(logits));
  double m = -std::numeric_limits<double>::infinity();
  for (float x : logits) m = std::max(m, static_cast<double>(x) / temperature);
  std::vector<double> p(logits.size());
  double s = 0.0;
  for (std::size_t i = 0; i < p.size(); ++i) s += p[i] = std::exp(logits[i] / temperature - m);
  std::vector<std::uint32_t> order(p.size());
  for (std::size_t i = 0; i < p.size(); ++i) order[i] = static_cast<std::uint32_t>(i);
  std::size_t n = p.size();
  if (top_p > 0.0f && top_p < 1.0f) {
    // The smallest set of most likely tokens whose mass exceeds top_p (ties: lower id).
    std::sort(order.begin(), order.end(), [&](std::uint32_t a, std::uint32_t b) {
      return p[a] > p[b] || (p[a] == p[b] && a < b);
    });
    double c = 0.0;
    for (n = 0; n < order.size();) {
      c += p[order[n++]];
      if (c > top_p * s) break;
    }
    s = c;
  }
  const double u = uniform01(rng) * s;
  double c = 0.0;
  for (std::size_t i = 0; i < n; ++i) {
    c += p[order[i]];
    if (u < c) return static_cast<int>(order[i]);
  }
  return static_cast<int>(order[n - 1]);  // rounding: u landed on the sum itself
}
}  // namespace detail

/// Whether `streams` streams of `tokens` tokens may keep their full logits (tokens x vocab
/// floats each) within `bytes`; above it the tools sample compact streams (Stream).
inline bool logits_fit(const Config& c, std::size_t tokens, std::size_t streams,
                       double bytes = 256.0 * 1024 * 1024) {
  return static_cast<double>(tokens) * static_cast<double>(streams) *
             static_cast<double>(c.vocab_size) * sizeof(float) <= bytes;
}

/// Samples a stream with the full cache (every token is fed, BOS included; nothing stops
/// the stream at an end-of-story token, so it may hold several stories).
inline Stream sample_stream(const std::shared_ptr<const Model>& model, const SampleOptions& o) {
  const Config& c = model->config();
  kvevict::detail::require(o.tokens >= 1 && o.tokens <= c.seq_len,
                           "sample_stream: tokens = ", o.tokens,
                           ", expected 1..seq_len = ", c.seq_len);
  kvevict::detail::require(std::isfinite(o.temperature) && o.temperature >= 0.0f,
                           "sample_stream: temperature = ", o.temperature, ", expected >= 0");
  kvevict::detail::require(o.top_p > 0.0f && o.top_p <= 1.0f, "sample_stream: top_p = ", o.top_p,
                           ", expected in (0, 1]");
  Transformer<policies::FullCache> full(model, Budget::unbounded());
  std::mt19937_64 rng(o.seed);
  Stream s;
  s.vocab = c.vocab_size;
  if (!o.keep_logits) s.model = model;
  s.tokens.push_back(o.first_token >= 0 ? o.first_token : c.bos_token);
  for (int t = 0; t < o.tokens; ++t) {
    detail::progress("sampling with the full cache:", static_cast<std::size_t>(t),
                     static_cast<std::size_t>(o.tokens));
    const auto logits = full.forward(s.tokens.back(), t);
    if (o.keep_logits) {
      s.full_logits.insert(s.full_logits.end(), logits.begin(), logits.end());
    } else {
      const auto h = full.final_hidden();
      s.full_hidden.insert(s.full_hidden.end(), h.begin(), h.end());
    }
    if (t + 1 < o.tokens) s.tokens.push_back(detail::sample(logits, o.temperature, rng, o.top_p));
  }
  return s;
}

/// The full cache's logits for a given token stream (a prompt, a dataset excerpt).
inline Stream reference_stream(const std::shared_ptr<const Model>& model,
                               std::span<const int> tokens) {
  const Config& c = model->config();
  kvevict::detail::require(!tokens.empty() && tokens.size() <= static_cast<std::size_t>(c.seq_len),
                           "reference_stream: ", tokens.size(),
                           " tokens, expected 1..seq_len = ", c.seq_len);
  Transformer<policies::FullCache> full(model, Budget::unbounded());
  Stream s;
  s.vocab = c.vocab_size;
  s.tokens.assign(tokens.begin(), tokens.end());
  for (std::size_t t = 0; t < tokens.size(); ++t) {
    const auto logits = full.forward(tokens[t], static_cast<int>(t));
    s.full_logits.insert(s.full_logits.end(), logits.begin(), logits.end());
  }
  return s;
}

struct ProtocolOptions {
  /// Leading positions left out of the means. Position 0 attends only to itself, so its
  /// KL is 0 under any policy; the figures in docs/engine.md count every position (0).
  std::size_t skip = 0;
  /// The stream's first `prefill` tokens are a prompt fed through
  /// Transformer::forward_block in blocks of `prefill_block` tokens (the prefill path: each
  /// block's projections and MLP are one matrix product, weights read once per block);
  /// the rest token by token. Attention and eviction still run per token in order, so the
  /// cache never holds more than the budget, and every position's figures equal the
  /// token-by-token ones up to float rounding (tests/e2e_prefill_test: KL within 1e-4).
  /// Every position is still scored, prompt included (the block's logits, held for one
  /// block: prefill_block x vocab floats). 0 = token by token throughout.
  std::size_t prefill = 0;
  std::size_t prefill_block = 64;
  /// With prefill: each block attends at full attention (held rows + the block) and goes to
  /// the cache in one prefill, the policy's prompt selection (Transformer::set_prefill_select).
  bool prefill_select = false;
  /// With prefill_select and a SnapKV cache: XKV budgets from the chunks
  /// (policies::ChunkedXkvPrefill) sharing this many selected tokens per KV head over the
  /// layers (windows excluded; the cache's own budget is replaced). 0: off.
  long long xkv_chunked_total = 0;
  /// A Mixed<Hot, Cold> cache (kvevict/mixed.hpp): rows per head in the hot band
  /// (KVCache::set_hot_rows); ignored by other storage types.
  std::size_t hot_rows = 0;
};

/// Per-position figures of one stream under one policy, and their means over the
/// counted positions [skip, T).
struct StreamResult {
  std::vector<double> kl;          ///< KL(full || policy) of the next-token distribution
  std::vector<std::uint8_t> top1;  ///< 1 when both put the same token first
  std::vector<double> nll;         ///< -log p_policy(tokens[t + 1]), t < T - 1
  std::vector<double> nll_full;    ///< the same under the full cache
  std::size_t skip = 0;

  [[nodiscard]] std::size_t counted() const { return kl.size() > skip ? kl.size() - skip : 0; }
};

/// Feeds `stream` one token at a time into a Transformer<Policy, Scalar> with `budget` and
/// compares with the stream's full-cache logits. Policy is copied per call, so one
/// configured instance serves many streams. (Oracle and FullCache take
/// Budget::unbounded(); the Oracle's row count is its own `rows`.) Scalar is the cache's
/// storage type (float, Eigen::half, a quantized format such as Q8<8>): the stream's
/// reference logits stay those of the float full cache it was sampled with.
template <class Policy, class Scalar = float>
StreamResult run_stream(const std::shared_ptr<const Model>& model, const Stream& stream,
                        const Budget& budget, Policy policy = Policy{},
                        const ProtocolOptions& options = {}) {
  kvevict::detail::require(stream.vocab == model->config().vocab_size, "run_stream: stream vocab ",
                           stream.vocab, ", expected the model's ", model->config().vocab_size);
  kvevict::detail::require(
      (stream.compact() ? stream.full_hidden.size() : stream.full_logits.size()) ==
          stream.size() * stream.floats_per_token(),
      "run_stream: stream has ",
      stream.compact() ? stream.full_hidden.size() : stream.full_logits.size(), " full ",
      stream.compact() ? "hidden floats, expected tokens x dim = "
                       : "logits, expected tokens x vocab = ",
      stream.size() * stream.floats_per_token());
  kvevict::detail::require(!stream.compact() || stream.model == model,
                           "run_stream: a compact stream recomputes logits with its own model, "
                           "expected the same model as the run");
  kvevict::detail::require(options.prefill == 0 || options.prefill_block > 0,
                           "run_stream: prefill = ", options.prefill,
                           " tokens with prefill_block = 0, expected a block of >= 1 token");
  Transformer<Policy, Scalar> tf(model, budget, std::move(policy));
  if constexpr (requires { tf.cache().set_hot_rows(options.hot_rows); })
    tf.cache().set_hot_rows(options.hot_rows);
  if (options.prefill_select) tf.set_prefill_select(true);
  constexpr bool kSnapKV = std::is_same_v<Policy, policies::SnapKV> && std::is_same_v<Scalar, float>;
  using Xkv = std::conditional_t<kSnapKV, policies::ChunkedXkvPrefill<typename Transformer<Policy, Scalar>::Cache>, int>;
  std::optional<Xkv> xkv;
  if (options.xkv_chunked_total > 0) {
    if constexpr (kSnapKV) {
      kvevict::detail::require(options.prefill_select, "run_stream: xkv_chunked_total needs prefill_select");
      xkv.emplace(tf.cache(), options.xkv_chunked_total, policies::XkvLayerAllocator::Config{});
      tf.set_prefill_sink([&](int l, std::int64_t p0, std::size_t n, std::span<const float> k,
                              std::span<const float> v, std::span<const float> q) { xkv->add_layer(l, p0, n, k, v, q); });
    } else {
      kvevict::detail::fail("run_stream: xkv_chunked_total needs a float SnapKV cache");
    }
  }
  StreamResult r;
  r.skip = options.skip;
  auto score = [&](std::size_t t, std::span<const float> q) {
    const auto p = stream.logits(t);
    r.kl.push_back(metrics::kl_divergence(p, q));
    r.top1.push_back(metrics::top1_agreement(p, q) ? 1 : 0);
    if (t + 1 < stream.size()) {
      const auto next = static_cast<std::size_t>(stream.tokens[t + 1]);
      r.nll.push_back(metrics::negative_log_likelihood(q, next));
      r.nll_full.push_back(metrics::negative_log_likelihood(p, next));
    }
  };
  const std::size_t prefill = std::min(options.prefill, stream.size());
  const auto V = static_cast<std::size_t>(stream.vocab);
  std::vector<float> block;
  for (std::size_t at = 0; at < prefill;) {
    detail::progress("prefilling the prompt under the policy:", at, stream.size());
    const std::size_t n = std::min(options.prefill_block, prefill - at);
    tf.forward_block(std::span<const int>(stream.tokens.data() + at, n), static_cast<int>(at),
                     &block);
    for (std::size_t i = 0; i < n; ++i) score(at + i, std::span<const float>(block.data() + i * V, V));
    at += n;
  }
  for (std::size_t t = prefill; t < stream.size(); ++t) {
    detail::progress("feeding the stream under the policy:", t, stream.size());
    score(t, tf.forward(stream.tokens[t], static_cast<int>(t)));
  }
  return r;
}

/// Figures pooled over every counted position of every stream (each token weighs the same).
struct Summary {
  double mean_kl = 0.0;
  double top1 = 0.0;        ///< share of positions whose top-1 token agrees
  double perplexity = 0.0;  ///< exp(mean NLL) under the policy
  double perplexity_full = 0.0;
  std::size_t positions = 0;
};

inline Summary summarize(std::span<const StreamResult> results) {
  Summary s;
  double kl = 0.0, top1 = 0.0, nll = 0.0, nll_full = 0.0;
  std::size_t n = 0, n_nll = 0;
  for (const auto& r : results) {
    for (std::size_t t = r.skip; t < r.kl.size(); ++t) {
      kl += r.kl[t];
      top1 += r.top1[t];
      ++n;
    }
    for (std::size_t t = r.skip; t < r.nll.size(); ++t) {
      nll += r.nll[t];
      nll_full += r.nll_full[t];
      ++n_nll;
    }
  }
  s.positions = n;
  if (n > 0) {
    s.mean_kl = kl / static_cast<double>(n);
    s.top1 = top1 / static_cast<double>(n);
  }
  if (n_nll > 0) {
    s.perplexity = std::exp(nll / static_cast<double>(n_nll));
    s.perplexity_full = std::exp(nll_full / static_cast<double>(n_nll));
  }
  return s;
}

/// run_stream over several streams, summarised (Scalar: the cache's storage type).
template <class Policy, class Scalar = float>
Summary evaluate(const std::shared_ptr<const Model>& model, std::span<const Stream> streams,
                 const Budget& budget, const Policy& policy = Policy{},
                 const ProtocolOptions& options = {}) {
  std::vector<StreamResult> results;
  for (const auto& s : streams)
    results.push_back(run_stream<Policy, Scalar>(model, s, budget, policy, options));
  return summarize(results);
}

}  // namespace kvevict::llama2c
