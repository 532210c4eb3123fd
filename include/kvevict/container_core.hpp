#pragma once
// ContainerCore: what every memory layout of a cache shares, written once. A layout
// (KVCache: dense rows it owns; IndexCache: engine-owned cells; paged layouts) decides
// only where a row's K/V lives and how a row moves; the core keeps the per-(layer, KV
// head) live-row bookkeeping (position and arrival index of each row, in the order the
// policy sees them), the per-layer arrival clocks, and runs every flow that touches the
// policy: validate -> choose victims -> reserve -> apply (swap-remove) -> on_append, the
// prefill paths (prefill_keep selection, on an empty layer or, for a policy that
// reselects, from the held rows plus each chunk; or token by token with causal attention
// for policies that observe it), observe, and a budget shrink.
//
// The layout is the derived class (CRTP). Hooks it may define (defaults below are no-ops):
//   rows_data(layer, kv_head) const -> RowsData   keys/values a policy reads (size rows)
//   load_rows(layer, kv_head, incoming_key, incoming_value)
//                                make rows_data() valid (IndexCache gathers engine rows);
//                                with an incoming row appended when given
//   reserve_rows(i, n)           allocate room for n rows of head i (exact)
//   prepare_head(layer, kv_head, i, victims)   more allocation before anything changes (KVCache:
//                                prefetches the rows the step will copy)
//   prepare_step(layer, total_victims, max_rows)
//   prepare_token(layer) const   a decode token for `layer` (a valid layer) is about to be
//                                checked: may request memory the step will write (KVCache:
//                                each full head's last row), so its misses overlap the checks
//   remove_row(layer, kv_head, i, r, last)     row r leaves, last row moves into r
//                                              (called before the core moves pos/seq)
//   push_row(layer, kv_head, i, row, position, seq, key, value, token)
//                                the new token's row goes to `row` (before pos/seq push)
//   keep_prompt_row / drop_prompt_row(layer, kv_head, i, row, t, key, value, position, seq)
//   begin_prompt_head(layer, kv_head)  before a head's kept prompt rows are written: gathered
//                                views hold exactly the head's live rows (after the held
//                                rows a chunked reselection dropped have left)
//   prepare_prompt(layer, tokens, keep, victims)  room for each head's kept block tokens
//                                after its held victims leave (victims: empty unless a
//                                chunked reselection drops held rows)
//   attention_rows(layer, kv_head) -> const Scalar*   rows for prefill attention
//   shrink_rows(i, cap)          release storage beyond cap after a budget shrink
//   check_stored(x, what, is_key)  reject keys/values the storage format cannot hold
//                                (default: check_storable<Scalar>; quantized KVCache: its codec)
//   stored_limit_bits(is_key)    check_stored's bound on |value| as a bit pattern (default:
//                                check_storable<Scalar>'s), 0 when it is not a bound; a
//                                layout overriding check_stored overrides it too
//
// Pooled budgets (Budget::pooled(), layer_pool.hpp) run through the same flows: only how
// many victims each head of a layer gives up is decided across the heads (choose_pooled),
// and a head's storage grows and is released with its changing share (reserve_head,
// release_head); the layouts' hooks are the same.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <numeric>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "attention_core.hpp"
#include "bookkeeping.hpp"
#include "errors.hpp"
#include "geometry.hpp"
#include "layer_pool.hpp"
#include "policy.hpp"

namespace kvevict::detail {

/// An allocator whose resize leaves new elements default-initialised (for float and byte
/// units: not written) instead of value-initialised (zeroed): a layout that grows its row
/// storage and then encodes the new row into it writes each element once. Every other
/// operation is std::allocator's.
template <class T>
struct RowAllocator : std::allocator<T> {
  using value_type = T;
  template <class U>
  struct rebind {
    using other = RowAllocator<U>;
  };
  RowAllocator() noexcept = default;
  template <class U>
  RowAllocator(const RowAllocator<U>&) noexcept {}
  template <class U>
  void construct(U* p) noexcept(std::is_nothrow_default_constructible_v<U>) {
    ::new (static_cast<void*>(p)) U;
  }
  template <class U, class... A>
  void construct(U* p, A&&... a) {
    ::new (static_cast<void*>(p)) U(std::forward<A>(a)...);
  }
};
template <class T, class U>
bool operator==(const RowAllocator<T>&, const RowAllocator<U>&) noexcept {
  return true;
}
/// K or V rows of one head, row-major: growing by a row does not zero it first.
template <class T>
using RowVector = std::vector<T, RowAllocator<T>>;

/// The live rows of one (layer, KV head), in the order the policy sees them. A layout's
/// per-head storage derives from it and adds where the rows' K/V live.
struct HeadRows {
  std::vector<std::int64_t> pos;
  std::vector<std::uint64_t> seq;
  [[nodiscard]] std::size_t size() const { return pos.size(); }
};

/// Rows to allocate so `rows` fit when `have` are allocated (0: enough already). Grows
/// geometrically but never past the capacity, so storage follows the budget.
inline std::size_t grown_rows(std::size_t have, std::size_t rows, std::size_t cap) {
  if (have >= rows) return 0;
  const std::size_t grown = std::max<std::size_t>({rows, 16, have * 2});
  return std::min(grown, std::max(cap, rows));
}

/// Keys and values a policy reads for one head (row-major, size x head_dim each).
template <class Scalar>
struct RowsData {
  const Scalar* keys = nullptr;
  const Scalar* values = nullptr;
};

template <class Layout, class Policy, class Scalar, class Head>
class ContainerCore {
 public:
  [[nodiscard]] const Geometry& geometry() const { return shape_.geometry; }
  [[nodiscard]] const CacheShape& shape() const { return shape_; }
  [[nodiscard]] Policy& policy() { return policy_; }
  [[nodiscard]] const Policy& policy() const { return policy_; }
  [[nodiscard]] std::size_t size(int layer, int kv_head) const { return head(layer, kv_head).size(); }
  /// What a reselecting policy's prefill_keep would be handed for a block on `layer`, per
  /// KV head, without changing anything: fn(const PrefillView&) once per head (the rows the
  /// head holds first, then the block; an empty layer: the block alone). The block (keys,
  /// values, queries) is checked as prefill checks it, so a prefill of it later cannot fail
  /// on its input. For a caller that decides budgets from a chunk before the chunk goes in
  /// (policies::ChunkedXkvPrefill).
  template <class Fn>
  void prefill_views(int layer, std::int64_t first_position, std::size_t tokens,
                     std::span<const float> keys, std::span<const float> values,
                     std::span<const float> queries, Fn&& fn) {
    static_assert(HasPrefillReselect<Policy, Scalar>, "prefill_views: a policy that reselects at chunked prefill");
    check_block(layer, first_position, tokens, keys, values, queries, true);
    std::vector<std::uint32_t> order;
    std::vector<float> held_keys;
    std::vector<std::uint64_t> held_seqs;
    for (int kh = 0; kh < shape_.geometry.n_kv_heads; ++kh) {
      const bool reselect = layers_[static_cast<std::size_t>(layer)].next_seq != 0 && policy_.reselects_prefill();
      const std::size_t held = reselect ? heads_[index(layer, kh)].size() : 0;
      fn(static_cast<const PrefillView&>(prompt_view(layer, kh, first_position, tokens, keys.data(),
                                                     queries.empty() ? nullptr : queries.data(), held,
                                                     order, held_keys, held_seqs)));
    }
  }
  /// The nominal capacity of (layer, kv_head): what the policy sees. Under a pooled budget
  /// a head may hold more or fewer rows (max_rows, layer_total).
  [[nodiscard]] std::size_t capacity(int layer, int kv_head) const {
    check_head(layer, kv_head);
    return shape_.at(layer, kv_head);
  }
  /// Whether a pooled budget is in effect: Budget::pooled() and a policy with the
  /// eviction_costs hook (without it a pooled budget keeps the nominal capacities).
  [[nodiscard]] bool pooled() const {
    if constexpr (kPoolable) return pool_.on;
    else return false;
  }
  /// Rows `layer` may hold in total: its pool's total (a model-scope pool: the whole
  /// cache's), else the sum of its heads' capacities (Budget::kUnbounded when one is).
  [[nodiscard]] std::size_t layer_total(int layer) const {
    check_layer(shape_.geometry, layer);
    if (pooled()) return pool_.total[pool_.pool_of(layer)];
    std::size_t t = 0;
    for (int h = 0; h < shape_.geometry.n_kv_heads; ++h) {
      const std::size_t c = shape_.at(layer, h);
      if (c == Budget::kUnbounded || t > Budget::kUnbounded - c) return Budget::kUnbounded;
      t += c;
    }
    return t;
  }
  /// Rows (layer, kv_head) may ever hold: under a pooled budget the layer total less the
  /// other heads' floors, else the capacity.
  [[nodiscard]] std::size_t max_rows(int layer, int kv_head) const {
    check_head(layer, kv_head);
    return pooled() ? pool_.ceiling[index(layer, kv_head)] : shape_.at(layer, kv_head);
  }
  /// Tokens appended to a layer so far (kept or not).
  [[nodiscard]] std::uint64_t tokens_seen(int layer) const { return layer_state(layer).next_seq; }
  [[nodiscard]] std::span<const std::int64_t> positions(int layer, int kv_head) const {
    return head(layer, kv_head).pos;
  }
  [[nodiscard]] std::span<const std::uint64_t> seqs(int layer, int kv_head) const {
    return head(layer, kv_head).seq;
  }

