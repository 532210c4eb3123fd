#pragma once
// The EvictionPolicy concept: what a policy must provide to plug into KVCache, and the
// signals it may ask for. The container pays only for the signals a policy declares.
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "geometry.hpp"

namespace kvevict {

/// Signals a policy may ask for. Combine with `|`.
enum class Signals : unsigned {
  none = 0,
  query = 1u << 0,           ///< the G query vectors of the group at append time
  attention = 1u << 1,       ///< attention probabilities after each step (observe hook)
  prefill_window = 1u << 2,  ///< the prompt's queries at prefill (prefill_keep hook)
};
constexpr Signals operator|(Signals a, Signals b) {
  return static_cast<Signals>(static_cast<unsigned>(a) | static_cast<unsigned>(b));
}
constexpr bool has(Signals set, Signals s) {
  return (static_cast<unsigned>(set) & static_cast<unsigned>(s)) != 0;
}

/// Read-only view of one (layer, KV head) handed to a policy. Rows [0, size) are live;
/// their order is arbitrary (swap-remove), so order-dependent rules use `seqs`.
template <class Scalar>
struct HeadView {
  int layer = 0;
  int kv_head = 0;
  int head_dim = 0;
  int group = 1;               ///< query heads per KV head (G)
  std::size_t size = 0;        ///< live rows
  std::size_t capacity = 0;    ///< rows allowed (Budget::kUnbounded for no limit)
  std::size_t need = 0;        ///< choose_victims: the minimum number of victims required
  /// size x head_dim, row-major. nullptr in IndexCache's views for a policy that declares
  /// reads_stored_rows = false (see detail::reads_stored_rows).
  const Scalar* keys = nullptr;
  const Scalar* values = nullptr;  ///< size x head_dim, row-major (nullptr as keys)
  const std::int64_t* positions = nullptr;  ///< engine positions of the rows
  const std::uint64_t* seqs = nullptr;      ///< arrival index of each row within the layer
  std::uint64_t incoming_seq = 0;    ///< arrival index of the token being appended
  std::int64_t incoming_position = 0;
  const float* incoming_key = nullptr;  ///< head_dim floats; nullptr when shrinking a budget
  /// group x head_dim; only with Signals::query, and nullptr when shrinking a budget.
  const float* queries = nullptr;

  [[nodiscard]] std::span<const Scalar> key(std::size_t row) const {
    return {keys + row * static_cast<std::size_t>(head_dim), static_cast<std::size_t>(head_dim)};
  }
  [[nodiscard]] std::span<const Scalar> value(std::size_t row) const {
    return {values + row * static_cast<std::size_t>(head_dim),
            static_cast<std::size_t>(head_dim)};
  }
};

/// Attention probabilities of one step for one (layer, KV head): `group` rows of `size`
/// probabilities each (row r = query head kv_head * group + r), over the live rows.
struct AttentionView {
  int layer = 0;
  int kv_head = 0;
  int group = 1;
  std::size_t size = 0;
  const float* probs = nullptr;  ///< group x size, row-major
  /// When not null: the group sums of every row, precomputed by the container in one pass
  /// (summed(row) == sums[row], bit for bit). Policies read attention through summed().
  const float* sums = nullptr;

  [[nodiscard]] float summed(std::size_t row) const {
    if (sums != nullptr) return sums[row];
    float s = 0.0f;
    for (int g = 0; g < group; ++g) s += probs[static_cast<std::size_t>(g) * size + row];
    return s;
  }
};

/// A prompt block for one (layer, KV head) at prefill, for policies that select from the
/// prompt at once (SnapKV, XKV, HashEvict's default). Token-major layout.
///
/// Chunked prefill (a policy with the reselection hooks, detail::HasPrefillReselect): when
/// the layer already holds rows, the view's first `held` tokens are the rows the head holds
/// (kept from earlier chunks or decoded), in arrival order, with their stored keys and
/// arrival indices; tokens [held, tokens) are the chunk. Without held rows (held == 0) the
/// view is the whole block, as before.
struct PrefillView {
  int layer = 0;
  int kv_head = 0;
  int head_dim = 0;
  int group = 1;
  int n_kv_heads = 1;
  int n_heads = 1;
  std::size_t tokens = 0;        ///< T: held rows + the chunk's tokens
  std::size_t capacity = 0;
  std::int64_t first_position = 0;  ///< position of the chunk's first token (token `held`)
  std::uint64_t first_seq = 0;      ///< arrival index of the chunk's first token (token `held`)
  const float* keys = nullptr;     ///< (T - held) x n_kv_heads x head_dim: the chunk
  const float* queries = nullptr;  ///< (T - held) x n_heads x head_dim, or nullptr
  std::size_t held = 0;                      ///< rows held before the chunk
  const float* held_keys = nullptr;          ///< held x head_dim, arrival order
  const std::uint64_t* held_seqs = nullptr;  ///< their arrival indices, ascending
  /// Their rows in the head (the index the policy's per-row columns use), same order. The
  /// keys of held rows are given only to a policy that reads stored rows; one that does not
  /// (HashEvict) finds what it needs in its own columns through these.
  const std::uint32_t* held_rows = nullptr;

