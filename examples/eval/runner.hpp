#pragma once
// Feeds a Workload through KVCache<Policy> one token at a time (prompt by prefill, then
// decode steps with kvevict::attend) and measures each decode step against the full
// cache on the same tokens.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <kvevict/attention.hpp>
#include <kvevict/cache.hpp>
#include <kvevict/metrics.hpp>
#include <kvevict/policies/full_cache.hpp>
#include <kvevict/policies/snapkv.hpp>
#include <limits>
#include <map>
#include <span>
#include <utility>
#include <vector>

#include "workloads.hpp"

namespace kvevict::eval {

struct RunOptions {
  std::size_t topk = 10;  ///< k of top-k recall (clamped to the context length)
  /// > 0: the prompt is prefilled in chunks of this many tokens (the last may be shorter),
  /// layer by layer per chunk, as an engine with chunked prefill feeds it; 0: one block.
  std::size_t prefill_chunk = 0;
  /// What SnapKV's selection does with the chunks after a layer's first (registry Knobs).
  policies::ChunkedPrefill chunked = policies::ChunkedPrefill::reselect;
  /// A Mixed<Hot, Cold> cache (kvevict/mixed.hpp): rows per head in the hot band.
  std::size_t hot_rows = 0;
};

/// Means over every (decode step, layer, query head) of a run.
struct Quality {
  double mass_recall = 0.0;   ///< share of the full cache's attention mass attended
  double output_error = 0.0;  ///< ||o_full - o_policy|| / ||o_full|| of attention outputs
  double topk_recall = 0.0;   ///< share of the full cache's top-k rows attended
  std::size_t needle_probes = 0;
  std::size_t needles_found = 0;
  std::size_t samples = 0;
  [[nodiscard]] double needle_rate() const {
    return needle_probes == 0
               ? std::numeric_limits<double>::quiet_NaN()
               : static_cast<double>(needles_found) / static_cast<double>(needle_probes);
  }
};

/// Called once per decode step of a run (for progress reporting).
using Tick = std::function<void()>;

namespace detail {

// Row (in the cache's row order) where the group's summed attention peaks.
inline std::size_t group_argmax(
    const Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>& p) {
  if (p.cols() == 0) return 0;
  Eigen::Index best = 0;
  p.colwise().sum().maxCoeff(&best);
  return static_cast<std::size_t>(best);
}

/// The prompt in chunks of `chunk` tokens (0: the whole prompt at once).
template <class Policy, class Scalar>
void prefill_all(KVCache<Policy, Scalar>& cache, const Workload& w, std::size_t chunk = 0) {
  if (w.prompt == 0) return;
  const Geometry& g = w.geometry;
  const std::size_t kv = static_cast<std::size_t>(g.n_kv_heads * g.head_dim);
  const std::size_t qs = static_cast<std::size_t>(g.n_heads * g.head_dim);
  const std::size_t step = chunk == 0 ? w.prompt : chunk;
  for (std::size_t t0 = 0; t0 < w.prompt; t0 += step) {
    const std::size_t n = std::min(step, w.prompt - t0);
    for (int l = 0; l < g.n_layers; ++l)
      cache.prefill(l, static_cast<std::int64_t>(t0), n, std::span<const float>(w.k(l, t0), kv * n),
                    std::span<const float>(w.v(l, t0), kv * n),
                    std::span<const float>(w.q(l, t0), qs * n));
  }
}

template <class Policy, class Scalar>
AttentionResult step(KVCache<Policy, Scalar>& cache, const Workload& w, int l, std::size_t t) {
  const Geometry& g = w.geometry;
  const std::size_t kv = static_cast<std::size_t>(g.n_kv_heads * g.head_dim);
  const std::size_t qs = static_cast<std::size_t>(g.n_heads * g.head_dim);
  std::span<const float> q(w.q(l, t), qs);
  cache.append(l, static_cast<std::int64_t>(t), std::span<const float>(w.k(l, t), kv),
               std::span<const float>(w.v(l, t), kv), q);
  return attend(cache, l, q);
}

}  // namespace detail

/// The full cache's attention on every decode step: probabilities (H x (t+1), token
/// order), outputs (H x d) and total mass per query head. Memory grows as
/// layers x H x (T^2 - prompt^2) / 2 floats.
class Reference {
 public:
  static Reference compute(const Workload& w, const Tick& tick = {}) {
    w.validate();
    Reference r;
    const Geometry& g = w.geometry;
    const std::size_t H = static_cast<std::size_t>(g.n_heads),
                      d = static_cast<std::size_t>(g.head_dim);
    const std::size_t steps = w.tokens - w.prompt, L = static_cast<std::size_t>(g.n_layers);
    r.prompt_ = w.prompt;
    r.layers_ = L;
    r.heads_ = H;
    r.dim_ = d;
    r.offset_.resize(steps * L + 1, 0);
    for (std::size_t s = 0; s < steps; ++s)
      for (std::size_t l = 0; l < L; ++l)
        r.offset_[s * L + l + 1] = r.offset_[s * L + l] + H * (w.prompt + s + 1);
    r.probs_.resize(r.offset_.back());
    r.out_.resize(steps * L * H * d);
    r.mass_.resize(steps * L * H);
    KVCache<policies::FullCache> cache(g, Budget::unbounded());
    detail::prefill_all(cache, w);
    const int G = g.group();
    for (std::size_t s = 0; s < steps; ++s) {
      const std::size_t t = w.prompt + s, n = t + 1;
      for (int l = 0; l < g.n_layers; ++l) {
        const auto res = detail::step(cache, w, l, t);
        float* p = r.probs_.data() + r.offset_[s * L + static_cast<std::size_t>(l)];
        for (int kh = 0; kh < g.n_kv_heads; ++kh) {
          const auto& pk = res.probs[static_cast<std::size_t>(kh)];
          std::copy(pk.data(), pk.data() + pk.size(), p + static_cast<std::size_t>(kh * G) * n);
        }
        std::copy(res.out.data(), res.out.data() + H * d,
                  r.out_.data() + (s * L + static_cast<std::size_t>(l)) * H * d);
        const std::vector<std::uint8_t> all(n, 1);
        for (std::size_t h = 0; h < H; ++h)
          r.mass_[(s * L + static_cast<std::size_t>(l)) * H + h] =
              metrics::mass_recall(std::span<const float>(p + h * n, n), all);
      }
      if (tick) tick();
    }
    return r;
  }

