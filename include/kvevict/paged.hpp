#pragma once
// Paged K/V: one pool of fixed-size blocks shared by many sequences, per-sequence block
// tables an engine's paged attention kernel reads directly, and block-granular eviction
// inside a per-sequence budget.
//
//   BlockAllocator   the pool's accounting: free list and owner of every block, O(1) per block
//   PagedTables      decisions only: sequences, their block tables, budgets and eviction,
//                    for an engine that owns the pool memory (it applies place / evict)
//   PagedKV<Scalar>  the same tables plus the pool's K/V memory
//
// A block holds `block_tokens` tokens (a power of two, 1..256) of one layer, either for one
// KV head (BlockLayout::per_kv_head: K block [tokens][head_dim]) or for all KV heads of the
// layer (BlockLayout::shared_cells, llama.cpp's cells: K block [tokens][n_kv_heads][head_dim]).
// A sequence has one table per (layer, KV head), or per layer with shared cells; a table
// lists its blocks oldest first, every block full but the last.
//
// Eviction is block-granular: when a table needs a new block and holds its budget, the
// block with the lowest aggregated score (sum, mean or max over its tokens' scores) among
// the unprotected ones is returned to the pool at once and its entry leaves the table. The
// first `sink_blocks` blocks ever appended and the `recent_blocks` newest are protected.
// Token scores come from observe(): the attention each token drew (summed over the query
// heads that read the table), decayed by `decay` per observed step — H2O's accumulated
// attention at decay 1, a decayed attention rate below 1. With no observe() calls every
// score is 0 and ties go to the oldest block: StreamingLLM at block granularity.
//
// Every call validates first and throws kvevict::Error naming the value; the pool and
// every table are unchanged after a throw.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <vector>

#include "bookkeeping.hpp"
#include "errors.hpp"
#include "geometry.hpp"

namespace kvevict {

/// How a pool's blocks divide a layer's K/V among its KV heads.
enum class BlockLayout : std::uint8_t {
  per_kv_head,   ///< one block per (layer, KV head): K/V block [tokens][head_dim]
  shared_cells,  ///< one block per layer for all KV heads: [tokens][n_kv_heads][head_dim]
};

/// How token scores combine into a block's score.
enum class BlockScore : std::uint8_t { sum, mean, max };

inline const char* to_string(BlockScore s) {
  switch (s) {
    case BlockScore::sum: return "sum";
    case BlockScore::mean: return "mean";
    case BlockScore::max: return "max";
  }
  return "?";
}

/// The pool's accounting. Blocks are ids 0..total-1; each is free or owned by one
/// sequence. allocate and release are O(1).
class BlockAllocator {
 public:
  static constexpr std::uint32_t kFree = std::numeric_limits<std::uint32_t>::max();

  explicit BlockAllocator(std::uint32_t blocks = 0) { reset(blocks); }
  void reset(std::uint32_t blocks) {
    owner_.assign(blocks, kFree);
    free_.resize(blocks);
    // Lowest ids first out: free_ is a stack, so push them in reverse.
    for (std::uint32_t i = 0; i < blocks; ++i) free_[i] = blocks - 1 - i;
  }
  [[nodiscard]] std::uint32_t total() const { return static_cast<std::uint32_t>(owner_.size()); }
  [[nodiscard]] std::uint32_t free_blocks() const { return static_cast<std::uint32_t>(free_.size()); }
  [[nodiscard]] std::uint32_t in_use() const { return total() - free_blocks(); }
  /// The sequence owning `block`, or kFree.
  [[nodiscard]] std::uint32_t owner(std::uint32_t block) const {
    detail::require(block < total(), "block = ", block, ", expected < ", total(), " (pool blocks)");
    return owner_[block];
  }
  /// Takes a free block for `owner`. Throws kvevict::Error when the pool is exhausted.
  std::uint32_t allocate(std::uint32_t owner) {
    detail::require(!free_.empty(), "pool exhausted: all ", total(),
                    " blocks in use, expected a free block");
    detail::require(owner != kFree, "owner = ", owner, ", expected a sequence id");
    const std::uint32_t b = free_.back();
    free_.pop_back();
    owner_[b] = owner;
    return b;
  }
  /// Returns `block` to the pool. Throws kvevict::Error if it is not in use.
  void release(std::uint32_t block) {
    detail::require(block < total(), "release: block = ", block, ", expected < ", total());
    detail::require(owner_[block] != kFree, "release: block ", block, " is free, expected a block in use");
    owner_[block] = kFree;
    free_.push_back(block);  // capacity == total: never reallocates
  }

