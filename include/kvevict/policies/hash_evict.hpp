#pragma once
// HashEvict (Liu et al. 2024, arXiv 2412.16187; reference KVCacheLSH in minghui-liu/cold-compress):
// pre-attention eviction. Every cached key keeps a b-bit SimHash code; when a head is full,
// the incoming token is hashed and the unprotected row farthest from it in Hamming distance
// is evicted, before attention runs, so the evicted row is never attended. Scores are fresh
// each step, never accumulated, and no attention is needed.
//
// Two forms: HashMode::key hashes the new token's key (the reference code), HashMode::query
// the current queries (the paper). The mode is a template parameter because it decides the
// policy's compile-time signals: only the query form makes the container gather queries.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "../errors.hpp"
#include "../kernels/hamming.hpp"
#include "../kernels/select.hpp"
#include "../kernels/simhash.hpp"
#include "common.hpp"

namespace kvevict::policies {

/// What is hashed to score the cached keys.
enum class HashMode {
  key,    ///< the incoming token's key (reference code)
  query,  ///< the incoming token's queries (paper); needs Signals::query
};

/// Query mode with GQA: how the G query heads of a KV head's group are combined.
enum class QueryCombine {
  sum,   ///< hash each query head, sum the G Hamming distances per row
  mean,  ///< hash the mean of the G queries, one distance per row
};

/// A prompt longer than the budget, on an empty layer.
enum class PrefillRule {
  keep_ends,  ///< the reference default: keep the first `sinks` and the last C - sinks tokens
  decode,     ///< feed the overflow token by token through the decode rule
};

template <HashMode Mode = HashMode::key>
class HashEvictSimHash {
 public:
  struct Config {
    int bits = 16;            ///< b, bits per projection: 8, 16, 32, 64, 128 or 256
    std::size_t sinks = 4;    ///< first tokens never evicted
    std::size_t recent = 10;  ///< tokens that arrived last, never evicted
    std::uint64_t seed = 0x6B7665766963742DULL;  ///< projections are drawn from this seed
    int ensemble = 1;  ///< m independent projections, distances summed (m * b <= 256)
    /// Query mode only. Mean measured better on the synthetic stream (docs/policies/hashevict.md).
    QueryCombine combine = QueryCombine::mean;
    PrefillRule prefill = PrefillRule::keep_ends;
    /// A prefill chunk on a layer that already holds rows (chunked prefill). first_chunk
    /// (the default): the chunk goes token by token through the decode rule. reselect: the
    /// prefill rule runs again over the held rows (oldest first, their stored codes) plus
    /// the chunk, and the held rows it drops leave before any chunk row is written, so a head
    /// never holds more than its capacity. keep_ends then keeps exactly what keep_ends keeps
    /// of the whole prompt, for any chunking; decode continues the decode rule's simulation
    /// from the held rows. Not with reference_slots.
    ChunkedPrefill chunked = ChunkedPrefill::first_chunk;
    /// Pin the Hamming/selection kernels to one ISA level (tests, benchmarks); default: the
    /// process-wide active_isa().
    std::optional<kernels::Isa> isa;
    /// Reference-exact slot order (off by default). The reference keeps a fixed array of
    /// slots: empty slots fill in order, and an eviction writes the new token into the
    /// evicted slot; ties at the largest distance go to the lowest slot. The container's rows
    /// are swap-removed, so by default ties go to the lowest row, which is another token.
    /// With this set the policy keeps each row's reference slot (a permutation that follows
    /// the rows through on_move) and breaks ties by it: the kept sets are the reference's.
    /// Costs one more pass over the distances per eviction (no fused argmax kernel).
    bool reference_slots = false;
  };

  static constexpr HashMode mode = Mode;
  static constexpr Signals signals = Mode == HashMode::query ? Signals::query : Signals::none;
  /// Codes are computed from the incoming key; stored keys are read only when a view has
  /// no incoming key (a restored KVCache replaying its rows), which IndexCache never sends.
  static constexpr bool reads_stored_rows = false;
  static constexpr const char* name() {
    return Mode == HashMode::query ? "HashEvictSimHash<query>" : "HashEvictSimHash<key>";
  }

