#pragma once
// IndexCache<Policy, Scalar>: KVCache's bookkeeping without K/V storage, for engines that
// keep their own cells (a llama.cpp-style cell array, a paged cache). It tracks, per
// (layer, KV head), the live rows in the order the policy sees them, each with its
// engine cell, position and arrival index; it runs any EvictionPolicy over those rows and
// returns decisions the engine applies to its own memory. Same policy hooks, same
// decisions as KVCache on the same stream (bookkeeping.hpp holds the shared rules).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
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

/// One instruction to the engine. For each victim of a head, an `evict` record comes
/// first; if the victim was not the last row, a `move` record (last row -> victim's row)
/// follows, and the head then has one row fewer. A `place` record says where the new
/// token's row is and which cell holds it. Engines that address K/V by cell only need to
/// free evicted cells; engines that keep K/V dense in row order apply the moves too.
struct Decision {
  enum class Kind : std::uint8_t { evict, move, place };
  static constexpr std::uint32_t kNoRow = std::numeric_limits<std::uint32_t>::max();
  Kind kind = Kind::evict;
  int layer = 0;
  int kv_head = 0;
  std::uint32_t row = 0;   ///< evict: the row leaving (kNoRow: a prompt token never kept);
                           ///< move: destination; place: the new token's row
  std::uint32_t from = 0;  ///< move: source row (the last live row); place, and evict with
                           ///< row = kNoRow: the token's index within the call's block
  std::uint32_t cell = 0;  ///< the engine cell of the row concerned (evict: now free)
  std::int64_t position = 0;
  std::uint64_t seq = 0;  ///< arrival index within the layer
};

/// Where one layer's stored K (or V) rows live in engine memory, for the duration of a
/// call: the row of KV head h in cell c starts at data + c * cell_stride + h * head_stride.
/// llama.cpp layout [cells][Hkv][d]: cell_stride = Hkv * d, head_stride = d.
/// Head-major [Hkv][cells][d]: cell_stride = d, head_stride = cells * d.
template <class Scalar>
struct CellRows {
  const Scalar* data = nullptr;
  std::size_t cell_stride = 0;
  std::size_t head_stride = 0;
  [[nodiscard]] const Scalar* row(int kv_head, std::uint32_t cell) const {
    return data + static_cast<std::size_t>(cell) * cell_stride +
           static_cast<std::size_t>(kv_head) * head_stride;
  }
};

template <class Policy, class Scalar = float>
  requires EvictionPolicy<Policy, Scalar>
class IndexCache {
 public:
  using scalar_type = Scalar;
  using policy_type = Policy;
  /// Pass as a cell to let the IndexCache allocate: a victim's freed cell, else the lowest
  /// never-used one, so cells stay in [0, capacity) under a bounded budget.
  static constexpr std::uint32_t kAutoCell = std::numeric_limits<std::uint32_t>::max();

  /// `cells_per_head`: cells the engine has per (layer, KV head); cell ids must be below
  /// it, and it must be >= every finite capacity (a full head needs a cell per row). 0: the
  /// largest capacity + 1 (one spare for engines that write the new token before
  /// evicting), or 2^20 under an unbounded budget (an append that would need more live
  /// rows than cells is then rejected).
  IndexCache(const Geometry& geometry, const Budget& budget, Policy policy = Policy{},
             std::uint32_t cells_per_head = 0)
      : policy_(std::move(policy)) {
    geometry.validate();
    budget.validate(geometry);
    shape_.geometry = geometry;
    shape_.capacity = detail::resolve_capacities(geometry, budget);
    detail::check_capacities(policy_, geometry, shape_.capacity);
    std::size_t finite = 0;  // the largest finite capacity
    bool unbounded = false;
    for (std::size_t c : shape_.capacity) {
      if (c == Budget::kUnbounded) unbounded = true;
      else finite = std::max(finite, c);
    }
    if (cells_per_head == 0) {
      detail::require(finite < kAutoCell - 1, "IndexCache: capacity ", finite,
                      " rows, expected < ", kAutoCell - 1, " (cells are 32-bit ids)");
      cells_per_head = static_cast<std::uint32_t>(finite + 1);
      if (unbounded) cells_per_head = std::max<std::uint32_t>(cells_per_head, 1u << 20);
    }
    detail::require(cells_per_head >= finite, "IndexCache: cells_per_head = ", cells_per_head,
                    ", expected >= the largest capacity ", finite,
                    " (a full head holds one row per cell)");
    detail::require(cells_per_head < kAutoCell, "IndexCache: cells_per_head = ", cells_per_head,
                    ", expected < ", kAutoCell, " (reserved for kAutoCell)");
    cell_limit_ = cells_per_head;
    heads_.resize(shape_.capacity.size());
    layers_.resize(static_cast<std::size_t>(geometry.n_layers));
    policy_.bind(shape_);
  }

