#pragma once
// PagedCache<Policy, Scalar>: the paged per-head layout over the container core. One
// sequence's K/V rows live in blocks drawn from a BlockPool shared by many sequences;
// every policy runs through the same core as KVCache (token-level decisions per KV head),
// and rows are kept dense over each head's block list: row r sits in block
// table(l, h)[r / block_tokens] at slot r % block_tokens. An eviction copies the head's
// last row into the hole (the compaction KVCache does), so every block is full but the
// last, and a block is returned to the pool the moment it empties. A paged attention
// kernel reads table(l, h) and pool.key_block(id) directly.
//
// Same rows as KVCache on the same stream, in the same order, bit for bit, at every block
// size (the core makes the decisions; the layout only says where rows live).
// The policy reads rows through HeadView as one contiguous matrix, so this layout gathers a
// head's rows into a scratch buffer when a policy reads them (O(rows x head_dim) per
// head and step, like IndexCache).
//
// Scalar: float, Eigen::half, Eigen::bfloat16, or a quantized format of quantized.hpp
// (Q8<G>, Q4<G>, E4M3, KV<KF, VF>), as for KVCache: rows are stored as the format's bytes
// (row_codec.hpp, the same encoding KVCache stores, bit for bit), policies read dequantised
// float rows.
#include <algorithm>
#include <bit>
#include <limits>
#include <cstdint>
#include <cstring>
#include <span>
#include <utility>
#include <vector>

#include "container_core.hpp"
#include "paged.hpp"
#include "row_codec.hpp"

namespace kvevict {

/// Blocks of K/V rows of one KV head each, shared by any number of PagedCache sequences:
/// a key block is [block_tokens][key_row_units()] elements of `unit` (head_dim elements of
/// Scalar for float, fp16 and bf16; the format's encoded row, scales included, for a
/// quantized Scalar), a value block likewise. Not thread-safe: sequences sharing a pool run
/// on one thread (or the engine serialises their appends).
template <class Scalar = float>
class BlockPool {
  using Codec = detail::RowCodec<Scalar>;

 public:
  using unit = typename Codec::unit;

  BlockPool(std::uint32_t blocks, std::uint32_t block_tokens, int head_dim) {
    PoolConfig cfg{Geometry{1, 1, 1, head_dim}, block_tokens, blocks, BlockLayout::per_kv_head};
    cfg.validate();
    Codec::check_dim(static_cast<std::size_t>(head_dim));
    block_tokens_ = block_tokens;
    d_ = static_cast<std::size_t>(head_dim);
    ku_ = Codec::key_units(d_);
    vu_ = Codec::value_units(d_);
    const std::size_t per_block = static_cast<std::size_t>(block_tokens) * std::max(ku_, vu_);
    detail::require(per_block <= std::numeric_limits<std::size_t>::max() / 2 / sizeof(unit) / blocks,
                    "pool: ", blocks, " blocks of ", per_block, " values overflow size_t");
    alloc_.reset(blocks);
    k_.assign(static_cast<std::size_t>(block_tokens) * ku_ * blocks, unit(0.0f));
    v_.assign(static_cast<std::size_t>(block_tokens) * vu_ * blocks, unit(0.0f));
  }
  [[nodiscard]] const BlockAllocator& allocator() const { return alloc_; }
  [[nodiscard]] std::uint32_t block_tokens() const { return block_tokens_; }
  [[nodiscard]] int head_dim() const { return static_cast<int>(d_); }
  /// Elements of `unit` per stored key / value row (head_dim unless quantized).
  [[nodiscard]] std::size_t key_row_units() const { return ku_; }
  [[nodiscard]] std::size_t value_row_units() const { return vu_; }
  /// Bytes per stored row, as KVCache::key_row_bytes / value_row_bytes.
  [[nodiscard]] std::size_t key_row_bytes() const { return ku_ * sizeof(unit); }
  [[nodiscard]] std::size_t value_row_bytes() const { return vu_ * sizeof(unit); }
  [[nodiscard]] const unit* key_block(std::uint32_t b) const { return k_.data() + offset(b, ku_); }
  [[nodiscard]] const unit* value_block(std::uint32_t b) const { return v_.data() + offset(b, vu_); }