  HashEvictSimHash() : HashEvictSimHash(Config{}) {}
  explicit HashEvictSimHash(Config c) : cfg_(c) {
    detail_check_bits(c.bits);
    kvevict::detail::require(c.ensemble >= 1, name(), ": ensemble = ", c.ensemble,
                             ", expected >= 1");
    // bits is one of 8..256 here, so comparing ensemble with 256 / bits cannot overflow.
    kvevict::detail::require(c.ensemble <= 256 / c.bits, name(), ": ensemble x bits = ", c.ensemble,
                             " x ", c.bits, " = ", static_cast<long long>(c.ensemble) * c.bits,
                             ", expected <= 256");
    (void)min_capacity();  // sinks + recent + 1 must fit: a kvevict::Error now, not at bind
    kvevict::detail::require(!(c.reference_slots && c.chunked == ChunkedPrefill::reselect), name(),
                             ": chunked = reselect with reference_slots, expected one of them "
                             "(the reference's slot order has no prompt reselection)");
    if (c.isa)
      kvevict::detail::require(
          kernels::isa_supported(*c.isa), name(), ": isa = ", kernels::isa_name(*c.isa),
          ", but this CPU supports at most ", kernels::isa_name(kernels::detected_isa()));
    // The m codes are concatenated into one word of `width_` bits, zero-padded: the Hamming
    // distance of concatenations is the sum of the m distances, so one kernel pass scores all.
    width_ = 8;
    while (width_ < c.bits * c.ensemble) width_ *= 2;
  }

  [[nodiscard]] const Config& config() const { return cfg_; }
  /// Bytes of code stored per cached row (m * b bits rounded up to a kernel width).
  [[nodiscard]] std::size_t code_bytes() const { return static_cast<std::size_t>(width_) / 8; }
  /// Seed of layer `layer`'s projection: each layer draws its own, shared by its KV heads.
  /// Ensemble member i is columns [i*b, (i+1)*b) of that projection (independent Gaussians).
  static std::uint64_t layer_seed(std::uint64_t seed, int layer) {
    std::uint64_t z = seed + 0x9E3779B97F4A7C15ULL * (static_cast<std::uint64_t>(layer) + 1);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  }

  [[nodiscard]] std::size_t min_capacity() const {
    return detail::protected_plus_one(name(), {{"sinks", cfg_.sinks}, {"recent", cfg_.recent}});
  }

  void bind(const CacheShape& shape) {
    n_kv_heads_ = shape.geometry.n_kv_heads;
    dim_ = shape.geometry.head_dim;
    group_ = shape.geometry.group();
    // Summed distances plus one must fit the uint16 scores.
    kvevict::detail::require(static_cast<long long>(group_) * width_ < 65535, name(), ": group = ",
                             group_, " with ", width_, "-bit codes, expected group x bits < 65535");
    projections_.clear();
    for (int l = 0; l < shape.geometry.n_layers; ++l)
      projections_.emplace_back(dim_, width_, layer_seed(cfg_.seed, l));
    heads_.assign(shape.capacity.size(), HeadState{});
    slots_.assign(cfg_.reference_slots ? shape.capacity.size() : 0, SlotOrder{});
  }

  template <class S>
  void choose_victims(const HeadView<S>& v, std::vector<std::uint32_t>& out) {
    HeadState& hs = head(v.layer, v.kv_head);
    hs.prune(v.incoming_seq, prot());
    const int ncodes = query_codes(v, hs);
    if (cfg_.reference_slots)
      select_by_slot(hs, slots_[index(v.layer, v.kv_head)], v.size, v.need, ncodes, out);
    else
      select(hs, v.size, v.need, ncodes, out);
  }