 private:
  std::vector<std::uint32_t> owner_;
  std::vector<std::uint32_t> free_;
};

/// A pool's shape.
struct PoolConfig {
  Geometry geometry;
  std::uint32_t block_tokens = 16;  ///< tokens per block: a power of two, 1..256
  std::uint32_t blocks = 0;         ///< blocks in the pool
  BlockLayout layout = BlockLayout::per_kv_head;

  void validate() const {
    geometry.validate();
    detail::require(block_tokens >= 1 && block_tokens <= 256 &&
                        (block_tokens & (block_tokens - 1)) == 0,
                    "pool: block_tokens = ", block_tokens, ", expected a power of two in [1, 256]");
    detail::require(blocks > 0 && blocks < BlockAllocator::kFree, "pool: blocks = ", blocks,
                    ", expected > 0 and < ", BlockAllocator::kFree);
  }
  /// Tables per sequence: layers x KV heads, or layers with shared cells.
  [[nodiscard]] std::size_t tables_per_sequence() const {
    return static_cast<std::size_t>(geometry.n_layers) * static_cast<std::size_t>(groups());
  }
  /// Tables per layer: n_kv_heads, or 1 with shared cells.
  [[nodiscard]] int groups() const {
    return layout == BlockLayout::per_kv_head ? geometry.n_kv_heads : 1;
  }
  /// KV heads one table serves.
  [[nodiscard]] int heads_per_table() const {
    return layout == BlockLayout::per_kv_head ? 1 : geometry.n_kv_heads;
  }
};

/// A sequence's budget and eviction rule.
struct SequenceBudget {
  /// Blocks each table may hold (0: unbounded). Tokens: use SequenceBudget::tokens().
  std::uint32_t blocks = 0;
  std::uint32_t sink_blocks = 1;    ///< the first blocks ever appended, never evicted
  std::uint32_t recent_blocks = 1;  ///< the newest blocks, never evicted (the last, partial one included)
  BlockScore score = BlockScore::mean;
  float decay = 1.0f;  ///< per observed step, in (0, 1]

  /// A budget in tokens, rounded down to whole blocks of `block_tokens`.
  static SequenceBudget tokens(std::size_t tokens, std::uint32_t block_tokens,
                               std::uint32_t sinks = 1, std::uint32_t recent = 1) {
    detail::require(block_tokens > 0, "budget: block_tokens = 0, expected > 0");
    detail::require(tokens >= block_tokens && tokens / block_tokens < BlockAllocator::kFree,
                    "budget: ", tokens, " tokens, expected >= one block (", block_tokens,
                    " tokens) and < 2^32 blocks");
    SequenceBudget b;
    b.blocks = static_cast<std::uint32_t>(tokens / block_tokens);
    b.sink_blocks = sinks;
    b.recent_blocks = recent;
    return b;
  }
};

/// One instruction to an engine that owns the pool memory, from PagedTables::append.
struct BlockEvent {
  enum class Kind : std::uint8_t { evict, place };
  Kind kind = Kind::place;
  int layer = 0;
  int group = 0;            ///< KV head (per_kv_head) or 0 (shared cells)
  std::uint32_t block = 0;  ///< evict: back in the pool; place: where the token goes
  std::uint32_t offset = 0; ///< place: token slot in the block
  std::uint32_t tokens = 0; ///< evict: tokens the block held
};

/// Sequences and their block tables over one BlockAllocator, decisions only.
class PagedTables {
 public:
  explicit PagedTables(const PoolConfig& config) : config_(config) {
    config_.validate();
    pool_.reset(config_.blocks);
  }

