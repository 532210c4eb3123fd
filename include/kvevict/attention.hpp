#pragma once
// Attention for one decode step over a KVCache: GQA-native (the G query heads of a group read
// their KV head's rows directly; K/V are never repeated per query head), float accumulation
// whatever the storage type. fp32 / fp16 / bf16 rows go through the fused, runtime-dispatched
// kernel (kernels/attention_decode.hpp); detail::attend_reference is the Eigen version it
// replaced, kept as the test oracle. decode_attention() is the same kernel on raw rows, for an
// engine without its own.
#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <span>
#include <string>
#include <vector>

#include "attention_core.hpp"
#include "bookkeeping.hpp"
#include "errors.hpp"
#include "mixed.hpp"
#include "policy.hpp"
#include "quantized.hpp"
#if !KVEVICT_KERNELS_DECLARE_ONLY
#include "kernels/attention_quant.hpp"  // separate-kernels mode: compiled (quant_format.hpp)
#endif

namespace kvevict {

/// Output of one step: out is n_heads x head_dim; probs[kv_head] is group x size over
/// that head's live rows (zero for rows the policy masked out of attention).
struct AttentionResult {
  Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> out;
  std::vector<Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>> probs;
};

/// How q.K is computed over quantized keys (KVCache<P, Q8<G> | Q4<G> | KV<..>>).
enum class QuantQK : int {
  /// Keys dequantised in registers, float products (the default).
  exact = 0,
  /// The query quantized to int8 per head, exact integer block dots, one float multiply per
  /// block (kernels::quant_attention_probs_qint; AVX512_VNNI where the CPU has it). Faster,
  /// not exact: Q8<32> keys' output error grows by about a quarter (docs/quantized.md).
  /// Needs Q8 / Q4 keys with a group size that is a multiple of 32 (not Mixed layouts).
  integer_query = 1,
};

struct AttendOptions {
  bool observe = true;  ///< hand the probabilities to the policy (if it declares attention)
  float scale = 0.0f;   ///< 0: 1 / sqrt(head_dim); else finite and > 0
  QuantQK quant_qk = QuantQK::exact;  ///< quantized keys only; else must stay exact
};

/// Scratch an engine keeps across steps so that attend / decode_attention allocate nothing
/// once it has grown to the largest step: the probabilities of every KV head of the last
/// step, back to back. Not shared between threads.
class AttendWorkspace {
 public:
  /// Probabilities of KV head `kv_head` of the last attend(..., workspace) step:
  /// group x size floats (after decode_attention: the one group it computed, kv_head 0).
  [[nodiscard]] std::span<const float> probs(int kv_head) const {
    detail::require(kv_head >= 0 && static_cast<std::size_t>(kv_head) + 1 < offset_.size(),
                    "AttendWorkspace::probs: kv_head = ", kv_head, ", expected 0 <= kv_head < ",
                    offset_.empty() ? 0 : offset_.size() - 1);
    const auto h = static_cast<std::size_t>(kv_head);
    return {probs_.data() + offset_[h], offset_[h + 1] - offset_[h]};
  }

  /// Prepares room for per-head blocks of the given float counts (no allocation when the
  /// capacity suffices); returns the first float of each block via block().
  template <class SizeOf>
  void layout(std::size_t heads, SizeOf&& floats_of_head) {
    offset_.resize(heads + 1);
    offset_[0] = 0;
    for (std::size_t h = 0; h < heads; ++h) {
      const std::size_t f = floats_of_head(h);
      detail::require(f <= std::numeric_limits<std::size_t>::max() / sizeof(float) - offset_[h],
                      "AttendWorkspace: ", f, " more floats overflow size_t");
      offset_[h + 1] = offset_[h] + f;
    }
    if (probs_.size() < offset_[heads]) probs_.resize(offset_[heads]);
  }
  [[nodiscard]] float* block(std::size_t h) { return probs_.data() + offset_[h]; }

