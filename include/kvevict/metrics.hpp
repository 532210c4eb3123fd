#pragma once
// Quality metrics, as defined in the project's ALGORITHMS notes. `probs` is the full
// cache's attention distribution a; `kept` marks the rows a policy kept (the set S).
#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <numeric>
#include <span>
#include <vector>

#include "errors.hpp"

namespace kvevict::metrics {
// Compiled-kernels mode (config.hpp): declarations only, defined once in kvevict_kernels
// (their addresses stay those of ordinary functions: tests/support/odr_exercise.hpp takes
// two). Header-only: the inline definitions below.
#if KVEVICT_KERNELS_DECLARE_ONLY
double mass_recall(std::span<const float> probs, std::span<const std::uint8_t> kept);
double output_relative_error(std::span<const float> probs, std::span<const std::uint8_t> kept,
                             std::span<const float> values, std::size_t head_dim);
double topk_recall(std::span<const float> probs, std::span<const std::uint8_t> kept,
                   std::size_t k);
std::vector<double> log_softmax(std::span<const float> logits);
double kl_divergence(std::span<const float> logits_p, std::span<const float> logits_q);
std::size_t argmax(std::span<const float> logits);
bool top1_agreement(std::span<const float> logits_p, std::span<const float> logits_q);
double negative_log_likelihood(std::span<const float> logits, std::size_t token);
#else

namespace detail {
KVEVICT_KERNEL_FN void same_size(std::size_t a, std::size_t b, const char* what) {
  kvevict::detail::require(a == b, what, ": sizes ", a, " and ", b, ", expected equal");
}
}  // namespace detail

/// m(S) = sum of a_i over the kept rows: the attention mass a policy retained.
KVEVICT_KERNEL_FN double mass_recall(std::span<const float> probs, std::span<const std::uint8_t> kept) {
  detail::same_size(probs.size(), kept.size(), "mass_recall");
  double m = 0.0;
  for (std::size_t i = 0; i < probs.size(); ++i)
    if (kept[i]) m += probs[i];
  return m;
}

/// ||o - o_S|| / ||o||, o = sum a_i v_i over all rows, o_S the same over the kept rows
/// with the weights renormalised. values is n x d (row-major). 1.0 when nothing is kept.
KVEVICT_KERNEL_FN double output_relative_error(std::span<const float> probs,
                                    std::span<const std::uint8_t> kept,
                                    std::span<const float> values, std::size_t head_dim) {
  detail::same_size(probs.size(), kept.size(), "output_relative_error");
  kvevict::detail::require(head_dim > 0 && values.size() == probs.size() * head_dim,
                           "output_relative_error: values has ", values.size(),
                           " floats, expected ", probs.size() * head_dim, " (n x head_dim)");
  std::vector<double> o(head_dim, 0.0), os(head_dim, 0.0);
  double ms = 0.0;
  for (std::size_t i = 0; i < probs.size(); ++i) {
    for (std::size_t j = 0; j < head_dim; ++j) o[j] += probs[i] * values[i * head_dim + j];
    if (kept[i]) {
      ms += probs[i];
      for (std::size_t j = 0; j < head_dim; ++j) os[j] += probs[i] * values[i * head_dim + j];
    }
  }
  double num = 0.0, den = 0.0;
  for (std::size_t j = 0; j < head_dim; ++j) {
    const double s = ms > 0.0 ? os[j] / ms : 0.0;
    num += (o[j] - s) * (o[j] - s);
    den += o[j] * o[j];
  }
  if (den == 0.0) return num == 0.0 ? 0.0 : std::numeric_limits<double>::infinity();
  return std::sqrt(num / den);
}

/// |S ∩ TopK(a)| / k, ties in a broken by lower index.
KVEVICT_KERNEL_FN double topk_recall(std::span<const float> probs, std::span<const std::uint8_t> kept,
                          std::size_t k) {
  detail::same_size(probs.size(), kept.size(), "topk_recall");
  kvevict::detail::require(k > 0 && k <= probs.size(), "topk_recall: k = ", k,
                           ", expected 1 <= k <= ", probs.size());
  std::vector<std::uint32_t> idx(probs.size());
  std::iota(idx.begin(), idx.end(), 0u);
  std::nth_element(idx.begin(), idx.begin() + static_cast<std::ptrdiff_t>(k - 1), idx.end(),
                   [&](std::uint32_t a, std::uint32_t b) {
                     return probs[a] > probs[b] || (probs[a] == probs[b] && a < b);
                   });
  std::size_t hit = 0;
  for (std::size_t i = 0; i < k; ++i) hit += kept[idx[i]] ? 1 : 0;
  return static_cast<double>(hit) / static_cast<double>(k);
}

/// log-softmax in double precision.
KVEVICT_KERNEL_FN std::vector<double> log_softmax(std::span<const float> logits) {
  kvevict::detail::require(!logits.empty(), "log_softmax: empty logits, expected at least one");
  double m = -std::numeric_limits<double>::infinity();
  for (float x : logits) m = std::max(m, static_cast<double>(x));
  double s = 0.0;
  for (float x : logits) s += std::exp(static_cast<double>(x) - m);
  const double lse = m + std::log(s);
  std::vector<double> out(logits.size());
  for (std::size_t i = 0; i < logits.size(); ++i) out[i] = static_cast<double>(logits[i]) - lse;
  return out;
}

/// KL(P || Q) of the softmax distributions of two logit vectors (P: the full cache).
KVEVICT_KERNEL_FN double kl_divergence(std::span<const float> logits_p, std::span<const float> logits_q) {
  detail::same_size(logits_p.size(), logits_q.size(), "kl_divergence");
  const auto lp = log_softmax(logits_p);
  const auto lq = log_softmax(logits_q);
  double kl = 0.0;
  for (std::size_t i = 0; i < lp.size(); ++i) kl += std::exp(lp[i]) * (lp[i] - lq[i]);
  return std::max(kl, 0.0);
}

/// Index of the largest logit (lowest index on ties).
KVEVICT_KERNEL_FN std::size_t argmax(std::span<const float> logits) {
  kvevict::detail::require(!logits.empty(), "argmax: empty logits, expected at least one");
  return static_cast<std::size_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

/// Whether two logit vectors agree on their top-1 token.
KVEVICT_KERNEL_FN bool top1_agreement(std::span<const float> logits_p, std::span<const float> logits_q) {
  detail::same_size(logits_p.size(), logits_q.size(), "top1_agreement");
  return argmax(logits_p) == argmax(logits_q);
}

/// -log p(token) under the softmax of the logits (for perplexity = exp(mean NLL)).
KVEVICT_KERNEL_FN double negative_log_likelihood(std::span<const float> logits, std::size_t token) {
  kvevict::detail::require(token < logits.size(), "negative_log_likelihood: token = ", token,
                           ", expected < vocabulary size ", logits.size());
  return -log_softmax(logits)[token];
}
#endif  // KVEVICT_KERNELS_DECLARE_ONLY

}  // namespace kvevict::metrics
