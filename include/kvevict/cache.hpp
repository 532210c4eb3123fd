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
#include <type_traits>
#include <utility>
#include <vector>

#include "attention_core.hpp"
#include "bookkeeping.hpp"
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

template <class Policy, class Scalar = float>
  requires EvictionPolicy<Policy, Scalar>
class KVCache {
 public:
  using scalar_type = Scalar;
  using policy_type = Policy;
  using RowMatrix = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using ConstRowsMap = Eigen::Map<const RowMatrix>;
  /// Must not throw: it runs while rows are being moved (a throw terminates).
  using EvictionCallback = std::function<void(const EvictedRow<Scalar>&)>;

  KVCache(const Geometry& geometry, const Budget& budget, Policy policy = Policy{})
      : policy_(std::move(policy)) {
    geometry.validate();
    budget.validate(geometry);
    shape_.geometry = geometry;
    shape_.capacity = resolve(geometry, budget);
    check_capacities(shape_.capacity);
    heads_.resize(shape_.capacity.size());
    layers_.resize(static_cast<std::size_t>(geometry.n_layers));
    policy_.bind(shape_);
  }

  KVCache(const KVCache&) = default;
  KVCache& operator=(const KVCache&) = default;
  /// A moved-from cache is valid and empty: it has no layers, geometry() is all zeros,
  /// allocated_bytes() is 0, and every call that names a layer, set_budget, save and
  /// load throw kvevict::Error saying it was moved from. Assigning a cache revives it.
  KVCache(KVCache&& o) noexcept(std::is_nothrow_move_constructible_v<Policy>)
      : shape_(std::exchange(o.shape_, CacheShape{})),
        policy_(std::move(o.policy_)),
        heads_(std::exchange(o.heads_, {})),
        layers_(std::exchange(o.layers_, {})),
        on_evict_(std::move(o.on_evict_)),
        scratch_victims_(std::exchange(o.scratch_victims_, {})) {}
  KVCache& operator=(KVCache&& o) noexcept(std::is_nothrow_move_assignable_v<Policy>) {
    if (this != &o) {
      shape_ = std::exchange(o.shape_, CacheShape{});
      policy_ = std::move(o.policy_);
      heads_ = std::exchange(o.heads_, {});
      layers_ = std::exchange(o.layers_, {});
      on_evict_ = std::move(o.on_evict_);
      scratch_victims_ = std::exchange(o.scratch_victims_, {});
    }
    return *this;
  }

  // --- shape -------------------------------------------------------------------------
  [[nodiscard]] const Geometry& geometry() const { return shape_.geometry; }
  [[nodiscard]] const CacheShape& shape() const { return shape_; }
  [[nodiscard]] Policy& policy() { return policy_; }
  [[nodiscard]] const Policy& policy() const { return policy_; }
  [[nodiscard]] std::size_t size(int layer, int kv_head) const { return head(layer, kv_head).size; }
  [[nodiscard]] std::size_t capacity(int layer, int kv_head) const {
    check_head(layer, kv_head);
    return shape_.at(layer, kv_head);
  }
  /// Rows of storage actually allocated (<= capacity): what the memory really holds.
  [[nodiscard]] std::size_t allocated_rows(int layer, int kv_head) const {
    return head(layer, kv_head).pos.capacity();
  }
  /// Bytes of K/V storage allocated across the whole cache.
  [[nodiscard]] std::size_t allocated_bytes() const {
    std::size_t b = 0;
    for (const auto& h : heads_)
      b += (h.k.capacity() + h.v.capacity()) * sizeof(Scalar) +
           h.pos.capacity() * (sizeof(std::int64_t) + sizeof(std::uint64_t));
    return b;
  }
  /// Tokens appended to a layer so far (kept or not).
  [[nodiscard]] std::uint64_t tokens_seen(int layer) const { return layer_state(layer).next_seq; }