  template <class S>
  void on_append(const HeadView<S>& v, std::size_t row) {
    HeadState& hs = head(v.layer, v.kv_head);
    const std::size_t w = code_bytes();
    hs.codes.resize((row + 1) * w);  // row is the last live row: drop stale codes beyond it
    if (v.incoming_key != nullptr) {
      std::uint8_t* dst = hs.codes.data() + row * w;
      KeyCode& kc = hs.key_code;
      if (kc.valid && kc.seq == v.incoming_seq &&
          std::memcmp(kc.key.data(), v.incoming_key, kc.key.size() * sizeof(float)) == 0)
        std::memcpy(dst, kc.code.data(), w);  // hashed already in choose_victims
      else
        hash_into(v.layer, v.incoming_key, dst);
      kc.valid = false;
    } else {
      key_buf_.resize(static_cast<std::size_t>(dim_));
      const auto k = v.key(row);
      for (std::size_t j = 0; j < k.size(); ++j) key_buf_[j] = static_cast<float>(k[j]);
      hash_into(v.layer, key_buf_.data(), hs.codes.data() + row * w);
    }
    hs.add(v.incoming_seq, static_cast<std::uint32_t>(row), prot());
    if (cfg_.reference_slots) slots_[index(v.layer, v.kv_head)].place(row);
  }

  void on_move(int layer, int kv_head, std::size_t from, std::size_t to) {
    if (cfg_.reference_slots) slots_[index(layer, kv_head)].move(from, to);
    HeadState& hs = head(layer, kv_head);
    const std::size_t w = code_bytes();
    std::memcpy(hs.codes.data() + to * w, hs.codes.data() + from * w, w);
    hs.codes.resize(from * w);
    for (auto& g : hs.guarded)
      if (g.row == from) g.row = static_cast<std::uint32_t>(to);
  }

  /// Chunked prefill (detail::HasPrefillReselect): whether a chunk on a layer that holds
  /// rows is selected again (Config::chunked).
  [[nodiscard]] bool reselects_prefill() const { return cfg_.chunked == ChunkedPrefill::reselect; }

  /// Prefill selection over the view's tokens: on an empty layer the prompt block; with
  /// chunked reselection the held rows (oldest first) then the chunk. keep_ends: the first
  /// `sinks` and the last C - sinks tokens (the reference's StreamingLLM-style prompt
  /// compression). decode: the set the decode rule leaves after feeding the tokens one at a
  /// time, starting from the held rows and their stored codes (the container then stores
  /// the chunk's kept rows in token order, so later ties may break differently than a
  /// token-by-token feed would).
  KVEVICT_DEFER void prefill_keep(const PrefillView& pv, std::vector<std::uint32_t>& keep) {
    const std::size_t T = pv.tokens, C = pv.capacity, H = pv.held;
    if (T <= C) {
      for (std::size_t t = 0; t < T; ++t) keep.push_back(static_cast<std::uint32_t>(t));
      return;
    }
    if (cfg_.prefill == PrefillRule::keep_ends) {
      const std::size_t s = std::min(cfg_.sinks, C);
      for (std::size_t t = 0; t < s; ++t) keep.push_back(static_cast<std::uint32_t>(t));
      for (std::size_t t = T - (C - s); t < T; ++t) keep.push_back(static_cast<std::uint32_t>(t));
      return;
    }
    // Simulate the decode rule on a scratch head: tokens[r] is the token held by row r.
    HeadState sim;
    std::vector<std::uint32_t> tokens, victim;
    const std::size_t w = code_bytes();
    const HeadState& hs = head(pv.layer, pv.kv_head);
    for (std::size_t j = 0; j < H; ++j) {  // the held rows, oldest first, with their codes
      tokens.push_back(static_cast<std::uint32_t>(j));
      sim.codes.resize((j + 1) * w);
      std::memcpy(sim.codes.data() + j * w, hs.codes.data() + std::size_t{pv.held_rows[j]} * w, w);
      sim.add(pv.seq(j), static_cast<std::uint32_t>(j), prot());
    }
    for (std::size_t t = H; t < T; ++t) {
      const std::uint64_t seq = pv.seq(t);
      if (tokens.size() >= C) {
        sim.prune(seq, prot());
        int ncodes = 1;
        if constexpr (Mode == HashMode::query) {
          if (pv.queries != nullptr) {
            // The group's G query heads are adjacent in the token's row of queries.
            ncodes = hash_queries(pv.layer, pv.query(t, 0));
          } else {
            qcodes_.resize(w);
            hash_into(pv.layer, pv.key(t), qcodes_.data());
          }
        } else {
          qcodes_.resize(w);
          hash_into(pv.layer, pv.key(t), qcodes_.data());
        }
        victim.clear();
        select(sim, tokens.size(), 1, ncodes, victim);
        const std::size_t r = victim[0], last = tokens.size() - 1;
        if (r != last) {
          tokens[r] = tokens[last];
          std::memcpy(sim.codes.data() + r * w, sim.codes.data() + last * w, w);
          for (auto& g : sim.guarded)
            if (g.row == last) g.row = static_cast<std::uint32_t>(r);
        }
        tokens.pop_back();
      }
      const std::size_t row = tokens.size();
      tokens.push_back(static_cast<std::uint32_t>(t));
      sim.codes.resize((row + 1) * w);
      hash_into(pv.layer, pv.key(t), sim.codes.data() + row * w);
      sim.add(seq, static_cast<std::uint32_t>(row), prot());
    }
    keep.insert(keep.end(), tokens.begin(), tokens.end());
  }