  /// Hands one step's attention probabilities of (layer, kv_head) to the policy:
  /// group x size floats over the live rows, in row order. Ignored by policies that do
  /// not declare Signals::attention.
  void observe(int layer, int kv_head, std::span<const float> probs) {
    const auto in_use = exclusive("observe");
    const std::size_t n = head(layer, kv_head).size();
    // Checked and group-summed in one pass (bookkeeping.hpp); the policy reads the sums.
    const AttentionView view =
        observed_view<Policy>(shape_.geometry, layer, kv_head, probs, n, sums_);
    pool_touch(index(layer, kv_head));
    if constexpr (has(Policy::signals, Signals::attention)) {
      static_assert(HasObserve<Policy>,
                    "EvictionPolicy declares Signals::attention but has no observe(AttentionView)");
      policy_.observe(view);
    }
  }

 protected:
  using LayerState = LayerClock;

  ContainerCore(const Geometry& geometry, const Budget& budget, Policy policy)
      : policy_(std::move(policy)) {
    geometry.validate();
    budget.validate(geometry);
    shape_.geometry = geometry;
    shape_.capacity = resolve_capacities(geometry, budget);
    check_capacities(policy_, geometry, shape_.capacity);
    if constexpr (kPoolable)
      pool_ = LayerPool::resolve(geometry, budget, shape_.capacity, policy_.min_capacity());
    pool_steps_.assign(pool_.total.size(), 0);
    pool_schedule_.assign(pool_.total.size(), {});
    pool_schedule_at_.assign(pool_.total.size(), 0);
    heads_.resize(shape_.capacity.size());
    layers_.resize(static_cast<std::size_t>(geometry.n_layers));
    policy_.bind(shape_);
  }

  ContainerCore(const ContainerCore&) = default;
  ContainerCore& operator=(const ContainerCore&) = default;
  /// A moved-from cache is valid and empty: it has no layers, geometry() is all zeros,
  /// and every call that names a layer (or set_budget, save, load) throws kvevict::Error
  /// saying it was moved from. Assigning a cache revives it. The layout's own members
  /// move with their defaults (vectors are left empty).
  ContainerCore(ContainerCore&& o) noexcept(std::is_nothrow_move_constructible_v<Policy>)
      : shape_(std::exchange(o.shape_, CacheShape{})),
        policy_(std::move(o.policy_)),
        heads_(std::exchange(o.heads_, {})),
        layers_(std::exchange(o.layers_, {})),
        scratch_victims_(std::exchange(o.scratch_victims_, {})),
        pool_(std::exchange(o.pool_, {})),
        pool_settled_(std::exchange(o.pool_settled_, {})),
        pool_steps_(std::exchange(o.pool_steps_, {})),
        pool_schedule_(std::exchange(o.pool_schedule_, {})),
        pool_schedule_at_(std::exchange(o.pool_schedule_at_, {})) {}
  ContainerCore& operator=(ContainerCore&& o) noexcept(std::is_nothrow_move_assignable_v<Policy>) {
    if (this != &o) {
      shape_ = std::exchange(o.shape_, CacheShape{});
      policy_ = std::move(o.policy_);
      heads_ = std::exchange(o.heads_, {});
      layers_ = std::exchange(o.layers_, {});
      scratch_victims_ = std::exchange(o.scratch_victims_, {});
      pool_ = std::exchange(o.pool_, {});
      pool_settled_ = std::exchange(o.pool_settled_, {});
      pool_steps_ = std::exchange(o.pool_steps_, {});
      pool_schedule_ = std::exchange(o.pool_schedule_, {});
      pool_schedule_at_ = std::exchange(o.pool_schedule_at_, {});
      pool_fresh_.clear();
    }
    return *this;
  }

  /// Marks the cache in use by a changing call for the returned scope's lifetime; with
  /// KVEVICT_CHECK_CONCURRENCY an overlapping changing call throws (bookkeeping.hpp).
  [[nodiscard]] ExclusiveUse::Scope exclusive(const char* what) { return exclusive_.enter(what); }

  // --- default layout hooks ---------------------------------------------------------
  void load_rows(int, int, const float*, const float*) {}
  void reserve_rows(std::size_t, std::size_t) {}
  void prepare_head(int, int, std::size_t, const std::vector<std::uint32_t>&) {}
  void prepare_token(int) const {}
  void prepare_step(int, std::size_t, std::size_t) {}
  void begin_prompt_head(int, int) {}
  void prepare_prompt(int, std::size_t, const std::vector<std::vector<std::uint32_t>>&,
                      const std::vector<std::vector<std::uint32_t>>&) {}
  void shrink_rows(std::size_t, std::size_t) {}
  /// Before a prefill block goes token by token (no prompt selection): throw now if a step
  /// of it could be refused.
  void prepare_token_prefill(int, std::size_t) {}
  /// For prepare_prompt: the most rows a head of `layer` holds while a prefill selection is
  /// applied (its held rows before the victims leave, or its rows after the kept block
  /// rows arrive). Layouts size their scratch by it before the first change.
  std::size_t prompt_rows_max(int layer, const std::vector<std::vector<std::uint32_t>>& keep,
                              const std::vector<std::vector<std::uint32_t>>& victims) const {
    std::size_t most = 0;
    for (std::size_t kh = 0; kh < keep.size(); ++kh) {
      const std::size_t held = heads_[index(layer, static_cast<int>(kh))].size();
      most = std::max({most, held, held - victims[kh].size() + keep[kh].size()});
    }
    return most;
  }
  /// A pooled budget about to take effect (throws kvevict::Error if the layout cannot run it).
  void check_pool(const LayerPool&) const {}
  /// Keys (is_key) or values about to be stored: storable in the layout's format.
  void check_stored(std::span<const float> x, const char* what, bool is_key) const {
    (void)is_key;
    check_storable<Scalar>(x, what);
  }
  /// check_stored's test when it is a bound on |value| (check_storable's, as the bit pattern
  /// of the smallest |value| rejected), else 0. A layout that overrides check_stored
  /// overrides this too (a static_assert in check_values holds them together).
  std::uint32_t stored_limit_bits(bool is_key) const {
    (void)is_key;
    return storage_limit_bits<Scalar>();
  }