  [[nodiscard]] const PoolConfig& config() const { return config_; }
  [[nodiscard]] const BlockAllocator& pool() const { return pool_; }
  [[nodiscard]] std::uint32_t block_tokens() const { return config_.block_tokens; }

  // --- sequences ------------------------------------------------------------------------
  /// Adds a sequence; returns its id. Takes no blocks until tokens arrive.
  std::uint32_t add_sequence(const SequenceBudget& budget) {
    check_budget(budget);
    std::uint32_t id;
    if (!free_ids_.empty()) {
      id = free_ids_.back();
      seqs_[id].tables.assign(config_.tables_per_sequence(), Table{});
      seqs_[id].clocks.assign(static_cast<std::size_t>(config_.geometry.n_layers), detail::LayerClock{});
      free_ids_.pop_back();
    } else {
      detail::require(seqs_.size() < BlockAllocator::kFree - 1, "add_sequence: ", seqs_.size(),
                      " sequences, expected fewer than 2^32 - 1");
      Sequence s;
      s.tables.assign(config_.tables_per_sequence(), Table{});
      s.clocks.assign(static_cast<std::size_t>(config_.geometry.n_layers), detail::LayerClock{});
      free_ids_.reserve(seqs_.size() + 1);
      seqs_.push_back(std::move(s));
      id = static_cast<std::uint32_t>(seqs_.size() - 1);
    }
    seqs_[id].budget = budget;
    seqs_[id].live = true;
    ++live_;
    return id;
  }
  /// Returns every block of the sequence to the pool; the id may be reused.
  void release_sequence(std::uint32_t seq) {
    auto& s = sequence(seq);
    for (auto& t : s.tables) {
      for (std::uint32_t b : t.blocks) pool_.release(b);
      t = Table{};
    }
    s.live = false;
    free_ids_.push_back(seq);  // reserved in add_sequence: cannot throw
    --live_;
  }
  [[nodiscard]] bool has_sequence(std::uint32_t seq) const {
    return seq < seqs_.size() && seqs_[seq].live;
  }
  [[nodiscard]] std::size_t sequences() const { return live_; }
  [[nodiscard]] const SequenceBudget& budget(std::uint32_t seq) const { return sequence(seq).budget; }

  // --- tables an attention kernel reads ------------------------------------------------
  /// Block ids of (seq, layer, group), oldest first; every block full but the last.
  [[nodiscard]] std::span<const std::uint32_t> table(std::uint32_t seq, int layer, int group) const {
    return table_ref(seq, layer, group).blocks;
  }
  /// Tokens held by (seq, layer, group): (blocks - 1) * block_tokens + tokens in the last.
  [[nodiscard]] std::size_t tokens(std::uint32_t seq, int layer, int group) const {
    const Table& t = table_ref(seq, layer, group);
    return t.blocks.empty() ? 0 : (t.blocks.size() - 1) * config_.block_tokens + t.fill;
  }
  /// Engine position of every token slot, in table order (block_tokens per block; slots
  /// past the last block's fill are stale).
  [[nodiscard]] std::span<const std::int64_t> positions(std::uint32_t seq, int layer, int group) const {
    return table_ref(seq, layer, group).pos;
  }
  /// Tokens appended to a layer of the sequence so far (kept or not).
  [[nodiscard]] std::uint64_t tokens_seen(std::uint32_t seq, int layer) const {
    detail::check_layer(config_.geometry, layer);
    return sequence(seq).clocks[static_cast<std::size_t>(layer)].next_seq;
  }

  /// Query heads that read one table: the group of a KV head, or all with shared cells.
  [[nodiscard]] int query_heads_per_table() const {
    return config_.layout == BlockLayout::per_kv_head ? config_.geometry.group()
                                                      : config_.geometry.n_heads;
  }