  IndexCache(const IndexCache&) = default;
  IndexCache& operator=(const IndexCache&) = default;
  /// A moved-from IndexCache is valid and empty, as a moved-from KVCache: no layers, and
  /// every call that names a layer throws kvevict::Error saying it was moved from.
  IndexCache(IndexCache&& o) noexcept(std::is_nothrow_move_constructible_v<Policy>)
      : shape_(std::exchange(o.shape_, CacheShape{})),
        policy_(std::move(o.policy_)),
        cell_limit_(std::exchange(o.cell_limit_, 0)),
        heads_(std::exchange(o.heads_, {})),
        layers_(std::exchange(o.layers_, {})),
        decisions_(std::exchange(o.decisions_, {})),
        scratch_victims_(std::exchange(o.scratch_victims_, {})),
        gather_(std::exchange(o.gather_, {})),
        gather_v_(std::exchange(o.gather_v_, {})) {}
  IndexCache& operator=(IndexCache&& o) noexcept(std::is_nothrow_move_assignable_v<Policy>) {
    if (this != &o) {
      shape_ = std::exchange(o.shape_, CacheShape{});
      policy_ = std::move(o.policy_);
      cell_limit_ = std::exchange(o.cell_limit_, 0);
      heads_ = std::exchange(o.heads_, {});
      layers_ = std::exchange(o.layers_, {});
      decisions_ = std::exchange(o.decisions_, {});
      scratch_victims_ = std::exchange(o.scratch_victims_, {});
      gather_ = std::exchange(o.gather_, {});
      gather_v_ = std::exchange(o.gather_v_, {});
    }
    return *this;
  }

  // --- state -------------------------------------------------------------------------
  [[nodiscard]] const Geometry& geometry() const { return shape_.geometry; }
  [[nodiscard]] const CacheShape& shape() const { return shape_; }
  [[nodiscard]] Policy& policy() { return policy_; }
  [[nodiscard]] const Policy& policy() const { return policy_; }
  [[nodiscard]] std::uint32_t cells_per_head() const { return cell_limit_; }
  [[nodiscard]] std::size_t size(int layer, int kv_head) const { return head(layer, kv_head).pos.size(); }
  [[nodiscard]] std::size_t capacity(int layer, int kv_head) const {
    check_head(layer, kv_head);
    return shape_.at(layer, kv_head);
  }
  [[nodiscard]] std::uint64_t tokens_seen(int layer) const { return layer_state(layer).next_seq; }
  /// Engine cell of each live row, in row order (the order the policy and observe use).
  [[nodiscard]] std::span<const std::uint32_t> cells(int layer, int kv_head) const {
    return head(layer, kv_head).cell;
  }
  [[nodiscard]] std::span<const std::int64_t> positions(int layer, int kv_head) const {
    return head(layer, kv_head).pos;
  }
  [[nodiscard]] std::span<const std::uint64_t> seqs(int layer, int kv_head) const {
    return head(layer, kv_head).seq;
  }

