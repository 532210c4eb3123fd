#pragma once
// Runs the llama2.c Transformer (examples/llama2c/llama2c.hpp) over a PagedCache whose
// blocks come from a BlockPool shared with other sequences: Transformer<Pooled<Policy>>
// is one sequence of a serving engine. Token-level decisions per KV head (every policy,
// through the container core); a block goes back to the pool the moment it empties.
//
// Attention: for each KV head, kvevict::decode_attention_paged (the fused, runtime-dispatched
// kernel) reads the head's blocks in place through its block table: float, fp16 and bf16
// pools, and quantized pools (Scalar = Q8<G>, KV<Q8<G>, Q4<G>>, ...: quantized.hpp) through
// decode_attention_paged<Scalar>, the quantized kernels attend() runs for a quantized
// KVCache (kernels/attention_quant.hpp) over the block table. No row is copied.
#include <cstdint>
#include <span>
#include <utility>

#include "kvevict/attention.hpp"
#include "kvevict/paged_cache.hpp"
#include "kvevict/quantized.hpp"
#include "llama2c.hpp"

namespace kvevict::serving {

/// The "policy" argument of Transformer<Pooled<Policy, Scalar>>: the real policy, the
/// shared pool (which must outlive the sequence) and the sequence's owner id in the pool.
template <class Policy, class Scalar = float>
struct Pooled {
  Policy policy;
  BlockPool<Scalar>* pool = nullptr;
  std::uint32_t sequence = 0;
};

/// The K/V store of Transformer<Pooled<Policy, Scalar>>: one PagedCache sequence.
template <class Policy, class Scalar = float>
class PooledStore {
  using Unit = typename BlockPool<Scalar>::unit;

 public:
  PooledStore(const Geometry& g, const Budget& budget, Pooled<Policy, Scalar> spec)
      : cache_(g, budget,
               (kvevict::detail::require(spec.pool != nullptr, "PooledStore: pool is null"),
                *spec.pool),
               spec.sequence, std::move(spec.policy)) {}

  [[nodiscard]] PagedCache<Policy, Scalar>& paged() { return cache_; }
  [[nodiscard]] const PagedCache<Policy, Scalar>& paged() const { return cache_; }

  void append(int layer, int pos, std::span<const float> k, std::span<const float> v,
              std::span<const float> q) {
    cache_.append(layer, pos, k, v, q);
  }

  /// Attention of every query head over its KV head's rows; the policy observes after
  /// every head is computed (the strong guarantee attend() gives).
  AttentionResult attend_layer(int layer, std::span<const float> q) {
    const Geometry& g = cache_.geometry();
    const auto G = static_cast<std::size_t>(g.group());
    const auto d = static_cast<std::size_t>(g.head_dim);
    const std::size_t B = cache_.pool().block_tokens();
    AttentionResult r;
    r.out.resize(g.n_heads, g.head_dim);
    r.probs.resize(static_cast<std::size_t>(g.n_kv_heads));
    const auto& pool = cache_.pool();
    const std::size_t ku = pool.key_row_units(), vu = pool.value_row_units();
    const PagedRows<Unit> keys{pool.key_block(0), B * ku, ku}, values{pool.value_block(0), B * vu, vu};
    for (int kh = 0; kh < g.n_kv_heads; ++kh) {
      const std::size_t n = cache_.size(layer, kh);
      auto& p = r.probs[static_cast<std::size_t>(kh)];
      p.resize(static_cast<Eigen::Index>(G), static_cast<Eigen::Index>(n));
      const float* qh = q.data() + static_cast<std::size_t>(kh) * G * d;
      float* oh = r.out.data() + static_cast<std::size_t>(kh) * G * d;
      // A quantized pool's Unit is its bytes (PagedRows<std::uint8_t>): the format is named.
      if constexpr (PagedCache<Policy, Scalar>::quantized)
        decode_attention_paged<Scalar>(qh, G, keys, values, cache_.table(layer, kh), B, n, d,
                                       0.0f, oh, p.data());
      else
        decode_attention_paged(qh, G, keys, values, cache_.table(layer, kh), B, n, d, 0.0f, oh,
                               p.data());
    }
    if constexpr (has(Policy::signals, Signals::attention))
      for (int kh = 0; kh < g.n_kv_heads; ++kh) {
        const auto& p = r.probs[static_cast<std::size_t>(kh)];
        cache_.observe(layer, kh, std::span<const float>(p.data(), static_cast<std::size_t>(p.size())));
      }
    return r;
  }

  /// Found by Transformer::forward's unqualified attend(cache_, layer, queries).
  friend AttentionResult attend(PooledStore& s, int layer, std::span<const float> q) {
    return s.attend_layer(layer, q);
  }

 private:
  PagedCache<Policy, Scalar> cache_;
};

}  // namespace kvevict::serving

namespace kvevict::llama2c {
template <class Policy, class Scalar>
struct CacheFor<serving::Pooled<Policy, Scalar>> {
  using type = serving::PooledStore<Policy, Scalar>;
};
}  // namespace kvevict::llama2c