  Layout& self() { return static_cast<Layout&>(*this); }
  const Layout& self() const { return static_cast<const Layout&>(*this); }

  int group() const { return shape_.geometry.group(); }
  std::size_t udim() const { return static_cast<std::size_t>(shape_.geometry.head_dim); }
  std::size_t index(int layer, int kv_head) const { return head_index(shape_.geometry, layer, kv_head); }
  void check_head(int layer, int kv_head) const { detail::check_head(shape_.geometry, layer, kv_head); }
  const Head& head(int layer, int kv_head) const {
    check_head(layer, kv_head);
    return heads_[index(layer, kv_head)];
  }
  const LayerState& layer_state(int layer) const {
    check_layer(shape_.geometry, layer);
    return layers_[static_cast<std::size_t>(layer)];
  }

  // --- argument checks shared by every layout ------------------------------------------
  /// The checks of one decode token that do not depend on where K/V lives. values: required
  /// (n_kv_heads x head_dim) unless `values_optional`, then empty or that size.
  void check_token(int layer, std::int64_t position, std::span<const float> keys,
                   std::span<const float> values, std::span<const float> queries,
                   bool values_optional) const {
    const Geometry& g = shape_.geometry;
    check_layer(g, layer);
    self().prepare_token(layer);
    check_token_rows(g, keys, "append: keys");
    if (values_optional) {
      const std::size_t kv = static_cast<std::size_t>(g.n_kv_heads) * udim();
      require(values.empty() || values.size() == kv, "append: values has ", values.size(),
              " floats, expected 0 or ", kv, " (n_kv_heads x head_dim)");
    } else {
      check_token_rows(g, values, "append: values");
    }
    check_queries<Policy>(g, queries, 1, "append");
    check_arrivals(layers_[static_cast<std::size_t>(layer)], layer, position, 1, "append");
    check_values(keys, values, queries, true, "append: keys", "append: values", "append: queries");
  }
  /// The value checks of an append or prefill, after the size checks: keys and values
  /// (`with_values`) storable in the layout's format, queries (may be empty) finite. When
  /// the layout's check_stored is a bound (stored_limit_bits) the three are tested in one
  /// pass (kernels::abs_below: their reads interleaved); otherwise, or when that pass finds
  /// a bad value, the checks run one by one in that order, naming the first bad value.
  void check_values(std::span<const float> keys, std::span<const float> values,
                    std::span<const float> queries, bool with_values, const char* keys_what,
                    const char* values_what, const char* queries_what) const {
    static_assert(std::is_same_v<decltype(&Layout::check_stored), decltype(&ContainerCore::check_stored)> ==
                      std::is_same_v<decltype(&Layout::stored_limit_bits),
                                     decltype(&ContainerCore::stored_limit_bits)>,
                  "a layout that overrides check_stored overrides stored_limit_bits");
    const std::uint32_t kl = self().stored_limit_bits(true), vl = self().stored_limit_bits(false);
    if (kl != 0 && vl != 0) {
      const float* xs[3] = {keys.data(), values.data(), queries.data()};
      const std::size_t ns[3] = {keys.size(), with_values ? values.size() : 0, queries.size()};
      const std::uint32_t limits[3] = {kl, vl, kFiniteLimit};
      if (kernels::abs_below(xs, ns, limits, 3)) return;
    }
    self().check_stored(keys, keys_what, true);
    if (with_values) self().check_stored(values, values_what, false);
    check_finite(queries, queries_what);
  }
  /// The checks of a prefill block that do not depend on where K/V lives (values: none, or
  /// tokens x n_kv_heads x head_dim).
  void check_block(int layer, std::int64_t first_position, std::size_t tokens,
                   std::span<const float> keys, std::span<const float> values,
                   std::span<const float> queries, bool with_values) const {
    const Geometry& g = shape_.geometry;
    check_layer(g, layer);
    require(tokens > 0, "prefill: tokens = 0, expected > 0");
    check_block_rows(g, keys, tokens, "prefill: keys");
    if (with_values) check_block_rows(g, values, tokens, "prefill: values");
    constexpr bool wants_queries = has(Policy::signals, Signals::query) ||
                                   has(Policy::signals, Signals::attention) ||
                                   has(Policy::signals, Signals::prefill_window);
    check_queries<Policy>(g, queries, tokens, "prefill", wants_queries);
    check_arrivals(layers_[static_cast<std::size_t>(layer)], layer, first_position, tokens,
                   "prefill");
    check_values(keys, values, queries, with_values, "prefill: keys", "prefill: values",
                 "prefill: queries");
  }

  // --- views ----------------------------------------------------------------------------
  HeadView<Scalar> make_view(int layer, int kv_head, std::size_t size) const {
    const auto& h = heads_[index(layer, kv_head)];
    const RowsData<Scalar> rows = self().rows_data(layer, kv_head);
    HeadView<Scalar> v;
    v.layer = layer;
    v.kv_head = kv_head;
    v.head_dim = shape_.geometry.head_dim;
    v.group = group();
    v.size = size;
    v.capacity = shape_.at(layer, kv_head);
    v.keys = rows.keys;
    v.values = rows.values;
    v.positions = h.pos.data();
    v.seqs = h.seq.data();
    return v;
  }
  HeadView<Scalar> incoming_view(int layer, int kh, std::size_t size, std::int64_t position,
                                 const float* keys, const float* queries) const {
    HeadView<Scalar> view = make_view(layer, kh, size);
    view.incoming_seq = layers_[static_cast<std::size_t>(layer)].next_seq;
    view.incoming_position = position;
    view.incoming_key = keys + static_cast<std::size_t>(kh) * udim();
    if constexpr (has(Policy::signals, Signals::query))
      view.queries = queries + static_cast<std::size_t>(kh * group()) * udim();
    else
      (void)queries;
    return view;
  }

  /// Allocates room for `rows` live rows of head i (bookkeeping and the layout's storage).
  void reserve_head(std::size_t i, std::size_t rows, std::size_t cap) {
    auto& h = heads_[i];
    const bool settled = i < pool_settled_.size() && pool_settled_[i];
    const std::size_t n =
        pooled() ? pool_grown_rows(h.pos.capacity(), rows, settled ? 0 : cap, pool_.chunk[i])
                 : grown_rows(h.pos.capacity(), rows, cap);
    if (n == 0) return;
    self().reserve_rows(i, n);
    h.pos.reserve(n);
    h.seq.reserve(n);
  }
  /// Pooled heads: releases storage a shrunken share no longer needs (pool_release_rows).
  /// Runs after rows moved, so a failed allocation only keeps the larger storage.
  void release_head(std::size_t i) noexcept {
    const std::size_t to = pool_release_rows(heads_[i].pos.capacity(), heads_[i].size(), pool_.chunk[i]);
    if (to == 0) return;
    try {
      shrink_head(i, to);
    } catch (const std::bad_alloc&) {  // keeping the larger storage is always correct
    }
  }