  // --- decode -------------------------------------------------------------------------
  /// One token of `layer`. keys (and values) are the new token's n_kv_heads x head_dim
  /// floats; queries n_heads x head_dim (required if the policy declares Signals::query).
  /// stored_keys/values locate the rows already in the engine's cells (read during this
  /// call only; values may be left empty for policies that never read stored values).
  /// new_cells: one cell per KV head where the engine has put or will put the new token,
  /// each free at call time; empty (or kAutoCell) to let the IndexCache allocate. The
  /// policy sees the new row as static_cast<Scalar>(keys), which is what the engine must
  /// store for decisions to match KVCache. Strong guarantee: on an exception nothing
  /// changed. The returned decisions stay valid until the next call.
  std::span<const Decision> append(int layer, std::int64_t position, std::span<const float> keys,
                                   CellRows<Scalar> stored_keys,
                                   std::span<const float> queries = {},
                                   std::span<const std::uint32_t> new_cells = {},
                                   std::span<const float> values = {},
                                   CellRows<Scalar> stored_values = {}) {
    const auto in_use = exclusive_.enter("append");
    const Geometry& g = shape_.geometry;
    detail::check_layer(g, layer);
    detail::check_token_rows(g, keys, "append: keys");
    const std::size_t kv = static_cast<std::size_t>(g.n_kv_heads) * udim();
    detail::require(values.empty() || values.size() == kv, "append: values has ", values.size(),
                    " floats, expected 0 or ", kv, " (n_kv_heads x head_dim)");
    // Policies may read stored rows through HeadView, so the engine must locate them.
    detail::require(stored_keys.data != nullptr || size_of_layer(layer) == 0,
                    "append: stored_keys.data is null, expected the engine's key rows");
    detail::check_queries<Policy>(g, queries, 1, "append");
    detail::check_arrivals(layers_[static_cast<std::size_t>(layer)], layer, position, 1, "append");
    detail::check_storable<Scalar>(keys, "append: keys");
    detail::check_storable<Scalar>(values, "append: values");
    detail::check_finite(queries, "append: queries");
    check_new_cells(layer, new_cells);
    decisions_.clear();
    append_unchecked(layer, position, keys.data(), values.empty() ? nullptr : values.data(),
                     queries.empty() ? nullptr : queries.data(), stored_keys, stored_values,
                     new_cells);
    return decisions_;
  }

  /// One step's attention probabilities of (layer, kv_head), group x size floats in row
  /// order, for policies that declare Signals::attention (ignored otherwise).
  void observe(int layer, int kv_head, std::span<const float> probs) {
    const auto in_use = exclusive_.enter("observe");
    const std::size_t n = size(layer, kv_head);
    detail::check_probs(shape_.geometry, probs, n);
    if constexpr (has(Policy::signals, Signals::attention))
      policy_.observe(AttentionView{layer, kv_head, group(), n, probs.data()});
  }

  // --- prefill ------------------------------------------------------------------------
  /// A block of T prompt tokens (layouts as KVCache::prefill). A policy with prefill_keep
  /// selects from the whole block when the layer is empty; otherwise tokens go through
  /// the decode rule one at a time, with causal attention probabilities computed here
  /// for policies that observe attention. The engine applies the decisions in order:
  /// `place` writes block token `from` into `cell`; `evict` frees `cell` (row = kNoRow:
  /// block token `from` was never kept). stored_keys locates rows kept before the block.
  std::span<const Decision> prefill(int layer, std::int64_t first_position, std::size_t tokens,
                                    std::span<const float> keys, std::span<const float> queries,
                                    CellRows<Scalar> stored_keys) {
    const auto in_use = exclusive_.enter("prefill");
    const Geometry& g = shape_.geometry;
    detail::check_layer(g, layer);
    detail::require(tokens > 0, "prefill: tokens = 0, expected > 0");
    detail::check_block_rows(g, keys, tokens, "prefill: keys");
    constexpr bool wants_queries = has(Policy::signals, Signals::query) ||
                                   has(Policy::signals, Signals::attention) ||
                                   has(Policy::signals, Signals::prefill_window);
    detail::check_queries<Policy>(g, queries, tokens, "prefill", wants_queries);
    detail::check_arrivals(layers_[static_cast<std::size_t>(layer)], layer, first_position, tokens,
                           "prefill");
    detail::check_storable<Scalar>(keys, "prefill: keys");
    detail::check_finite(queries, "prefill: queries");
    for (int kh = 0; kh < g.n_kv_heads; ++kh) {  // cells, before the first token changes anything
      const std::size_t rows =
          std::min(shape_.at(layer, kh), heads_[index(layer, kh)].pos.size() + tokens);
      detail::require(rows <= cell_limit_, "prefill: layer ", layer, " KV head ", kh,
                      " would hold ", rows, " rows, expected <= cells_per_head = ", cell_limit_);
    }
    decisions_.clear();
    const float* q = queries.empty() ? nullptr : queries.data();
    if constexpr (detail::HasPrefillKeep<Policy>) {
      if (layer_state(layer).next_seq == 0) {
        prefill_select(layer, first_position, tokens, keys.data(), q);
        return decisions_;
      }
    }
    const std::size_t stride = static_cast<std::size_t>(shape_.geometry.n_kv_heads) * udim();
    const std::size_t hq = static_cast<std::size_t>(shape_.geometry.n_heads) * udim();
    const std::uint64_t first_seq = layers_[static_cast<std::size_t>(layer)].next_seq;
    std::vector<Decision> all;
    std::vector<float> probs;
    for (std::size_t t = 0; t < tokens; ++t) {
      const float* qt = q ? q + t * hq : nullptr;
      decisions_.clear();
      append_unchecked(layer, first_position + static_cast<std::int64_t>(t), keys.data() + t * stride,
                       nullptr, qt, stored_keys, {}, {}, keys.data(), first_seq,
                       static_cast<std::uint32_t>(t));
      all.insert(all.end(), decisions_.begin(), decisions_.end());
      if constexpr (has(Policy::signals, Signals::attention)) {
        for (int kh = 0; kh < shape_.geometry.n_kv_heads; ++kh) {
          const auto& h = heads_[index(layer, kh)];
          gather_rows(layer, kh, stored_keys, nullptr, keys.data(), first_seq);
          probs.resize(static_cast<std::size_t>(group()) * h.pos.size());
          detail::group_probabilities(gather_.data(), h.pos.size(), udim(),
                                      qt + static_cast<std::size_t>(kh * group()) * udim(), group(),
                                      probs.data());
          policy_.observe(AttentionView{layer, kh, group(), h.pos.size(), probs.data()});
        }
      }
    }
    decisions_ = std::move(all);
    return decisions_;
  }