  // --- views for the engine's attention kernel ----------------------------------------
  [[nodiscard]] ConstRowsMap keys(int layer, int kv_head) const {
    const auto& h = head(layer, kv_head);
    return ConstRowsMap(h.k.data(), static_cast<Eigen::Index>(h.size), dim());
  }
  [[nodiscard]] ConstRowsMap values(int layer, int kv_head) const {
    const auto& h = head(layer, kv_head);
    return ConstRowsMap(h.v.data(), static_cast<Eigen::Index>(h.size), dim());
  }
  [[nodiscard]] std::span<const std::int64_t> positions(int layer, int kv_head) const {
    const auto& h = head(layer, kv_head);
    return {h.pos.data(), h.size};
  }
  [[nodiscard]] std::span<const std::uint64_t> seqs(int layer, int kv_head) const {
    const auto& h = head(layer, kv_head);
    return {h.seq.data(), h.size};
  }

  void set_eviction_callback(EvictionCallback cb) { on_evict_ = std::move(cb); }

  // --- decode -------------------------------------------------------------------------
  /// Appends one token to `layer`: keys and values are n_kv_heads x head_dim, queries
  /// n_heads x head_dim (required when the policy declares Signals::query, else optional).
  /// Evicts first when a head is full, so the cache never exceeds its budget. Strong
  /// guarantee: on any exception the cache is unchanged.
  void append(int layer, std::int64_t position, std::span<const float> keys,
              std::span<const float> values, std::span<const float> queries = {}) {
    const auto in_use = exclusive_.enter("append");
    const Geometry& g = shape_.geometry;
    detail::check_layer(g, layer);
    detail::check_token_rows(g, keys, "append: keys");
    detail::check_token_rows(g, values, "append: values");
    detail::check_queries<Policy>(g, queries, 1, "append");
    detail::check_arrivals(layers_[static_cast<std::size_t>(layer)], layer, position, 1, "append");
    detail::check_storable<Scalar>(keys, "append: keys");
    detail::check_storable<Scalar>(values, "append: values");
    detail::check_finite(queries, "append: queries");
    append_unchecked(layer, position, keys.data(), values.data(),
                     queries.empty() ? nullptr : queries.data());
  }

  /// Hands one step's attention probabilities of (layer, kv_head) to the policy:
  /// group x size floats over the live rows, in row order. Ignored by policies that do
  /// not declare Signals::attention.
  void observe(int layer, int kv_head, std::span<const float> probs) {
    const auto in_use = exclusive_.enter("observe");
    const auto& h = head(layer, kv_head);
    detail::check_probs(shape_.geometry, probs, h.size);
    if constexpr (has(Policy::signals, Signals::attention)) {
      static_assert(detail::HasObserve<Policy>,
                    "EvictionPolicy declares Signals::attention but has no observe(AttentionView)");
      policy_.observe(AttentionView{layer, kv_head, group(), h.size, probs.data()});
    }
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
    const auto in_use = exclusive_.enter("prefill");
    const Geometry& g = shape_.geometry;
    detail::check_layer(g, layer);
    detail::require(tokens > 0, "prefill: tokens = 0, expected > 0");
    detail::check_block_rows(g, keys, tokens, "prefill: keys");
    detail::check_block_rows(g, values, tokens, "prefill: values");
    constexpr bool wants_queries =
        has(Policy::signals, Signals::query) || has(Policy::signals, Signals::attention) ||
        has(Policy::signals, Signals::prefill_window);
    detail::check_queries<Policy>(g, queries, tokens, "prefill", wants_queries);
    detail::check_arrivals(layers_[static_cast<std::size_t>(layer)], layer, first_position, tokens,
                           "prefill");
    detail::check_storable<Scalar>(keys, "prefill: keys");
    detail::check_storable<Scalar>(values, "prefill: values");
    detail::check_finite(queries, "prefill: queries");

    const std::size_t hq = static_cast<std::size_t>(shape_.geometry.n_heads) * udim();
    const float* q = queries.empty() ? nullptr : queries.data();
    if constexpr (detail::HasPrefillKeep<Policy>) {
      if (layer_state(layer).next_seq == 0) {
        prefill_select(layer, first_position, tokens, keys.data(), values.data(), q);
        return;
      }
    }
    std::vector<float> probs;
    for (std::size_t t = 0; t < tokens; ++t) {
      const std::size_t off = t * static_cast<std::size_t>(shape_.geometry.n_kv_heads) * udim();
      const float* qt = q ? q + t * hq : nullptr;
      append_unchecked(layer, first_position + static_cast<std::int64_t>(t), keys.data() + off,
                       values.data() + off, qt);
      if constexpr (has(Policy::signals, Signals::attention)) {
        for (int kh = 0; kh < shape_.geometry.n_kv_heads; ++kh) {
          const auto& h = head(layer, kh);
          probs.resize(static_cast<std::size_t>(group()) * h.size);
          detail::group_probabilities(h.k.data(), h.size, udim(),
                                      qt + static_cast<std::size_t>(kh * group()) * udim(),
                                      group(), probs.data());
          policy_.observe(AttentionView{layer, kh, group(), h.size, probs.data()});
        }
      }
    }
  }