  // --- decode -----------------------------------------------------------------------------
  /// One token of `layer` of sequence `seq` at `position`. For each table of the layer:
  /// if its last block is full it needs a new one, and if it already holds its budget,
  /// the lowest-scoring unprotected block is evicted first (returned to the pool at
  /// once). Returns the evict and place events, valid until the next call. Throws
  /// kvevict::Error (unknown sequence, bad layer, position not increasing, pool exhausted)
  /// with nothing changed.
  std::span<const BlockEvent> append(std::uint32_t seq, int layer, std::int64_t position) {
    auto& s = sequence(seq);
    detail::check_layer(config_.geometry, layer);
    auto& clock = s.clocks[static_cast<std::size_t>(layer)];
    detail::check_position(clock, layer, position);
    const int groups = config_.groups();
    // Phase 1: decide and reserve everything that may throw.
    std::size_t need = 0, freed = 0;
    victims_.assign(static_cast<std::size_t>(groups), kNone);
    for (int g = 0; g < groups; ++g) {
      Table& t = s.tables[table_index(layer, g)];
      if (!t.blocks.empty() && t.fill < config_.block_tokens) continue;
      if (s.budget.blocks != 0 && t.blocks.size() >= s.budget.blocks) {
        victims_[static_cast<std::size_t>(g)] = choose_block(t, s.budget);
        ++freed;
      }
      ++need;
      t.blocks.reserve(t.blocks.size() + 1);
      t.first_seq.reserve(t.blocks.size() + 1);
      t.pos.reserve((t.blocks.size() + 1) * config_.block_tokens);
      t.score.reserve((t.blocks.size() + 1) * config_.block_tokens);
    }
    detail::require(need - freed <= pool_.free_blocks(), "append: pool exhausted: sequence ", seq,
                    " layer ", layer, " needs ", need - freed, " new blocks, ", pool_.free_blocks(),
                    " of ", pool_.total(), " free");
    events_.clear();
    events_.reserve(static_cast<std::size_t>(2 * groups));
    // Phase 2: apply (nothing below throws).
    for (int g = 0; g < groups; ++g) {
      Table& t = s.tables[table_index(layer, g)];
      const std::size_t v = victims_[static_cast<std::size_t>(g)];
      if (v != kNone) {
        const std::uint32_t held = v + 1 == t.blocks.size() ? t.fill : config_.block_tokens;
        events_.push_back(BlockEvent{BlockEvent::Kind::evict, layer, g, t.blocks[v], 0, held});
        pool_.release(t.blocks[v]);
        erase_block(t, v);
      }
      if (t.blocks.empty() || t.fill == config_.block_tokens) {
        t.blocks.push_back(pool_.allocate(seq));
        t.first_seq.push_back(t.appended_blocks++);
        t.pos.resize(t.blocks.size() * config_.block_tokens, 0);
        t.score.resize(t.blocks.size() * config_.block_tokens, 0.0f);
        t.fill = 0;
      }
      const std::size_t slot = (t.blocks.size() - 1) * config_.block_tokens + t.fill;
      t.pos[slot] = position;
      t.score[slot] = 0.0f;
      events_.push_back(BlockEvent{BlockEvent::Kind::place, layer, g, t.blocks.back(), t.fill, 0});
      ++t.fill;
    }
    ++clock.next_seq;
    clock.last_position = position;
    return events_;
  }

  /// One step's attention of (seq, layer, group) over its tokens in table order:
  /// `heads` rows of tokens(seq, layer, group) probabilities (the query heads that read
  /// the table: the group of a KV head, or every query head with shared cells). Each
  /// token's score decays by the sequence's `decay` and adds the attention it drew,
  /// summed over the rows.
  void observe(std::uint32_t seq, int layer, int group, std::span<const float> probs) {
    const std::size_t n = tokens(seq, layer, group);
    const std::size_t heads = static_cast<std::size_t>(query_heads_per_table());
    detail::require(probs.size() == heads * n, "observe: probs has ", probs.size(),
                    " floats, expected ", heads * n, " (", heads, " query heads x ", n,
                    " tokens of the table)");
    auto& s = sequence(seq);
    Table& t = s.tables[table_index(layer, group)];
    // One row-wise pass sums the query heads per token and checks finiteness (the
    // dispatched kernel the containers' observe uses; same sums as a scalar loop adding
    // the heads in order from 0). Nothing is written to the table before the check.
    sums_.resize(n);
    if (!kernels::group_sum_checked(probs.data(), heads, n, sums_.data()))
      detail::check_finite(probs, "observe: probs");  // names the bad value and throws
    const float decay = s.budget.decay;
    for (std::size_t i = 0; i < n; ++i) t.score[i] = decay * t.score[i] + sums_[i];
  }

