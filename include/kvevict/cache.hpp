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
#include "mixed.hpp"
#include "policy.hpp"
#include "quantized.hpp"
#include "row_codec.hpp"

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
/// What a row of a byte-storing cache (quantized or mixed) hands the eviction callback.
struct EvictedBytes {
  int layer = 0;
  int kv_head = 0;
  std::int64_t position = 0;
  std::uint64_t seq = 0;
  std::span<const std::uint8_t> key;    ///< the stored key bytes
  std::span<const std::uint8_t> value;  ///< the stored value bytes
  std::size_t head_dim = 0;
};
}  // namespace detail

/// A row of a quantized cache (quantized.hpp) leaving it: the stored bytes, bit for bit,
/// and a dequantising view (dequantize_key / dequantize_value write head_dim floats).
template <class Scalar>
  requires detail::QuantizedStorage<Scalar>
struct EvictedRow<Scalar> : detail::EvictedBytes {
  void dequantize_key(std::span<float> out) const {
    detail::require(out.size() == head_dim, "EvictedRow::dequantize_key: out has ", out.size(),
                    " floats, expected head_dim ", head_dim);
    detail::StorageOf<Scalar>::key_codec::decode(key.data(), head_dim, out.data());
  }
  void dequantize_value(std::span<float> out) const {
    detail::require(out.size() == head_dim, "EvictedRow::dequantize_value: out has ", out.size(),
                    " floats, expected head_dim ", head_dim);
    detail::StorageOf<Scalar>::value_codec::decode(value.data(), head_dim, out.data());
  }
};

/// A row of a mixed cache (mixed.hpp) leaving it: the stored bytes in the format of the
/// band it was in (hot: the hot band's).
template <class Scalar>
  requires detail::MixedStorage<Scalar>
struct EvictedRow<Scalar> : detail::EvictedBytes {
  bool hot = false;  ///< stored in the hot (recent) band's format
  void dequantize_key(std::span<float> out) const { decode(true, out); }
  void dequantize_value(std::span<float> out) const { decode(false, out); }

 private:
  void decode(bool is_key, std::span<float> out) const {
    using H = detail::BandCodecs<typename Scalar::hot_format>;
    using C = detail::BandCodecs<typename Scalar::cold_format>;
    detail::require(out.size() == head_dim, "EvictedRow::dequantize_", is_key ? "key" : "value",
                    ": out has ", out.size(), " floats, expected head_dim ", head_dim);
    if (is_key) hot ? H::key::decode(key.data(), head_dim, out.data()) : C::key::decode(key.data(), head_dim, out.data());
    else hot ? H::value::decode(value.data(), head_dim, out.data()) : C::value::decode(value.data(), head_dim, out.data());
  }
};

namespace detail {
/// KVCache's storage of one (layer, KV head): K and V rows (size x head_dim, row-major)
/// beside the core's positions and arrival indices.
template <class Scalar>
struct DenseHead : HeadRows {
  RowVector<Scalar> k, v;  ///< a new row is encoded into storage that was not zeroed first
};
/// The head type of KVCache<P, S>: dense rows, or a mixed layout's two bands.
template <class S>
struct CacheHeadOf {
  using type = DenseHead<typename StorageOf<S>::unit>;
};
template <class H, class C>
struct CacheHeadOf<Mixed<H, C>> {
  using type = MixedHead<H, C>;
};
}  // namespace detail

/// Scalar: float, Eigen::half, Eigen::bfloat16 (rows stored as that element type), or a
/// quantized format of quantized.hpp (Q8<G>, Q4<G>, E4M3, KV<KF, VF>): rows stored as
/// bytes, policies read dequantised float rows (HeadView<float>); or Mixed<Hot, Cold>
/// (mixed.hpp): a recent band of hot_rows() rows per head in Hot, older rows in Cold.
template <class Policy, class Scalar = float>
  requires EvictionPolicy<Policy, typename detail::StorageOf<Scalar>::view>