  // --- budget -------------------------------------------------------------------------
  /// Changes the budget. Heads above their new capacity evict through the policy (every
  /// row reaches the callback); storage beyond the new capacity is released.
  void set_budget(const Budget& budget) {
    const auto in_use = exclusive_.enter("set_budget");
    detail::check_live(shape_.geometry, "set_budget");
    budget.validate(shape_.geometry);
    auto caps = resolve(shape_.geometry, budget);
    check_capacities(caps);
    std::vector<std::vector<std::uint32_t>> victims(heads_.size());
    const Geometry& g = shape_.geometry;
    for (int l = 0; l < g.n_layers; ++l)
      for (int kh = 0; kh < g.n_kv_heads; ++kh) {
        const std::size_t i = index(l, kh);
        auto& h = heads_[i];
        if (h.size <= caps[i]) continue;
        HeadView<Scalar> view = make_view(l, kh);
        view.capacity = caps[i];
        view.need = h.size - caps[i];
        view.incoming_seq = layers_[static_cast<std::size_t>(l)].next_seq;
        policy_.choose_victims(view, victims[i]);
        validate_victims(victims[i], view);
      }
    shape_.capacity = std::move(caps);
    for (int l = 0; l < g.n_layers; ++l)
      for (int kh = 0; kh < g.n_kv_heads; ++kh) {
        const std::size_t i = index(l, kh);
        evict_rows(l, kh, victims[i]);
        shrink_storage(heads_[i], shape_.capacity[i]);
      }
  }

 private:
  friend struct detail::CacheAccess<KVCache>;
  struct HeadStore {
    std::vector<Scalar> k, v;
    std::vector<std::int64_t> pos;
    std::vector<std::uint64_t> seq;
    std::size_t size = 0;
  };
  using LayerState = detail::LayerClock;

  static std::vector<std::size_t> resolve(const Geometry& g, const Budget& b) {
    return detail::resolve_capacities(g, b);
  }
  void check_capacities(const std::vector<std::size_t>& caps) const {
    detail::check_capacities(policy_, shape_.geometry, caps);
  }

  int group() const { return shape_.geometry.group(); }
  Eigen::Index dim() const { return shape_.geometry.head_dim; }
  std::size_t udim() const { return static_cast<std::size_t>(shape_.geometry.head_dim); }
  std::size_t index(int layer, int kv_head) const {
    return detail::head_index(shape_.geometry, layer, kv_head);
  }
  void check_head(int layer, int kv_head) const {
    detail::check_head(shape_.geometry, layer, kv_head);
  }
  const HeadStore& head(int layer, int kv_head) const {
    check_head(layer, kv_head);
    return heads_[index(layer, kv_head)];
  }
  const LayerState& layer_state(int layer) const {
    detail::check_layer(shape_.geometry, layer);
    return layers_[static_cast<std::size_t>(layer)];
  }

  HeadView<Scalar> make_view(int layer, int kv_head) const {
    const auto& h = heads_[index(layer, kv_head)];
    HeadView<Scalar> v;
    v.layer = layer;
    v.kv_head = kv_head;
    v.head_dim = shape_.geometry.head_dim;
    v.group = group();
    v.size = h.size;
    v.capacity = shape_.at(layer, kv_head);
    v.keys = h.k.data();
    v.values = h.v.data();
    v.positions = h.pos.data();
    v.seqs = h.seq.data();
    return v;
  }