  /// After a chunk's selection dropped held rows (their codes followed the moved rows
  /// through on_move): the codes beyond the live rows go, and the protected-row list is
  /// rebuilt from the survivors (a dropped row's entry would otherwise linger).
  template <class S>
  void on_prefill_selected(const HeadView<S>& v) {
    HeadState& hs = head(v.layer, v.kv_head);
    hs.codes.resize(v.size * code_bytes());
    hs.guarded.clear();
    for (std::size_t r = 0; r < v.size; ++r)
      if (prot().is_protected(v.seqs[r], v.incoming_seq)) hs.guarded.push_back({v.seqs[r], static_cast<std::uint32_t>(r)});
  }

  /// reference_slots: the reference slot of each live row of (layer, kv_head), in row order.
  [[nodiscard]] std::vector<std::uint32_t> slots(int layer, int kv_head) const {
    if (!cfg_.reference_slots) return {};
    const auto& so = slots_[index(layer, kv_head)];
    return {so.of_row.begin(), so.of_row.begin() + static_cast<std::ptrdiff_t>(so.live)};
  }

  /// Serialisation hooks (serialize.hpp). The codes and protection are rebuilt from the rows
  /// on restore; what cannot be derived is the reference slot order, so the state is the
  /// reference_slots flag and, when set, each head's slots. A state only loads into a policy
  /// with the same flag.
  /// The configuration comes first and is checked on load (codes are rebuilt from the
  /// stored keys; the kernel ISA does not change decisions and is not saved).
  void save_state(std::vector<std::uint8_t>& out) const {
    detail::save_config(out, saved_config());
    kvevict::detail::ByteWriter w(out);
    w.put<std::uint8_t>(cfg_.reference_slots ? 1 : 0);
    if (!cfg_.reference_slots) return;
    w.put<std::uint64_t>(slots_.size());
    for (std::size_t i = 0; i < slots_.size(); ++i) {
      w.put<std::uint64_t>(slots_[i].live);
      for (std::size_t r = 0; r < slots_[i].live; ++r) w.put<std::uint32_t>(slots_[i].of_row[r]);
      w.put<std::uint32_t>(slots_[i].next);
      w.put<std::uint64_t>(slots_[i].free.size());
      for (std::uint32_t f : slots_[i].free) w.put<std::uint32_t>(f);
    }
  }
  void load_state(std::span<const std::uint8_t> in) {
    const auto config = saved_config();
    const std::size_t config_bytes = config.size() * sizeof(std::uint64_t);
    kvevict::detail::require(in.size() >= config_bytes, name(), " state: ", in.size(),
                             " bytes, expected at least ", config_bytes, " (its configuration)");
    detail::check_config(in.first(config_bytes), name(), config);
    kvevict::detail::ByteReader r(in.subspan(config_bytes));
    const auto flag = r.get<std::uint8_t>("HashEvict reference_slots");
    kvevict::detail::require(flag == (cfg_.reference_slots ? 1 : 0), name(),
                             " state: saved with reference_slots = ", int{flag}, ", expected ",
                             int{cfg_.reference_slots});
    std::vector<SlotOrder> fresh(slots_.size());
    if (cfg_.reference_slots) {
      const auto n = r.get<std::uint64_t>("HashEvict head count");
      kvevict::detail::require(n == slots_.size(), name(), " state: ", n, " heads, expected ",
                               slots_.size());
      for (std::size_t i = 0; i < fresh.size(); ++i) {
        const std::size_t rows = slots_[i].live;  // rebuilt by on_append before load_state
        const auto saved_rows = r.get<std::uint64_t>("HashEvict rows");
        kvevict::detail::require(saved_rows == rows, name(), " state: head ", i, " has ",
                                 saved_rows, " slots, expected ", rows, " (its rows)");
        SlotOrder& so = fresh[i];
        so.of_row.resize(rows);
        so.live = rows;
        for (auto& x : so.of_row) x = r.get<std::uint32_t>("HashEvict slot");
        so.next = r.get<std::uint32_t>("HashEvict next slot");
        const auto nfree = r.get<std::uint64_t>("HashEvict free slots");
        kvevict::detail::require(nfree <= r.remaining() / 4, name(), " state: ", nfree,
                                 " free slots, more than the input holds");
        for (std::uint64_t k = 0; k < nfree; ++k) so.free.push_back(r.get<std::uint32_t>("slot"));
        // Every slot below `next` is either held by one row or free, exactly once.
        std::vector<std::uint32_t> all(so.of_row);
        all.insert(all.end(), so.free.begin(), so.free.end());
        std::sort(all.begin(), all.end());
        bool perm = all.size() == so.next;
        for (std::size_t k = 0; perm && k < all.size(); ++k) perm = all[k] == k;
        kvevict::detail::require(perm, name(), " state: head ", i,
                                 " slots are not a permutation of 0..", so.next);
        std::sort(so.free.begin(), so.free.end(), std::greater<>());
      }
    }
    kvevict::detail::require(r.remaining() == 0, name(), " state: ", r.remaining(),
                             " trailing bytes");
    slots_.swap(fresh);
  }