  /// Pooled budgets: the victims (victims[i], by flat head index) of every head of
  /// `layer`'s pool (layer scope: the layer's heads; model scope: every head) when the pool
  /// would pass its total, or a head its ceiling. `stepping`: the layer whose heads each get
  /// one incoming row (-1: none, a budget change). The counts come from pooled_victim_counts
  /// over the policy's eviction costs (model scope: a head's costs are reused until it
  /// changes); each head's rows from its choose_victims, or, when the policy has the
  /// pooled_victims hook, from that: the same choice reusing the protection its
  /// eviction_costs pass computed (one protection pass per head and step, not two).
  /// `view(l, kh, n)` builds a view. With `schedule` (PoolOptions::Frozen::schedule, a step
  /// of a pool with rebalance_every > 1) the next rows of the pool's order are written to
  /// it as head indices from the pool's first head (pooled_victim_counts' schedule).
  template <class MakeView>
  void choose_pooled(int layer, int stepping, const LayerPool& pool, MakeView&& view,
                     std::vector<std::vector<std::uint32_t>>& victims,
                     std::vector<std::uint32_t>* schedule = nullptr) {
    const auto hkv = static_cast<std::size_t>(shape_.geometry.n_kv_heads);
    const auto [first, last] = pool.heads_of(layer, hkv);
    const std::size_t total = pool.total[pool.pool_of(layer)];
    const auto incoming = [&](std::size_t i) -> std::size_t {
      return stepping >= 0 && i / hkv == static_cast<std::size_t>(stepping) ? 1 : 0;
    };
    victims.resize(heads_.size());
    std::size_t after = 0;
    bool over = false;
    for (std::size_t i = first; i < last; ++i) {
      victims[i].clear();
      const std::size_t n = heads_[i].size() + incoming(i);
      after += n;
      over |= n > pool.ceiling[i];
    }
    if (schedule) schedule->clear();
    if (after <= total && !over) return;
    if constexpr (kPoolable) {
      pool_costs_.resize(heads_.size());
      pool_prefix_.resize(heads_.size());
      pool_fresh_.resize(heads_.size(), 0);
      pool_heads_.clear();
      // The heads whose costs are recomputed: their columns are cold (other layers ran
      // since), so each one's reads are started while the one before is costed.
      // Model scope: a head's costs unchanged since the last selection are reused, and so
      // is its sorted prefix; every other head with rows is costed again.
      const auto reused = [&](std::size_t i) { return pool.model && pool_fresh_[i] != 0; };
      pool_stale_.clear();
      for (std::size_t i = first; i < last; ++i)
        if (!reused(i) && heads_[i].size() > 0) pool_stale_.push_back(i);
      std::size_t next_stale = 0;
      const auto prefetch_stale = [&](std::size_t j) {
        if constexpr (HasPrefetchHead<Policy>)
          if (j < pool_stale_.size())
            policy_.prefetch_head(static_cast<int>(pool_stale_[j] / hkv), static_cast<int>(pool_stale_[j] % hkv));
      };
      prefetch_stale(0);
      for (std::size_t i = first; i < last; ++i) {
        const auto& h = heads_[i];
        auto& c = pool_costs_[i];
        const bool reuse = reused(i);
        if (!reuse) {
          if (h.size() == 0) {
            c.clear();
          } else {  // eviction_costs writes size costs over c
            prefetch_stale(++next_stale);
            const int l = static_cast<int>(i / hkv), kh = static_cast<int>(i % hkv);
            self().load_rows(l, kh, nullptr, nullptr);
            HeadView<Scalar> v = view(l, kh, h.size());
            if (pool.share && stepping >= 0) v.capacity = std::max(pool.floor[i], h.size());
            policy_.eviction_costs(v, c);
            if (c.size() != h.size())
              throw std::logic_error(std::string("kvevict: policy ") + Policy::name() +
                                     " eviction_costs wrote " + std::to_string(c.size()) +
                                     " costs, expected " + std::to_string(h.size()));
            scale_pool_costs_by(c, pool_factor(i, h.size(), pool));
          }
          pool_fresh_[i] = 1;
        }
        pool_heads_.push_back(PoolHead{h.size(), incoming(i), pool.floor[i], pool.ceiling[i], c.data(),
                                       h.seq.data(), &pool_prefix_[i], reuse});
      }
      // The schedule's length: the frozen steps' rows until the next re-split, at most
      // the pool's total.
      const std::size_t extra =
          schedule ? std::min(total, (pool.every_of(pool.pool_of(layer)) - 1) * static_cast<std::size_t>(hkv)) : 0;
      pooled_victim_counts(pool_heads_, total, pool_counts_, pool_scratch_, Policy::name(), extra,
                           extra > 0 ? schedule : nullptr);
      pooled_victims_of(first, last, stepping, pool, view, victims, true);
    }
  }
  /// pool_cost_factor(rows, pool.nominal[i], pool.exponent), kept per head for the last
  /// few row counts it was taken for (a head's rows move by a few between selections).
  float pool_factor(std::size_t i, std::size_t rows, const LayerPool& pool) {
    if (pool_factor_.size() < heads_.size()) pool_factor_.resize(heads_.size());
    PoolFactors& pf = pool_factor_[i];
    if (pf.nominal != pool.nominal[i] || pf.exponent != pool.exponent) pf = {{}, {}, pool.nominal[i], pool.exponent, 0};
    for (std::size_t k = 0; k < PoolFactors::kept; ++k)
      if (pf.rows[k] == rows) return pf.f[k];
    const std::size_t k = pf.next;
    pf.next = (k + 1) % PoolFactors::kept;
    pf.rows[k] = rows;
    pf.f[k] = pool_cost_factor(rows, pool.nominal[i], pool.exponent);
    return pf.f[k];
  }
  /// The victims of the pool's heads [first, last) for the counts in pool_counts_ (indexed
  /// from first): each head's k rows by its choose_victims (`costed`: its pooled_victims,
  /// reusing this step's eviction_costs pass).
  template <class MakeView>
  void pooled_victims_of(std::size_t first, std::size_t last, int stepping, const LayerPool& pool,
                         MakeView&& view, std::vector<std::vector<std::uint32_t>>& victims, bool costed) {
    const auto hkv = static_cast<std::size_t>(shape_.geometry.n_kv_heads);
    for (std::size_t i = first; i < last; ++i) {
      const std::size_t k = pool_counts_[i - first];
      if (k == 0) continue;
      const int l = static_cast<int>(i / hkv), kh = static_cast<int>(i % hkv);
      self().load_rows(l, kh, nullptr, nullptr);
      HeadView<Scalar> v = view(l, kh, heads_[i].size());
      if (pool.share && stepping >= 0) v.capacity = std::max(pool.floor[i], v.size);
      v.need = k;
      if constexpr (HasPooledVictims<Policy, Scalar>) {  // reuses the costs pass's protection
        if (costed) policy_.pooled_victims(v, victims[i]);
        else policy_.choose_victims(v, victims[i]);
      } else {
        policy_.choose_victims(v, victims[i]);
      }
      validate_victims<Policy>(victims[i], v.size, v.need);
    }
  }
  /// PoolOptions::Frozen::schedule, a frozen step of `layer`: the counts (pool_counts_, from
  /// the pool's first head) the pool's schedule gives from its read position
  /// (pool_schedule_take), or nothing when it runs out first (the step re-splits).
  std::optional<std::size_t> pool_schedule_counts(int layer) {
    const auto hkv = static_cast<std::size_t>(shape_.geometry.n_kv_heads);
    const std::size_t p = pool_.pool_of(layer);
    const auto [first, last] = pool_.heads_of(layer, hkv);
    pool_heads_.clear();
    for (std::size_t i = first; i < last; ++i)
      pool_heads_.push_back(PoolHead{heads_[i].size(), i / hkv == static_cast<std::size_t>(layer) ? 1u : 0u,
                                     pool_.floor[i], pool_.ceiling[i]});
    return pool_schedule_take(pool_heads_, pool_schedule_[p], pool_schedule_at_[p], pool_counts_);
  }
  /// PoolOptions::rebalance_every: whether the step of `layer` about to run keeps its
  /// pool's split (each stepping head gives up one row by its own choose_victims) instead
  /// of re-deciding it: not the pool's rebalance step (its step count since the budget took
  /// effect a multiple of rebalance_every), the pool full (its rows exactly its total), and
  /// every head of `layer` holding a row, at least its floor and at most its ceiling.
  bool pool_frozen(int layer) const {
    const std::size_t p = pool_.pool_of(layer);
    const std::size_t every = pool_.every_of(p);
    if (every <= 1) return false;
    if (pool_steps_[p] % every == 0) return false;
    const auto hkv = static_cast<std::size_t>(shape_.geometry.n_kv_heads);
    const auto [first, last] = pool_.heads_of(layer, hkv);
    std::size_t rows = 0;
    for (std::size_t i = first; i < last; ++i) rows += heads_[i].size();
    if (rows != pool_.total[p]) return false;
    for (std::size_t kh = 0; kh < hkv; ++kh) {
      const std::size_t i = index(layer, static_cast<int>(kh)), n = heads_[i].size();
      if (n == 0 || n < pool_.floor[i] || n > pool_.ceiling[i]) return false;
    }
    return true;
  }
  /// Model-scope pools reuse a head's eviction costs until the head changes.
  void pool_touch(std::size_t i) {
    if (i < pool_fresh_.size()) pool_fresh_[i] = 0;
  }
  /// A view of a head outside the stepping layer (no incoming token).
  HeadView<Scalar> resting_view(int layer, int kv_head, std::size_t n) const {
    HeadView<Scalar> v = make_view(layer, kv_head, n);
    v.incoming_seq = layers_[static_cast<std::size_t>(layer)].next_seq;
    return v;
  }