 private:
  std::vector<float> probs_;
  std::vector<std::size_t> offset_;
};

namespace detail {
template <class P>
concept RestrictsAttention = requires(const P& p, int layer, int head) {
  { p.attention_limit(layer, head) } -> std::convertible_to<std::size_t>;
};

using RowMajorF = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

// The Oracle's per-step ceiling. Units are `block` consecutive rows (row r in unit r /
// block; 1 = single rows); the `limit / block` units of largest summed mass are kept
// (ties: lowest unit first) and every query head is renormalised over them. Templates
// (unused parameter) in both build modes: only the Oracle calls them, and an inline
// non-template function would instantiate its Eigen reduction in every includer.
template <class KvevictLazy = void>
void top_mass_units(const float* mass, std::size_t n, std::size_t limit, std::size_t block,
                    std::vector<char>& keep) {
  keep.assign(n, 1);
  const std::size_t units = (n + block - 1) / block, kept = limit / block;
  if (kept >= units) return;
  std::vector<double> unit_mass(units, 0.0);
  for (std::size_t i = 0; i < n; ++i) unit_mass[i / block] += mass[i];
  std::vector<std::uint32_t> idx(units);
  std::iota(idx.begin(), idx.end(), 0u);
  std::nth_element(idx.begin(), idx.begin() + static_cast<std::ptrdiff_t>(kept), idx.end(),
                   [&](std::uint32_t a, std::uint32_t b) {
                     return unit_mass[a] > unit_mass[b] || (unit_mass[a] == unit_mass[b] && a < b);
                   });
  std::vector<char> unit_keep(units, 0);
  for (std::size_t u = 0; u < kept; ++u) unit_keep[idx[u]] = 1;
  for (std::size_t i = 0; i < n; ++i) keep[i] = unit_keep[i / block];
}
template <class KvevictLazy = void>
void keep_only(Eigen::Ref<dependent_t<RowMajorF, KvevictLazy>> p, const std::vector<char>& keep) {
  const auto n = static_cast<std::size_t>(p.cols());
  for (Eigen::Index g = 0; g < p.rows(); ++g) {
    float s = 0.0f;
    for (std::size_t i = 0; i < n; ++i) {
      if (!keep[i]) p(g, static_cast<Eigen::Index>(i)) = 0.0f;
      s += p(g, static_cast<Eigen::Index>(i));
    }
    if (s > 0.0f) p.row(g) /= s;
  }
}
template <class KvevictLazy = void>
void restrict_to_top(Eigen::Ref<dependent_t<RowMajorF, KvevictLazy>> p, std::size_t limit, std::size_t block = 1) {
  const auto n = static_cast<std::size_t>(p.cols());
  if (limit >= n) return;
  const dependent_t<Eigen::RowVectorXf, KvevictLazy> mass = p.colwise().sum();
  std::vector<char> keep;
  top_mass_units(mass.data(), n, limit, block, keep);
  keep_only(p, keep);
}
/// The restriction of a RestrictsAttention policy over the hkv KV heads of `layer`:
/// prob_of(kh) is head kh's group x n probabilities (an Eigen map). Per head, or, when the
/// policy's attention_shared() is true (shared cells: one set for all KV heads of a layer),
/// one set from the mass summed over every query head of the layer.
template <class Policy, class ProbOf>
void restrict_attention(const Policy& policy, int layer, std::size_t hkv, ProbOf&& prob_of) {
  std::size_t block = 1;
  bool shared = false;
  if constexpr (requires { policy.attention_block(); }) block = policy.attention_block();
  if constexpr (requires { policy.attention_shared(); }) shared = policy.attention_shared();
  if (!shared) {
    for (std::size_t kh = 0; kh < hkv; ++kh)
      restrict_to_top(prob_of(kh), policy.attention_limit(layer, static_cast<int>(kh)), block);
    return;
  }
  const auto n = static_cast<std::size_t>(prob_of(0).cols());
  const std::size_t limit = policy.attention_limit(layer, 0);
  if (limit >= n) return;
  using RowF = dependent_t<Eigen::RowVectorXf, Policy>;
  RowF mass = RowF::Zero(static_cast<Eigen::Index>(n));
  for (std::size_t kh = 0; kh < hkv; ++kh) {
    auto p = prob_of(kh);
    require(static_cast<std::size_t>(p.cols()) == n, "attend: shared attention restriction: KV head ",
            kh, " holds ", p.cols(), " rows, expected ", n, " (every KV head of the layer the same)");
    mass += p.colwise().sum();
  }
  std::vector<char> keep;
  top_mass_units(mass.data(), n, limit, block, keep);
  for (std::size_t kh = 0; kh < hkv; ++kh) keep_only(prob_of(kh), keep);
}

/// AttendOptions::scale: finite and > 0, or 0 for 1 / sqrt(d). Returns the scale to use.
inline float resolve_scale(float scale, std::size_t d, const char* what) {
  require(std::isfinite(scale) && scale >= 0.0f, what, ": scale = ", scale,
          ", expected a finite value > 0 (or 0 for 1/sqrt(head_dim))");
  return scale == 0.0f ? 1.0f / std::sqrt(static_cast<float>(d)) : scale;
}

/// attend()'s argument checks; returns the scale to use. n_heads x head_dim is computed in
/// size_t (an int product could wrap for huge geometries).
inline float check_attend_args(const Geometry& g, int layer, std::span<const float> queries,
                               const AttendOptions& options) {
  check_live(g, "attend");
  require(layer >= 0 && layer < g.n_layers, "attend: layer = ", layer,
          ", expected 0 <= layer < ", g.n_layers);
  const auto d = static_cast<std::size_t>(g.head_dim);
  const std::size_t expect = static_cast<std::size_t>(g.n_heads) * d;
  require(queries.size() == expect, "attend: queries has ", queries.size(), " floats, expected ",
          expect, " (n_heads x head_dim)");
  // A NaN query would poison every accumulated score of an attention policy for good.
  check_finite(queries, "attend: queries");
  return resolve_scale(options.scale, d, "attend");
}

/// p.V of one group: out (group x d, row stride d) = probs (group x n) * values (n x d).
template <class Scalar>
void group_output(const float* probs, std::size_t group, const Scalar* values, std::size_t n,
                  std::size_t d, float* out) {
  if constexpr (kernel_scalar<Scalar>) {
    kernels::attention_output_as<kv_format_of<Scalar>()>(probs, group, values, d, n, d, out, d);
  } else {
    using RowMajorS = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
    using F = dependent_t<RowMajorF, Scalar>;
    const auto G = static_cast<Eigen::Index>(group), N = static_cast<Eigen::Index>(n),
               D = static_cast<Eigen::Index>(d);
    Eigen::Map<F> o(out, G, D);
    if (n == 0) {
      o.setZero();
      return;
    }
    o.noalias() = Eigen::Map<const F>(probs, G, N) *
                  Eigen::Map<const RowMajorS>(values, N, D).template cast<float>();
  }
}

/// q.K^T softmax of one KV head's group (false: a score is not finite). Quantized caches
/// (quantized.hpp) run the quantized kernel over the stored bytes.
template <class Cache>
bool head_probabilities(const Cache& cache, int layer, int kh, const float* q, std::size_t G,
                        float* p, float scale, QuantQK qk = QuantQK::exact) {
  const auto d = static_cast<std::size_t>(cache.geometry().head_dim);
  const std::size_t n = cache.size(layer, kh);
  using S = typename Cache::scalar_type;
  if constexpr (MixedStorage<S>) {  // both bands, one softmax (mixed.hpp)
    return n == 0 || cache.mixed_probs(layer, kh, q, G, p, scale);
  } else if constexpr (QuantizedStorage<S>) {
    if (n == 0) return true;
    using D = typename StorageOf<S>::key_codec::desc;
    kernels::require_quant_kernels<D>();
    if (qk == QuantQK::integer_query)
      return kernels::quant_attention_probs_qint<D>(q, d, G, cache.stored_keys(layer, kh).data(),
                                                    cache.key_row_bytes(), n, d, scale, p);
    return kernels::quant_attention_probs<D>(q, d, G, cache.stored_keys(layer, kh).data(),
                                             cache.key_row_bytes(), n, d, scale, p);
  } else {
    return group_probabilities_checked(cache.keys(layer, kh).data(), n, d, q, G, p, scale);
  }
}

/// A QuantQK against key storage S at head_dim: integer_query needs Q8 / Q4 keys whose group
/// size is a multiple of 32 (the integer kernel's shape).
template <class S>
void check_quant_qk_for(QuantQK qk, std::size_t head_dim, const char* what) {
  const auto v = static_cast<int>(qk);
  require(v == 0 || v == 1, what, ": quant_qk = ", v,
          ", expected QuantQK::exact (0) or QuantQK::integer_query (1)");
  if (qk == QuantQK::exact) return;
  bool ok = false;
  std::string keys;
  if constexpr (MixedStorage<S>) {
    keys = "a Mixed layout";
  } else if constexpr (QuantizedStorage<S>) {
    using C = typename StorageOf<S>::key_codec;
    ok = kernels::detail::qint_shape<typename C::desc>(head_dim);
    keys = C::name();
  } else {
    keys = storage_name<S>();
  }
  require(ok, what, ": quant_qk = QuantQK::integer_query needs Q8 or Q4 keys with a group size ",
          "that is a multiple of 32; these keys are ", keys, " (use QuantQK::exact)");
}

/// AttendOptions::quant_qk against the cache's key storage.
template <class Cache>
void check_quant_qk(const Cache& cache, QuantQK qk) {
  check_quant_qk_for<typename Cache::scalar_type>(
      qk, static_cast<std::size_t>(cache.geometry().head_dim), "attend");
}

/// p.V of one KV head's group into o (G x head_dim).
template <class Cache>
void head_output(const Cache& cache, int layer, int kh, const float* p, std::size_t G, float* o) {
  const auto d = static_cast<std::size_t>(cache.geometry().head_dim);
  const std::size_t n = cache.size(layer, kh);
  using S = typename Cache::scalar_type;
  if constexpr (MixedStorage<S>) {
    cache.mixed_output(layer, kh, p, G, o);
  } else if constexpr (QuantizedStorage<S>) {
    using D = typename StorageOf<S>::value_codec::desc;
    kernels::require_quant_kernels<D>();
    kernels::quant_attention_output<D>(p, G, cache.stored_values(layer, kh).data(),
                                       cache.value_row_bytes(), n, d, o, d);
  } else {
    group_output(p, G, cache.values(layer, kh).data(), n, d, o);
  }
}

/// The whole step, with the strong guarantee: every KV head's probabilities and output are
/// computed and checked before any policy observes anything. probs_of(kh, n) returns the
/// group x n block for head kh; out is n_heads x head_dim.
template <class Cache, class ProbsOf>
void attend_step(Cache& cache, int layer, std::span<const float> queries, float* out,
                 const AttendOptions& options, ProbsOf&& probs_of) {
  const Geometry& g = cache.geometry();
  const float scale = check_attend_args(g, layer, queries, options);
  check_quant_qk(cache, options.quant_qk);
  const auto G = static_cast<std::size_t>(g.group());
  const auto d = static_cast<std::size_t>(g.head_dim);
  const auto hkv = static_cast<std::size_t>(g.n_kv_heads);
  const auto probabilities = [&](std::size_t kh) {
    const float* q = queries.data() + kh * G * d;
    require(head_probabilities(cache, layer, static_cast<int>(kh), q, G,
                               probs_of(kh, cache.size(layer, static_cast<int>(kh))), scale,
                               options.quant_qk),
            "attend: layer ", layer, " KV head ", kh, ": a score q.k x scale (scale ", scale,
            ") is not finite (query or key magnitudes overflow float); no policy observed "
            "this step");
  };
  const auto output = [&](std::size_t kh) {
    head_output(cache, layer, static_cast<int>(kh), probs_of(kh, cache.size(layer, static_cast<int>(kh))),
                G, out + kh * G * d);
  };
  using Policy = typename Cache::policy_type;
  if constexpr (RestrictsAttention<Policy>) {  // the Oracle: every head's mass first
    for (std::size_t kh = 0; kh < hkv; ++kh) probabilities(kh);
    restrict_attention(cache.policy(), layer, hkv, [&](std::size_t kh) {
      const auto n = cache.size(layer, static_cast<int>(kh));
      return Eigen::Map<dependent_t<RowMajorF, Cache>>(probs_of(kh, n), static_cast<Eigen::Index>(G), static_cast<Eigen::Index>(n));
    });
    for (std::size_t kh = 0; kh < hkv; ++kh) output(kh);
  } else {
    for (std::size_t kh = 0; kh < hkv; ++kh) {
      probabilities(kh);
      output(kh);
    }
  }
  // Only a policy that reads attention is handed the step: for the others observe() would
  // only check probabilities this kernel computed (in range by construction: ~2% of a
  // StreamingLLM decode step of the llama2c engine at 128 rows, measured).
  if constexpr (has(Policy::signals, Signals::attention))
    if (options.observe)
      for (std::size_t kh = 0; kh < hkv; ++kh) {
        const auto n = cache.size(layer, static_cast<int>(kh));
        if (n == 0) continue;  // an empty head has nothing to observe
        cache.observe(layer, static_cast<int>(kh), std::span<const float>(probs_of(kh, n), G * n));
      }
}

/// The Eigen attention this kernel replaced (q K^T GEMM, Eigen exp, p V GEMM), kept as the
/// test oracle. Same checks and contract as attend().
template <class Cache>
AttentionResult attend_reference(Cache& cache, int layer, std::span<const float> queries,
                                 AttendOptions options = {}) {
  const Geometry& g = cache.geometry();
  const float scale = check_attend_args(g, layer, queries, options);
  const auto d = static_cast<std::size_t>(g.head_dim);
  dependent_t<AttentionResult, Cache> r;
  r.out.setZero(g.n_heads, g.head_dim);
  r.probs.resize(static_cast<std::size_t>(g.n_kv_heads));
  const int G = g.group();
  for (int kh = 0; kh < g.n_kv_heads; ++kh) {
    const auto k = cache.keys(layer, kh);
    const auto n = static_cast<std::size_t>(k.rows());
    auto& p = r.probs[static_cast<std::size_t>(kh)];
    p.resize(G, static_cast<Eigen::Index>(n));
    if (n == 0) continue;
    group_probabilities_reference(k.data(), n, d,
                                  queries.data() + static_cast<std::size_t>(kh) * std::size_t(G) * d,
                                  G, p.data(), scale);
  }
  using Policy = typename Cache::policy_type;
  if constexpr (RestrictsAttention<Policy>)
    restrict_attention(cache.policy(), layer, r.probs.size(),
                       [&](std::size_t kh) { return Eigen::Ref<dependent_t<RowMajorF, Cache>>(r.probs[kh]); });
  for (int kh = 0; kh < g.n_kv_heads; ++kh) {
    const auto v = cache.values(layer, kh);
    const auto& p = r.probs[static_cast<std::size_t>(kh)];
    if (p.cols() == 0) continue;
    if constexpr (std::is_same_v<typename Cache::scalar_type, float>)
      r.out.middleRows(kh * G, G).noalias() = p * v;
    else
      r.out.middleRows(kh * G, G).noalias() = p * v.template cast<float>();
  }
  for (const auto& p : r.probs)
    check_finite(std::span<const float>(p.data(), static_cast<std::size_t>(p.size())),
                 "attend: probabilities");
  if (options.observe)
    for (int kh = 0; kh < g.n_kv_heads; ++kh) {
      const auto& p = r.probs[static_cast<std::size_t>(kh)];
      cache.observe(layer, kh, std::span<const float>(p.data(), static_cast<std::size_t>(p.size())));
    }
  return r;
}
}  // namespace detail

/// Attention of one decode step of `layer`: queries is n_heads x head_dim. Policies that
/// declare Signals::attention receive the probabilities unless options.observe is false.
/// Strong guarantee: every KV head is computed and checked before any policy observes, so
/// on an exception the cache and its policy are unchanged. Allocates the result; an engine
/// stepping many times uses the workspace overload below.
template <class Cache>
AttentionResult attend(Cache& cache, int layer, std::span<const float> queries,
                       AttendOptions options = {}) {
  const Geometry& g = cache.geometry();
  detail::check_live(g, "attend");
  detail::dependent_t<AttentionResult, Cache> r;
  r.out.resize(g.n_heads, g.head_dim);
  r.probs.resize(static_cast<std::size_t>(g.n_kv_heads));
  const auto G = static_cast<Eigen::Index>(g.group());
  detail::attend_step(cache, layer, queries, r.out.data(), options,
                      [&](std::size_t kh, std::size_t n) {
                        auto& p = r.probs[kh];
                        if (p.rows() != G || p.cols() != static_cast<Eigen::Index>(n))
                          p.resize(G, static_cast<Eigen::Index>(n));
                        return p.data();
                      });
  return r;
}

/// The same step writing into caller memory: out holds n_heads x head_dim floats, the
/// probabilities stay in `workspace` (workspace.probs(kv_head)). Allocates nothing once the
/// workspace has grown to the largest step. Same checks and guarantee as attend() (out may
/// be partly written when it throws).
template <class Cache>
void attend(Cache& cache, int layer, std::span<const float> queries, std::span<float> out,
            AttendWorkspace& workspace, AttendOptions options = {}) {
  const Geometry& g = cache.geometry();
  detail::check_live(g, "attend");
  const std::size_t expect =
      static_cast<std::size_t>(g.n_heads) * static_cast<std::size_t>(g.head_dim);
  detail::require(out.size() == expect, "attend: out has ", out.size(), " floats, expected ",
                  expect, " (n_heads x head_dim)");
  detail::check_attend_args(g, layer, queries, options);  // before keys(layer, ...) below
  const auto G = static_cast<std::size_t>(g.group());
  workspace.layout(static_cast<std::size_t>(g.n_kv_heads), [&](std::size_t kh) {
    return G * cache.size(layer, static_cast<int>(kh));
  });
  detail::attend_step(cache, layer, queries, out.data(), options,
                      [&](std::size_t kh, std::size_t) { return workspace.block(kh); });
}

namespace detail {
/// decode_attention(_paged)'s checks but the rows' format: strides (in units of the stored
/// rows) at least key_min / value_min (a row's units: head_dim, or a quantized row's bytes).
/// A template (unused parameter) so that an includer that never calls it compiles nothing.
template <class KvevictLazy = void>
void check_decode_core(const float* queries, std::size_t group, bool have_keys, bool have_values,
                       std::size_t key_stride, std::size_t key_min, std::size_t value_stride,
                       std::size_t value_min, std::size_t n, std::size_t d, const float* out,
                       const char* what, const char* what_queries) {
  require(group >= 1, what, ": group = ", group, ", expected >= 1");
  require(d >= 1, what, ": head_dim = ", d, ", expected >= 1");
  if (key_min == d && value_min == d)
    require(key_stride >= d && value_stride >= d, what, ": key_stride = ", key_stride,
            ", value_stride = ", value_stride, ", expected both >= head_dim = ", d);
  else
    require(key_stride >= key_min && value_stride >= value_min, what, ": key_stride = ",
            key_stride, ", value_stride = ", value_stride, ", expected >= ", key_min, " and >= ",
            value_min, " (the bytes of a stored key / value row of head_dim ", d, ")");
  require(group <= std::numeric_limits<std::size_t>::max() / d / sizeof(float),
          what, ": group x head_dim = ", group, " x ", d, " overflows size_t");
  require(queries != nullptr && out != nullptr, what, ": queries or out is null");
  require(n == 0 || (have_keys && have_values), what, ": n = ", n,
          " but keys or values is null");
  require(n <= std::numeric_limits<std::size_t>::max() / sizeof(float) / group,
          what, ": group x n = ", group, " x ", n, " overflows size_t");
  check_finite(std::span<const float>(queries, group * d), what_queries);
}

template <class Scalar>
void check_decode_args(const float* queries, std::size_t group, const Scalar* keys,
                       std::size_t key_stride, const Scalar* values, std::size_t value_stride,
                       std::size_t n, std::size_t d, const float* out,
                       const char* what = "decode_attention",
                       const char* what_queries = "decode_attention: queries") {
  static_assert(kernel_scalar<Scalar>,
                "decode_attention(_paged) reads float, Eigen::half or Eigen::bfloat16 rows "
                "(quantized rows: decode_attention_paged<Q8<G> | Q4<G> | E4M3 | KV<K, V>> over "
                "PagedRows<std::uint8_t>)");
  check_decode_core(queries, group, keys != nullptr, values != nullptr, key_stride, d,
                    value_stride, d, n, d, out, what, what_queries);
}

/// decode_attention_paged's block-table checks: block_rows >= 1 and a block for every row.
/// Returns the largest pool block the n rows use.
template <class KvevictLazy = void>
std::uint32_t check_paged_blocks(std::span<const std::uint32_t> blocks, std::size_t block_rows,
                                 std::size_t n, const char* what) {
  require(block_rows >= 1, what, ": block_rows = ", block_rows, ", expected >= 1");
  const std::size_t used = n / block_rows + (n % block_rows != 0 ? 1 : 0);
  require(blocks.size() >= used, what, ": ", blocks.size(), " blocks for n = ", n, " rows of ",
          block_rows, ", expected at least ", used);
  std::uint32_t top = 0;
  for (std::size_t b = 0; b < used; ++b) top = blocks[b] > top ? blocks[b] : top;
  return top;
}

/// Whether block `top`'s last row lies within size_t: top x block_stride + (block_rows - 1)
/// x row_stride + extent <= limit (units of the rows: elements or bytes; limit = the largest
/// addressable count of them; row_stride >= extent >= 1 checked before).
template <class KvevictLazy = void>
void check_paged_reach(std::uint32_t top, std::size_t block_rows, std::size_t n,
                       std::size_t block_stride, std::size_t row_stride, std::size_t extent,
                       std::size_t limit, const char* what) {
  const bool fits =
      n == 0 || (block_rows - 1 <= (limit - extent) / row_stride &&
                 (block_stride == 0 ||
                  top <= (limit - extent - (block_rows - 1) * row_stride) / block_stride));
  require(fits, what, ": block ", top, " x block_stride ", block_stride, " + ", block_rows,
          " rows x row_stride ", row_stride, " overflows size_t");
}
}  // namespace detail

/// One decode step of one KV head on an engine's own rows (no KVCache needed): the G query
/// heads of the group (queries: group x head_dim floats, contiguous) against n K and V rows
/// (row i at keys + i * key_stride, values + i * value_stride; Scalar float, Eigen::half or
/// Eigen::bfloat16). Writes out (group x head_dim, contiguous) and probs (group x n,
/// softmax over the rows, nullable). scale 0 means 1 / sqrt(head_dim). Throws
/// kvevict::Error on bad arguments or when a score overflows float. Allocates nothing.
template <class Scalar>
void decode_attention(const float* queries, std::size_t group, const Scalar* keys,
                      std::size_t key_stride, const Scalar* values, std::size_t value_stride,
                      std::size_t n, std::size_t head_dim, float scale, float* out, float* probs) {
  detail::check_decode_args(queries, group, keys, key_stride, values, value_stride, n, head_dim,
                            out);
  detail::require(n == 0 || probs != nullptr,
                  "decode_attention: probs is null (use the AttendWorkspace overload)");
  scale = detail::resolve_scale(scale, head_dim, "decode_attention");
  if (n > 0)
    detail::require(kernels::attention_probs_as<detail::kv_format_of<Scalar>()>(
                        queries, head_dim, group, keys, key_stride, n, head_dim, scale, probs),
                    "decode_attention: a score q.k x scale (scale ", scale,
                    ") is not finite (query or key magnitudes overflow float)");
  kernels::attention_output_as<detail::kv_format_of<Scalar>()>(probs, group, values, value_stride,
                                                               n, head_dim, out, head_dim);
}

/// As above, with the probabilities kept in `workspace` (workspace.probs(0)).
template <class Scalar>
void decode_attention(const float* queries, std::size_t group, const Scalar* keys,
                      std::size_t key_stride, const Scalar* values, std::size_t value_stride,
                      std::size_t n, std::size_t head_dim, float scale, float* out,
                      AttendWorkspace& workspace) {
  detail::check_decode_args(queries, group, keys, key_stride, values, value_stride, n, head_dim,
                            out);
  workspace.layout(1, [&](std::size_t) { return group * n; });
  decode_attention(queries, group, keys, key_stride, values, value_stride, n, head_dim, scale, out,
                   workspace.block(0));
}

/// One KV head's rows in a block pool, read in place by decode_attention_paged: row i at
/// base + blocks[i / block_rows] * block_stride + (i % block_rows) * row_stride (elements of
/// Scalar). base points at the head's first element in pool block 0: for a pool with a
/// block per KV head (vLLM's layout, PagedCache's BlockPool) the pool's start, with
/// block_stride = block_rows x row_stride; for shared cells (llama.cpp's layout, PagedKV
/// with BlockLayout::shared_cells) the pool's start + kv_head x head_dim, with row_stride =
/// n_kv_heads x head_dim.
template <class Scalar>
struct PagedRows {
  const Scalar* base = nullptr;
  std::size_t block_stride = 0;
  std::size_t row_stride = 0;
};

/// decode_attention over rows held in a block pool, read in place (no copy): blocks lists the
/// head's pool blocks in table order (at least ceil(n / block_rows) of them; the last may
/// be partly filled), n the rows to attend. Same contract as decode_attention; out and
/// probs equal decode_attention's on the same rows copied into one array, bit for bit.
/// Throws kvevict::Error (nothing written) on bad arguments, including a block whose rows
/// would lie beyond what size_t can address.
template <class Scalar>
void decode_attention_paged(const float* queries, std::size_t group, PagedRows<Scalar> keys,
                            PagedRows<Scalar> values, std::span<const std::uint32_t> blocks,
                            std::size_t block_rows, std::size_t n, std::size_t head_dim,
                            float scale, float* out, float* probs) {
  constexpr const char* what = "decode_attention_paged";
  detail::check_decode_args(queries, group, keys.base, keys.row_stride, values.base,
                            values.row_stride, n, head_dim, out, what,
                            "decode_attention_paged: queries");
  detail::require(n == 0 || probs != nullptr, what, ": probs is null");
  const std::uint32_t top = detail::check_paged_blocks(blocks, block_rows, n, what);
  constexpr std::size_t limit = std::numeric_limits<std::size_t>::max() / sizeof(Scalar);
  for (const PagedRows<Scalar>* r : {&keys, &values})
    detail::check_paged_reach(top, block_rows, n, r->block_stride, r->row_stride, head_dim, limit,
                              what);
  scale = detail::resolve_scale(scale, head_dim, what);
  constexpr kernels::KvFormat F = detail::kv_format_of<Scalar>();
  const kernels::BlockTable kt{blocks.data(), block_rows, keys.block_stride};
  const kernels::BlockTable vt{blocks.data(), block_rows, values.block_stride};
  if (n > 0)
    detail::require(kernels::attention_probs_paged_as<F>(queries, head_dim, group, keys.base,
                                                         keys.row_stride, kt, n, head_dim, scale,
                                                         probs),
                    what, ": a score q.k x scale (scale ", scale,
                    ") is not finite (query or key magnitudes overflow float)");
  kernels::attention_output_paged_as<F>(probs, group, values.base, values.row_stride, vt, n,
                                        head_dim, out, head_dim);
}

/// decode_attention_paged over quantized rows (quantized.hpp), read in place as stored:
/// Storage, given explicitly, is Q8<G>, Q4<G>, E4M3 or KV<KF, VF> (keys in KF, values in
/// VF), keys and values are PagedRows<std::uint8_t> with strides in bytes (row_stride at
/// least the format's row bytes: a BlockPool's or KVCache's key_row_bytes() /
/// value_row_bytes()), e.g. for a BlockPool<Q8<32>> pool:
///   decode_attention_paged<Q8<32>>(q, G, PagedRows<std::uint8_t>{pool.key_block(0),
///       B * kb, kb}, PagedRows<std::uint8_t>{pool.value_block(0), B * vb, vb}, table, B, n,
///       head_dim, 0.0f, out, probs);
/// qk as AttendOptions::quant_qk (integer_query: Q8 / Q4 keys with a group size that is a
/// multiple of 32). Same contract as the float form; out and probs equal the quantized
/// kernels that attend() runs on a quantized KVCache (kernels::quant_attention_probs(_qint)
/// / quant_attention_output) on the same rows copied into one array, bit for bit. Throws
/// kvevict::Error (nothing written) on bad arguments, including a group size that does not
/// divide head_dim.
template <class Storage>
  requires(detail::QuantizedStorage<Storage> && !detail::MixedStorage<Storage>)
void decode_attention_paged(const float* queries, std::size_t group,
                            PagedRows<std::uint8_t> keys, PagedRows<std::uint8_t> values,
                            std::span<const std::uint32_t> blocks, std::size_t block_rows,
                            std::size_t n, std::size_t head_dim, float scale, float* out,
                            float* probs, QuantQK qk = QuantQK::exact) {
  constexpr const char* what = "decode_attention_paged";
  using KC = typename detail::StorageOf<Storage>::key_codec;
  using VC = typename detail::StorageOf<Storage>::value_codec;
  kernels::require_quant_kernels<typename KC::desc>();
  kernels::require_quant_kernels<typename VC::desc>();
  detail::require(head_dim >= 1, what, ": head_dim = ", head_dim, ", expected >= 1");
  detail::check_codec_dim<KC>(head_dim, "decode_attention_paged: key");
  detail::check_codec_dim<VC>(head_dim, "decode_attention_paged: value");
  detail::check_quant_qk_for<Storage>(qk, head_dim, what);
  // A row's bytes: at most 3 x head_dim (Q8<1>), so in size_t when group x head_dim floats are.
  detail::require(head_dim <= std::numeric_limits<std::size_t>::max() / 4, what, ": head_dim = ",
                  head_dim, " overflows size_t");
  const std::size_t kb = KC::row_bytes(head_dim), vb = VC::row_bytes(head_dim);
  detail::check_decode_core(queries, group, keys.base != nullptr, values.base != nullptr,
                            keys.row_stride, kb, values.row_stride, vb, n, head_dim, out, what,
                            "decode_attention_paged: queries");
  detail::require(n == 0 || probs != nullptr, what, ": probs is null");
  const std::uint32_t top = detail::check_paged_blocks(blocks, block_rows, n, what);
  constexpr std::size_t limit = std::numeric_limits<std::size_t>::max();
  detail::check_paged_reach(top, block_rows, n, keys.block_stride, keys.row_stride, kb, limit, what);
  detail::check_paged_reach(top, block_rows, n, values.block_stride, values.row_stride, vb, limit,
                            what);
  scale = detail::resolve_scale(scale, head_dim, what);
  const kernels::BlockTable kt{blocks.data(), block_rows, keys.block_stride};
  const kernels::BlockTable vt{blocks.data(), block_rows, values.block_stride};
  if (n > 0) {
    using KD = typename KC::desc;
    const bool finite =
        qk == QuantQK::integer_query
            ? kernels::quant_attention_probs_qint_paged<KD>(queries, head_dim, group, keys.base,
                                                            keys.row_stride, kt, n, head_dim,
                                                            scale, probs)
            : kernels::quant_attention_probs_paged<KD>(queries, head_dim, group, keys.base,
                                                       keys.row_stride, kt, n, head_dim, scale,
                                                       probs);
    detail::require(finite, what, ": a score q.k x scale (scale ", scale,
                    ") is not finite (query or key magnitudes overflow float)");
  }
  kernels::quant_attention_output_paged<typename VC::desc>(probs, group, values.base,
                                                           values.row_stride, vt, n, head_dim,
                                                           out, head_dim);
}

}  // namespace kvevict

// Compiled-kernels mode: extern template declarations of the common caches (extern_templates.hpp).
#define KVEVICT_HAVE_ATTENTION_HPP 1
#include "extern_templates.hpp"