 private:
  struct HeadBook {
    std::vector<std::int64_t> pos;
    std::vector<std::uint64_t> seq;
    std::vector<std::uint32_t> cell;
    std::vector<std::uint32_t> free_cells;  // freed by evictions, reused first (LIFO)
    std::vector<std::uint8_t> used;         // used[c]: cell c holds a live row
    std::uint32_t next_cell = 0;            // lowest never-allocated cell
  };
  using LayerState = detail::LayerClock;

  int group() const { return shape_.geometry.group(); }
  std::size_t udim() const { return static_cast<std::size_t>(shape_.geometry.head_dim); }
  std::size_t index(int layer, int kv_head) const {
    return detail::head_index(shape_.geometry, layer, kv_head);
  }
  std::size_t size_of_layer(int layer) const {
    std::size_t n = 0;
    for (int kh = 0; kh < shape_.geometry.n_kv_heads; ++kh) n += heads_[index(layer, kh)].pos.size();
    return n;
  }
  void check_head(int layer, int kv_head) const {
    detail::check_head(shape_.geometry, layer, kv_head);
  }
  const HeadBook& head(int layer, int kv_head) const {
    check_head(layer, kv_head);
    return heads_[index(layer, kv_head)];
  }
  const LayerState& layer_state(int layer) const {
    detail::check_layer(shape_.geometry, layer);
    return layers_[static_cast<std::size_t>(layer)];
  }
  void check_new_cells(int layer, std::span<const std::uint32_t> cells) const {
    if (cells.empty()) return;
    detail::require(cells.size() == static_cast<std::size_t>(shape_.geometry.n_kv_heads),
                    "append: new_cells has ", cells.size(), " entries, expected 0 or ",
                    shape_.geometry.n_kv_heads, " (one per KV head)");
    for (int kh = 0; kh < shape_.geometry.n_kv_heads; ++kh) {
      const std::uint32_t c = cells[static_cast<std::size_t>(kh)];
      if (c == kAutoCell) continue;
      detail::require(c < cell_limit_, "append: new_cells[", kh, "] = ", c, ", expected < ",
                      cell_limit_, " (cells_per_head)");
      const auto& h = heads_[index(layer, kh)];
      detail::require(c >= h.used.size() || !h.used[c], "append: new_cells[", kh, "] = ", c,
                      " is in use by a live row of layer ", layer, ", expected a free cell");
    }
  }