  static void validate_victims(std::vector<std::uint32_t>& victims, const HeadView<Scalar>& view) {
    detail::validate_victims<Policy>(victims, view.size, view.need);
  }

  void reserve_rows(HeadStore& h, std::size_t rows, std::size_t cap) {
    if (h.pos.capacity() >= rows) return;
    const std::size_t grown = std::max<std::size_t>({rows, 16, h.pos.capacity() * 2});
    const std::size_t n = std::min(grown, std::max(cap, rows));
    // reserve() allocates exactly n rows, so storage never exceeds the capacity.
    h.k.reserve(n * udim());
    h.v.reserve(n * udim());
    h.pos.reserve(n);
    h.seq.reserve(n);
  }

  void shrink_storage(HeadStore& h, std::size_t cap) {
    if (h.pos.capacity() <= cap) return;
    auto shrink = [&](auto& vec, std::size_t n) {
      std::remove_reference_t<decltype(vec)> fresh;
      fresh.reserve(n);
      fresh.assign(vec.begin(), vec.end());
      vec.swap(fresh);
    };
    shrink(h.k, cap * udim());
    shrink(h.v, cap * udim());
    shrink(h.pos, cap);
    shrink(h.seq, cap);
  }

  // Evicts `victims` (sorted descending, validated) by swap-remove.
  void evict_rows(int layer, int kv_head, const std::vector<std::uint32_t>& victims) noexcept {
    auto& h = heads_[index(layer, kv_head)];
    const std::size_t d = udim();
    for (std::uint32_t r : victims) {
      if (on_evict_) {
        on_evict_(EvictedRow<Scalar>{layer, kv_head, h.pos[r], h.seq[r],
                                     std::span<const Scalar>(h.k.data() + r * d, d),
                                     std::span<const Scalar>(h.v.data() + r * d, d)});
      }
      const std::size_t last = h.size - 1;
      if (r != last) {
        std::memcpy(h.k.data() + r * d, h.k.data() + last * d, d * sizeof(Scalar));
        std::memcpy(h.v.data() + r * d, h.v.data() + last * d, d * sizeof(Scalar));
        h.pos[r] = h.pos[last];
        h.seq[r] = h.seq[last];
        policy_.on_move(layer, kv_head, last, r);
      }
      h.k.resize(last * d);
      h.v.resize(last * d);
      h.pos.resize(last);
      h.seq.resize(last);
      h.size = last;
    }
  }

  void append_unchecked(int layer, std::int64_t position, const float* keys, const float* values,
                        const float* queries) {
    const Geometry& g = shape_.geometry;
    auto& ls = layers_[static_cast<std::size_t>(layer)];
    const std::size_t d = udim();
    // Phase 1: every decision and allocation that may throw, before anything changes.
    scratch_victims_.resize(static_cast<std::size_t>(g.n_kv_heads));
    for (int kh = 0; kh < g.n_kv_heads; ++kh) {
      auto& victims = scratch_victims_[static_cast<std::size_t>(kh)];
      victims.clear();
      auto& h = heads_[index(layer, kh)];
      const std::size_t cap = shape_.at(layer, kh);
      const std::size_t limit = detail::append_limit(policy_, cap, layer, kh);
      if (h.size >= limit) {
        HeadView<Scalar> view = incoming_view(layer, kh, position, keys, queries);
        view.need = h.size - limit + 1;
        policy_.choose_victims(view, victims);
        validate_victims(victims, view);
      }
      reserve_rows(h, h.size - victims.size() + 1, cap);
    }
    // Phase 2: apply; nothing below throws except the policy's own bookkeeping.
    for (int kh = 0; kh < g.n_kv_heads; ++kh) {
      evict_rows(layer, kh, scratch_victims_[static_cast<std::size_t>(kh)]);
      auto& h = heads_[index(layer, kh)];
      const float* kin = keys + static_cast<std::size_t>(kh) * d;
      const float* vin = values + static_cast<std::size_t>(kh) * d;
      for (std::size_t j = 0; j < d; ++j) h.k.push_back(static_cast<Scalar>(kin[j]));
      for (std::size_t j = 0; j < d; ++j) h.v.push_back(static_cast<Scalar>(vin[j]));
      h.pos.push_back(position);
      h.seq.push_back(ls.next_seq);
      ++h.size;
      HeadView<Scalar> view = incoming_view(layer, kh, position, keys, queries);
      policy_.on_append(view, h.size - 1);
    }
    ++ls.next_seq;
    ls.last_position = position;
  }