  /// Shared decisions (HasSharedDecisions, policy_.shared_decisions()): one victim set for
  /// every KV head of `layer`, from the heads' token costs combined per row, written to
  /// scratch_victims_. Returns false (per-head decisions) for other policies, and while the
  /// heads do not hold the same tokens in the same rows (a budget that gives the heads of
  /// a layer different capacities makes them diverge).
  bool choose_shared(int layer, std::int64_t position, const float* keys, const float* queries) {
    if constexpr (HasSharedDecisions<Policy, Scalar>) {
      if (!shared_layer(layer)) return false;
      const int hkv = shape_.geometry.n_kv_heads;
      const std::size_t n = heads_[index(layer, 0)].size();
      std::size_t limit = append_limit(policy_, shape_.at(layer, 0), layer, 0);
      for (int kh = 1; kh < hkv; ++kh)
        limit = std::min(limit, append_limit(policy_, shape_.at(layer, kh), layer, kh));
      for (auto& v : scratch_victims_) v.clear();
      if (n < limit) return true;
      shared_victims(layer, n - limit + 1, scratch_victims_, [&](int kh) {
        return incoming_view(layer, kh, n, position, keys, queries);
      });
      return true;
    } else {
      (void)layer, (void)position, (void)keys, (void)queries;
      return false;
    }
  }
  /// Whether `layer`'s heads decide together: a shared-decisions policy, and every KV head
  /// holding the same tokens in the same rows.
  bool shared_layer(int layer) const {
    if constexpr (HasSharedDecisions<Policy, Scalar>) {
      if (!policy_.shared_decisions()) return false;
      const auto& h0 = heads_[index(layer, 0)];
      for (int kh = 1; kh < shape_.geometry.n_kv_heads; ++kh) {
        const auto& h = heads_[index(layer, kh)];
        if (h.size() != h0.size() || !std::equal(h.seq.begin(), h.seq.end(), h0.seq.begin())) return false;
      }
      return true;
    } else {
      (void)layer;
      return false;
    }
  }
  /// One victim set of `need` or more rows for every KV head of `layer` (heads aligned:
  /// shared_layer), from the heads' token costs combined per row; view(kh) is the HeadView
  /// each head is asked through (its need is set here). out[kh] receives the victims.
  template <class MakeView>
  void shared_victims(int layer, std::size_t need, std::vector<std::vector<std::uint32_t>>& out,
                      MakeView&& view_of) {
    if constexpr (HasSharedDecisions<Policy, Scalar>) {
      const int hkv = shape_.geometry.n_kv_heads;
      const std::size_t n = heads_[index(layer, 0)].size();
      shared_costs_.resize(static_cast<std::size_t>(hkv));
      for (int kh = 0; kh < hkv; ++kh) {
        self().load_rows(layer, kh, nullptr, nullptr);
        HeadView<Scalar> view = view_of(kh);
        view.need = need;
        auto& c = shared_costs_[static_cast<std::size_t>(kh)];
        policy_.token_costs(view, c);
        if (c.size() != n)
          throw std::logic_error(std::string("kvevict: policy ") + Policy::name() +
                                 " token_costs wrote " + std::to_string(c.size()) +
                                 " costs, expected " + std::to_string(n));
      }
      policy_.combine_costs(std::span<const std::vector<float>>(shared_costs_), shared_combined_);
      self().load_rows(layer, 0, nullptr, nullptr);
      HeadView<Scalar> view = view_of(0);
      view.need = need;
      out.resize(static_cast<std::size_t>(hkv));
      auto& victims = out[0];
      policy_.victims_from_costs(view, std::span<const float>(shared_combined_), victims);
      validate_victims<Policy>(victims, view.size, view.need);
      for (int kh = 1; kh < hkv; ++kh) out[static_cast<std::size_t>(kh)] = victims;
    } else {
      (void)layer, (void)need, (void)out, (void)view_of;
    }
  }

  /// Swap-removes `victims` (validated, sorted descending) from (layer, kv_head).
  void evict_victims(int layer, int kv_head, const std::vector<std::uint32_t>& victims) {
    const std::size_t i = index(layer, kv_head);
    auto& h = heads_[i];
    if (!victims.empty()) {
      pool_touch(i);
      if (pooled()) {  // from now on its storage grows by chunks (pool_grown_rows)
        if (pool_settled_.size() != heads_.size()) pool_settled_.assign(heads_.size(), 0);
        pool_settled_[i] = 1;
      }
    }
    for (std::uint32_t r : victims) {
      const std::size_t last = h.size() - 1;
      self().remove_row(layer, kv_head, i, r, last);
      if (r != last) {
        h.pos[r] = h.pos[last];
        h.seq[r] = h.seq[last];
        policy_.on_move(layer, kv_head, last, r);
      }
      h.pos.pop_back();
      h.seq.pop_back();
    }
  }

