#pragma once
// KVCache<Policy, Scalar>: dense K/V rows per (layer, KV head) inside a token budget.
// Rows [0, size) are always live and contiguous, so an engine's attention kernel reads
// them as one matrix; eviction swaps the last row into the hole (O(d), no compaction).
#include <Eigen/Core>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <span>
#include <utility>
#include <vector>

#include "attention_core.hpp"
#include "bookkeeping.hpp"
#include "container_core.hpp"
#include "errors.hpp"
#include "geometry.hpp"
#include "policy.hpp"

namespace kvevict {

namespace detail {
template <class Cache>
struct CacheAccess;  // serialize.hpp: saves and restores the private state
}  // namespace detail

/// A row leaving the cache, handed to the eviction callback before it is overwritten.
template <class Scalar>
struct EvictedRow {
  int layer = 0;
  int kv_head = 0;
  std::int64_t position = 0;
  std::uint64_t seq = 0;  ///< arrival index within the layer
  std::span<const Scalar> key;
  std::span<const Scalar> value;
};

namespace detail {
/// KVCache's storage of one (layer, KV head): K and V rows (size x head_dim, row-major)
/// beside the core's positions and arrival indices.
template <class Scalar>
struct DenseHead : HeadRows {
  std::vector<Scalar> k, v;
};
}  // namespace detail

template <class Policy, class Scalar = float>
  requires EvictionPolicy<Policy, Scalar>
class KVCache
    : public detail::ContainerCore<KVCache<Policy, Scalar>, Policy, Scalar, detail::DenseHead<Scalar>> {
  using Core = detail::ContainerCore<KVCache, Policy, Scalar, detail::DenseHead<Scalar>>;
  friend Core;

 public:
  using scalar_type = Scalar;
  using policy_type = Policy;
  using RowMatrix = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using ConstRowsMap = Eigen::Map<const RowMatrix>;
  /// Must not throw: it runs while rows are being moved (a throw terminates).
  using EvictionCallback = std::function<void(const EvictedRow<Scalar>&)>;

  KVCache(const Geometry& geometry, const Budget& budget, Policy policy = Policy{})
      : Core(geometry, budget, std::move(policy)) {}

  // --- shape: geometry(), shape(), policy(), size(), capacity(), tokens_seen(), observe(),
  // positions(), seqs() come from the core --------------------------------------------
  /// Rows of storage actually allocated (<= capacity): what the memory really holds.
  [[nodiscard]] std::size_t allocated_rows(int layer, int kv_head) const {
    return this->head(layer, kv_head).pos.capacity();
  }
  /// Bytes of K/V storage allocated across the whole cache.
  [[nodiscard]] std::size_t allocated_bytes() const {
    std::size_t b = 0;
    for (const auto& h : this->heads_)
      b += (h.k.capacity() + h.v.capacity()) * sizeof(Scalar) +
           h.pos.capacity() * (sizeof(std::int64_t) + sizeof(std::uint64_t));
    return b;
  }

  // --- views for the engine's attention kernel ----------------------------------------
  [[nodiscard]] ConstRowsMap keys(int layer, int kv_head) const {
    const auto& h = this->head(layer, kv_head);
    return ConstRowsMap(h.k.data(), static_cast<Eigen::Index>(h.size()), dim());
  }
  [[nodiscard]] ConstRowsMap values(int layer, int kv_head) const {
    const auto& h = this->head(layer, kv_head);
    return ConstRowsMap(h.v.data(), static_cast<Eigen::Index>(h.size()), dim());
  }

  void set_eviction_callback(EvictionCallback cb) { on_evict_ = std::move(cb); }

  // --- decode -------------------------------------------------------------------------
  /// Appends one token to `layer`: keys and values are n_kv_heads x head_dim, queries
  /// n_heads x head_dim (required when the policy declares Signals::query, else optional).
  /// Evicts first when a head is full, so the cache never exceeds its budget. Strong
  /// guarantee: on any exception the cache is unchanged.
  void append(int layer, std::int64_t position, std::span<const float> keys,
              std::span<const float> values, std::span<const float> queries = {}) {
    const auto in_use = this->exclusive("append");
    this->check_token(layer, position, keys, values, queries, false);
    this->step(layer, position, keys.data(), values.data(),
               queries.empty() ? nullptr : queries.data());
  }

  // --- prefill ------------------------------------------------------------------------
  /// Appends a block of T tokens at positions first_position.. (+T-1). keys and values are
  /// T x n_kv_heads x head_dim; queries T x n_heads x head_dim (needed by policies that
  /// declare Signals::query, Signals::attention or Signals::prefill_window).
  /// A policy with prefill_keep selects from the whole block when the layer is empty;
  /// otherwise tokens go through the decode rule one at a time, with causal attention
  /// probabilities computed here for policies that observe attention.
  void prefill(int layer, std::int64_t first_position, std::size_t tokens,
               std::span<const float> keys, std::span<const float> values,
               std::span<const float> queries = {}) {
    const auto in_use = this->exclusive("prefill");
    this->check_block(layer, first_position, tokens, keys, values, queries, true);
    this->prefill_block(layer, first_position, tokens, keys.data(), values.data(),
                        queries.empty() ? nullptr : queries.data());
  }

  // --- budget -------------------------------------------------------------------------
  /// Changes the budget. Heads above their new capacity evict through the policy (every
  /// row reaches the callback); storage beyond the new capacity is released.
  void set_budget(const Budget& budget) {
    const auto in_use = this->exclusive("set_budget");
    this->change_budget(budget);
  }

 private:
  friend struct detail::CacheAccess<KVCache>;
  using HeadStore = detail::DenseHead<Scalar>;
  using typename Core::LayerState;

  Eigen::Index dim() const { return this->shape_.geometry.head_dim; }

  // --- layout hooks (container_core.hpp): rows live densely in this->heads_ -----------
  detail::RowsData<Scalar> rows_data(int layer, int kv_head) const {
    const auto& h = this->heads_[this->index(layer, kv_head)];
    return {h.k.data(), h.v.data()};
  }
  const Scalar* attention_rows(int layer, int kv_head) const {
    return this->heads_[this->index(layer, kv_head)].k.data();
  }
  void reserve_rows(std::size_t i, std::size_t n) {
    // reserve() allocates exactly n rows, so storage never exceeds the capacity.
    auto& h = this->heads_[i];
    h.k.reserve(n * this->udim());
    h.v.reserve(n * this->udim());
  }
  void shrink_rows(std::size_t i, std::size_t cap) {
    auto& h = this->heads_[i];
    Core::shrink_vector(h.k, cap * this->udim());
    Core::shrink_vector(h.v, cap * this->udim());
  }
  // Row r leaves (to the callback); the last row's K/V moves into it.
  void remove_row(int layer, int kv_head, std::size_t i, std::uint32_t r, std::size_t last) noexcept {
    auto& h = this->heads_[i];
    const std::size_t d = this->udim();
    if (on_evict_) {
      on_evict_(EvictedRow<Scalar>{layer, kv_head, h.pos[r], h.seq[r],
                                   std::span<const Scalar>(h.k.data() + r * d, d),
                                   std::span<const Scalar>(h.v.data() + r * d, d)});
    }
    if (r != last) {
      std::memcpy(h.k.data() + r * d, h.k.data() + last * d, d * sizeof(Scalar));
      std::memcpy(h.v.data() + r * d, h.v.data() + last * d, d * sizeof(Scalar));
    }
    h.k.resize(last * d);
    h.v.resize(last * d);
  }
  void write_row(std::size_t i, const float* key, const float* value) {
    auto& h = this->heads_[i];
    const std::size_t d = this->udim();
    for (std::size_t j = 0; j < d; ++j) h.k.push_back(static_cast<Scalar>(key[j]));
    for (std::size_t j = 0; j < d; ++j) h.v.push_back(static_cast<Scalar>(value[j]));
  }
  void push_row(int, int, std::size_t i, std::size_t, std::int64_t, std::uint64_t, const float* key,
                const float* value, std::uint32_t) {
    write_row(i, key, value);
  }
  void keep_prompt_row(int, int, std::size_t i, std::size_t, std::size_t, const float* key,
                       const float* value, std::int64_t, std::uint64_t) {
    write_row(i, key, value);
  }
  // Dropped prompt rows reach the callback too: nothing leaves unseen.
  void drop_prompt_row(int layer, int kv_head, std::size_t, std::size_t, const float* key,
                       const float* value, std::int64_t position, std::uint64_t seq) {
    if (!on_evict_) return;
    const std::size_t d = this->udim();
    std::vector<Scalar> kr(d), vr(d);
    for (std::size_t j = 0; j < d; ++j) {
      kr[j] = static_cast<Scalar>(key[j]);
      vr[j] = static_cast<Scalar>(value[j]);
    }
    on_evict_(EvictedRow<Scalar>{layer, kv_head, position, seq, kr, vr});
  }

  EvictionCallback on_evict_;
};

}  // namespace kvevict