  HeadView<Scalar> incoming_view(int layer, int kh, std::int64_t position, const float* keys,
                                 const float* queries) const {
    HeadView<Scalar> view = make_view(layer, kh);
    view.incoming_seq = layers_[static_cast<std::size_t>(layer)].next_seq;
    view.incoming_position = position;
    view.incoming_key = keys + static_cast<std::size_t>(kh) * udim();
    if constexpr (has(Policy::signals, Signals::query))
      view.queries = queries + static_cast<std::size_t>(kh * group()) * udim();
    else
      (void)queries;
    return view;
  }

  void prefill_select(int layer, std::int64_t first_position, std::size_t tokens,
                      const float* keys, const float* values, const float* queries) {
    const Geometry& g = shape_.geometry;
    auto& ls = layers_[static_cast<std::size_t>(layer)];
    std::vector<std::vector<std::uint32_t>> keep(static_cast<std::size_t>(g.n_kv_heads));
    for (int kh = 0; kh < g.n_kv_heads; ++kh) {
      PrefillView pv{layer, kh, g.head_dim, group(), g.n_kv_heads, g.n_heads, tokens,
                     shape_.at(layer, kh), first_position, ls.next_seq, keys, queries};
      auto& kp = keep[static_cast<std::size_t>(kh)];
      policy_.prefill_keep(pv, kp);
      detail::validate_prefill_keep<Policy>(kp, tokens, pv.capacity);
      reserve_rows(heads_[index(layer, kh)], kp.size(), pv.capacity);
    }
    const std::size_t d = udim();
    const std::size_t stride = static_cast<std::size_t>(g.n_kv_heads) * d;
    for (int kh = 0; kh < g.n_kv_heads; ++kh) {
      auto& h = heads_[index(layer, kh)];
      const auto& kp = keep[static_cast<std::size_t>(kh)];
      std::size_t next = 0;
      for (std::size_t t = 0; t < tokens; ++t) {
        const float* kin = keys + t * stride + static_cast<std::size_t>(kh) * d;
        const float* vin = values + t * stride + static_cast<std::size_t>(kh) * d;
        if (next < kp.size() && kp[next] == t) {
          ++next;
          for (std::size_t j = 0; j < d; ++j) h.k.push_back(static_cast<Scalar>(kin[j]));
          for (std::size_t j = 0; j < d; ++j) h.v.push_back(static_cast<Scalar>(vin[j]));
          h.pos.push_back(first_position + static_cast<std::int64_t>(t));
          h.seq.push_back(ls.next_seq + t);
          ++h.size;
          HeadView<Scalar> view = make_view(layer, kh);
          view.incoming_seq = ls.next_seq + t;
          view.incoming_position = first_position + static_cast<std::int64_t>(t);
          view.incoming_key = kin;
          policy_.on_append(view, h.size - 1);
        } else if (on_evict_) {
          // Dropped prompt rows reach the callback too: nothing leaves unseen.
          std::vector<Scalar> kr(d), vr(d);
          for (std::size_t j = 0; j < d; ++j) {
            kr[j] = static_cast<Scalar>(kin[j]);
            vr[j] = static_cast<Scalar>(vin[j]);
          }
          on_evict_(EvictedRow<Scalar>{layer, kh, first_position + static_cast<std::int64_t>(t),
                                       ls.next_seq + t, kr, vr});
        }
      }
    }
    ls.next_seq += tokens;
    ls.last_position = first_position + static_cast<std::int64_t>(tokens) - 1;
  }

  CacheShape shape_;
  Policy policy_;
  std::vector<HeadStore> heads_;
  std::vector<LayerState> layers_;
  EvictionCallback on_evict_;
  std::vector<std::vector<std::uint32_t>> scratch_victims_;
  detail::ExclusiveUse exclusive_;
};

}  // namespace kvevict
