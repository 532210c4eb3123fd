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
#include <utility>
#include <vector>

#include "attention_core.hpp"
#include "bookkeeping.hpp"
#include "container_core.hpp"
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

namespace detail {
/// IndexCache's bookkeeping of one (layer, KV head): the engine cell of each live row
/// beside the core's positions and arrival indices, and the cell allocator.
struct CellHead : HeadRows {
  std::vector<std::uint32_t> cell;
  std::vector<std::uint32_t> free_cells;  // freed by evictions, reused first (LIFO)
  std::vector<std::uint8_t> used;         // used[c]: cell c holds a live row
  std::uint32_t next_cell = 0;            // lowest never-allocated cell
};
}  // namespace detail

template <class Policy, class Scalar = float>
  requires EvictionPolicy<Policy, Scalar>
class IndexCache
    : public detail::ContainerCore<IndexCache<Policy, Scalar>, Policy, Scalar, detail::CellHead> {
  using Core = detail::ContainerCore<IndexCache, Policy, Scalar, detail::CellHead>;
  friend Core;

 public:
  using scalar_type = Scalar;
  using policy_type = Policy;
  /// Pass as a cell to let the IndexCache allocate: a victim's freed cell, else the lowest
  /// never-used one, so cells stay in [0, capacity) under a bounded budget.
  static constexpr std::uint32_t kAutoCell = std::numeric_limits<std::uint32_t>::max();

  /// `cells_per_head`: cells the engine has per (layer, KV head); cell ids must be below
  /// it, and it must be >= every finite capacity (a full head holds one row per cell). 0:
  /// the largest capacity (pooled budgets: the largest max_rows) + 1 (one spare for engines that write the new token before
  /// evicting), at least 2^20 under an unbounded budget (an append or prefill that would
  /// need more live rows than cells is then refused before anything changes).
  IndexCache(const Geometry& geometry, const Budget& budget, Policy policy = Policy{},
             std::uint32_t cells_per_head = 0)
      : Core(geometry, budget, std::move(policy)) {
    std::size_t finite = 0;  // the largest finite capacity
    bool unbounded = false;
    // Under a pooled budget a head may grow to its ceiling (Core::max_rows).
    for (int l = 0; l < geometry.n_layers; ++l)
      for (int h = 0; h < geometry.n_kv_heads; ++h) {
        const std::size_t c = this->max_rows(l, h);
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
    check_pool(this->pool_);
  }

  // --- state: geometry(), shape(), policy(), size(), capacity(), tokens_seen(), observe(),
  // positions(), seqs() come from the core ---------------------------------------------
  [[nodiscard]] std::uint32_t cells_per_head() const { return cell_limit_; }
  /// Engine cell of each live row, in row order (the order the policy and observe use).
  [[nodiscard]] std::span<const std::uint32_t> cells(int layer, int kv_head) const {
    return this->head(layer, kv_head).cell;
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
    const auto in_use = this->exclusive("append");
    this->check_token(layer, position, keys, values, queries, true);
    // Policies may read stored rows through HeadView, so the engine must locate them.
    detail::require(stored_keys.data != nullptr || size_of_layer(layer) == 0,
                    "append: stored_keys.data is null, expected the engine's key rows");
    check_new_cells(layer, new_cells);
    decisions_.clear();
    call_ = Call{stored_keys, stored_values, new_cells, nullptr, 0};
    this->step(layer, position, keys.data(), values.empty() ? nullptr : values.data(),
               queries.empty() ? nullptr : queries.data());
    return decisions_;
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
    const auto in_use = this->exclusive("prefill");
    this->check_block(layer, first_position, tokens, keys, {}, queries, false);
    for (int kh = 0; kh < this->shape_.geometry.n_kv_heads; ++kh) {  // cells, before any token
      const std::size_t rows = std::min(this->shape_.at(layer, kh),
                                        this->heads_[this->index(layer, kh)].size() + tokens);
      detail::require(rows <= cell_limit_, "prefill: layer ", layer, " KV head ", kh,
                      " would hold ", rows, " rows, expected <= cells_per_head = ", cell_limit_);
    }
    // Gathered stored rows are read by the decode rule, and by a chunked reselection.
    detail::require(!kGather || stored_keys.data != nullptr || size_of_layer(layer) == 0,
                    "prefill: stored_keys.data is null, expected the engine's key rows");
    decisions_.clear();
    // Rows of this block are read from `keys` until the engine applies the decisions.
    call_ = Call{stored_keys, {}, {}, keys.data(), this->layer_state(layer).next_seq};
    this->prefill_block(layer, first_position, tokens, keys.data(), nullptr,
                        queries.empty() ? nullptr : queries.data());
    return decisions_;
  }

 private:
  using typename Core::LayerState;
  // What the current call says about engine memory, read by the layout hooks.
  struct Call {
    CellRows<Scalar> stored_keys, stored_values;
    std::span<const std::uint32_t> new_cells;
    const float* block = nullptr;  // prefill: the block's keys (rows with seq >= block_seq)
    std::uint64_t block_seq = 0;
  };

  std::size_t size_of_layer(int layer) const {
    std::size_t n = 0;
    for (int kh = 0; kh < this->shape_.geometry.n_kv_heads; ++kh)
      n += this->heads_[this->index(layer, kh)].size();
    return n;
  }
  void check_new_cells(int layer, std::span<const std::uint32_t> cells) const {
    if (cells.empty()) return;
    const int hkv = this->shape_.geometry.n_kv_heads;
    detail::require(cells.size() == static_cast<std::size_t>(hkv), "append: new_cells has ",
                    cells.size(), " entries, expected 0 or ", hkv, " (one per KV head)");
    for (int kh = 0; kh < hkv; ++kh) {
      const std::uint32_t c = cells[static_cast<std::size_t>(kh)];
      if (c == kAutoCell) continue;
      detail::require(c < cell_limit_, "append: new_cells[", kh, "] = ", c, ", expected < ",
                      cell_limit_, " (cells_per_head)");
      const auto& h = this->heads_[this->index(layer, kh)];
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
    const auto& h = this->heads_[this->index(layer, kh)];
    const std::size_t d = this->udim();
    const std::size_t n = h.size();
    const std::size_t stride = static_cast<std::size_t>(this->shape_.geometry.n_kv_heads) * d;
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
    const auto& h = this->heads_[this->index(layer, kh)];
    const std::size_t d = this->udim();
    const std::size_t n = h.size();
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

  std::uint32_t allocate_cell(detail::CellHead& h) {
    while (!h.free_cells.empty()) {
      const std::uint32_t c = h.free_cells.back();
      h.free_cells.pop_back();
      if (c >= h.used.size() || !h.used[c]) return c;
    }
    while (h.next_cell < h.used.size() && h.used[h.next_cell]) ++h.next_cell;
    return h.next_cell++;
  }
  std::uint32_t take_cell(detail::CellHead& h, std::uint32_t want) {
    const std::uint32_t cell = want != kAutoCell ? want : allocate_cell(h);
    if (h.used.size() <= cell) h.used.resize(cell + std::size_t{1}, 0);
    h.used[cell] = 1;
    h.cell.push_back(cell);
    return cell;
  }
  std::uint32_t wanted_cell(int kh) const {
    return call_.new_cells.empty() ? kAutoCell : call_.new_cells[static_cast<std::size_t>(kh)];
  }

  // --- layout hooks (container_core.hpp): rows live in engine cells ------------------
  // The policy reads keys/values gathered from the engine's cells into gather_/gather_v_.
  // A policy declaring reads_stored_rows = false gets views without keys/values, and
  // decode steps gather nothing from engine memory (kGather).
  detail::RowsData<Scalar> rows_data(int, int) const {
    if constexpr (!kGather) return {nullptr, nullptr};
    return {gather_.data(), gather_v_.empty() ? nullptr : gather_v_.data()};
  }
  void load_rows(int layer, int kh, const float* key, const float* value) {
    if constexpr (!kGather) return;
    gather_rows(layer, kh, call_.stored_keys, key, call_.block, call_.block_seq);
    gather_values(layer, kh, call_.stored_values, value);
  }
  const Scalar* attention_rows(int layer, int kh) {
    gather_rows(layer, kh, call_.stored_keys, nullptr, call_.block, call_.block_seq);
    return gather_.data();
  }
  /// A model-scope pool evicts rows of layers other than the stepping one, which the
  /// engine locates only for the stepping layer (stored_keys): refused.
  void check_pool(const detail::LayerPool& p) const {
    detail::require(!p.on || !p.model, "IndexCache: a pooled budget of scope model "
                    "(PoolOptions::Scope::model) evicts rows of other layers than the appended "
                    "one, expected scope layer");
  }
  void reserve_rows(std::size_t i, std::size_t n) {
    this->heads_[i].cell.reserve(n);
    this->heads_[i].used.reserve(n);
  }
  void prepare_head(int layer, int kh, std::size_t i, const std::vector<std::uint32_t>& victims) {
    auto& h = this->heads_[i];
    // Live rows never outnumber cells, so an allocated cell is always below the limit
    // (reachable only under an unbounded budget: bounded ones were checked at construction).
    const std::size_t rows = h.size() - victims.size() + 1;
    detail::require(rows <= cell_limit_, "append: layer ", layer, " KV head ", kh, " would hold ",
                    rows, " rows, expected <= cells_per_head = ", cell_limit_);
    h.free_cells.reserve(h.free_cells.size() + victims.size());
    const std::uint32_t want = wanted_cell(kh);
    const std::size_t top = want != kAutoCell ? want + std::size_t{1} : h.next_cell + std::size_t{1};
    if (h.used.size() < top) h.used.reserve(std::max<std::size_t>(top, 2 * h.used.size()));
  }
  void prepare_step(int, std::size_t total_victims, std::size_t max_rows) {
    const std::size_t d = this->udim();
    if constexpr (kGather) {
      gather_.reserve(max_rows * d);
      if (call_.stored_values.data != nullptr) gather_v_.reserve(max_rows * d);
    }
    reserve_decisions(2 * total_victims + static_cast<std::size_t>(this->shape_.geometry.n_kv_heads));
  }
  // Phase 1 of a prefill selection: room for its decisions, each head's freed cells, the
  // used-cell marks of cells never used before, and the gathered keys, so applying the
  // selection allocates nothing.
  void prepare_prompt(int layer, std::size_t tokens, const std::vector<std::vector<std::uint32_t>>& keep,
                      const std::vector<std::vector<std::uint32_t>>& victims) {
    std::size_t evictions = 0;  // a held row leaving: evict + move
    for (const auto& v : victims) evictions += 2 * v.size();
    reserve_decisions(tokens * static_cast<std::size_t>(this->shape_.geometry.n_kv_heads) + evictions);
    for (std::size_t kh = 0; kh < keep.size(); ++kh) {
      auto& h = this->heads_[this->index(layer, static_cast<int>(kh))];
      h.free_cells.reserve(h.free_cells.size() + victims[kh].size());
      const std::size_t top = h.next_cell + keep[kh].size() + std::size_t{1};
      if (h.used.size() < top) h.used.reserve(top);
    }
    gather_.reserve(this->prompt_rows_max(layer, keep, victims) * this->udim());
  }
  // Geometric, so a prefill's decisions (one call, many tokens) grow in amortised O(1).
  void reserve_decisions(std::size_t more) {
    const std::size_t need = decisions_.size() + more;
    if (decisions_.capacity() < need)
      decisions_.reserve(std::max(need, 2 * decisions_.capacity()));
  }
  void remove_row(int layer, int kh, std::size_t i, std::uint32_t r, std::size_t last) {
    auto& h = this->heads_[i];
    decisions_.push_back(Decision{Decision::Kind::evict, layer, kh, r, r, h.cell[r], h.pos[r], h.seq[r]});
    h.used[h.cell[r]] = 0;
    h.free_cells.push_back(h.cell[r]);
    if (r != last) {
      decisions_.push_back(Decision{Decision::Kind::move, layer, kh, r, static_cast<std::uint32_t>(last),
                                    h.cell[last], h.pos[last], h.seq[last]});
      h.cell[r] = h.cell[last];
      if constexpr (kGather) move_gathered(r, last);
    }
    h.cell.pop_back();
  }
  void push_row(int layer, int kh, std::size_t i, std::size_t n, std::int64_t position,
                std::uint64_t seq, const float*, const float*, std::uint32_t token) {
    // The gathered block now holds the survivors in row order, then the incoming row.
    const std::size_t d = this->udim();
    if constexpr (kGather) {
      std::memmove(gather_.data() + n * d, gather_.data() + (gather_.size() - d),
                   d * sizeof(Scalar));
      gather_.resize((n + 1) * d);
      if (!gather_v_.empty()) {
        std::memmove(gather_v_.data() + n * d, gather_v_.data() + (gather_v_.size() - d),
                     d * sizeof(Scalar));
        gather_v_.resize((n + 1) * d);
      }
    }
    const std::uint32_t cell = take_cell(this->heads_[i], wanted_cell(kh));
    decisions_.push_back(Decision{Decision::Kind::place, layer, kh, static_cast<std::uint32_t>(n),
                                  token, cell, position, seq});
  }
  // The gathered block keeps the head's live rows (those a chunked reselection kept; none
  // on an empty layer); kept prompt rows are appended to it.
  void begin_prompt_head(int layer, int kh) {
    gather_.resize(this->heads_[this->index(layer, kh)].size() * this->udim());
  }
  void keep_prompt_row(int layer, int kh, std::size_t i, std::size_t row, std::size_t t,
                       const float* key, const float*, std::int64_t position, std::uint64_t seq) {
    const std::uint32_t cell = take_cell(this->heads_[i], kAutoCell);
    for (std::size_t j = 0; j < this->udim(); ++j) gather_.push_back(static_cast<Scalar>(key[j]));
    decisions_.push_back(Decision{Decision::Kind::place, layer, kh, static_cast<std::uint32_t>(row),
                                  static_cast<std::uint32_t>(t), cell, position, seq});
  }
  void drop_prompt_row(int layer, int kh, std::size_t, std::size_t t, const float*, const float*,
                       std::int64_t position, std::uint64_t seq) {
    decisions_.push_back(Decision{Decision::Kind::evict, layer, kh, Decision::kNoRow,
                                  static_cast<std::uint32_t>(t), Decision::kNoRow, position, seq});
  }

  // Mirrors a swap-remove on the gathered block; its last row (the incoming one) stays.
  void move_gathered(std::size_t to, std::size_t from) {
    const std::size_t d = this->udim();
    std::memcpy(gather_.data() + to * d, gather_.data() + from * d, d * sizeof(Scalar));
    if (!gather_v_.empty())
      std::memcpy(gather_v_.data() + to * d, gather_v_.data() + from * d, d * sizeof(Scalar));
  }

  std::uint32_t cell_limit_ = 0;
  Call call_;
  std::vector<Decision> decisions_;
  std::vector<Scalar> gather_, gather_v_;
  /// Whether decode steps gather stored rows from engine memory for the policy's views.
  static constexpr bool kGather = detail::reads_stored_rows<Policy>();
};

}  // namespace kvevict