  // --- one decode token (validated) ----------------------------------------------------
  /// `keys` (and `values`, may be null) are n_kv_heads x head_dim; `token` is the token's
  /// index within a prefill block (0 for a decode step), passed to the layout.
  void step(int layer, std::int64_t position, const float* keys, const float* values,
            const float* queries, std::uint32_t token = 0) {
    const Geometry& g = shape_.geometry;
    auto& ls = layers_[static_cast<std::size_t>(layer)];
    const std::size_t d = udim();
    // Phase 1: every decision and allocation that may throw, before anything changes.
    scratch_victims_.resize(static_cast<std::size_t>(g.n_kv_heads));
    std::size_t total_victims = 0, max_rows = 0;
    const auto hkv = static_cast<std::size_t>(g.n_kv_heads);
    const bool frozen = pooled() && pool_frozen(layer);
    // PoolOptions::Frozen::schedule: the frozen step's counts from the schedule (nothing
    // when it ran out: the step re-splits); own: each stepping head decides alone.
    std::optional<std::size_t> scheduled;
    if (frozen && pool_.schedule) scheduled = pool_schedule_counts(layer);
    const bool own = frozen && !pool_.schedule;
    bool new_schedule = false;  // a re-split wrote pool_next_schedule_
    if (own) {  // the split kept: each head gives one row by its own decision
      for (int kh = 0; kh < g.n_kv_heads; ++kh) {
        auto& victims = scratch_victims_[static_cast<std::size_t>(kh)];
        victims.clear();
        const std::size_t i = index(layer, kh), n = heads_[i].size();
        self().load_rows(layer, kh, nullptr, nullptr);
        HeadView<Scalar> view = incoming_view(layer, kh, n, position, keys, queries);
        if (pool_.share) view.capacity = std::max(pool_.floor[i], n);
        view.need = 1;
        policy_.choose_victims(view, victims);
        validate_victims<Policy>(victims, view.size, view.need);
      }
    } else if (pooled()) {
      const auto view = [&](int l, int kh, std::size_t n) {
        return l == layer ? incoming_view(layer, kh, n, position, keys, queries) : resting_view(l, kh, n);
      };
      if (scheduled) {  // the schedule's counts, each head's rows by its own choice
        const auto [first, last] = pool_.heads_of(layer, hkv);
        pool_victims_.resize(heads_.size());
        for (std::size_t i = first; i < last; ++i) pool_victims_[i].clear();
        if constexpr (HasPrefetchHead<Policy>)  // the named heads are cold: overlap their reads
          for (std::size_t i = first; i < last; ++i)
            if (pool_counts_[i - first] > 0)
              policy_.prefetch_head(static_cast<int>(i / hkv), static_cast<int>(i % hkv));
        pooled_victims_of(first, last, layer, pool_, view, pool_victims_, false);
      } else {
        new_schedule = pool_.schedule && pool_.every_of(pool_.pool_of(layer)) > 1;
        choose_pooled(layer, layer, pool_, view, pool_victims_, new_schedule ? &pool_next_schedule_ : nullptr);
      }
      for (std::size_t kh = 0; kh < hkv; ++kh)
        scratch_victims_[kh].assign(pool_victims_[index(layer, static_cast<int>(kh))].begin(),
                                    pool_victims_[index(layer, static_cast<int>(kh))].end());
      if (pool_.model)  // other layers' heads give rows too: room to gather them
        for (std::size_t i = 0; i < heads_.size(); ++i)
          if (!pool_victims_[i].empty() && i / hkv != static_cast<std::size_t>(layer)) {
            total_victims += pool_victims_[i].size();
            max_rows = std::max(max_rows, heads_[i].size() + 1);
          }
    } else if (!choose_shared(layer, position, keys, queries)) {
      for (int kh = 0; kh < g.n_kv_heads; ++kh) {
        auto& victims = scratch_victims_[static_cast<std::size_t>(kh)];
        victims.clear();
        const std::size_t n = heads_[index(layer, kh)].size();
        const std::size_t limit = append_limit(policy_, shape_.at(layer, kh), layer, kh);
        if (n >= limit) {
          self().load_rows(layer, kh, nullptr, nullptr);
          HeadView<Scalar> view = incoming_view(layer, kh, n, position, keys, queries);
          view.need = n - limit + 1;
          policy_.choose_victims(view, victims);
          validate_victims<Policy>(victims, view.size, view.need);
        }
      }
    }
    for (int kh = 0; kh < g.n_kv_heads; ++kh) {
      const auto& victims = scratch_victims_[static_cast<std::size_t>(kh)];
      const std::size_t i = index(layer, kh);
      const std::size_t n = heads_[i].size();
      total_victims += victims.size();
      reserve_head(i, n - victims.size() + 1, shape_.at(layer, kh));
      self().prepare_head(layer, kh, i, victims);
      // The victims' positions and arrival indices are overwritten in phase 2: request
      // their lines now, so that the heads' misses overlap.
      for (const std::uint32_t r : victims) {
        __builtin_prefetch(heads_[i].pos.data() + r, 1);
        __builtin_prefetch(heads_[i].seq.data() + r, 1);
      }
      max_rows = std::max(max_rows, n + 1);
    }
    self().prepare_step(layer, total_victims, max_rows);
    // Phase 2: apply; nothing below throws except the policy's own bookkeeping.
    if (scheduled) {
      pool_schedule_at_[pool_.pool_of(layer)] = *scheduled;
    } else if (new_schedule) {
      pool_schedule_[pool_.pool_of(layer)].swap(pool_next_schedule_);
      pool_schedule_at_[pool_.pool_of(layer)] = 0;
    }
    if (pooled() && pool_.model && !own)  // first the other layers' victims of a model pool
      for (std::size_t i = 0; i < heads_.size(); ++i)
        if (!pool_victims_[i].empty() && i / hkv != static_cast<std::size_t>(layer)) {
          const int l = static_cast<int>(i / hkv), kh = static_cast<int>(i % hkv);
          self().load_rows(l, kh, nullptr, nullptr);
          evict_victims(l, kh, pool_victims_[i]);
          pool_victims_[i].clear();
          release_head(i);
        }
    for (int kh = 0; kh < g.n_kv_heads; ++kh) {
      const std::size_t i = index(layer, kh);
      const float* kin = keys + static_cast<std::size_t>(kh) * d;
      const float* vin = values ? values + static_cast<std::size_t>(kh) * d : nullptr;
      self().load_rows(layer, kh, kin, vin);
      evict_victims(layer, kh, scratch_victims_[static_cast<std::size_t>(kh)]);
      auto& h = heads_[i];
      const std::size_t row = h.size();
      self().push_row(layer, kh, i, row, position, ls.next_seq, kin, vin, token);
      h.pos.push_back(position);
      h.seq.push_back(ls.next_seq);
      HeadView<Scalar> view = incoming_view(layer, kh, row + 1, position, keys, queries);
      policy_.on_append(view, row);
      pool_touch(i);
      if (pooled() && !scratch_victims_[static_cast<std::size_t>(kh)].empty()) release_head(i);
    }
    ++ls.next_seq;
    ls.last_position = position;
    if (pooled()) ++pool_steps_[pool_.pool_of(layer)];
  }

  // --- prefill (validated) ---------------------------------------------------------------
  /// keys and values (values may be null) are tokens x n_kv_heads x head_dim.
  void prefill_block(int layer, std::int64_t first_position, std::size_t tokens, const float* keys,
                     const float* values, const float* queries) {
    if constexpr (HasPrefillKeep<Policy>) {
      if (layers_[static_cast<std::size_t>(layer)].next_seq == 0) {
        prefill_select(layer, first_position, tokens, keys, values, queries, false);
        return;
      }
      // Chunked prefill: a policy that reselects picks from its held rows plus the chunk.
      if constexpr (HasPrefillReselect<Policy, Scalar>) {
        if (policy_.reselects_prefill()) {
          prefill_select(layer, first_position, tokens, keys, values, queries, true);
          return;
        }
      }
    }
    const std::size_t stride = static_cast<std::size_t>(shape_.geometry.n_kv_heads) * udim();
    const std::size_t hq = static_cast<std::size_t>(shape_.geometry.n_heads) * udim();
    // Token by token, each a step: a layout that may refuse a step (an exhausted block pool)
    // checks the whole block first, so a refusal never leaves part of the block applied.
    self().prepare_token_prefill(layer, tokens);
    std::vector<float> probs;
    for (std::size_t t = 0; t < tokens; ++t) {
      const float* qt = queries ? queries + t * hq : nullptr;
      step(layer, first_position + static_cast<std::int64_t>(t), keys + t * stride,
           values ? values + t * stride : nullptr, qt, static_cast<std::uint32_t>(t));
      if constexpr (has(Policy::signals, Signals::attention)) {
        for (int kh = 0; kh < shape_.geometry.n_kv_heads; ++kh) {
          const std::size_t n = heads_[index(layer, kh)].size();
          const Scalar* rows = self().attention_rows(layer, kh);
          probs.resize(static_cast<std::size_t>(group()) * n);
          group_probabilities(rows, n, udim(), qt + static_cast<std::size_t>(kh * group()) * udim(),
                              group(), probs.data());
          policy_.observe(AttentionView{layer, kh, group(), n, probs.data()});
        }
      }
    }
  }