 protected:
  static constexpr std::size_t kNone = std::numeric_limits<std::size_t>::max();
  struct Table {
    std::vector<std::uint32_t> blocks;     // pool ids, oldest first
    std::vector<std::uint64_t> first_seq;  // arrival index of each block within the table
    std::vector<std::int64_t> pos;         // per slot, table order
    std::vector<float> score;              // per slot, table order
    std::uint32_t fill = 0;                // tokens in the last block
    std::uint64_t appended_blocks = 0;
  };
  struct Sequence {
    std::vector<Table> tables;
    std::vector<detail::LayerClock> clocks;
    SequenceBudget budget;
    bool live = false;
  };

  void check_budget(const SequenceBudget& b) const {
    detail::require(std::isfinite(b.decay) && b.decay > 0.0f && b.decay <= 1.0f,
                    "budget: decay = ", b.decay, ", expected in (0, 1]");
    if (b.blocks == 0) return;
    const std::uint64_t protect = std::uint64_t{b.sink_blocks} + b.recent_blocks;
    detail::require(b.blocks > protect, "budget: ", b.blocks, " blocks, expected > ", protect,
                    " (", b.sink_blocks, " sink + ", b.recent_blocks,
                    " recent blocks are protected; one must be evictable)");
    detail::require(b.recent_blocks >= 1, "budget: recent_blocks = 0, expected >= 1 (the block "
                    "being filled is always recent)");
  }
  Sequence& sequence(std::uint32_t seq) {
    detail::require(has_sequence(seq), "sequence ", seq, " is unknown (released or never added)");
    return seqs_[seq];
  }
  const Sequence& sequence(std::uint32_t seq) const {
    detail::require(has_sequence(seq), "sequence ", seq, " is unknown (released or never added)");
    return seqs_[seq];
  }
  std::size_t table_index(int layer, int group) const {
    return static_cast<std::size_t>(layer) * static_cast<std::size_t>(config_.groups()) +
           static_cast<std::size_t>(group);
  }
  const Table& table_ref(std::uint32_t seq, int layer, int group) const {
    const Sequence& s = sequence(seq);
    detail::check_layer(config_.geometry, layer);
    detail::require(group >= 0 && group < config_.groups(), "group = ", group,
                    ", expected 0 <= group < ", config_.groups(),
                    config_.layout == BlockLayout::shared_cells ? " (shared cells: one table per layer)"
                                                                : " (n_kv_heads)");
    return s.tables[table_index(layer, group)];
  }

  // The unprotected block with the lowest aggregated score; the oldest on ties.
  std::size_t choose_block(const Table& t, const SequenceBudget& b) const {
    const std::size_t n = t.blocks.size();
    const std::size_t B = config_.block_tokens;
    std::size_t best = kNone;
    float best_score = 0.0f;
    for (std::size_t i = 0; i + b.recent_blocks < n; ++i) {
      if (t.first_seq[i] < b.sink_blocks) continue;
      const float* sc = t.score.data() + i * B;
      float agg = 0.0f;
      switch (b.score) {
        case BlockScore::sum:
        case BlockScore::mean:
          for (std::size_t j = 0; j < B; ++j) agg += sc[j];
          break;
        case BlockScore::max:
          for (std::size_t j = 0; j < B; ++j) agg = std::max(agg, sc[j]);
          break;
      }
      // Every evictable block is full (the last block is always recent), so the mean is
      // the sum over B: the same order. It differs only in what it reports.
      if (best == kNone || agg < best_score) {
        best = i;
        best_score = agg;
      }
    }
    return best;  // check_budget guarantees one exists when the table holds its budget
  }
  void erase_block(Table& t, std::size_t i) {
    const std::size_t B = config_.block_tokens;
    t.blocks.erase(t.blocks.begin() + static_cast<std::ptrdiff_t>(i));
    t.first_seq.erase(t.first_seq.begin() + static_cast<std::ptrdiff_t>(i));
    t.pos.erase(t.pos.begin() + static_cast<std::ptrdiff_t>(i * B),
                t.pos.begin() + static_cast<std::ptrdiff_t>((i + 1) * B));
    t.score.erase(t.score.begin() + static_cast<std::ptrdiff_t>(i * B),
                  t.score.begin() + static_cast<std::ptrdiff_t>((i + 1) * B));
  }