  // Copies the live rows of a head into gather_ (row order) from engine memory, or from
  // the float `block` for rows of the current prefill block (seq >= block_seq), which the
  // engine writes only once it applies the decisions; then the converted incoming key as
  // one extra row when `incoming` is given.
  void gather_rows(int layer, int kh, CellRows<Scalar> rows, const float* incoming,
                   const float* block = nullptr, std::uint64_t block_seq = 0) {
    const auto& h = heads_[index(layer, kh)];
    const std::size_t d = udim();
    const std::size_t n = h.pos.size();
    const std::size_t stride = static_cast<std::size_t>(shape_.geometry.n_kv_heads) * d;
    gather_.resize((n + (incoming ? 1 : 0)) * d);
    for (std::size_t r = 0; r < n; ++r) {
      if (block != nullptr && h.seq[r] >= block_seq) {
        const float* src = block + (h.seq[r] - block_seq) * stride + static_cast<std::size_t>(kh) * d;
        for (std::size_t j = 0; j < d; ++j) gather_[r * d + j] = static_cast<Scalar>(src[j]);
      } else {
        std::memcpy(gather_.data() + r * d, rows.row(kh, h.cell[r]), d * sizeof(Scalar));
      }
    }
    if (incoming)
      for (std::size_t j = 0; j < d; ++j) gather_[n * d + j] = static_cast<Scalar>(incoming[j]);
  }
  void gather_values(int layer, int kh, CellRows<Scalar> rows, const float* incoming) {
    const auto& h = heads_[index(layer, kh)];
    const std::size_t d = udim();
    const std::size_t n = h.pos.size();
    if (rows.data == nullptr) {
      gather_v_.clear();
      return;
    }
    gather_v_.resize((n + 1) * d);
    for (std::size_t r = 0; r < n; ++r)
      std::memcpy(gather_v_.data() + r * d, rows.row(kh, h.cell[r]), d * sizeof(Scalar));
    for (std::size_t j = 0; j < d; ++j)
      gather_v_[n * d + j] = incoming ? static_cast<Scalar>(incoming[j]) : Scalar(0.0f);
  }

  HeadView<Scalar> make_view(int layer, int kh, std::size_t size) const {
    HeadView<Scalar> v;
    const auto& h = heads_[index(layer, kh)];
    v.layer = layer;
    v.kv_head = kh;
    v.head_dim = shape_.geometry.head_dim;
    v.group = group();
    v.size = size;
    v.capacity = shape_.at(layer, kh);
    v.keys = gather_.data();
    v.values = gather_v_.empty() ? nullptr : gather_v_.data();
    v.positions = h.pos.data();
    v.seqs = h.seq.data();
    return v;
  }

  std::uint32_t allocate_cell(HeadBook& h) {
    while (!h.free_cells.empty()) {
      const std::uint32_t c = h.free_cells.back();
      h.free_cells.pop_back();
      if (c >= h.used.size() || !h.used[c]) return c;
    }
    while (h.next_cell < h.used.size() && h.used[h.next_cell]) ++h.next_cell;
    return h.next_cell++;
  }

