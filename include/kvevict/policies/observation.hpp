#pragma once
// Observation-window importance, shared by SnapKV and XKV: the queries of the last W
// prompt tokens attend (causally) to the whole prompt, the probabilities are summed over
// the window and over the G query heads of a KV group, and the result is pooled along
// positions. Only the prefix [0, T - W) is scored; the window itself is always kept.
#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <numeric>
#include <span>
#include <vector>

#include "../config.hpp"
#include "../errors.hpp"
#include "../policy.hpp"

namespace kvevict::policies {

enum class Pooling { avg, max };

/// How importance is measured. SnapKV's paper defaults: window 32, kernel 5; XKV's
/// (arXiv 2412.05896): window 8, kernel 7. Both use average pooling by default.
struct ObservationConfig {
  std::size_t window = 8;  ///< W: prompt tokens whose queries observe the rest
  std::size_t kernel = 7;  ///< odd pooling width; 1 disables pooling
  Pooling pooling = Pooling::avg;

  void validate(const char* who) const {
    kvevict::detail::require(window > 0, who, ": window = 0, expected > 0");
    kvevict::detail::require(kernel % 2 == 1, who, ": pooling kernel = ", kernel,
                             ", expected an odd width (padding kernel/2 keeps the length)");
  }
};

/// One pooled value over in[lo, hi) (lo < hi): the sum times `inv`, or the maximum.
inline float pool_range(std::span<const float> in, std::size_t lo, std::size_t hi, Pooling pooling,
                        float inv) {
  if (pooling == Pooling::avg) {
    float s = 0.0f;
    for (std::size_t j = lo; j < hi; ++j) s += in[j];
    return s * inv;
  }
  float m = in[lo];
  for (std::size_t j = lo + 1; j < hi; ++j) m = std::max(m, in[j]);
  return m;
}

/// 1-D pooling, stride 1, padding kernel/2. Average pooling counts the zero padding in
/// the divisor (PyTorch's avg_pool1d default, which both reference codes use), so edge
/// tokens are damped; max pooling ignores padding.
inline void pool1d(std::span<const float> in, std::size_t kernel, Pooling pooling,
                   std::vector<float>& out) {
  const std::size_t n = in.size();
  const std::size_t half = kernel / 2;
  out.resize(n);
  const float inv = 1.0f / static_cast<float>(kernel);
  for (std::size_t i = 0; i < n; ++i) {
    const std::size_t lo = i >= half ? i - half : 0;
    const std::size_t hi = std::min(n, i + half + 1);
    out[i] = pool_range(in, lo, hi, pooling, inv);
  }
}

namespace detail {

/// One window token's rows of logits (group x visible keys): scaled, softmaxed, and the
/// probabilities of the first `prefix` keys added to out.
template <class M>
inline void add_window_probabilities(M& logits, float scale, std::size_t prefix, std::vector<float>& out) {
  for (Eigen::Index g = 0; g < logits.rows(); ++g) {
    auto row = logits.row(g);
    row *= scale;
    const float m = row.maxCoeff();
    row = (row.array() - m).exp().matrix();
    const float inv = 1.0f / row.sum();
    for (std::size_t j = 0; j < prefix; ++j) out[j] += row[static_cast<Eigen::Index>(j)] * inv;
  }
}

/// Raw window importance of one KV head: out[j] for j < T - W is the softmax probability
/// (float, scale 1/sqrt(d)) that window query t (T-W <= t < T, keys 0..t) of each of the
/// G query heads puts on key j, summed over window rows and the group. Needs T > W.
/// GQA reads the KV head's keys once for its G query heads: no K is repeated.
KVEVICT_LAZY KVEVICT_KERNEL_FN void window_importance(const PrefillView& v, std::size_t window,
                                                      std::vector<float>& out);
// The Eigen product below is the costliest template instantiation of kvevict.hpp; in
// separate-kernels mode (config.hpp) it is compiled once into the kvevict_kernels library.
#if !KVEVICT_KERNELS_DECLARE_ONLY
KVEVICT_LAZY_DEF KVEVICT_KERNEL_FN void window_importance(const PrefillView& v, std::size_t window,
                                                          std::vector<float>& out) {
  using RowMajorF = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using Strided = Eigen::Map<const RowMajorF, 0, Eigen::OuterStride<>>;
  const std::size_t T = v.tokens;
  const std::size_t prefix = T - window;
  const auto d = static_cast<Eigen::Index>(v.head_dim);
  out.assign(prefix, 0.0f);
  // keys of this head: T rows, stride n_kv_heads * d between tokens
  Strided keys(v.key(0), static_cast<Eigen::Index>(T), d,
               Eigen::OuterStride<>(static_cast<Eigen::Index>(v.n_kv_heads) * d));
  const float scale = 1.0f / std::sqrt(static_cast<float>(v.head_dim));
  RowMajorF logits;
  for (std::size_t t = prefix; t < T; ++t) {
    // the G query heads of the group are contiguous in the token's query row
    Strided q(v.query(t, 0), v.group, d, Eigen::OuterStride<>(d));
    const auto visible = static_cast<Eigen::Index>(t + 1);  // causal inside the window
    logits.noalias() = q * keys.topRows(visible).transpose();
    add_window_probabilities(logits, scale, prefix, out);
  }
}

#endif  // !KVEVICT_KERNELS_DECLARE_ONLY

}  // namespace detail

/// Pooled observation scores of the prefix [0, T - W) of one KV head (empty if T <= W).
KVEVICT_DEFER inline void observation_scores(const PrefillView& v, const ObservationConfig& c,
                               std::vector<float>& out) {
  kvevict::detail::require(v.queries != nullptr,
                           "observation_scores: the prefill has no queries, expected T x n_heads "
                           "x head_dim (the observation window needs them)");
  if (v.tokens <= c.window) {
    out.clear();
    return;
  }
  std::vector<float> raw;
  detail::window_importance(v, c.window, raw);
  pool1d(raw, c.kernel, c.pooling, out);
}

namespace detail {

/// Chunked prefill (v.held > 0, the held rows first): raw window importance of the prefix
/// [0, T - W) over the held rows and the chunk, as window_importance computes it over a
/// whole prompt. The queries are the last `wn` arrivals' (wn <= W; `wq`: wn x group x
/// head_dim, arrival order, ending with token T - 1): a window token whose query is not
/// known (earlier than the chunk and not stashed) adds nothing. Each window query attends
/// causally over what the view holds; tokens dropped before are not in the softmax.
KVEVICT_LAZY KVEVICT_KERNEL_FN void held_window_importance(const PrefillView& v,
                                                            std::size_t window, const float* wq,
                                                            std::size_t wn,
                                                            std::vector<float>& out);
// Another observation-window GEMM: compiled once into kvevict_kernels in separate-kernels
// mode, as window_importance.
#if !KVEVICT_KERNELS_DECLARE_ONLY
KVEVICT_LAZY_DEF KVEVICT_KERNEL_FN void held_window_importance(const PrefillView& v,
                                                                std::size_t window,
                                                                const float* wq, std::size_t wn,
                                                                std::vector<float>& out) {
  using RowMajorF = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  const std::size_t T = v.tokens, prefix = T - window;
  const auto d = static_cast<Eigen::Index>(v.head_dim);
  const std::size_t ud = static_cast<std::size_t>(v.head_dim);
  RowMajorF keys(static_cast<Eigen::Index>(T), d);
  for (std::size_t t = 0; t < T; ++t)
    std::copy(v.key(t), v.key(t) + ud, keys.data() + t * ud);
  out.assign(prefix, 0.0f);
  const float scale = 1.0f / std::sqrt(static_cast<float>(v.head_dim));
  RowMajorF logits;
  const std::size_t gd = static_cast<std::size_t>(v.group) * ud;
  for (std::size_t t = prefix; t < T; ++t) {
    if (t + wn < T) continue;  // no query known for this window token
    Eigen::Map<const RowMajorF> q(wq + (t + wn - T) * gd, v.group, d);
    const auto visible = static_cast<Eigen::Index>(t + 1);
    logits.noalias() = q * keys.topRows(visible).transpose();
    add_window_probabilities(logits, scale, prefix, out);
  }
}
#endif  // !KVEVICT_KERNELS_DECLARE_ONLY

/// pool1d over arrival indices with gaps: the neighbours of token i are the tokens whose
/// arrival index is within kernel/2 of its own; a dropped token counts as the padding does
/// (zero in the average's divisor, ignored by max). On consecutive indices this is pool1d.
inline void pool1d_by_seq(std::span<const float> in, const PrefillView& v, std::size_t kernel,
                          Pooling pooling, std::vector<float>& out) {
  const std::size_t n = in.size();
  const std::uint64_t half = kernel / 2;
  out.resize(n);
  const float inv = 1.0f / static_cast<float>(kernel);
  std::size_t lo = 0, hi = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint64_t s = v.seq(i);
    while (v.seq(lo) + half < s) ++lo;
    if (hi < i + 1) hi = i + 1;
    while (hi < n && v.seq(hi) <= s + half) ++hi;
    out[i] = pool_range(in, lo, hi, pooling, inv);
  }
}

}  // namespace detail

/// Indices of the n largest scores, larger first, ties to the lower index, returned in
/// ascending index order. The tie rule is part of the contract (tests rely on it).
KVEVICT_DEFER inline std::vector<std::uint32_t> top_n_indices(std::span<const float> scores, std::size_t n) {
  std::vector<std::uint32_t> idx(scores.size());
  std::iota(idx.begin(), idx.end(), 0u);
  n = std::min(n, idx.size());
  auto better = [&](std::uint32_t a, std::uint32_t b) {
    return scores[a] > scores[b] || (scores[a] == scores[b] && a < b);
  };
  if (n < idx.size())
    std::nth_element(idx.begin(), idx.begin() + static_cast<std::ptrdiff_t>(n), idx.end(), better);
  idx.resize(n);
  std::sort(idx.begin(), idx.end());
  return idx;
}

}  // namespace kvevict::policies