  PoolConfig config_;
  BlockAllocator pool_;
  std::vector<Sequence> seqs_;
  std::vector<std::uint32_t> free_ids_;
  std::vector<float> sums_;  ///< observe scratch (per-token sums over the query heads)
  std::size_t live_ = 0;
  std::vector<std::size_t> victims_;
  std::vector<BlockEvent> events_;
};

/// PagedTables plus the pool's K/V memory: blocks of Scalar, laid out as the pool's
/// BlockLayout says. An attention kernel reads table(seq, layer, group) and, per block id,
/// key_block(id) / value_block(id): block_tokens rows of row_width() Scalars each (the KV
/// heads of a shared cell side by side, [tokens][n_kv_heads][head_dim]).
template <class Scalar = float>
class PagedKV : public PagedTables {
 public:
  explicit PagedKV(const PoolConfig& config) : PagedTables(config) {
    const std::size_t width = row_width();
    const std::size_t per_block = static_cast<std::size_t>(config_.block_tokens) * width;
    const std::size_t limit = std::numeric_limits<std::size_t>::max() / 2 / sizeof(Scalar);
    detail::require(per_block <= limit / config_.blocks, "pool: ", config_.blocks, " blocks of ",
                    per_block, " values do not fit in memory arithmetic (size_t)");
    k_.assign(per_block * config_.blocks, Scalar(0.0f));
    v_.assign(per_block * config_.blocks, Scalar(0.0f));
  }
  /// Scalars per token row of a block: head_dim, or n_kv_heads x head_dim for shared cells.
  [[nodiscard]] std::size_t row_width() const {
    return static_cast<std::size_t>(config_.heads_per_table()) *
           static_cast<std::size_t>(config_.geometry.head_dim);
  }
  [[nodiscard]] const Scalar* key_block(std::uint32_t block) const { return k_.data() + offset(block); }
  [[nodiscard]] const Scalar* value_block(std::uint32_t block) const { return v_.data() + offset(block); }
  /// Bytes of K/V the pool holds.
  [[nodiscard]] std::size_t pool_bytes() const { return (k_.size() + v_.size()) * sizeof(Scalar); }

  /// One token of `layer`: keys and values n_kv_heads x head_dim floats. Evicts as
  /// PagedTables::append, then stores the token (converted to Scalar) in its slots.
  std::span<const BlockEvent> append(std::uint32_t seq, int layer, std::int64_t position,
                                     std::span<const float> keys, std::span<const float> values) {
    detail::check_token_rows(config_.geometry, keys, "append: keys");
    detail::check_token_rows(config_.geometry, values, "append: values");
    detail::check_finite(keys, "append: keys");
    detail::check_finite(values, "append: values");
    auto events = PagedTables::append(seq, layer, position);
    const std::size_t w = row_width();
    for (const BlockEvent& e : events) {
      if (e.kind != BlockEvent::Kind::place) continue;
      const std::size_t dst = offset(e.block) + static_cast<std::size_t>(e.offset) * w;
      const std::size_t src = static_cast<std::size_t>(e.group) * w;
      for (std::size_t j = 0; j < w; ++j) {
        k_[dst + j] = static_cast<Scalar>(keys[src + j]);
        v_[dst + j] = static_cast<Scalar>(values[src + j]);
      }
    }
    return events;
  }

 private:
  std::size_t offset(std::uint32_t block) const {
    detail::require(block < config_.blocks, "block = ", block, ", expected < ", config_.blocks);
    return static_cast<std::size_t>(block) * config_.block_tokens * row_width();
  }
  std::vector<Scalar> k_, v_;
};

}  // namespace kvevict