  /// Codes of the live rows of (layer, kv_head), code_bytes() each, in row order.
  [[nodiscard]] const std::vector<std::uint8_t>& codes(int layer, int kv_head) const {
    return heads_[index(layer, kv_head)].codes;
  }

 private:
  struct Guard {
    std::uint64_t seq;
    std::uint32_t row;
  };
  /// The incoming key's code computed by choose_victims (key mode, and query mode with one
  /// query code), reused by on_append. One per head: the container chooses every head's
  /// victims before it appends to any head.
  struct KeyCode {
    std::uint64_t seq = 0;
    bool valid = false;
    std::vector<std::uint8_t> code;
    std::vector<float> key;
  };
  // Per (layer, KV head): the code column, and the rows still protected (at most
  // sinks + recent), so building the protection mask costs O(sinks + recent), not O(rows).
  struct HeadState {
    std::vector<std::uint8_t> codes;
    std::vector<Guard> guarded;
    std::vector<std::uint64_t> mask;  // all zero between calls
    KeyCode key_code;

    void prune(std::uint64_t incoming_seq, const detail::Protection& p) {
      std::erase_if(guarded, [&](const Guard& g) { return !p.is_protected(g.seq, incoming_seq); });
    }
    // Protection only ever ends (the window slides forward), so a row unprotected for the
    // next token stays so: keep only rows still protected when seq + 1 arrives.
    void add(std::uint64_t seq, std::uint32_t row, const detail::Protection& p) {
      prune(seq + 1, p);
      if (p.is_protected(seq, seq + 1)) guarded.push_back({seq, row});
    }
  };