  /// Probabilities of query head h at decode step s (token prompt + s), t + 1 floats.
  [[nodiscard]] std::span<const float> probs(std::size_t s, int l, std::size_t h) const {
    const std::size_t n = prompt_ + s + 1;
    return {probs_.data() + offset_[s * layers_ + static_cast<std::size_t>(l)] + h * n, n};
  }
  [[nodiscard]] std::span<const float> out(std::size_t s, int l, std::size_t h) const {
    return {out_.data() + ((s * layers_ + static_cast<std::size_t>(l)) * heads_ + h) * dim_, dim_};
  }
  [[nodiscard]] double mass(std::size_t s, int l, std::size_t h) const {
    return mass_[(s * layers_ + static_cast<std::size_t>(l)) * heads_ + h];
  }

 private:
  std::size_t prompt_ = 0, layers_ = 0, heads_ = 0, dim_ = 0;
  std::vector<std::size_t> offset_;
  std::vector<float> probs_, out_;
  std::vector<double> mass_;
};

/// Runs `policy` inside `budget` over the workload and compares every decode step with
/// the reference. The kept set S of a step is the rows the policy's attention used:
/// its cached rows, and for policies that restrict attention (Oracle) the rows with
/// non-zero probability. Scalar is the cache's storage type (a quantized format of
/// quantized.hpp: attend reads the stored bytes); the reference stays the float cache.
template <class Policy, class Scalar = float>
Quality evaluate(const Workload& w, const Reference& ref, Policy policy, const Budget& budget,
                 const RunOptions& options = {}, const Tick& tick = {}) {
  KVCache<Policy, Scalar> cache(w.geometry, budget, std::move(policy));
  if constexpr (requires { cache.set_hot_rows(options.hot_rows); }) cache.set_hot_rows(options.hot_rows);
  detail::prefill_all(cache, w, options.prefill_chunk);
  const Geometry& g = w.geometry;
  const int G = g.group();
  const std::size_t d = static_cast<std::size_t>(g.head_dim);
  std::map<std::pair<std::size_t, int>, std::vector<NeedleProbe>> probes;
  for (const auto& p : w.needles) probes[{p.probe, p.layer}].push_back(p);

  double recall = 0.0, error = 0.0, topk = 0.0;
  Quality q;
  std::vector<std::uint8_t> kept;
  for (std::size_t t = w.prompt; t < w.tokens; ++t) {
    const std::size_t s = t - w.prompt, n = t + 1;
    for (int l = 0; l < g.n_layers; ++l) {
      const auto res = detail::step(cache, w, l, t);
      for (int kh = 0; kh < g.n_kv_heads; ++kh) {
        const auto seqs = cache.seqs(l, kh);
        const auto& pk = res.probs[static_cast<std::size_t>(kh)];
        kept.assign(n, 0);
        for (std::size_t r = 0; r < seqs.size(); ++r) {
          if constexpr (kvevict::detail::RestrictsAttention<Policy>) {
            if (pk.col(static_cast<Eigen::Index>(r)).maxCoeff() <= 0.0f) continue;
          }
          kept[seqs[r]] = 1;
        }
        for (int gi = 0; gi < G; ++gi) {
          const std::size_t h = static_cast<std::size_t>(kh * G + gi);
          const auto p = ref.probs(s, l, h);
          recall += metrics::mass_recall(p, kept) / ref.mass(s, l, h);
          topk += metrics::topk_recall(p, kept, std::min(options.topk, n));
          const auto o = ref.out(s, l, h);
          double num = 0.0, den = 0.0;
          for (std::size_t j = 0; j < d; ++j) {
            const double diff = static_cast<double>(o[j]) -
                                res.out(static_cast<Eigen::Index>(h), static_cast<Eigen::Index>(j));
            num += diff * diff;
            den += static_cast<double>(o[j]) * o[j];
          }
          error += den > 0.0 ? std::sqrt(num / den) : (num > 0.0 ? 1.0 : 0.0);
          ++q.samples;
        }
      }
      if (auto it = probes.find({t, l}); it != probes.end()) {
        for (const auto& p : it->second) {
          const auto& pk = res.probs[static_cast<std::size_t>(p.kv_head)];
          const auto seqs = cache.seqs(l, p.kv_head);
          ++q.needle_probes;
          if (!seqs.empty() && seqs[detail::group_argmax(pk)] == p.needle) ++q.needles_found;
        }
      }
    }
    if (tick) tick();
  }
  const auto m = static_cast<double>(std::max<std::size_t>(q.samples, 1));
  q.mass_recall = recall / m;
  q.output_error = error / m;
  q.topk_recall = topk / m;
  return q;
}

}  // namespace kvevict::eval