class KVCache
    : public detail::ContainerCore<KVCache<Policy, Scalar>, Policy,
                                   typename detail::StorageOf<Scalar>::view,
                                   typename detail::CacheHeadOf<Scalar>::type> {
  using Storage = detail::StorageOf<Scalar>;
  using Unit = typename Storage::unit;
  using View = typename Storage::view;
  using HeadStore = typename detail::CacheHeadOf<Scalar>::type;
  using Core = detail::ContainerCore<KVCache, Policy, View, HeadStore>;
  friend Core;

 public:
  using scalar_type = Scalar;
  static constexpr bool quantized = Storage::quantized;
  static constexpr bool mixed = detail::IsMixed<Scalar>::value;
  using policy_type = Policy;
  using RowMatrix = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using ConstRowsMap = Eigen::Map<const RowMatrix>;
  /// Must not throw: it runs while rows are being moved (a throw terminates).
  using EvictionCallback = std::function<void(const EvictedRow<Scalar>&)>;

  // The entry points that run the container's code (constructor, append, prefill,
  // set_budget) are defined below the class, not inline: in compiled-kernels mode
  // (config.hpp) the common KVCache types are instantiated once in kvevict_kernels and
  // user translation units see `extern template` declarations (extern_templates.hpp), which
  // suppress the instantiation of non-inline members only.
  KVCache(const Geometry& geometry, const Budget& budget, Policy policy = Policy{});

  // --- shape: geometry(), shape(), policy(), size(), capacity(), tokens_seen(), observe(),
  // positions(), seqs() come from the core --------------------------------------------
  /// Rows of storage actually allocated (<= capacity): what the memory really holds.
  [[nodiscard]] std::size_t allocated_rows(int layer, int kv_head) const {
    return this->head(layer, kv_head).pos.capacity();
  }
  /// Bytes of K/V storage allocated across the whole cache.
  [[nodiscard]] std::size_t allocated_bytes() const {
    std::size_t b = 0;
    for (const auto& h : this->heads_) {
      if constexpr (mixed) b += h.allocated_bytes();
      else b += (h.k.capacity() + h.v.capacity()) * sizeof(Unit);
      b += h.pos.capacity() * (sizeof(std::int64_t) + sizeof(std::uint64_t));
    }
    return b;
  }

  // --- views for the engine's attention kernel ----------------------------------------
  [[nodiscard]] ConstRowsMap keys(int layer, int kv_head) const
    requires(!quantized)
  {
    const auto& h = this->head(layer, kv_head);
    return ConstRowsMap(h.k.data(), static_cast<Eigen::Index>(h.size()), dim());
  }
  [[nodiscard]] ConstRowsMap values(int layer, int kv_head) const
    requires(!quantized)
  {
    const auto& h = this->head(layer, kv_head);
    return ConstRowsMap(h.v.data(), static_cast<Eigen::Index>(h.size()), dim());
  }

  // --- quantized caches: the stored bytes and dequantised copies ----------------------
  /// Bytes of one stored key row / value row (size(l, h) rows, row-major, back to back):
  /// head_dim x sizeof(Scalar) for float, fp16 and bf16 caches, the encoded row (scales
  /// included) for quantized ones.
  [[nodiscard]] std::size_t key_row_bytes() const
    requires(!mixed)
  {
    return key_units() * sizeof(Unit);
  }
  [[nodiscard]] std::size_t value_row_bytes() const
    requires(!mixed)
  {
    return value_units() * sizeof(Unit);
  }
  [[nodiscard]] std::span<const Unit> stored_keys(int layer, int kv_head) const
    requires(!mixed)
  {
    const auto& h = this->head(layer, kv_head);
    return {h.k.data(), h.size() * key_units()};
  }
  [[nodiscard]] std::span<const Unit> stored_values(int layer, int kv_head) const
    requires(!mixed)
  {
    const auto& h = this->head(layer, kv_head);
    return {h.v.data(), h.size() * value_units()};
  }
  /// The rows as floats (size x head_dim), dequantised (or widened) from what is stored.
  [[nodiscard]] Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>
  dequantized_keys(int layer, int kv_head) const {
    return decoded(layer, kv_head, true);
  }
  [[nodiscard]] Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>
  dequantized_values(int layer, int kv_head) const {
    return decoded(layer, kv_head, false);
  }

  // --- mixed caches (mixed.hpp): two bands per head -----------------------------------
  /// Rows per head kept in the hot (recent) format; the rest are stored cold.
  [[nodiscard]] std::size_t hot_rows() const
    requires mixed
  {
    return hot_rows_;
  }
  /// Sets the hot band to R rows per head. Only on a cache that holds no rows, and R must not
  /// exceed any head's capacity: else kvevict::Error naming R, the cache unchanged.
  void set_hot_rows(std::size_t R)
    requires mixed
  {  // defined in the class: clang 14 rejects an out-of-line trailing requires-clause here
    const auto in_use = this->exclusive("set_hot_rows");
    for (std::size_t i = 0; i < this->heads_.size(); ++i) {
      detail::require(this->heads_[i].size() == 0, "set_hot_rows: R = ", R, " on a cache holding ",
                      this->heads_[i].size(), " rows in head ", i, ", expected an empty cache");
      detail::require(R <= this->shape_.capacity[i], "set_hot_rows: R = ", R,
                      " exceeds the capacity ", this->shape_.capacity[i], " of (layer ",
                      i / static_cast<std::size_t>(this->geometry().n_kv_heads), ", KV head ",
                      i % static_cast<std::size_t>(this->geometry().n_kv_heads),
                      "), expected R <= every head's capacity");
    }
    detail::require(!this->pooled() || R == 0, "set_hot_rows: R = ", R,
                    " on a pooled budget, expected a fixed budget (per-head capacities move)");
    hot_rows_ = R;
  }
  /// Bytes of one row in the hot / cold band (key + value, scales included).
  [[nodiscard]] std::size_t hot_row_bytes() const
    requires mixed
  {
    return HeadStore::HK::row_bytes(this->udim()) + HeadStore::HV::row_bytes(this->udim());
  }
  [[nodiscard]] std::size_t cold_row_bytes() const
    requires mixed
  {
    return HeadStore::CK::row_bytes(this->udim()) + HeadStore::CV::row_bytes(this->udim());
  }
  /// Bytes a head holding `rows` rows stores (hot band first): what the memory holds.
  [[nodiscard]] std::size_t head_bytes(std::size_t rows) const
    requires mixed
  {
    const std::size_t h = std::min(rows, hot_rows_);
    return h * hot_row_bytes() + (rows - h) * cold_row_bytes();
  }
  /// Row r of a head as stored: its band and its key / value bytes.
  [[nodiscard]] EvictedRow<Scalar> stored_row(int layer, int kv_head, std::size_t r) const
    requires mixed
  {
    const auto& h = this->head(layer, kv_head);
    detail::require(r < h.size(), "stored_row: r = ", r, ", expected r < ", h.size());
    return evicted_at(layer, kv_head, h, r);
  }
  /// Rows of the hot band of a head (<= hot_rows()).
  [[nodiscard]] std::size_t hot_count(int layer, int kv_head) const
    requires mixed
  {
    return this->head(layer, kv_head).hot_rows();
  }
  /// attend()'s kernels over both bands (attention.hpp): probabilities in row order.
  bool mixed_probs(int layer, int kv_head, const float* q, std::size_t G, float* p, float scale) const
    requires mixed
  {
    return this->head(layer, kv_head).probs(q, G, this->udim(), scale, p, attend_scratch_);
  }
  void mixed_output(int layer, int kv_head, const float* p, std::size_t G, float* o) const
    requires mixed
  {
    this->head(layer, kv_head).output(p, G, this->udim(), o, attend_scratch_);
  }

  void set_eviction_callback(EvictionCallback cb) { on_evict_ = std::move(cb); }

  // --- decode -------------------------------------------------------------------------
  /// Appends one token to `layer`: keys and values are n_kv_heads x head_dim, queries
  /// n_heads x head_dim (required when the policy declares Signals::query, else optional).
  /// Evicts first when a head is full, so the cache never exceeds its budget. Strong
  /// guarantee: on any exception the cache is unchanged.
  void append(int layer, std::int64_t position, std::span<const float> keys,
              std::span<const float> values, std::span<const float> queries = {});

  // --- prefill ------------------------------------------------------------------------
  /// Appends a block of T tokens at positions first_position.. (+T-1). keys and values are
  /// T x n_kv_heads x head_dim; queries T x n_heads x head_dim (needed by policies that
  /// declare Signals::query, Signals::attention or Signals::prefill_window).
  /// A policy with prefill_keep selects from the whole block when the layer is empty;
  /// otherwise tokens go through the decode rule one at a time, with causal attention
  /// probabilities computed here for policies that observe attention.
  void prefill(int layer, std::int64_t first_position, std::size_t tokens,
               std::span<const float> keys, std::span<const float> values,
               std::span<const float> queries = {});

  // --- budget -------------------------------------------------------------------------
  /// Changes the budget. Heads above their new capacity evict through the policy (every
  /// row reaches the callback); storage beyond the new capacity is released.
  void set_budget(const Budget& budget);

 private:
  friend struct detail::CacheAccess<KVCache>;
  using typename Core::LayerState;
  using Codec = detail::RowCodec<Scalar>;  // dense rows (not called for mixed caches)

  Eigen::Index dim() const { return this->shape_.geometry.head_dim; }
  // Dense rows only (a mixed cache has a row size per band: MixedHead).
  std::size_t key_units() const
    requires(!mixed)
  {
    return Codec::key_units(this->udim());
  }
  std::size_t value_units() const
    requires(!mixed)
  {
    return Codec::value_units(this->udim());
  }
  static void decode_rows(bool is_key, const Unit* in, std::size_t rows, std::size_t d, float* out)
    requires(!mixed)
  {
    Codec::decode(is_key, in, rows, d, out);
  }
  Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> decoded(int layer, int kv_head,
                                                                                bool is_key) const {
    const auto& h = this->head(layer, kv_head);
    Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> m(
        static_cast<Eigen::Index>(h.size()), dim());
    decode_head(h, is_key, 0, h.size(), m.data());
    return m;
  }
  /// rows [first, first + rows) of head h as floats.
  void decode_head(const HeadStore& h, bool is_key, std::size_t first, std::size_t rows, float* out) const {
    const std::size_t d = this->udim();
    if constexpr (mixed)
      h.decode_rows(is_key, first, rows, d, out);
    else
      decode_rows(is_key, (is_key ? h.k.data() + first * key_units() : h.v.data() + first * value_units()),
                  rows, d, out);
  }
  void check_stored(std::span<const float> x, const char* what, bool is_key) const {
    if constexpr (mixed) HeadStore::check_stored(x, what, is_key);
    else Codec::check_stored(x, what, is_key);
  }
  std::uint32_t stored_limit_bits(bool is_key) const {
    if constexpr (mixed) return 0;  // two bands, two formats: MixedHead::check_stored
    else return Codec::limit_bits(is_key);
  }
  /// Quantized caches: head i dequantised into view_k_/view_v_ (the rows policies read),
  /// kept in step with removals and appends of that head, rebuilt when another head is
  /// read.
  void refresh_view(std::size_t i) const {
    const auto& h = this->heads_[i];
    const std::size_t d = this->udim();
    if (view_head_ == i && view_rows_ == h.size()) return;
    view_k_.resize(h.size() * d);
    view_v_.resize(h.size() * d);
    decode_head(h, true, 0, h.size(), view_k_.data());
    decode_head(h, false, 0, h.size(), view_v_.data());
    view_head_ = i;
    view_rows_ = h.size();
  }
  void forget_view() const { view_head_ = kNoHead; }
  static constexpr std::size_t kNoHead = static_cast<std::size_t>(-1);

  // --- layout hooks (container_core.hpp): rows live densely in this->heads_ -----------
  detail::RowsData<View> rows_data(int layer, int kv_head) const {
    const std::size_t i = this->index(layer, kv_head);
    if constexpr (quantized) {
      if constexpr (!detail::reads_stored_rows<Policy>()) return {};
      refresh_view(i);
      return {view_k_.data(), view_v_.data()};
    } else {
      const auto& h = this->heads_[i];
      return {h.k.data(), h.v.data()};
    }
  }
  const View* attention_rows(int layer, int kv_head) const {
    const std::size_t i = this->index(layer, kv_head);
    if constexpr (quantized) {
      refresh_view(i);
      return view_k_.data();
    } else {
      return this->heads_[i].k.data();
    }
  }
  void reserve_rows(std::size_t i, std::size_t n) {
    // reserve() allocates exactly n rows, so storage never exceeds the capacity.
    auto& h = this->heads_[i];
    if constexpr (mixed) {
      h.reserve(n, hot_rows_, this->udim());
    } else {
      h.k.reserve(n * key_units());
      h.v.reserve(n * value_units());
    }
  }
  void shrink_rows(std::size_t i, std::size_t cap) {
    auto& h = this->heads_[i];
    if constexpr (mixed) {
      h.shrink(cap, hot_rows_, this->udim(), [](auto& vec, std::size_t n) { Core::shrink_vector(vec, n); });
    } else {
      Core::shrink_vector(h.k, cap * key_units());
      Core::shrink_vector(h.v, cap * value_units());
    }
  }
  // The core's phase 1, after every head of the step decided: each victim's K/V row (the
  // last row's copy goes there) and the last row (copied, then the incoming row is encoded
  // into its place) are requested for writing, so that the heads' misses overlap instead
  // of each copy waiting on its own (after an attention step the rows are out of L2).
  void prepare_head(int, int, std::size_t i, const std::vector<std::uint32_t>& victims) const {
    if constexpr (!mixed) {
      const auto& h = this->heads_[i];
      if (victims.empty()) return;
      for (std::uint32_t r : victims) touch_row(h, r);
      touch_row(h, h.size() - 1);
    } else {
      (void)i, (void)victims;
    }
  }
  /// Requests row r's K and V lines of head h for writing.
  void touch_row(const HeadStore& h, std::size_t r) const
    requires(!mixed)
  {
    const std::size_t kb = key_units(), vb = value_units();
    const auto touch = [](const Unit* p, std::size_t units) {
      const auto* b = reinterpret_cast<const char*>(p);
      for (std::size_t o = 0; o < units * sizeof(Unit); o += 64) __builtin_prefetch(b + o, 1);
    };
    touch(h.k.data() + r * kb, kb);
    touch(h.v.data() + r * vb, vb);
  }
  // Before a token's values are checked (the core's check_token, after the layer check):
  // the last row of each full head of the layer, which a one-victim swap-remove copies and
  // the incoming row then overwrites, is requested for writing, so that its misses overlap
  // the reads of the check instead of following them.
  void prepare_token(int layer) const {
    if constexpr (!mixed) {
      for (int kh = 0; kh < this->shape_.geometry.n_kv_heads; ++kh) {
        const std::size_t i = this->index(layer, kh);
        const auto& h = this->heads_[i];
        if (h.size() > 0 && h.size() >= this->shape_.capacity[i]) touch_row(h, h.size() - 1);
      }
    } else {
      (void)layer;
    }
  }
  // Row r leaves (to the callback); the last row's K/V moves into it.
  void remove_row(int layer, int kv_head, std::size_t i, std::uint32_t r, std::size_t last) noexcept {
    auto& h = this->heads_[i];
    if constexpr (mixed) {
      if (on_evict_) on_evict_(evicted_at(layer, kv_head, h, r));
      h.remove(r, last, this->udim());
    } else {
      const std::size_t kb = key_units(), vb = value_units();
      if (on_evict_) on_evict_(evicted(layer, kv_head, h.pos[r], h.seq[r], h.k.data() + r * kb,
                                       h.v.data() + r * vb));
      if (r != last) {
        std::memcpy(h.k.data() + r * kb, h.k.data() + last * kb, kb * sizeof(Unit));
        std::memcpy(h.v.data() + r * vb, h.v.data() + last * vb, vb * sizeof(Unit));
      }
      h.k.resize(last * kb);
      h.v.resize(last * vb);
    }
    if constexpr (quantized) {
      if (view_head_ == i && view_rows_ == last + 1) {  // mirror the swap-remove
        const std::size_t d = this->udim();
        if (r != last) {
          std::memcpy(view_k_.data() + r * d, view_k_.data() + last * d, d * sizeof(float));
          std::memcpy(view_v_.data() + r * d, view_v_.data() + last * d, d * sizeof(float));
        }
        view_k_.resize(last * d);
        view_v_.resize(last * d);
        view_rows_ = last;
      } else if (view_head_ == i) {
        forget_view();
      }
    }
  }
  EvictedRow<Scalar> evicted_at(int layer, int kv_head, const HeadStore& h, std::size_t r) const
    requires mixed
  {
    const std::size_t d = this->udim();
    const detail::MixedRowRef x = h.row(r, d);
    using HS = HeadStore;
    return {{layer, kv_head, h.pos[r], h.seq[r],
             std::span<const Unit>(x.key, x.hot ? HS::HK::row_bytes(d) : HS::CK::row_bytes(d)),
             std::span<const Unit>(x.value, x.hot ? HS::HV::row_bytes(d) : HS::CV::row_bytes(d)), d},
            x.hot};
  }
  EvictedRow<Scalar> evicted(int layer, int kv_head, std::int64_t position, std::uint64_t seq,
                             const Unit* k, const Unit* v) const
    requires(!mixed)
  {
    if constexpr (quantized)
      return {{layer, kv_head, position, seq, std::span<const Unit>(k, key_units()),
               std::span<const Unit>(v, value_units()), this->udim()}};
    else
      return {layer, kv_head, position, seq, std::span<const Unit>(k, key_units()),
              std::span<const Unit>(v, value_units())};
  }
  /// Encodes one row into `k`/`v` (key_units() / value_units() elements).
  void encode_row(const float* key, const float* value, Unit* k, Unit* v) const
    requires(!mixed)
  {
    Codec::encode(key, value, this->udim(), k, v);
  }
  void write_row(std::size_t i, const float* key, const float* value, std::uint64_t seq) {
    auto& h = this->heads_[i];
    if constexpr (mixed) {
      const std::size_t d = this->udim(), rows = h.where.size();
      const std::size_t demoted = h.push(key, value, seq, hot_rows_, d, demote_tmp_.data());
      if (view_head_ == i && view_rows_ == rows) {  // keep the policy's view in step
        view_k_.resize((rows + 1) * d);
        view_v_.resize((rows + 1) * d);
        decode_head(h, true, rows, 1, view_k_.data() + rows * d);
        decode_head(h, false, rows, 1, view_v_.data() + rows * d);
        if (demoted != HeadStore::npos) {  // its stored bytes changed
          decode_head(h, true, demoted, 1, view_k_.data() + demoted * d);
          decode_head(h, false, demoted, 1, view_v_.data() + demoted * d);
        }
        view_rows_ = rows + 1;
      } else if (view_head_ == i) {
        forget_view();
      }
    } else {
      write_dense_row(i, key, value);
    }
  }
  void write_dense_row(std::size_t i, const float* key, const float* value)
    requires(!mixed)
  {
    auto& h = this->heads_[i];
    const std::size_t kb = key_units(), vb = value_units();
    const std::size_t rows = h.k.size() / kb;
    // Capacity was reserved before (the core's phase 1): these resizes do not allocate.
    h.k.resize(h.k.size() + kb);
    h.v.resize(h.v.size() + vb);
    encode_row(key, value, h.k.data() + rows * kb, h.v.data() + rows * vb);
    if constexpr (quantized) {
      if (view_head_ == i && view_rows_ == rows) {  // keep the policy's view in step
        const std::size_t d = this->udim();
        view_k_.resize((rows + 1) * d);
        view_v_.resize((rows + 1) * d);
        decode_rows(true, h.k.data() + rows * kb, 1, d, view_k_.data() + rows * d);
        decode_rows(false, h.v.data() + rows * vb, 1, d, view_v_.data() + rows * d);
        view_rows_ = rows + 1;
      } else if (view_head_ == i) {
        forget_view();
      }
    }
  }
  void push_row(int, int, std::size_t i, std::size_t, std::int64_t, std::uint64_t seq, const float* key,
                const float* value, std::uint32_t) {
    write_row(i, key, value, seq);
  }
  void keep_prompt_row(int, int, std::size_t i, std::size_t, std::size_t, const float* key,
                       const float* value, std::int64_t, std::uint64_t seq) {
    write_row(i, key, value, seq);
  }
  // Before a prefill selection is applied (the core's phase 1): the quantized view of any
  // head while the selection is applied, and the row a dropped prompt token is encoded into
  // for the callback, so applying it allocates nothing.
  void prepare_prompt(int layer, std::size_t, const std::vector<std::vector<std::uint32_t>>& keep,
                      const std::vector<std::vector<std::uint32_t>>& victims) {
    if constexpr (quantized) {
      const std::size_t n = this->prompt_rows_max(layer, keep, victims) * this->udim();
      view_k_.reserve(n);
      view_v_.reserve(n);
    }
    if (on_evict_) {
      if constexpr (mixed) {
        const std::size_t d = this->udim();
        drop_k_.resize(std::max(HeadStore::HK::row_bytes(d), HeadStore::CK::row_bytes(d)));
        drop_v_.resize(std::max(HeadStore::HV::row_bytes(d), HeadStore::CV::row_bytes(d)));
      } else {
        drop_k_.resize(key_units());
        drop_v_.resize(value_units());
      }
    }
  }
  // Dropped prompt rows reach the callback too: nothing leaves unseen.
  void drop_prompt_row(int layer, int kv_head, std::size_t, std::size_t, const float* key,
                       const float* value, std::int64_t position, std::uint64_t seq) {
    if (!on_evict_) return;
    if constexpr (mixed) {  // a dropped prompt row arrives hot when the band has rows, else cold
      const std::size_t d = this->udim();
      using HS = HeadStore;
      const bool hot = hot_rows_ > 0;
      const std::size_t kb = hot ? HS::HK::row_bytes(d) : HS::CK::row_bytes(d);
      const std::size_t vb = hot ? HS::HV::row_bytes(d) : HS::CV::row_bytes(d);
      if (hot) {
        HS::HK::encode(key, d, drop_k_.data());
        HS::HV::encode(value, d, drop_v_.data());
      } else {
        HS::CK::encode(key, d, drop_k_.data());
        HS::CV::encode(value, d, drop_v_.data());
      }
      on_evict_({{layer, kv_head, position, seq, std::span<const Unit>(drop_k_.data(), kb),
                  std::span<const Unit>(drop_v_.data(), vb), d},
                 hot});
    } else {
      encode_row(key, value, drop_k_.data(), drop_v_.data());
      on_evict_(evicted(layer, kv_head, position, seq, drop_k_.data(), drop_v_.data()));
    }
  }

  EvictionCallback on_evict_;
  // Quantized caches: one head's rows dequantised for the policy (rows_data, attention_rows):
  // a cache of what heads_ holds (view_head_'s first view_rows_ rows), never state of its own.
  mutable std::vector<float> view_k_, view_v_;
  mutable std::size_t view_head_ = kNoHead, view_rows_ = 0;
  std::vector<Unit> drop_k_, drop_v_;  ///< a dropped prompt row encoded for the callback
  // Mixed caches: the hot band's rows per head, a row re-encoded hot -> cold (2 x head_dim
  // floats, sized at construction), attend()'s per-band probabilities and outputs.
  std::size_t hot_rows_ = 0;
  std::vector<float> demote_tmp_;
  mutable std::vector<float> attend_scratch_;
};