  // reference_slots: the reference's slot of each row. Evicted slots are freed and the
  // lowest free slot is filled first (an eviction followed by an append writes the new
  // token into the evicted slot, as the reference does); otherwise slots grow in order.
  struct SlotOrder {
    std::vector<std::uint32_t> of_row;
    std::vector<std::uint32_t> free;  // sorted descending: the lowest at the back
    std::uint32_t next = 0;
    std::size_t live = 0;  // live rows: of_row[0, live) is meaningful

    void release(std::uint32_t row) {
      free.insert(std::upper_bound(free.begin(), free.end(), of_row[row], std::greater<>()),
                  of_row[row]);
    }
    void place(std::size_t row) {
      of_row.resize(row + 1);
      live = row + 1;
      if (free.empty()) {
        of_row[row] = next++;
      } else {
        of_row[row] = free.back();
        free.pop_back();
      }
    }
    void move(std::size_t from, std::size_t to) { of_row[to] = of_row[from]; }
  };

  static void detail_check_bits(int bits) {
    kvevict::detail::require(
        bits == 8 || bits == 16 || bits == 32 || bits == 64 || bits == 128 || bits == 256,
        "HashEvictSimHash: bits = ", bits, ", expected 8, 16, 32, 64, 128 or 256");
  }
  [[nodiscard]] detail::Protection prot() const { return {cfg_.sinks, cfg_.recent}; }
  [[nodiscard]] std::vector<detail::Field> saved_config() const {
    std::vector<detail::Field> f{{"bits", static_cast<std::uint64_t>(cfg_.bits)},
            {"ensemble", static_cast<std::uint64_t>(cfg_.ensemble)},
            {"sinks", cfg_.sinks},
            {"recent", cfg_.recent},
            {"seed", cfg_.seed},
            {"combine", static_cast<std::uint64_t>(cfg_.combine)},
            {"prefill", static_cast<std::uint64_t>(cfg_.prefill)}};
    // The chunked rule only when not the default, so saves made before it existed load.
    if (cfg_.chunked != ChunkedPrefill::first_chunk)
      f.push_back({"chunked", static_cast<std::uint64_t>(cfg_.chunked)});
    return f;
  }
  std::size_t index(int layer, int kv_head) const {
    return static_cast<std::size_t>(layer) * static_cast<std::size_t>(n_kv_heads_) +
           static_cast<std::size_t>(kv_head);
  }
  HeadState& head(int layer, int kv_head) { return heads_[index(layer, kv_head)]; }