  /// The view prefill_keep selects from on (layer, kv_head): the head's first `held` rows
  /// in arrival order (their row indices; their stored keys widened to float when the
  /// policy reads stored rows), then the block. The view points into the caller's buffers.
  PrefillView prompt_view(int layer, int kh, std::int64_t first_position, std::size_t tokens,
                          const float* keys, const float* queries, std::size_t held,
                          std::vector<std::uint32_t>& order, std::vector<float>& held_keys,
                          std::vector<std::uint64_t>& held_seqs) {
    const Geometry& g = shape_.geometry;
    const auto& h = heads_[index(layer, kh)];
    const std::size_t d = udim();
    require(tokens < (std::size_t{1} << 32) - held, "prefill: ", tokens, " tokens after ", held,
            " held rows, expected fewer than 2^32 in one selection");
    PrefillView pv{layer, kh, g.head_dim, group(), g.n_kv_heads, g.n_heads, held + tokens,
                   shape_.at(layer, kh), first_position,
                   layers_[static_cast<std::size_t>(layer)].next_seq, keys, queries};
    if constexpr (HasPrefillReselect<Policy, Scalar>) {
      if (held > 0) {  // the held rows in arrival order
        order.resize(held);
        std::iota(order.begin(), order.end(), 0u);
        std::sort(order.begin(), order.end(),
                  [&](std::uint32_t a, std::uint32_t b) { return h.seq[a] < h.seq[b]; });
        held_seqs.resize(held);
        for (std::size_t j = 0; j < held; ++j) held_seqs[j] = h.seq[order[j]];
        pv.held = held;
        pv.held_rows = order.data();
        pv.held_seqs = held_seqs.data();
        if constexpr (reads_stored_rows<Policy>()) {  // keys widened to float
          self().load_rows(layer, kh, nullptr, nullptr);
          const RowsData<Scalar> rows = self().rows_data(layer, kh);
          held_keys.resize(held * d);
          for (std::size_t j = 0; j < held; ++j) {
            const Scalar* src = rows.keys + static_cast<std::size_t>(order[j]) * d;
            for (std::size_t c = 0; c < d; ++c) held_keys[j * d + c] = static_cast<float>(src[c]);
          }
          pv.held_keys = held_keys.data();
        }
      }
    } else {
      (void)order, (void)held_keys, (void)held_seqs, (void)d, (void)h;
    }
    return pv;
  }

  /// prefill_keep selection per head. On an empty layer (`reselect` false) the policy
  /// selects from the block alone. With `reselect` (chunked prefill, HasPrefillReselect)
  /// the view holds the head's rows first (arrival order, stored keys) and then the block;
  /// held rows the selection drops are evicted (swap-remove, through the layout's
  /// remove_row: callbacks, decisions, freed blocks) before any block row is written, so
  /// a head never holds more than its capacity, not even while a chunk is selected.
  /// Everything that may throw (the selection, allocation, the layout's checks) runs
  /// before anything changes.
  void prefill_select(int layer, std::int64_t first_position, std::size_t tokens,
                      const float* keys, const float* values, const float* queries,
                      bool reselect) {
    const Geometry& g = shape_.geometry;
    auto& ls = layers_[static_cast<std::size_t>(layer)];
    const auto hkv = static_cast<std::size_t>(g.n_kv_heads);
    const std::size_t d = udim();
    std::vector<std::vector<std::uint32_t>> keep(hkv), victims(hkv);
    std::vector<std::uint32_t> chosen, order;
    std::vector<float> held_keys;
    std::vector<std::uint64_t> held_seqs;
    for (int kh = 0; kh < g.n_kv_heads; ++kh) {
      const std::size_t i = index(layer, kh);
      const std::size_t held = reselect ? heads_[i].size() : 0;
      const PrefillView pv = prompt_view(layer, kh, first_position, tokens, keys, queries, held,
                                         order, held_keys, held_seqs);
      chosen.clear();
      policy_.prefill_keep(pv, chosen);
      validate_prefill_keep<Policy>(chosen, pv.tokens, pv.capacity);
      auto& kp = keep[static_cast<std::size_t>(kh)];
      auto& vk = victims[static_cast<std::size_t>(kh)];
      std::size_t next = 0;  // chosen is ascending: held indices first
      for (std::size_t j = 0; j < held; ++j) {
        if (next < chosen.size() && chosen[next] == j) ++next;
        else vk.push_back(order[j]);
      }
      for (; next < chosen.size(); ++next) kp.push_back(chosen[next] - static_cast<std::uint32_t>(held));
      std::sort(vk.begin(), vk.end(), std::greater<>());
      const std::size_t after = held - vk.size() + kp.size();
      reserve_head(i, std::max(held, after), pv.capacity);
    }
    self().prepare_prompt(layer, tokens, keep, victims);
    const std::size_t stride = hkv * d;
    for (int kh = 0; kh < g.n_kv_heads; ++kh) {
      const std::size_t i = index(layer, kh);
      auto& h = heads_[i];
      const auto& kp = keep[static_cast<std::size_t>(kh)];
      if (reselect && h.size() > 0) {
        self().load_rows(layer, kh, nullptr, nullptr);  // gathered views mirror the removals
        evict_victims(layer, kh, victims[static_cast<std::size_t>(kh)]);
      }
      self().begin_prompt_head(layer, kh);
      if constexpr (HasPrefillReselect<Policy, Scalar>) {
        HeadView<Scalar> view = make_view(layer, kh, h.size());
        view.incoming_seq = ls.next_seq;
        view.incoming_position = first_position;
        policy_.on_prefill_selected(view);
      }
      std::size_t next = 0;
      for (std::size_t t = 0; t < tokens; ++t) {
        const float* kin = keys + t * stride + static_cast<std::size_t>(kh) * d;
        const float* vin = values ? values + t * stride + static_cast<std::size_t>(kh) * d : nullptr;
        const auto pos = first_position + static_cast<std::int64_t>(t);
        const std::uint64_t seq = ls.next_seq + t;
        if (next < kp.size() && kp[next] == t) {
          ++next;
          const std::size_t row = h.size();
          self().keep_prompt_row(layer, kh, i, row, t, kin, vin, pos, seq);
          h.pos.push_back(pos);
          h.seq.push_back(seq);
          pool_touch(i);
          HeadView<Scalar> view = make_view(layer, kh, row + 1);
          view.incoming_seq = seq;
          view.incoming_position = pos;
          view.incoming_key = kin;
          policy_.on_append(view, row);
        } else {
          self().drop_prompt_row(layer, kh, i, t, kin, vin, pos, seq);
        }
      }
    }
    ls.next_seq += tokens;
    ls.last_position = first_position + static_cast<std::int64_t>(tokens) - 1;
  }

