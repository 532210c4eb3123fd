#pragma once
// Reference attention for one decode step over a KVCache (Eigen, float accumulation).
// GQA-native: the G query heads of a group read their KV head's rows directly; K/V are
// never repeated per query head.
#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <span>
#include <vector>

#include "attention_core.hpp"
#include "bookkeeping.hpp"
#include "errors.hpp"
#include "policy.hpp"

namespace kvevict {

/// Output of one step: out is n_heads x head_dim; probs[kv_head] is group x size over
/// that head's live rows (zero for rows the policy masked out of attention).
struct AttentionResult {
  Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> out;
  std::vector<Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>> probs;
};

struct AttendOptions {
  bool observe = true;  ///< hand the probabilities to the policy (if it declares attention)
  float scale = 0.0f;   ///< 0: 1 / sqrt(head_dim)
};

namespace detail {
template <class P>
concept RestrictsAttention = requires(const P& p, int layer, int head) {
  { p.attention_limit(layer, head) } -> std::convertible_to<std::size_t>;
};

// Keeps, per KV head, the `limit` rows of largest group-summed mass and renormalises
// each query head over them (the Oracle's per-step ceiling). Ties: lowest row first.
inline void restrict_to_top(Eigen::Ref<Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic,
                                                     Eigen::RowMajor>> p,
                            std::size_t limit) {
  const auto n = static_cast<std::size_t>(p.cols());
  if (limit >= n) return;
  Eigen::RowVectorXf mass = p.colwise().sum();
  std::vector<std::uint32_t> idx(n);
  std::iota(idx.begin(), idx.end(), 0u);
  std::nth_element(idx.begin(), idx.begin() + static_cast<std::ptrdiff_t>(limit), idx.end(),
                   [&](std::uint32_t a, std::uint32_t b) {
                     return mass[a] > mass[b] || (mass[a] == mass[b] && a < b);
                   });
  std::vector<char> keep(n, 0);
  for (std::size_t i = 0; i < limit; ++i) keep[idx[i]] = 1;
  for (Eigen::Index g = 0; g < p.rows(); ++g) {
    float s = 0.0f;
    for (std::size_t i = 0; i < n; ++i) {
      if (!keep[i]) p(g, static_cast<Eigen::Index>(i)) = 0.0f;
      s += p(g, static_cast<Eigen::Index>(i));
    }
    if (s > 0.0f) p.row(g) /= s;
  }
}
}  // namespace detail

/// Attention of one decode step of `layer`: queries is n_heads x head_dim. Policies that
/// declare Signals::attention receive the probabilities unless options.observe is false.
template <class Cache>
AttentionResult attend(Cache& cache, int layer, std::span<const float> queries,
                       AttendOptions options = {}) {
  const Geometry& g = cache.geometry();
  detail::require(layer >= 0 && layer < g.n_layers, "attend: layer = ", layer,
                  ", expected 0 <= layer < ", g.n_layers);
  const std::size_t expect = static_cast<std::size_t>(g.n_heads * g.head_dim);
  detail::require(queries.size() == expect, "attend: queries has ", queries.size(),
                  " floats, expected ", expect, " (n_heads x head_dim)");
  // A NaN query would poison every accumulated score of an attention policy for good.
  detail::check_finite(queries, "attend: queries");
  AttentionResult r;
  r.out.setZero(g.n_heads, g.head_dim);
  r.probs.resize(static_cast<std::size_t>(g.n_kv_heads));
  const int G = g.group();
  const auto d = static_cast<std::size_t>(g.head_dim);
  for (int kh = 0; kh < g.n_kv_heads; ++kh) {
    const auto k = cache.keys(layer, kh);
    const auto v = cache.values(layer, kh);
    const auto n = static_cast<std::size_t>(k.rows());
    auto& p = r.probs[static_cast<std::size_t>(kh)];
    p.resize(G, static_cast<Eigen::Index>(n));
    if (n == 0) continue;
    detail::group_probabilities(k.data(), n, d, queries.data() + static_cast<std::size_t>(kh * G) * d,
                                G, p.data(), options.scale);
    using Policy = typename Cache::policy_type;
    if constexpr (detail::RestrictsAttention<Policy>)
      detail::restrict_to_top(p, cache.policy().attention_limit(layer, kh));
    if constexpr (std::is_same_v<typename Cache::scalar_type, float>)
      r.out.middleRows(kh * G, G).noalias() = p * v;
    else
      r.out.middleRows(kh * G, G).noalias() = p * v.template cast<float>();
    if (options.observe)
      cache.observe(layer, kh, std::span<const float>(p.data(), static_cast<std::size_t>(p.size())));
  }
  return r;
}

}  // namespace kvevict