  // Code of one vector: the layer's projection, padding bits beyond m * b cleared.
  KVEVICT_DEFER void hash_into(int layer, const float* x, std::uint8_t* code) const {
    projections_[static_cast<std::size_t>(layer)].hash_one(x, code);
    clear_padding(code, 1);
  }
  void clear_padding(std::uint8_t* codes, std::size_t n) const {
    const std::size_t used = static_cast<std::size_t>(cfg_.bits * cfg_.ensemble) / 8;
    const std::size_t w = code_bytes();
    if (used == w) return;
    for (std::size_t i = 0; i < n; ++i) std::memset(codes + i * w + used, 0, w - used);
  }
  // Codes of the G queries (sum) or of their mean into qcodes_; returns how many.
  KVEVICT_DEFER int hash_queries(int layer, const float* queries) {
    const std::size_t w = code_bytes();
    const auto& proj = projections_[static_cast<std::size_t>(layer)];
    if (cfg_.combine == QueryCombine::sum || group_ == 1) {
      qcodes_.resize(static_cast<std::size_t>(group_) * w);
      proj.hash(queries, static_cast<std::size_t>(group_), qcodes_.data());
      clear_padding(qcodes_.data(), static_cast<std::size_t>(group_));
      return group_;
    }
    sum_queries(queries);
    qcodes_.resize(w);
    hash_into(layer, mean_.data(), qcodes_.data());
    return 1;
  }
  // mean_ = the sum of the G queries (scaling by 1/G would not change a sign bit: the sum
  // hashes like the mean), each element summed in query order from 0.
  void sum_queries(const float* queries) {
    const std::size_t d = static_cast<std::size_t>(dim_);
    mean_.resize(d);
    float* m = mean_.data();
    for (std::size_t j = 0; j < d; ++j) m[j] = 0.0f + queries[j];
    for (int g = 1; g < group_; ++g) {
      const float* q = queries + static_cast<std::size_t>(g) * d;
      for (std::size_t j = 0; j < d; ++j) m[j] += q[j];
    }
  }
  // kc.code holds the code of v's incoming key: on_append stores the same key's code, so
  // the key is hashed once per step. (The key itself is compared too: an append that threw
  // may be retried with the same seq and another key.)
  template <class S>
  void remember_key(const HeadView<S>& v, KeyCode& kc) {
    kc.key.assign(v.incoming_key, v.incoming_key + dim_);
    kc.seq = v.incoming_seq;
    kc.valid = true;
  }
  // What the incoming token is scored against; returns the number of query codes. Without
  // an incoming token (set_budget shrinking) the newest cached row stands in for it.
  template <class S>
  int query_codes(const HeadView<S>& v, HeadState& hs) {
    const std::size_t w = code_bytes();
    if constexpr (Mode == HashMode::query) {
      if (v.queries != nullptr) {
        // The queries' one code (their mean's, or the single query's) and the incoming key's
        // in one pass over the projection (hash_two: the codes hash_one gives each); the
        // key's code is kept for on_append, which would otherwise hash the key again.
        const bool one_code = cfg_.combine == QueryCombine::mean || group_ == 1;
        if (!one_code || v.incoming_key == nullptr) return hash_queries(v.layer, v.queries);
        const float* x = v.queries;
        if (group_ > 1) {
          sum_queries(v.queries);
          x = mean_.data();
        }
        KeyCode& kc = hs.key_code;
        qcodes_.resize(w);
        kc.valid = false;  // until the code below is the key's
        kc.code.resize(w);
        projections_[static_cast<std::size_t>(v.layer)].hash_two(x, v.incoming_key,
                                                                 qcodes_.data(), kc.code.data());
        clear_padding(qcodes_.data(), 1);
        clear_padding(kc.code.data(), 1);
        remember_key(v, kc);
        return 1;
      }
    }
    qcodes_.resize(w);
    if (v.incoming_key != nullptr) {
      hash_into(v.layer, v.incoming_key, qcodes_.data());
      hs.key_code.code.assign(qcodes_.begin(), qcodes_.end());
      remember_key(v, hs.key_code);
    } else {
      const std::size_t newest =
          static_cast<std::size_t>(std::max_element(v.seqs, v.seqs + v.size) - v.seqs);
      std::memcpy(qcodes_.data(), hs.codes.data() + newest * w, w);
    }
    return 1;
  }

  template <class F>
  decltype(auto) with_isa(F&& f) const {
    return kernels::detail::with_isa(cfg_.isa ? *cfg_.isa : kernels::active_isa(),
                                     std::forward<F>(f));
  }

  // Appends the `need` unprotected rows of [0, n) farthest from the ncodes query codes
  // (distances summed over the codes); ties go to the lowest row.
  void select(HeadState& hs, std::size_t n, std::size_t need, int ncodes,
              std::vector<std::uint32_t>& out) {
    const int bits = width_;
    check_evictable(hs, n, need);
    if (ncodes == 1 && need == 1) {
      // The common decode step: one fused distance + masked argmax pass over the codes.
      hs.mask.resize(std::max(hs.mask.size(), (n + 63) / 64), 0);
      for (const auto& g : hs.guarded) hs.mask[g.row >> 6] |= std::uint64_t{1} << (g.row & 63);
      const std::size_t r = with_isa([&](auto isa) {
        return kernels::hamming_argmax<isa()>(qcodes_.data(), hs.codes.data(), n, bits,
                                              hs.mask.data());
      });
      for (const auto& g : hs.guarded) hs.mask[g.row >> 6] = 0;
      if (r == kernels::npos)
        throw std::logic_error(std::string("kvevict: ") + name() + ": no evictable row");
      out.push_back(static_cast<std::uint32_t>(r));
      return;
    }
    score_rows(hs, n, ncodes);
    if (need == 1) {
      out.push_back(static_cast<std::uint32_t>(std::max_element(score_.begin(), score_.end()) -
                                               score_.begin()));
      return;
    }
    const std::size_t base = out.size();
    out.resize(base + need);
    with_isa([&](auto isa) {
      kernels::counting_topk<isa()>(score_.data(), n, need, out.data() + base);
    });
  }