  // For layouts (PagedCache): accounting and unchecked row access.
  std::uint32_t allocate(std::uint32_t owner) { return alloc_.allocate(owner); }
  void release(std::uint32_t block) { alloc_.release(block); }
  unit* key_row(std::uint32_t b, std::size_t slot) { return k_.data() + (static_cast<std::size_t>(b) * block_tokens_ + slot) * ku_; }
  unit* value_row(std::uint32_t b, std::size_t slot) { return v_.data() + (static_cast<std::size_t>(b) * block_tokens_ + slot) * vu_; }

 private:
  std::size_t offset(std::uint32_t b, std::size_t units) const {
    detail::require(b < alloc_.total(), "block = ", b, ", expected < ", alloc_.total());
    return static_cast<std::size_t>(b) * block_tokens_ * units;
  }
  BlockAllocator alloc_;
  std::uint32_t block_tokens_ = 1;
  std::size_t d_ = 1, ku_ = 1, vu_ = 1;
  std::vector<unit> k_, v_;
};

namespace detail {
/// PagedCache's per-head state: the head's blocks in row order.
struct PagedHead : HeadRows {
  std::vector<std::uint32_t> blocks;
};
}  // namespace detail

template <class Policy, class Scalar = float>
  requires EvictionPolicy<Policy, typename detail::RowCodec<Scalar>::view>
class PagedCache
    : public detail::ContainerCore<PagedCache<Policy, Scalar>, Policy,
                                   typename detail::RowCodec<Scalar>::view, detail::PagedHead> {
  using Codec = detail::RowCodec<Scalar>;
  using View = typename Codec::view;  ///< rows as policies read them (float if quantized)
  using Unit = typename Codec::unit;  ///< rows as the pool stores them
  using Core = detail::ContainerCore<PagedCache, Policy, View, detail::PagedHead>;
  friend Core;

 public:
  using scalar_type = Scalar;
  using policy_type = Policy;
  static constexpr bool quantized = Codec::quantized;

  /// A sequence over `pool` (which must outlive it), owner id `sequence` in the pool's
  /// accounting. Takes no blocks until tokens arrive; returns all of them when destroyed.
  PagedCache(const Geometry& geometry, const Budget& budget, BlockPool<Scalar>& pool,
             std::uint32_t sequence, Policy policy = Policy{})
      : Core(geometry, budget, std::move(policy)), pool_(&pool), owner_(sequence) {
    detail::require(pool.head_dim() == geometry.head_dim, "PagedCache: pool head_dim = ",
                    pool.head_dim(), ", expected ", geometry.head_dim, " (the geometry's)");
    detail::require(sequence != BlockAllocator::kFree, "PagedCache: sequence = ", sequence,
                    ", expected < ", BlockAllocator::kFree);
    shift_ = static_cast<unsigned>(std::countr_zero(pool.block_tokens()));
  }
  PagedCache(const PagedCache&) = delete;
  PagedCache& operator=(const PagedCache&) = delete;
  ~PagedCache() { release(); }

  /// Returns every block to the pool. The sequence is over: append and prefill throw
  /// afterwards (the policy's per-row state is not reset).
  void release() noexcept {
    released_ = true;
    for (auto& h : this->heads_) {
      for (std::uint32_t b : h.blocks) pool_->release(b);
      h.blocks.clear();
      h.pos.clear();
      h.seq.clear();
    }
  }

  /// Block ids of (layer, kv_head) in row order: row r is in block r / block_tokens.
  [[nodiscard]] std::span<const std::uint32_t> table(int layer, int kv_head) const {
    return this->head(layer, kv_head).blocks;
  }
  [[nodiscard]] const BlockPool<Scalar>& pool() const { return *pool_; }
  /// Blocks this sequence holds.
  [[nodiscard]] std::size_t blocks_in_use() const {
    std::size_t n = 0;
    for (const auto& h : this->heads_) n += h.blocks.size();
    return n;
  }

  /// As KVCache::append. Also throws kvevict::Error (nothing changed) when the pool has no
  /// free block for a head that needs one.
  void append(int layer, std::int64_t position, std::span<const float> keys,
              std::span<const float> values, std::span<const float> queries = {}) {
    check_live();
    this->check_token(layer, position, keys, values, queries, false);
    need_blocks_ = 0;
    this->step(layer, position, keys.data(), values.data(), queries.empty() ? nullptr : queries.data());
  }
  /// As KVCache::prefill.
  void prefill(int layer, std::int64_t first_position, std::size_t tokens,
               std::span<const float> keys, std::span<const float> values,
               std::span<const float> queries = {}) {
    check_live();
    this->check_block(layer, first_position, tokens, keys, values, queries, true);
    need_blocks_ = 0;
    this->prefill_block(layer, first_position, tokens, keys.data(), values.data(),
                        queries.empty() ? nullptr : queries.data());
  }

 private:
  void check_live() const {
    detail::require(!released_, "PagedCache: sequence ", owner_,
                    " was released, expected a live sequence");
  }
  std::uint32_t block_of(const detail::PagedHead& h, std::size_t row) const { return h.blocks[row >> shift_]; }
  std::size_t slot_of(std::size_t row) const { return row & (pool_->block_tokens() - 1); }
  std::size_t blocks_for(std::size_t rows) const { return (rows + pool_->block_tokens() - 1) >> shift_; }

  // --- layout hooks (container_core.hpp) ------------------------------------------------
  // A policy declaring reads_stored_rows = false gets views without keys/values, and decode
  // steps gather nothing from the pool (kGather), as in IndexCache.
  detail::RowsData<View> rows_data(int, int) const {
    if constexpr (!kGather) return {nullptr, nullptr};
    return {gather_k_.data(), gather_v_.data()};
  }
  void load_rows(int layer, int kh, const float* key, const float* value) {
    if constexpr (kGather) gather(layer, kh, key, value);
  }
  // The head's rows (and the incoming one) as contiguous matrices, as policies read them:
  // copies of the stored rows, or for a quantized pool the rows dequantised (the incoming
  // one encoded and decoded, as it will be stored).
  void gather(int layer, int kh, const float* key, const float* value) {
    const auto& h = this->heads_[this->index(layer, kh)];
    const std::size_t d = this->udim(), n = h.size();
    gather_k_.resize((n + 1) * d);
    gather_v_.resize((n + 1) * d);
    for (std::size_t r = 0; r < n; ++r) read_row(block_of(h, r), slot_of(r), gather_k_.data() + r * d,
                                                 gather_v_.data() + r * d);
    View* kn = gather_k_.data() + n * d;
    View* vn = gather_v_.data() + n * d;
    if constexpr (quantized) {
      if (key && value) {
        row_k_.resize(pool_->key_row_units());
        row_v_.resize(pool_->value_row_units());
        Codec::encode(key, value, d, row_k_.data(), row_v_.data());
        Codec::decode(true, row_k_.data(), 1, d, kn);
        Codec::decode(false, row_v_.data(), 1, d, vn);
        return;
      }
    }
    for (std::size_t j = 0; j < d; ++j) {
      kn[j] = key ? static_cast<View>(key[j]) : View(0.0f);
      vn[j] = value ? static_cast<View>(value[j]) : View(0.0f);
    }
  }
  // One stored row as policies read it (d elements of View each).
  void read_row(std::uint32_t block, std::size_t slot, View* k, View* v) const {
    const std::size_t d = this->udim();
    if constexpr (quantized) {
      Codec::decode(true, pool_->key_row(block, slot), 1, d, k);
      Codec::decode(false, pool_->value_row(block, slot), 1, d, v);
    } else {
      std::memcpy(k, pool_->key_row(block, slot), d * sizeof(View));
      std::memcpy(v, pool_->value_row(block, slot), d * sizeof(View));
    }
  }
  void check_stored(std::span<const float> x, const char* what, bool is_key) const {
    Codec::check_stored(x, what, is_key);
  }
  std::uint32_t stored_limit_bits(bool is_key) const { return Codec::limit_bits(is_key); }
  const View* attention_rows(int layer, int kh) {
    gather(layer, kh, nullptr, nullptr);
    return gather_k_.data();
  }
  void reserve_rows(std::size_t i, std::size_t n) { this->heads_[i].blocks.reserve(blocks_for(n)); }
  void prepare_head(int, int, std::size_t i, const std::vector<std::uint32_t>& victims) {
    const auto& h = this->heads_[i];
    const std::size_t after = blocks_for(h.size() - victims.size() + 1);
    if (after > h.blocks.size()) need_blocks_ += after - h.blocks.size();
  }
  void prepare_step(int layer, std::size_t total_victims, std::size_t max_rows) {
    (void)total_victims;
    if constexpr (kGather) {
      const std::size_t d = this->udim();
      gather_k_.reserve(max_rows * d);
      gather_v_.reserve(max_rows * d);
    } else {
      (void)max_rows;
    }
    check_pool(layer);
  }
  // A prefill_keep selection: each head's held victims leave (returning their blocks)
  // before its kept block rows are written, so a head needs the blocks of its rows after
  // the selection beyond those it has (on an empty layer: all of them).
  void prepare_prompt(int layer, std::size_t, const std::vector<std::vector<std::uint32_t>>& keep,
                      const std::vector<std::vector<std::uint32_t>>& victims) {
    for (std::size_t kh = 0; kh < keep.size(); ++kh) {
      const auto& h = this->heads_[this->index(layer, static_cast<int>(kh))];
      const std::size_t after = blocks_for(h.size() - victims[kh].size() + keep[kh].size());
      if (after > h.blocks.size()) need_blocks_ += after - h.blocks.size();
    }
    check_pool(layer);
    if constexpr (kGather) {  // the gathered rows while the selection is applied
      const std::size_t n = this->prompt_rows_max(layer, keep, victims) * this->udim();
      gather_k_.reserve(n);
      gather_v_.reserve(n);
    }
  }
  // A block that goes token by token: each step keeps at most capacity rows, so the head
  // ends with at most min(rows + tokens, capacity) rows, and needs the blocks of that beyond
  // those it has. Checked for the whole block before its first step (a refusal half way
  // would leave the block's first tokens in). Conservative for a policy that evicts more
  // than one row per step; a pooled budget's head may exceed its own capacity (not bounded
  // here: its steps are still each checked).
  void prepare_token_prefill(int layer, std::size_t tokens) {
    need_blocks_ = 0;
    for (int kh = 0; kh < this->shape_.geometry.n_kv_heads; ++kh) {
      const auto& h = this->heads_[this->index(layer, kh)];
      const std::size_t cap = this->shape_.at(layer, kh);
      const std::size_t rows = h.size() >= cap || tokens >= cap - h.size() ? std::max(cap, h.size()) : h.size() + tokens;
      const std::size_t after = blocks_for(rows);
      if (after > h.blocks.size()) need_blocks_ += after - h.blocks.size();
    }
    check_pool(layer);
  }
  void check_pool(int layer) {
    const std::size_t free = pool_->allocator().free_blocks();
    detail::require(need_blocks_ <= free, "append: pool exhausted: layer ", layer, " of sequence ",
                    owner_, " needs ", need_blocks_, " new blocks, ", free, " of ",
                    pool_->allocator().total(), " free");
    need_blocks_ = 0;
  }
  void remove_row(int, int, std::size_t i, std::uint32_t r, std::size_t last) noexcept {
    auto& h = this->heads_[i];
    const std::size_t d = this->udim();
    if (r != last) {
      std::memcpy(pool_->key_row(block_of(h, r), slot_of(r)), pool_->key_row(block_of(h, last), slot_of(last)),
                  pool_->key_row_bytes());
      std::memcpy(pool_->value_row(block_of(h, r), slot_of(r)),
                  pool_->value_row(block_of(h, last), slot_of(last)), pool_->value_row_bytes());
      if constexpr (kGather) {
        std::memcpy(gather_k_.data() + r * d, gather_k_.data() + last * d, d * sizeof(View));
        std::memcpy(gather_v_.data() + r * d, gather_v_.data() + last * d, d * sizeof(View));
      }
    }
    if (slot_of(last) == 0) {  // the last block held only the removed row: back to the pool
      pool_->release(h.blocks.back());
      h.blocks.pop_back();
    }
  }
  void write_row(detail::PagedHead& h, std::size_t row, const float* key, const float* value) {
    if (slot_of(row) == 0) h.blocks.push_back(pool_->allocate(owner_));  // checked in phase 1
    Codec::encode(key, value, this->udim(), pool_->key_row(h.blocks.back(), slot_of(row)),
                  pool_->value_row(h.blocks.back(), slot_of(row)));
  }
  void push_row(int, int, std::size_t i, std::size_t row, std::int64_t, std::uint64_t,
                const float* key, const float* value, std::uint32_t) {
    write_row(this->heads_[i], row, key, value);
    if constexpr (!kGather) return;
    // The gathered matrices now hold the survivors in row order, then the incoming row.
    const std::size_t d = this->udim();
    std::memmove(gather_k_.data() + row * d, gather_k_.data() + (gather_k_.size() - d), d * sizeof(View));
    std::memmove(gather_v_.data() + row * d, gather_v_.data() + (gather_v_.size() - d), d * sizeof(View));
    gather_k_.resize((row + 1) * d);
    gather_v_.resize((row + 1) * d);
  }
  // The gathered matrices keep the head's live rows (those a chunked reselection kept;
  // none on an empty layer); kept prompt rows are appended to them.
  void begin_prompt_head(int layer, int kh) {
    const std::size_t n = this->heads_[this->index(layer, kh)].size() * this->udim();
    gather_k_.resize(std::min(n, gather_k_.size()));
    gather_v_.resize(std::min(n, gather_v_.size()));
  }
  void keep_prompt_row(int, int, std::size_t i, std::size_t row, std::size_t, const float* key,
                       const float* value, std::int64_t, std::uint64_t) {
    auto& h = this->heads_[i];
    write_row(h, row, key, value);
    if constexpr (!kGather) return;
    const std::size_t d = this->udim();  // the row as stored
    gather_k_.resize(gather_k_.size() + d);
    gather_v_.resize(gather_v_.size() + d);
    read_row(h.blocks.back(), slot_of(row), gather_k_.data() + gather_k_.size() - d,
             gather_v_.data() + gather_v_.size() - d);
  }
  void drop_prompt_row(int, int, std::size_t, std::size_t, const float*, const float*, std::int64_t,
                       std::uint64_t) {}

  BlockPool<Scalar>* pool_;
  std::uint32_t owner_;
  unsigned shift_ = 0;
  std::size_t need_blocks_ = 0;
  bool released_ = false;
  std::vector<View> gather_k_, gather_v_;
  std::vector<Unit> row_k_, row_v_;  ///< quantized pools: the incoming row encoded
  /// Whether decode steps gather stored rows from the pool for the policy's views.
  static constexpr bool kGather = detail::reads_stored_rows<Policy>();
};

}  // namespace kvevict