  void append_unchecked(int layer, std::int64_t position, const float* keys, const float* values,
                        const float* queries, CellRows<Scalar> stored_keys,
                        CellRows<Scalar> stored_values, std::span<const std::uint32_t> new_cells,
                        const float* block = nullptr, std::uint64_t block_seq = 0,
                        std::uint32_t token = 0) {
    const Geometry& g = shape_.geometry;
    auto& ls = layers_[static_cast<std::size_t>(layer)];
    const std::size_t d = udim();
    // Phase 1: every decision and allocation that may throw, before anything changes.
    scratch_victims_.resize(static_cast<std::size_t>(g.n_kv_heads));
    std::size_t total_victims = 0, max_rows = 0;
    for (int kh = 0; kh < g.n_kv_heads; ++kh) {
      auto& victims = scratch_victims_[static_cast<std::size_t>(kh)];
      victims.clear();
      auto& h = heads_[index(layer, kh)];
      const std::size_t cap = shape_.at(layer, kh);
      const std::size_t limit = detail::append_limit(policy_, cap, layer, kh);
      if (h.pos.size() >= limit) {
        gather_rows(layer, kh, stored_keys, nullptr, block, block_seq);
        gather_values(layer, kh, stored_values, nullptr);
        HeadView<Scalar> view = incoming_view(layer, kh, h.pos.size(), position, keys, queries);
        view.need = h.pos.size() - limit + 1;
        policy_.choose_victims(view, victims);
        detail::validate_victims<Policy>(victims, view.size, view.need);
        total_victims += victims.size();
      }
      const std::size_t rows = h.pos.size() - victims.size() + 1;
      // Live rows never outnumber cells, so an allocated cell is always below the limit
      // (only reachable under an unbounded budget: bounded ones were checked at construction).
      detail::require(rows <= cell_limit_, "append: layer ", layer, " KV head ", kh, " would hold ",
                      rows, " rows, expected <= cells_per_head = ", cell_limit_);
      if (h.pos.capacity() < rows) {
        const std::size_t grown = std::max<std::size_t>({rows, 16, h.pos.capacity() * 2});
        const std::size_t n = std::min(grown, std::max(cap, rows));
        h.pos.reserve(n);
        h.seq.reserve(n);
        h.cell.reserve(n);
      }
      h.free_cells.reserve(h.free_cells.size() + victims.size());
      const std::uint32_t want = new_cells.empty() ? kAutoCell : new_cells[static_cast<std::size_t>(kh)];
      const std::size_t top = want != kAutoCell ? want + std::size_t{1} : h.next_cell + std::size_t{1};
      if (h.used.size() < top) h.used.reserve(std::max<std::size_t>(top, 2 * h.used.size()));
      max_rows = std::max(max_rows, h.pos.size() + 1);
    }
    gather_.reserve(max_rows * d);
    if (stored_values.data != nullptr) gather_v_.reserve(max_rows * d);
    decisions_.reserve(decisions_.size() + 2 * total_victims + static_cast<std::size_t>(g.n_kv_heads));
    // Phase 2: apply; nothing below throws except the policy's own bookkeeping.
    for (int kh = 0; kh < g.n_kv_heads; ++kh) {
      auto& h = heads_[index(layer, kh)];
      // Refresh the policy's view of stored rows: the gather above may belong to another head.
      gather_rows(layer, kh, stored_keys, keys + static_cast<std::size_t>(kh) * d, block, block_seq);
      gather_values(layer, kh, stored_values,
                    values ? values + static_cast<std::size_t>(kh) * d : nullptr);
      for (std::uint32_t r : scratch_victims_[static_cast<std::size_t>(kh)]) {
        const std::size_t last = h.pos.size() - 1;
        decisions_.push_back(Decision{Decision::Kind::evict, layer, kh, r, r, h.cell[r], h.pos[r], h.seq[r]});
        h.used[h.cell[r]] = 0;
        h.free_cells.push_back(h.cell[r]);
        if (r != last) {
          decisions_.push_back(Decision{Decision::Kind::move, layer, kh, r,
                                        static_cast<std::uint32_t>(last), h.cell[last],
                                        h.pos[last], h.seq[last]});
          h.pos[r] = h.pos[last];
          h.seq[r] = h.seq[last];
          h.cell[r] = h.cell[last];
          move_gathered(r, last);
          policy_.on_move(layer, kh, last, r);
        }
        h.pos.pop_back();
        h.seq.pop_back();
        h.cell.pop_back();
      }
      // The gathered block now holds the survivors in row order, then the incoming row.
      const std::size_t n = h.pos.size();
      std::memmove(gather_.data() + n * d, gather_.data() + (gather_.size() - d), d * sizeof(Scalar));
      gather_.resize((n + 1) * d);
      if (!gather_v_.empty()) {
        std::memmove(gather_v_.data() + n * d, gather_v_.data() + (gather_v_.size() - d),
                     d * sizeof(Scalar));
        gather_v_.resize((n + 1) * d);
      }
      const std::uint32_t want = new_cells.empty() ? kAutoCell : new_cells[static_cast<std::size_t>(kh)];
      const std::uint32_t cell = want != kAutoCell ? want : allocate_cell(h);
      if (h.used.size() <= cell) h.used.resize(cell + std::size_t{1}, 0);
      h.used[cell] = 1;
      h.pos.push_back(position);
      h.seq.push_back(ls.next_seq);
      h.cell.push_back(cell);
      decisions_.push_back(Decision{Decision::Kind::place, layer, kh, static_cast<std::uint32_t>(n),
                                    token, cell, position, ls.next_seq});
      HeadView<Scalar> view = incoming_view(layer, kh, n + 1, position, keys, queries);
      policy_.on_append(view, n);
    }
    ++ls.next_seq;
    ls.last_position = position;
  }