template <class Policy, class Scalar>
  requires EvictionPolicy<Policy, typename detail::StorageOf<Scalar>::view>
KVCache<Policy, Scalar>::KVCache(const Geometry& geometry, const Budget& budget, Policy policy)
    : Core(geometry, budget, std::move(policy)) {
  if constexpr (mixed) {
    HeadStore::check_dim(this->udim());
    demote_tmp_.resize(2 * this->udim());
  } else {
    Codec::check_dim(this->udim());
  }
}


template <class Policy, class Scalar>
  requires EvictionPolicy<Policy, typename detail::StorageOf<Scalar>::view>
void KVCache<Policy, Scalar>::append(int layer, std::int64_t position,
                                     std::span<const float> keys, std::span<const float> values,
                                     std::span<const float> queries) {
  const auto in_use = this->exclusive("append");
  this->check_token(layer, position, keys, values, queries, false);
  this->step(layer, position, keys.data(), values.data(),
             queries.empty() ? nullptr : queries.data());
}

template <class Policy, class Scalar>
  requires EvictionPolicy<Policy, typename detail::StorageOf<Scalar>::view>
void KVCache<Policy, Scalar>::prefill(int layer, std::int64_t first_position, std::size_t tokens,
                                      std::span<const float> keys, std::span<const float> values,
                                      std::span<const float> queries) {
  const auto in_use = this->exclusive("prefill");
  this->check_block(layer, first_position, tokens, keys, values, queries, true);
  this->prefill_block(layer, first_position, tokens, keys.data(), values.data(),
                      queries.empty() ? nullptr : queries.data());
}

template <class Policy, class Scalar>
  requires EvictionPolicy<Policy, typename detail::StorageOf<Scalar>::view>
void KVCache<Policy, Scalar>::set_budget(const Budget& budget) {
  const auto in_use = this->exclusive("set_budget");
  if constexpr (mixed) {  // the hot band must fit every head's new capacity
    const auto caps = detail::resolve_capacities(this->geometry(), budget);
    for (std::size_t i = 0; i < caps.size(); ++i)
      detail::require(caps[i] >= hot_rows_, "set_budget: capacity ", caps[i], " of head ", i,
                      " is below the hot band's ", hot_rows_, " rows, expected >= hot_rows()");
    detail::require(hot_rows_ == 0 || !budget.is_pooled(), "set_budget: a pooled budget with a hot band of ",
                    hot_rows_, " rows, expected a fixed budget");
  }
  this->change_budget(budget);
}

}  // namespace kvevict

// Compiled-kernels mode: extern template declarations of the common caches (extern_templates.hpp).
#define KVEVICT_HAVE_CACHE_HPP 1
#include "extern_templates.hpp"