  [[nodiscard]] const float* key(std::size_t t) const {
    if (t < held) return held_keys + t * static_cast<std::size_t>(head_dim);
    t -= held;
    return keys + (t * static_cast<std::size_t>(n_kv_heads) + static_cast<std::size_t>(kv_head)) *
                      static_cast<std::size_t>(head_dim);
  }
  /// Query of the g-th head of this KV head's group at token t (nullptr without queries,
  /// and for held rows: their queries are gone).
  [[nodiscard]] const float* query(std::size_t t, int g) const {
    if (queries == nullptr || t < held) return nullptr;
    t -= held;
    return queries + (t * static_cast<std::size_t>(n_heads) +
                      static_cast<std::size_t>(kv_head * group + g)) *
                         static_cast<std::size_t>(head_dim);
  }
  /// Arrival index of token t.
  [[nodiscard]] std::uint64_t seq(std::size_t t) const {
    return t < held ? held_seqs[t] : first_seq + (t - held);
  }
};

/// Capacity of every (layer, KV head), resolved from a Budget: capacity[l * Hkv + h].
struct CacheShape {
  Geometry geometry;
  std::vector<std::size_t> capacity;
  [[nodiscard]] std::size_t at(int layer, int kv_head) const {
    return capacity[static_cast<std::size_t>(layer) * static_cast<std::size_t>(geometry.n_kv_heads) +
                    static_cast<std::size_t>(kv_head)];
  }
};

/// What every policy provides. Per-row side data (scores, codes) lives in the policy and
/// follows its row through on_append / on_move, the one relocation hook.
///  - `signals`: which inputs the container must gather (Signals).
///  - `name()`: for error messages and reports.
///  - `min_capacity()`: the smallest legal capacity (protected rows + one evictable slot).
///  - `bind(shape)`: size per-(layer, head) state; called once by the container.
///  - `choose_victims(view, out)`: append at least view.need distinct rows of [0, size).
///  - `on_append(view, row)`: a new row was written at `row` (view describes it).
///  - `on_move(layer, kv_head, from, to)`: row `from` now lives at `to`.
/// Optional hooks, detected by the container: observe(const AttentionView&) (required when
/// signals has Signals::attention), prefill_keep(const PrefillView&, std::vector<uint32_t>&),
/// attention_limit(layer, kv_head) (Oracle), check_budget(const CacheShape&) const (throws
/// kvevict::Error for capacities the policy cannot serve; run on construction and set_budget),
/// on_budget(const CacheShape&) (set_budget took effect: the shape holds the new capacities),
/// row_limit(layer, kv_head) const (the policy's own, possibly changing, bound on a head's
/// rows: an append evicts through choose_victims once the head holds min(capacity,
/// row_limit) rows, so a policy can trigger itself under an unbounded budget, as BUZZ does).
template <class P, class Scalar = float>
concept EvictionPolicy =
    requires(P& p, const P& cp, const CacheShape& shape, const HeadView<Scalar>& view,
             std::vector<std::uint32_t>& victims, std::size_t row, int layer, int head) {
      { P::signals } -> std::convertible_to<Signals>;
      { P::name() } -> std::convertible_to<const char*>;
      { cp.min_capacity() } -> std::convertible_to<std::size_t>;
      p.bind(shape);
      p.choose_victims(view, victims);
      p.on_append(view, row);
      p.on_move(layer, head, row, row);
    };

namespace detail {
/// Whether a policy reads the keys/values of stored rows through HeadView::keys / values /
/// key() / value(). A policy opts out with `static constexpr bool reads_stored_rows =
/// false;`; IndexCache then hands it views without them (keys == values == nullptr) and
/// skips gathering the rows from engine memory every step. Default: it reads them.
template <class P>
constexpr bool reads_stored_rows() {
  if constexpr (requires { P::reads_stored_rows; })
    return static_cast<bool>(P::reads_stored_rows);
  else
    return true;
}
template <class P>
concept HasObserve = requires(P& p, const AttentionView& a) { p.observe(a); };
template <class P>
concept HasCheckBudget = requires(const P& p, const CacheShape& s) { p.check_budget(s); };
template <class P>
concept HasOnBudget = requires(P& p, const CacheShape& s) { p.on_budget(s); };
template <class P>
concept HasRowLimit = requires(const P& p, int layer, int head) {
  { p.row_limit(layer, head) } -> std::convertible_to<std::size_t>;
};
/// The optional pooled-budget hook: `eviction_costs(view, costs)` writes one comparable
/// cost per live row (costs.size() == view.size on return; the vector arrives holding an
/// earlier call's values, so resize or assign it, never append): what keeping the row is worth, on a
/// scale shared by every KV head of a layer (lower = evicted first; +infinity = the policy
/// would not evict it now). Budget::pooled() splits a layer's evictions over its heads by
/// these costs; the policy's choose_victims still picks the rows.
template <class P, class Scalar = float>
concept HasEvictionCosts = requires(P& p, const HeadView<Scalar>& v, std::vector<float>& costs) {
  p.eviction_costs(v, costs);
};
/// The optional shared-decision hooks (policies::BlockGranular with `shared`): when
/// `shared_decisions()` is true, ContainerCore asks every KV head of the stepping layer for
/// `token_costs(view, costs)` (one per row), combines them per row with `combine_costs`
/// and applies the victims `victims_from_costs(view, combined, out)` chooses to every head
/// (one decision per token for all KV heads: llama.cpp's cells), on every step and on a
/// budget shrink that leaves the layer's heads one capacity.
template <class P, class Scalar = float>
concept HasSharedDecisions =
    requires(P& p, const P& cp, const HeadView<Scalar>& v, std::vector<float>& c,
             std::span<const std::vector<float>> heads, std::vector<std::uint32_t>& out) {
      { cp.shared_decisions() } -> std::convertible_to<bool>;
      p.token_costs(v, c);
      cp.combine_costs(heads, c);
      p.victims_from_costs(v, std::span<const float>(c), out);
    };
/// The optional single-pass companion of eviction_costs: `pooled_victims(view, out)`
/// chooses exactly what `choose_victims(view, out)` would, for a head whose eviction_costs
/// ran last on the same view (need aside) with no call on that head since, so the policy
/// can reuse the protection that pass computed. Pooled budgets call it instead of
/// choose_victims (ContainerCore::choose_pooled).
template <class P, class Scalar = float>
concept HasPooledVictims = requires(P& p, const HeadView<Scalar>& v, std::vector<std::uint32_t>& out) {
  p.pooled_victims(v, out);
};
/// Optional: `prefetch_head(layer, kv_head)` starts the reads of the columns the policy's
/// next decision on that head reads. A hint only (no decision may depend on it). A pooled
/// budget's frozen step under PoolOptions::Frozen::schedule calls it for every head the
/// schedule names before deciding any of them: those heads are spread over the layers, so
/// each one's columns are cold and their reads can overlap.
template <class P>
concept HasPrefetchHead = requires(const P& p, int layer, int kv_head) { p.prefetch_head(layer, kv_head); };
template <class P>
concept HasPrefillKeep = requires(P& p, const PrefillView& v, std::vector<std::uint32_t>& keep) {
  p.prefill_keep(v, keep);
};
/// Chunked prefill by reselection (optional, with prefill_keep): when `reselects_prefill()`
/// is true, a prefill block on a layer that already holds rows goes through prefill_keep
/// too, with the held rows at the front of the view (PrefillView::held), and the selection
/// may drop held rows; `on_prefill_selected(view)` runs after the dropped held rows left
/// (view: the survivors) and before the block's kept tokens are appended (on_append), on
/// every prefill_keep selection, so the policy can rescore the rows it keeps.
template <class P, class Scalar = float>
concept HasPrefillReselect = HasPrefillKeep<P> && requires(P& p, const P& cp, const HeadView<Scalar>& v) {
  { cp.reselects_prefill() } -> std::convertible_to<bool>;
  p.on_prefill_selected(v);
};
}  // namespace detail

}  // namespace kvevict