  void check_evictable(const HeadState& hs, std::size_t n, std::size_t need) const {
    const std::size_t free_rows = n - std::min(n, hs.guarded.size());
    if (n == 0 || need > free_rows)
      throw std::logic_error(std::string("kvevict: ") + name() + ": " + std::to_string(free_rows) +
                             " evictable rows, need " + std::to_string(need));
  }

  // Summed distances shifted by one into score_, protected rows at zero: the largest are
  // the victims.
  void score_rows(const HeadState& hs, std::size_t n, int ncodes) {
    const std::size_t w = code_bytes();
    score_.assign(n, 1);
    dist_.resize(n);
    for (int c = 0; c < ncodes; ++c) {
      with_isa([&](auto isa) {
        kernels::hamming_distances<isa()>(qcodes_.data() + static_cast<std::size_t>(c) * w,
                                          hs.codes.data(), n, width_, dist_.data());
      });
      for (std::size_t i = 0; i < n; ++i)
        score_[i] = static_cast<std::uint16_t>(score_[i] + dist_[i]);
    }
    for (const auto& g : hs.guarded) score_[g.row] = 0;
  }

  // reference_slots: the `need` unprotected rows farthest from the query codes, ties to the
  // lowest reference slot; their slots are freed for the incoming token.
  void select_by_slot(HeadState& hs, SlotOrder& so, std::size_t n, std::size_t need, int ncodes,
                      std::vector<std::uint32_t>& out) {
    check_evictable(hs, n, need);
    score_rows(hs, n, ncodes);
    so.live = n - need;  // after the container's swap-removes
    auto before = [&](std::uint32_t a, std::uint32_t b) {  // a is a better victim than b
      return score_[a] > score_[b] || (score_[a] == score_[b] && so.of_row[a] < so.of_row[b]);
    };
    if (need == 1) {
      std::uint32_t best = 0;
      for (std::uint32_t r = 1; r < n; ++r)
        if (before(r, best)) best = r;
      out.push_back(best);
      so.release(best);
      return;
    }
    order_.resize(n);
    for (std::uint32_t r = 0; r < n; ++r) order_[r] = r;
    std::partial_sort(order_.begin(), order_.begin() + static_cast<std::ptrdiff_t>(need),
                      order_.end(), before);
    for (std::size_t i = 0; i < need; ++i) {
      out.push_back(order_[i]);
      so.release(order_[i]);
    }
  }

  Config cfg_;
  int width_ = 8;  // bits per stored code: m * b rounded up to a kernel width
  int n_kv_heads_ = 1;
  int dim_ = 0;
  int group_ = 1;
  std::vector<kernels::SimHashProjection> projections_;  // one per layer
  std::vector<HeadState> heads_;
  // Scratch reused across steps so the decode path does not allocate once warm.
  std::vector<std::uint8_t> qcodes_;
  std::vector<std::uint16_t> dist_, score_;
  std::vector<float> mean_, key_buf_;
  std::vector<SlotOrder> slots_;  // reference_slots only, per (layer, KV head)
  std::vector<std::uint32_t> order_;
};

using HashEvictKey = HashEvictSimHash<HashMode::key>;
using HashEvictQuery = HashEvictSimHash<HashMode::query>;

}  // namespace kvevict::policies