  // Mirrors a swap-remove on the gathered block; its last row (the incoming one) stays.
  void move_gathered(std::size_t to, std::size_t from) {
    const std::size_t d = udim();
    std::memcpy(gather_.data() + to * d, gather_.data() + from * d, d * sizeof(Scalar));
    if (!gather_v_.empty())
      std::memcpy(gather_v_.data() + to * d, gather_v_.data() + from * d, d * sizeof(Scalar));
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

  void prefill_select(int layer, std::int64_t first_position, std::size_t tokens,
                      const float* keys, const float* queries) {
    const Geometry& g = shape_.geometry;
    auto& ls = layers_[static_cast<std::size_t>(layer)];
    const std::size_t d = udim();
    const std::size_t stride = static_cast<std::size_t>(g.n_kv_heads) * d;
    std::vector<std::vector<std::uint32_t>> keep(static_cast<std::size_t>(g.n_kv_heads));
    for (int kh = 0; kh < g.n_kv_heads; ++kh) {
      PrefillView pv{layer, kh, g.head_dim, group(), g.n_kv_heads, g.n_heads, tokens,
                     shape_.at(layer, kh), first_position, ls.next_seq, keys, queries};
      auto& kp = keep[static_cast<std::size_t>(kh)];
      policy_.prefill_keep(pv, kp);
      detail::validate_prefill_keep<Policy>(kp, tokens, pv.capacity);
      auto& h = heads_[index(layer, kh)];
      h.pos.reserve(kp.size());
      h.seq.reserve(kp.size());
      h.cell.reserve(kp.size());
      h.used.reserve(kp.size());
    }
    decisions_.reserve(tokens * static_cast<std::size_t>(g.n_kv_heads));
    for (int kh = 0; kh < g.n_kv_heads; ++kh) {
      auto& h = heads_[index(layer, kh)];
      const auto& kp = keep[static_cast<std::size_t>(kh)];
      std::size_t next = 0;
      gather_.clear();
      for (std::size_t t = 0; t < tokens; ++t) {
        const float* kin = keys + t * stride + static_cast<std::size_t>(kh) * d;
        const auto pos = first_position + static_cast<std::int64_t>(t);
        if (next < kp.size() && kp[next] == t) {
          ++next;
          const std::uint32_t cell = allocate_cell(h);
          if (h.used.size() <= cell) h.used.resize(cell + std::size_t{1}, 0);
          h.used[cell] = 1;
          h.pos.push_back(pos);
          h.seq.push_back(ls.next_seq + t);
          h.cell.push_back(cell);
          for (std::size_t j = 0; j < d; ++j) gather_.push_back(static_cast<Scalar>(kin[j]));
          decisions_.push_back(Decision{Decision::Kind::place, layer, kh,
                                        static_cast<std::uint32_t>(h.pos.size() - 1),
                                        static_cast<std::uint32_t>(t), cell, pos, ls.next_seq + t});
          HeadView<Scalar> view = make_view(layer, kh, h.pos.size());
          view.incoming_seq = ls.next_seq + t;
          view.incoming_position = pos;
          view.incoming_key = kin;
          policy_.on_append(view, h.pos.size() - 1);
        } else {
          decisions_.push_back(Decision{Decision::Kind::evict, layer, kh, Decision::kNoRow,
                                        static_cast<std::uint32_t>(t), Decision::kNoRow, pos,
                                        ls.next_seq + t});
        }
      }
    }
    ls.next_seq += tokens;
    ls.last_position = first_position + static_cast<std::int64_t>(tokens) - 1;
  }

  CacheShape shape_;
  Policy policy_;
  std::uint32_t cell_limit_ = 0;
  std::vector<HeadBook> heads_;
  std::vector<LayerState> layers_;
  std::vector<Decision> decisions_;
  std::vector<std::vector<std::uint32_t>> scratch_victims_;
  std::vector<Scalar> gather_, gather_v_;
  detail::ExclusiveUse exclusive_;
};

}  // namespace kvevict