  // --- budget ----------------------------------------------------------------------------
  /// Changes the budget: heads above their new capacity evict through the policy (chosen
  /// for every head before anything moves); storage beyond the new capacity is released.
  void change_budget(const Budget& budget) {
    check_live(shape_.geometry, "set_budget");
    budget.validate(shape_.geometry);
    auto caps = resolve_capacities(shape_.geometry, budget);
    check_capacities(policy_, shape_.geometry, caps);
    LayerPool pool;
    if constexpr (kPoolable) pool = LayerPool::resolve(shape_.geometry, budget, caps, policy_.min_capacity());
    std::vector<std::vector<std::uint32_t>> victims(heads_.size());
    const Geometry& g = shape_.geometry;
    if (pool.on) self().check_pool(pool);
    pool_fresh_.assign(pool_fresh_.size(), 0);  // costs were computed under the old budget
    pool_settled_.assign(pool.on ? heads_.size() : 0, 1);  // no geometric regrowth after a change
    for (int l = 0; pool.on && l < (pool.model ? 1 : g.n_layers); ++l) {
      // The pool's rows over its new total leave across its heads, by eviction cost.
      choose_pooled(
          l, -1, pool,
          [&](int hl, int kh, std::size_t n) {
            HeadView<Scalar> view = resting_view(hl, kh, n);
            view.capacity = caps[index(hl, kh)];
            return view;
          },
          pool_victims_);
      const auto [first, last] = pool.heads_of(l, static_cast<std::size_t>(g.n_kv_heads));
      for (std::size_t i = first; i < last; ++i) victims[i] = pool_victims_[i];
    }
    pool_fresh_.assign(pool_fresh_.size(), 0);
    for (int l = 0; !pool.on && l < g.n_layers; ++l) {
      // Shared decisions shrink a layer whose heads share one capacity with one victim set,
      // so its heads keep holding the same tokens.
      const std::size_t first = index(l, 0), n0 = heads_[first].size();
      const bool same_cap = std::all_of(caps.begin() + static_cast<std::ptrdiff_t>(first),
                                        caps.begin() + static_cast<std::ptrdiff_t>(first) + g.n_kv_heads,
                                        [&](std::size_t c) { return c == caps[first]; });
      if (same_cap && n0 > caps[first] && shared_layer(l)) {
        shared_victims(l, n0 - caps[first], shared_shrink_, [&](int kh) {
          HeadView<Scalar> view = make_view(l, kh, n0);
          view.capacity = caps[first];
          view.incoming_seq = layers_[static_cast<std::size_t>(l)].next_seq;
          return view;
        });
        for (int kh = 0; kh < g.n_kv_heads; ++kh)
          victims[first + static_cast<std::size_t>(kh)] = std::move(shared_shrink_[static_cast<std::size_t>(kh)]);
        continue;
      }
      for (int kh = 0; kh < g.n_kv_heads; ++kh) {
        const std::size_t i = index(l, kh);
        const std::size_t n = heads_[i].size();
        if (n <= caps[i]) continue;
        self().load_rows(l, kh, nullptr, nullptr);
        HeadView<Scalar> view = make_view(l, kh, n);
        view.capacity = caps[i];
        view.need = n - caps[i];
        view.incoming_seq = layers_[static_cast<std::size_t>(l)].next_seq;
        policy_.choose_victims(view, victims[i]);
        validate_victims<Policy>(victims[i], view.size, view.need);
      }
    }
    shape_.capacity = std::move(caps);
    pool_ = std::move(pool);
    pool_steps_.assign(pool_.total.size(), 0);  // step 0 of the new budget re-splits
    pool_schedule_.assign(pool_.total.size(), {});
    pool_schedule_at_.assign(pool_.total.size(), 0);
    for (int l = 0; l < g.n_layers; ++l)
      for (int kh = 0; kh < g.n_kv_heads; ++kh) {
        const std::size_t i = index(l, kh);
        evict_victims(l, kh, victims[i]);
        pool_touch(i);
        if (pooled()) release_head(i);
        else shrink_head(i, shape_.capacity[i]);
      }
    if constexpr (detail::HasOnBudget<Policy>) policy_.on_budget(shape_);
  }

  void shrink_head(std::size_t i, std::size_t cap) {
    auto& h = heads_[i];
    if (h.pos.capacity() <= cap) return;
    self().shrink_rows(i, cap);
    shrink_vector(h.pos, cap);
    shrink_vector(h.seq, cap);
  }
  template <class V>
  static void shrink_vector(V& vec, std::size_t n) {
    V fresh;
    fresh.reserve(n);
    fresh.assign(vec.begin(), vec.end());
    vec.swap(fresh);
  }

  CacheShape shape_;
  Policy policy_;
  std::vector<Head> heads_;
  std::vector<LayerState> layers_;
  std::vector<std::vector<std::uint32_t>> scratch_victims_;
  std::vector<float> sums_;  ///< observe scratch: the group sum of each row
  std::vector<std::vector<float>> shared_costs_;  ///< choose_shared: token costs per KV head
  std::vector<float> shared_combined_;            ///< choose_shared: combined per row
  std::vector<std::vector<std::uint32_t>> shared_shrink_;  ///< change_budget: shared victims
  /// Budget::pooled() takes effect only for policies that rank rows across heads.
  static constexpr bool kPoolable = HasEvictionCosts<Policy, Scalar>;
  LayerPool pool_;  ///< the pooled budget (pool_.on), else empty
  std::vector<std::vector<float>> pool_costs_;  ///< choose_pooled: costs per head
  std::vector<std::uint8_t> pool_fresh_;         ///< model scope: pool_costs_[i] still valid
  /// choose_pooled: each head's cheapest rows, sorted (model scope: reused while the head is
  /// unchanged; both scopes: the guessed bound of its next scan)
  std::vector<PoolPrefix> pool_prefix_;
  /// choose_pooled: per head its cost factor (pool_cost_factor) and what it was taken for
  /// (0 rows: none yet); the heads whose costs are recomputed.
  struct PoolFactors {
    static constexpr std::size_t kept = 4;
    std::size_t rows[kept] = {};  ///< 0: no entry (a head of 0 rows is not costed)
    float f[kept] = {};
    std::size_t nominal = 0;
    double exponent = 0.0;
    std::size_t next = 0;
  };
  std::vector<PoolFactors> pool_factor_;
  std::vector<std::size_t> pool_stale_;
  /// Pooled heads that gave up rows: their storage grows by chunks only, never
  /// geometrically, so a layer's storage stays within its total + the chunks.
  std::vector<std::uint8_t> pool_settled_;
  /// Steps of each pool since its budget took effect (PoolOptions::rebalance_every).
  std::vector<std::uint64_t> pool_steps_;
  std::vector<std::vector<std::uint32_t>> pool_victims_;  ///< choose_pooled: victims per head
  /// PoolOptions::Frozen::schedule: per pool, the heads (from its first) of the rows its last
  /// re-split ranked after its own victims, in the pool's order, and the next entry to read.
  std::vector<std::vector<std::uint32_t>> pool_schedule_;
  std::vector<std::size_t> pool_schedule_at_;
  std::vector<std::uint32_t> pool_next_schedule_;  ///< a re-split's schedule until applied
  std::vector<PoolHead> pool_heads_;
  std::vector<std::size_t> pool_counts_;
  PoolScratch pool_scratch_;
  ExclusiveUse exclusive_;
};

}  // namespace kvevict::detail
