#pragma once
// DecayedAttention: evict the row with the lowest exponentially decayed attention,
//   score <- decay * score + (attention this step, summed over the G query heads).
// decay = 1 is H2O's accumulated score, which favours old rows simply because they have
// been attended longer; decay = 0 is TOVA (Oren et al. 2024: drop the row the latest
// query attends least). In between, a row's score is its recent attention rate, so old
// and new rows compete on equal terms. Optional sinks and a recent window are protected.
//
// Both knobs can scale with each head's capacity C, which is what transfers across
// budgets: `horizon` h sets decay = 1 - h / C (a row's score remembers about C / h steps),
// and `recent_fraction` f protects the floor(f * C) most recent rows.
//
// A decayed score forgets a fact that is needed again only much later (an early name).
// `recall_fraction` r keeps such rows: each row remembers its *long-range spike*, the
// largest attention it drew (summed over the group) while it was older than the recent
// band, and the floor(r * C) unprotected rows with the largest non-zero spike are kept
// whatever their decayed score. Attention from far away is the evidence that a row is
// referred back to; attention a row draws while it is recent (previous-token heads) is
// not counted, so the reserve does not fill with local rows.
//
// Repeated text gives every copy of a token its own spike. Options (off in recommended(),
// measured in docs/quality.md) keep it from filling the reserve: RecallRank::excess ranks
// by spike minus mean long-range draw, RecallRank::total by the sum of long-range draws
// (the oldest attended rows first, as H2O), RecallDedup keeps reserve rows whose keys
// differ modulo RoPE (detail::key_signature). `recall_successor` keeps each reserve row
// together with the row that arrived right after it (an induction head, asked for a
// fact's next token, attends the row whose key says "the previous token was X": the
// successor of X's row).
//
// recommended() is the setting chosen on stories260K (docs/quality.md): h = 3,
// f = 3/8, r = 1/8, one sink.
#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <unordered_map>

#include "../bytes.hpp"
#include "../errors.hpp"
#include "../kernels/select.hpp"
#include "common.hpp"

namespace kvevict::policies {

class H2O;

class DecayedAttention {
 public:
  /// How the recall reserve ranks rows.
  enum class RecallRank {
    spike,   ///< the largest long-range attention drawn (recommended()'s rule)
    /// the largest long-range draw minus the row's mean long-range draw: a row every query
    /// attends alike (a repeated sentence boundary acting as a sink) scores near zero, a row
    /// attended rarely but strongly (a name referred back to) keeps its spike
    excess,
    /// the sum of the row's long-range draws: H2O's accumulated score, counted only while
    /// the row is older than the recent band. An old row that every query still attends a
    /// little (the intro a later cue refers to) outranks a young repetition with one spike;
    /// the rest of the cache stays ranked by the decayed score
    total,
  };
  /// Which rows the recall reserve must differ from (by key signature, detail::key_signature:
  /// the same token in the same context, repeated at another position, has the same one).
  enum class RecallDedup {
    none,       ///< no deduplication (recommended()'s rule)
    reserve,    ///< at most one reserve row per signature: repeated text holds one slot
    protected_rows,  ///< also none whose signature a sink or recent row already has
  };
  struct Config {
    float decay = 0.0f;       ///< 0 = TOVA, 1 = H2O-style accumulation (when horizon = 0)
    std::size_t sinks = 0;    ///< first rows never evicted
    std::size_t recent = 0;   ///< rows that arrived last, never evicted
    float horizon = 0.0f;     ///< > 0: decay = 1 - horizon / capacity, per head
    float recent_fraction = 0.0f;  ///< protect max(recent, floor(fraction * capacity)) rows
    float recall_fraction = 0.0f;  ///< keep floor(fraction * capacity) rows by long-range spike
    RecallRank recall_rank = RecallRank::spike;  ///< the reserve's ranking (with recall_fraction > 0)
    RecallDedup recall_dedup = RecallDedup::none;  ///< reserve rows with distinct key signatures
    float dedup_step = 0.1f;  ///< the signature's rounding step (with recall_dedup)
    RopeLayout rope = RopeLayout::interleaved;  ///< the engine's RoPE pairs (with recall_dedup)
    /// The reserve keeps each row it ranks in, in rank order, together with its successor
    /// (the row whose arrival index is one more, when held and not protected); a pair takes
    /// two of the reserve's rows. Not with recall_dedup.
    bool recall_successor = false;
  };
  DecayedAttention() = default;
  KVEVICT_DEFER explicit DecayedAttention(Config c) : config_(c) {
    kvevict::detail::require(std::isfinite(c.decay) && c.decay >= 0.0f && c.decay <= 1.0f,
                             "DecayedAttention: decay = ", c.decay, ", expected in [0, 1]");
    kvevict::detail::require(std::isfinite(c.horizon) && c.horizon >= 0.0f,
                             "DecayedAttention: horizon = ", c.horizon, ", expected >= 0");
    kvevict::detail::require(
        std::isfinite(c.recent_fraction) && c.recent_fraction >= 0.0f && c.recent_fraction < 1.0f,
        "DecayedAttention: recent_fraction = ", c.recent_fraction, ", expected in [0, 1)");
    kvevict::detail::require(
        std::isfinite(c.recall_fraction) && c.recall_fraction >= 0.0f && c.recall_fraction < 1.0f,
        "DecayedAttention: recall_fraction = ", c.recall_fraction, ", expected in [0, 1)");
    kvevict::detail::require(
        c.recall_rank == RecallRank::spike || c.recall_rank == RecallRank::excess ||
            c.recall_rank == RecallRank::total,
        "DecayedAttention: recall_rank = ", static_cast<int>(c.recall_rank),
        ", expected RecallRank::spike, excess or total");
    kvevict::detail::require(
        c.recall_dedup == RecallDedup::none || c.recall_dedup == RecallDedup::reserve ||
            c.recall_dedup == RecallDedup::protected_rows,
        "DecayedAttention: recall_dedup = ", static_cast<int>(c.recall_dedup),
        ", expected RecallDedup::none, reserve or protected_rows");
    kvevict::detail::require(!c.recall_successor || c.recall_dedup == RecallDedup::none,
                             "DecayedAttention: recall_successor = true with recall_dedup = ",
                             static_cast<int>(c.recall_dedup), ", expected RecallDedup::none");
    kvevict::detail::require(std::isfinite(c.dedup_step) && c.dedup_step > 0.0f,
                             "DecayedAttention: dedup_step = ", c.dedup_step, ", expected > 0");
    kvevict::detail::require(c.rope == RopeLayout::none || c.rope == RopeLayout::interleaved ||
                                 c.rope == RopeLayout::halves,
                             "DecayedAttention: rope = ", static_cast<int>(c.rope),
                             ", expected RopeLayout::none, interleaved or halves");
  }
  /// The setting recommended for streaming generation (chosen on held-in streams of
  /// stories260K, reported on held-out ones: docs/quality.md). For facts given early and
  /// asked for through repetitive text, recall() recalls better (measured there).
  KVEVICT_DEFER static DecayedAttention recommended() {
    return DecayedAttention(Config{
        .sinks = 1, .horizon = 3.0f, .recent_fraction = 0.375f, .recall_fraction = 0.125f});
  }
  /// The setting recommended when early facts must be recalled through repetitive text
  /// (docs/quality.md, "The filler measure on a larger held-out set, stop 40"):
  /// recommended() with a reserve of a quarter of the rows whose key signatures differ from
  /// each other and from the protected rows' (RecallDedup::protected_rows, step 0.1;
  /// chosen on tuning data in stop 38). `rope` is the engine's RoPE pair layout (the
  /// signature is taken per pair). Its KL is 5-19% above recommended()'s on stories260K and
  /// its step costs more (docs/policies/decayed_attention.md, "Cost").
  KVEVICT_DEFER static DecayedAttention recall(RopeLayout rope = RopeLayout::interleaved) {
    return DecayedAttention(Config{.sinks = 1,
                                   .horizon = 3.0f,
                                   .recent_fraction = 0.375f,
                                   .recall_fraction = 0.25f,
                                   .recall_dedup = RecallDedup::protected_rows,
                                   .dedup_step = 0.1f,
                                   .rope = rope});
  }

  /// Decay used for a head of `capacity` rows.
  [[nodiscard]] float decay_for(std::size_t capacity) const {
    if (config_.horizon <= 0.0f || capacity == Budget::kUnbounded) return config_.decay;
    return std::clamp(1.0f - config_.horizon / static_cast<float>(capacity), 0.0f, 1.0f);
  }
  /// Recent rows protected in a head of `capacity` rows (always leaves one evictable slot).
  [[nodiscard]] std::size_t recent_for(std::size_t capacity) const {
    return detail::recent_rows(config_.recent, config_.recent_fraction, config_.sinks, capacity);
  }
  /// Rows kept by long-range spike in a head of `capacity` rows (0 when unbounded).
  [[nodiscard]] std::size_t recall_for(std::size_t capacity) const {
    if (capacity == Budget::kUnbounded) return 0;
    return static_cast<std::size_t>(config_.recall_fraction * static_cast<float>(capacity));
  }

  static constexpr Signals signals = Signals::attention;
  static constexpr const char* name() { return "DecayedAttention"; }
  /// Never reads stored keys/values: IndexCache need not gather them.
  static constexpr bool reads_stored_rows = false;
  [[nodiscard]] const Config& config() const { return config_; }
  [[nodiscard]] std::size_t min_capacity() const {
    return detail::protected_plus_one(label_, {{"sinks", config_.sinks}, {"recent", config_.recent}});
  }
  KVEVICT_DEFER void bind(const CacheShape& shape) {
    memo_.clear();
    costed_.clear();
    ahead_.assign(shape.capacity.size(), Ahead{});
    scores_.bind(shape);
    hkv_ = static_cast<std::size_t>(shape.geometry.n_kv_heads);
    decay_.clear();
    capacity_.assign(shape.capacity.begin(), shape.capacity.end());
    for (std::size_t c : shape.capacity) decay_.push_back(decay_for(c));
    if (recalls()) {
      spikes_.bind(shape);
      seqs_.bind(shape);
      latest_.assign(shape.capacity.size(), 0);
      floor_.assign(shape.capacity.size(), 0.0f);
      if (ranks_draws()) bind_excess(shape);
      if (dedups()) {
        kvevict::detail::require(config_.rope == RopeLayout::none || shape.geometry.head_dim % 2 == 0,
                                 "DecayedAttention: recall_dedup with RoPE pairs needs an even "
                                 "head_dim, got ", shape.geometry.head_dim);
        head_dim_ = static_cast<std::size_t>(shape.geometry.head_dim);
        sigs_.bind(shape);
        ids_.bind(shape);
        interned_.clear();
        interned_.resize(shape.capacity.size());
        // clear + resize: n fresh bands.
        bands_.clear();
        bands_.resize(shape.capacity.size());
        bounds_.assign(shape.capacity.size(), Bound{});
      }
    }
  }
  /// set_budget: the recent band that decides which attention counts as long-range (the
  /// reserve's spikes) follows the new capacities at once, as a restored cache's does (the
  /// decay follows at the next eviction, as before; it is part of the saved state).
  KVEVICT_DEFER void on_budget(const CacheShape& shape) {
    memo_.clear();  // pooled_victims recomputes under the new capacities
    costed_.clear();  // the new budget may not be pooled: decide ahead again until costed
    for (Ahead& a : ahead_) a.valid = false;
    for (Bound& b : bounds_) b.valid = false;
    capacity_.assign(shape.capacity.begin(), shape.capacity.end());
  }
  /// With recommended()'s reserve (ranked by spike, no dedup), the decision of a full
  /// head's next append is taken at the end of its observe (decide_ahead), while the
  /// columns it reads are in cache; here it is used when nothing changed since and the
  /// view is the one it was taken for, else decided now. The same victim either way.
  ///
  /// A pooled head (ranked by eviction_costs) asked here directly (a frozen step of the
  /// amortised split names it) is marked to decide ahead again (costed_ 2), for a capacity
  /// that follows its rows (what the pool's share capacity gives at or above its floor).
  template <class S>
  void choose_victims(const HeadView<S>& v, std::vector<std::uint32_t>& out) {
    const std::size_t h = head_index(v.layer, v.kv_head);
    if (h < costed_.size() && costed_[h] == 1) costed_[h] = 2;
    decide(v, out);
  }
  /// choose_victims' decision, without its hint.
  template <class S>
  void decide(const HeadView<S>& v, std::vector<std::uint32_t>& out) {
    if (take_ahead(v, out)) return;
    // RecallDedup's one-victim path: its shortcuts reason from the spike, and its columns
    // (signatures, numbers, band) are bound only with a reserve (recall_fraction > 0).
    if (recalls() && dedups() && v.need == 1 && !ranks_draws()) {
      distinct_victim(v, out);
      return;
    }
    protect(v);
    pick(v, bits_.data(), out);
  }
  /// Pooled budgets (Budget::pooled()): each row's cost on a scale shared by the KV heads
  /// of a layer: its attention rate, the decayed score times (1 - decay) (a row drawing a
  /// steady share x of the group's attention tends to x), or H2O's accumulated score at
  /// decay 1. Rows choose_victims would not evict with need 1: +infinity for the sinks and
  /// the recent band (never evicted), the highest finite cost (FLT_MAX) for the recall
  /// reserve, which gives up rows when a head must lose more than its other rows (a
  /// pooled budget shrinking by much): a pool takes reserve rows only once every other
  /// finite row is taken, and choose_victims with that larger need keeps a smaller
  /// reserve. Same protection, so the split follows the rows the policy would give up.
  template <class S>
  void eviction_costs(const HeadView<S>& view, std::vector<float>& out) {
    HeadView<S> v = view;
    v.need = std::max<std::size_t>(v.need, 1);
    protect(v, &outside_);
    const std::size_t h = head_index(v.layer, v.kv_head);
    const auto& sc = scores_.of(v.layer, v.kv_head);
    const float scale = decay_[h] < 1.0f ? 1.0f - decay_[h] : 1.0f;
    out.resize(v.size);
    // Every row's rate, +infinity for the sinks and the recent band (the rows outside
    // [sinks, incoming - recent): protect's bits before the reserve was added, a subset of
    // the bits), FLT_MAX for the rest of the bits, the reserve: one dispatched pass
    // (kernels::masked_costs).
    kernels::masked_costs(sc.data(), v.size, scale, bits_.data(), outside_.data(), out.data());
    // Kept for pooled_victims: this pass's protection and what its reserve depended on.
    if (memo_.size() != capacity_.size()) memo_.resize(capacity_.size());
    Memo& m = memo_[h];
    m.bits.assign(bits_.begin(), bits_.end());
    m.size = v.size;
    m.capacity = v.capacity;
    m.incoming_seq = v.incoming_seq;
    m.need = v.need;
    m.evictable = last_evictable_;
    m.reserve = last_reserve_;
    m.valid = true;
    if (costed_.size() != capacity_.size()) costed_.assign(capacity_.size(), 0);
    costed_[h] = 1;
  }
  /// Pooled budgets, the single protection pass: the victims choose_victims(view, out)
  /// would choose, for a head whose eviction_costs ran last on the same view (need aside)
  /// with no call on that head since (the container's promise). The protection that pass
  /// computed is reused when the recall reserve would be the same for `view.need`: the
  /// reserve's target min(recall rows, candidates, evictable - need) is unchanged while
  /// need <= evictable - (the pass's target), which holds whenever the container asks a
  /// head for no more rows than its costs marked finite (without RecallDedup; with it the
  /// reserve may keep fewer than its target). Otherwise, and whenever the view does not
  /// match the kept one, the protection is recomputed.
  template <class S>
  void pooled_victims(const HeadView<S>& v, std::vector<std::uint32_t>& out) {
    const std::size_t h = head_index(v.layer, v.kv_head);
    if (h < memo_.size()) {
      const Memo& m = memo_[h];
      if (m.valid && m.size == v.size && m.capacity == v.capacity &&
          m.incoming_seq == v.incoming_seq &&
          (!recalls() || v.need == m.need || v.need + m.reserve <= m.evictable)) {
        pick(v, m.bits.data(), out);
        return;
      }
    }
    decide(v, out);
  }
  /// Decisions of pooled heads (costed_ 2) that take_ahead served, for the tests.
  [[nodiscard]] std::size_t pooled_ahead_taken() const { return pooled_ahead_; }
  /// HasPrefetchHead: starts the reads of the head's columns a decision reads (the scores;
  /// with the recall reserve also the spikes and arrival indices). No effect on results.
  KVEVICT_DEFER void prefetch_head(int layer, int kv_head) const {
    if (recalls()) prefetch_columns(layer, kv_head);
    else prefetch_rows(scores_.of(layer, kv_head));
  }
  template <class S>
  void on_append(const HeadView<S>& v, std::size_t row) {
    forget(v.layer, v.kv_head);
    scores_.set(v.layer, v.kv_head, row, 0.0f);
    if (recalls()) {
      spikes_.set(v.layer, v.kv_head, row, 0.0f);
      seqs_.set(v.layer, v.kv_head, row, v.seqs[row]);
      latest_[head_index(v.layer, v.kv_head)] = v.seqs[row];
      if (ranks_draws()) append_excess(v.layer, v.kv_head, row);
      if (dedups()) {
        const std::uint64_t sg = v.incoming_key ? detail::key_signature(v.incoming_key, head_dim_,
                                                                        config_.rope, config_.dedup_step)
                                                : 0;
        sigs_.set(v.layer, v.kv_head, row, sg);
        Interned& in = interned_[head_index(v.layer, v.kv_head)];
        settle(v.layer, v.kv_head);  // the previous append's row, if still unnumbered
        // Unnumbered heads get 0 here and are renumbered at their next decision. Numbered
        // ones number the row (and count it in the band) at the head's next decision or
        // move (settle): the table slot the signature hashes to is fetched now, and read
        // then, after the attention step (one cache miss per append less in the step).
        ids_.set(v.layer, v.kv_head, row, 0);
        if (in.valid) {
          in.pending = true;
          in.pending_row = row;
          in.pending_seq = v.seqs[row];
          if (!in.table.empty()) __builtin_prefetch(&in.table[slot_of(sg, in.table.size() - 1)]);
        }
      }
    }
  }
  KVEVICT_DEFER void on_move(int layer, int kv_head, std::size_t from, std::size_t to) {
    forget(layer, kv_head);
    if (dedups() && recalls()) settle(layer, kv_head);  // the unnumbered row may move
    scores_.move(layer, kv_head, from, to);
    if (recalls()) {
      spikes_.move(layer, kv_head, from, to);
      seqs_.move(layer, kv_head, from, to);
      if (ranks_draws()) move_excess(layer, kv_head, from, to);
      if (dedups()) {
        sigs_.move(layer, kv_head, from, to);
        ids_.move(layer, kv_head, from, to);
      }
    }
  }
  KVEVICT_DEFER void observe(const AttentionView& a) {
    forget(a.layer, a.kv_head);
    auto& sc = scores_.of(a.layer, a.kv_head);
    const std::size_t h = head_index(a.layer, a.kv_head);
    const float g = decay_[h];
    const float* x = detail::group_sums(a, sum_);
    if (!recalls()) {
      for (std::size_t r = 0; r < a.size; ++r) sc[r] = g * sc[r] + x[r];
      return;
    }
    if (ranks_draws()) {
      observe_excess(a, g);
      return;
    }
    // A row older than the recent band at the next eviction counts as long-range.
    auto& sp = spikes_.of(a.layer, a.kv_head);
    const auto& sq = seqs_.of(a.layer, a.kv_head);
    const std::size_t recent = recent_for(capacity_[h]);
    // The capacity the next decision is expected to see: the head's last one, or for a
    // pooled head deciding by choose_victims (costed_ 2) its rows (the share capacity; a
    // guess: take_ahead checks it). The fused pass needs that capacity's recent band to be
    // the band the spikes are counted with.
    const std::uint8_t costed = h < costed_.size() ? costed_[h] : 0;
    const std::size_t capacity = costed == 2 ? a.size : capacity_[h];
    if (pairs() || a.size == 0 || a.size != capacity || costed == 1 ||
        (costed == 2 && recent_for(capacity) != recent)) {
      // One dispatched pass (kernels::decay_spike): the decayed score of every row, the
      // spike of the rows with latest - seq >= band. A head ranked by eviction_costs (a
      // pooled budget) takes its decisions from those costs (pooled_victims), so the next
      // append's decision is not taken ahead for it (until choose_victims marks it).
      kernels::decay_spike(sc.data(), sp.data(), x, sq.data(), a.size, g, latest_[h], recent);
      return;
    }
    // A full head (its next append evicts one row): the same pass also gathers that
    // decision's protection bits and reserve candidates (kernels::decay_spike_gather), and
    // the decision is taken now, while the columns are in cache (decide_ahead).
    const std::uint64_t incoming = latest_[h] + 1;
    detail::size_bits(bits_, a.size);
    reserve_candidates(a.size);
    // RecallDedup without a threshold (floor_ 0: the last reserve kept all of B) gathers no
    // candidates: its decision usually needs none (distinct_row gathers them if it does).
    const float gather_floor = dedups() && !(floor_[h] > 0.0f)
                                   ? std::numeric_limits<float>::infinity()
                                   : floor_[h];
    cand_n_ = kernels::decay_spike_gather(sc.data(), sp.data(), x, sq.data(), a.size, g,
                                          latest_[h], recent, config_.sinks,
                                          incoming >= recent ? incoming - recent : 0, gather_floor,
                                          bits_.data(), cand_spike_.data(), cand_row_.data());
    decide_ahead(a.layer, a.kv_head, a.size, capacity);
  }
  /// Saved state for serialize.hpp: the configuration (checked on load), the per-head
  /// decays (they follow set_budget) and the scores.
  KVEVICT_DEFER void save_state(std::vector<std::uint8_t>& out) const {
    kvevict::detail::ByteWriter w(out);
    w.put<float>(config_.decay);
    w.put<std::uint64_t>(config_.sinks);
    w.put<std::uint64_t>(config_.recent);
    w.put<float>(config_.horizon);
    w.put<float>(config_.recent_fraction);
    w.put<float>(config_.recall_fraction);
    w.put<std::uint64_t>(decay_.size());
    for (float d : decay_) w.put<float>(d);
    scores_.save(w);
    if (recalls()) {
      spikes_.save(w);
      seqs_.save(w);
      for (std::uint64_t s : latest_) w.put<std::uint64_t>(s);
      if (ranks_draws()) {  // only with RecallRank::excess / total: other states keep their format
        // total's state starts with a tag (excess's format predates it; its first word is a
        // column count): the states of the two ranks do not mix either way
        if (config_.recall_rank != RecallRank::excess) w.put<std::uint64_t>(kTotalTag);
        draws_.save(w);
        counts_.save(w);
      }
      if (dedups()) sigs_.save(w);  // only with recall_dedup, likewise
    }
  }
  KVEVICT_DEFER void load_state(std::span<const std::uint8_t> in) {
    memo_.clear();  // derived from the scores; pooled_victims recomputes without it
    kvevict::detail::ByteReader r(in);
    const auto decay = r.get<float>("DecayedAttention decay");
    const auto sinks = r.get<std::uint64_t>("DecayedAttention sinks");
    const auto recent = r.get<std::uint64_t>("DecayedAttention recent");
    const auto horizon = r.get<float>("DecayedAttention horizon");
    const auto fraction = r.get<float>("DecayedAttention recent_fraction");
    const auto recall = r.get<float>("DecayedAttention recall_fraction");
    kvevict::detail::require(
        decay == config_.decay && sinks == config_.sinks && recent == config_.recent &&
            horizon == config_.horizon && fraction == config_.recent_fraction &&
            recall == config_.recall_fraction,
        "DecayedAttention state: saved with decay ", decay, ", sinks ", sinks, ", recent ", recent,
        ", horizon ", horizon, ", recent_fraction ", fraction, ", recall_fraction ", recall,
        "; expected decay ", config_.decay, ", sinks ", config_.sinks, ", recent ",
        config_.recent, ", horizon ", config_.horizon, ", recent_fraction ",
        config_.recent_fraction, ", recall_fraction ", config_.recall_fraction);
    const auto n = r.get<std::uint64_t>("DecayedAttention head count");
    kvevict::detail::require(n == decay_.size(), "DecayedAttention state: ", n,
                             " heads, expected ", decay_.size());
    std::vector<float> decays(decay_.size());
    for (auto& d : decays) {
      d = r.get<float>("DecayedAttention head decay");
      kvevict::detail::require(std::isfinite(d) && d >= 0.0f && d <= 1.0f,
                               "DecayedAttention state: head decay ", d, ", expected in [0, 1]");
    }
    // Load into copies so a bad state leaves this policy untouched.
    auto scores = scores_;
    auto spikes = spikes_;
    auto seqs = seqs_;
    auto latest = latest_;
    auto draws = draws_;
    auto counts = counts_;
    auto sigs = sigs_;
    const auto valid = [](float x) { return std::isfinite(x) && x >= 0.0f; };
    scores.load(r, name(), valid);
    if (recalls()) {
      spikes.load(r, name(), valid);
      seqs.load(r, name());
      for (std::size_t i = 0; i < latest.size(); ++i) {
        latest[i] = r.get<std::uint64_t>("DecayedAttention latest arrival");
        const auto& got = seqs.of(static_cast<int>(i / hkv_), static_cast<int>(i % hkv_));
        for (std::uint64_t s : got)
          kvevict::detail::require(s <= latest[i], "DecayedAttention state: row arrival ", s,
                                   " after the head's latest arrival ", latest[i]);
        // The restore replayed the cache's rows through on_append first: the saved arrival
        // indices must be theirs (the decision reads seqs_ in place of the view's seqs).
        const auto& rows = seqs_.of(static_cast<int>(i / hkv_), static_cast<int>(i % hkv_));
        for (std::size_t r = 0; r < got.size(); ++r)
          kvevict::detail::require(got[r] == rows[r], "DecayedAttention state: row ", r,
                                   " of head ", i, " has arrival ", got[r],
                                   ", expected the cache's ", rows[r]);
      }
      if (ranks_draws()) {
        if (config_.recall_rank != RecallRank::excess) {
          const auto tag = r.get<std::uint64_t>("DecayedAttention recall_rank tag");
          kvevict::detail::require(tag == kTotalTag, "DecayedAttention state: recall_rank tag ",
                                   tag, ", expected ", kTotalTag, " (saved with another recall_rank)");
        }
        draws.load(r, name(), valid);
        counts.load(r, name());
      }
      if (dedups()) sigs.load(r, name());
    }
    kvevict::detail::require(r.remaining() == 0, "DecayedAttention state: ", r.remaining(),
                             " trailing bytes");
    decay_ = std::move(decays);
    scores_ = std::move(scores);
    spikes_ = std::move(spikes);
    seqs_ = std::move(seqs);
    latest_ = std::move(latest);
    draws_ = std::move(draws);
    counts_ = std::move(counts);
    sigs_ = std::move(sigs);
    for (Band& b : bands_) b.valid = false;  // rebuilt from the loaded rows
    for (Bound& b : bounds_) b.valid = false;
    for (Interned& in : interned_) {  // renumbered from the loaded signatures
      in.valid = false;
      in.pending = false;
    }
    for (Ahead& a : ahead_) a.valid = false;
    std::fill(floor_.begin(), floor_.end(), 0.0f);  // a hint only: reset with the rows
  }
  [[nodiscard]] const std::vector<float>& scores(int layer, int kv_head) const {
    return scores_.of(layer, kv_head);
  }
  /// Long-range spikes of the rows of one head (empty unless recall_fraction > 0).
  [[nodiscard]] const std::vector<float>& spikes(int layer, int kv_head) const {
    return spikes_.of(layer, kv_head);
  }
  /// RecallDedup, counts for tests and profiles: reserve computations that ranked only the
  /// candidates reaching the last threshold (keep_distinct's hinted path), and those whose
  /// threshold was tried and refused (fewer than k allowed signatures reached it: every
  /// candidate was ranked). The rows are those of ranking every candidate either way.
  struct HintCounts {
    std::uint64_t hinted = 0, refused = 0;
    /// one-victim decisions whose lowest open row was shown outside the reserve from the
    /// threshold alone (distinct_victim: beyond_reserve), the reserve not computed
    std::uint64_t beyond = 0;
    /// RecallDedup decisions taken at the end of observe (decide_ahead: distinct_row from
    /// the bits and candidates the observe pass gathered); each is used by the next append
    /// when its view is the one it was taken for
    std::uint64_t ahead = 0;
    /// of those, the ones an append used (take_ahead)
    std::uint64_t ahead_taken = 0;
    /// hinted or beyond decisions that used the candidates the observe pass gathered
    /// (decay_spike_gather) rather than gathering their own
    std::uint64_t from_observe = 0;
    /// of the beyond decisions, those shown without counting signatures: enough candidates
    /// at the threshold less the repeated numbers reach the reserve's size (beyond_reserve,
    /// Interned::repeats)
    std::uint64_t uncounted = 0;
  };
  [[nodiscard]] const HintCounts& hint_counts() const { return hint_counts_; }

 private:
  // H2O is this policy at decay 1; it keeps its own name and save format (h2o.hpp).
  friend class H2O;
  [[nodiscard]] bool recalls() const { return config_.recall_fraction > 0.0f; }
  /// The reserve ranks by the draws columns (RecallRank::excess or total), not the spike alone.
  [[nodiscard]] bool ranks_draws() const { return config_.recall_rank != RecallRank::spike; }
  /// The first word of RecallRank::total's draws state ("TOTAL" in ASCII).
  static constexpr std::uint64_t kTotalTag = 0x4C41544F54ULL;
  [[nodiscard]] bool dedups() const { return config_.recall_dedup != RecallDedup::none; }
  [[nodiscard]] bool pairs() const { return config_.recall_successor; }

  // RecallRank::excess: per row, the sum and count of its long-range draws (the spike is
  // kept as for RecallRank::spike); kept apart from the default path.
  KVEVICT_DEFER void bind_excess(const CacheShape& shape) {
    draws_.bind(shape);
    counts_.bind(shape);
  }
  KVEVICT_DEFER void append_excess(int layer, int kv_head, std::size_t row) {
    draws_.set(layer, kv_head, row, 0.0f);
    counts_.set(layer, kv_head, row, 0u);
  }
  KVEVICT_DEFER void move_excess(int layer, int kv_head, std::size_t from, std::size_t to) {
    draws_.move(layer, kv_head, from, to);
    counts_.move(layer, kv_head, from, to);
  }
  KVEVICT_DEFER void observe_excess(const AttentionView& a, float g) {
    auto& sc = scores_.of(a.layer, a.kv_head);
    auto& sp = spikes_.of(a.layer, a.kv_head);
    auto& dr = draws_.of(a.layer, a.kv_head);
    auto& ct = counts_.of(a.layer, a.kv_head);
    const auto& sq = seqs_.of(a.layer, a.kv_head);
    const std::size_t h = head_index(a.layer, a.kv_head);
    const std::uint64_t band = recent_for(capacity_[h]);
    const std::uint64_t latest = latest_[h];
    for (std::size_t r = 0; r < a.size; ++r) {
      const float x = a.summed(r);
      sc[r] = g * sc[r] + x;
      if (latest - sq[r] >= band) {
        sp[r] = std::max(sp[r], x);
        dr[r] += x;
        ++ct[r];
      }
    }
  }
  /// The reserve's rank of row r under RecallRank::excess (spike - mean long-range draw) or
  /// RecallRank::total (the sum of its long-range draws).
  [[nodiscard]] float rank_of(int layer, int kv_head, std::size_t r) const {
    if (config_.recall_rank == RecallRank::total) return draws_.of(layer, kv_head)[r];
    const std::uint32_t n = counts_.of(layer, kv_head)[r];
    if (n == 0) return 0.0f;
    return spikes_.of(layer, kv_head)[r] - draws_.of(layer, kv_head)[r] / static_cast<float>(n);
  }

  /// Follows the head's capacity (it may change through set_budget or a pooled budget) and
  /// sets bits_ (set = never evicted): a row is evictable iff its arrival index lies in
  /// [sinks, incoming - recent) (one vectorised pass over the seqs) and it is not held by
  /// the recall reserve.
  ///
  /// With the spike-ranked reserve and no dedup (recommended()'s rule), the protection bits
  /// and the reserve's candidates at its last threshold come from one kernel pass
  /// (kernels::open_gather: the bits of protect_outside, the candidates of gather_open).
  ///
  /// `outside` (optional): receives a copy of the bits of the sinks and the recent band
  /// alone (protect_outside's bits, before the reserve is added), for eviction_costs.
  template <class S>
  void protect(const HeadView<S>& v, std::vector<std::uint64_t>* outside = nullptr) {
    const std::size_t h = head_index(v.layer, v.kv_head);
    decay_[h] = decay_for(v.capacity);
    capacity_[h] = v.capacity;
    const std::size_t recent = recent_for(v.capacity);
    if (!recalls()) {
      detail::protection_bits(v, config_.sinks, recent, bits_);
      if (outside) outside->assign(bits_.begin(), bits_.end());
      return;
    }
    if (ranks_draws() || dedups() || pairs()) {
      detail::protection_bits(v, config_.sinks, recent, bits_);
      if (outside) outside->assign(bits_.begin(), bits_.end());
      keep_recalled(v, false);
      return;
    }
    // The head's columns are cold here (the model's other layers ran since its last step):
    // start the reads of its scores (read last, by the victim search) and of the next KV
    // head's columns (decided next) so that their latency overlaps this decision.
    if (v.kv_head == 0) prefetch_rows(scores_.of(v.layer, v.kv_head));
    if (static_cast<std::size_t>(v.kv_head) + 1 < hkv_) prefetch_columns(v.layer, v.kv_head + 1);
    protect_spiked(v, outside);
  }
  /// protect's bits for the spike-ranked reserve without dedup (recalls() only): no state
  /// but scratch and the reserve's threshold hint changes.
  template <class S>
  void protect_spiked(const HeadView<S>& v, std::vector<std::uint64_t>* outside = nullptr) {
    const std::size_t h = head_index(v.layer, v.kv_head);
    const std::size_t recent = recent_for(v.capacity);
    detail::size_bits(bits_, v.size);
    reserve_candidates(v.size);
    // seqs_ holds the view's arrival indices (on_append / on_move keep it in step with the
    // rows; load_state requires it): read here instead of the view's, so that the decision
    // and the next observe read the same lines.
    cand_n_ = kernels::open_gather(seqs_.of(v.layer, v.kv_head).data(),
                                   spikes_.of(v.layer, v.kv_head).data(), v.size, config_.sinks,
                                   detail::open_below(v, recent), floor_[h], bits_.data(),
                                   cand_spike_.data(), cand_row_.data());
    if (outside) outside->assign(bits_.begin(), bits_.end());
    keep_recalled(v, true);
  }
  /// The end of observe, recommended()'s reserve, a full head (n == capacity_: its next
  /// append evicts one row): that append's decision from the columns observe has just
  /// written, for the view choose_victims will get (size, capacity, need 1, the next
  /// arrival index; arrival indices from seqs_, which holds the view's), through the same
  /// reserve and victim search as protect + pick, from the protection bits and candidates
  /// observe gathered (what protect_spiked's open_gather gives for that view). Kept in ahead_
  /// until the head's rows, scores or budget change (forget, on_budget, load_state);
  /// take_ahead checks the view before using it. Changes no state but scratch and floor_
  /// (a hint: the same rows are kept whatever it is).
  KVEVICT_DEFER void decide_ahead(int layer, int kv_head, std::size_t n, std::size_t capacity) {
    const std::size_t h = head_index(layer, kv_head);
    Ahead& a = ahead_[h];
    a.valid = false;
    HeadView<float> v;
    v.layer = layer;
    v.kv_head = kv_head;
    v.size = n;
    v.capacity = capacity;
    v.need = 1;
    v.seqs = seqs_.of(layer, kv_head).data();
    v.incoming_seq = latest_[h] + 1;
    std::size_t row;
    if (dedups()) {  // RecallDedup: distinct_victim's decision from the gathered bits and candidates
      row = distinct_row(v, true, floor_[h] > 0.0f);
      ++hint_counts_.ahead;
    } else {
      keep_recalled(v, true);
      row = kernels::lowest_masked_seq(scores_.of(layer, kv_head).data(), v.seqs, n, bits_.data());
    }
    if (row == kernels::npos) return;  // decided (and refused) at the append
    a.size = n;
    a.capacity = capacity;
    a.incoming_seq = v.incoming_seq;
    a.row = static_cast<std::uint32_t>(row);
    a.valid = true;
  }
  /// choose_victims from decide_ahead's decision when it was taken for this view (and
  /// nothing changed since: forget clears it); sets what protect sets (the head's decay
  /// and capacity).
  template <class S>
  bool take_ahead(const HeadView<S>& v, std::vector<std::uint32_t>& out) {
    const std::size_t h = head_index(v.layer, v.kv_head);
    if (h >= ahead_.size()) return false;
    Ahead& a = ahead_[h];
    if (!a.valid || v.need != 1 || a.size != v.size || a.capacity != v.capacity ||
        a.incoming_seq != v.incoming_seq)
      return false;
    a.valid = false;
    decay_[h] = decay_for(v.capacity);
    capacity_[h] = v.capacity;
    if (h < costed_.size() && costed_[h] == 2) ++pooled_ahead_;
    if (dedups()) ++hint_counts_.ahead_taken;
    out.push_back(a.row);
    // The swap-remove and the append write these columns next, and the head's observe
    // reads them after its attention step: start their reads now.
    prefetch_columns(v.layer, v.kv_head);
    return true;
  }
  /// Hints the cache to fetch the 64-byte lines of a column (no effect on results).
  template <class T>
  static void prefetch_rows(const std::vector<T>& c) {
    const char* p = reinterpret_cast<const char*>(c.data());
    const std::size_t bytes = c.size() * sizeof(T);
    for (std::size_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o);
  }
  /// prefetch_rows over the columns a decision and an observe read (recalls() only).
  KVEVICT_DEFER void prefetch_columns(int layer, int kv_head) const {
    prefetch_rows(scores_.of(layer, kv_head));
    prefetch_rows(spikes_.of(layer, kv_head));
    prefetch_rows(seqs_.of(layer, kv_head));
  }
  /// keep_recalled's candidate buffers hold at least n entries (they only grow).
  KVEVICT_DEFER void reserve_candidates(std::size_t n) {
    if (cand_spike_.size() < n) {
      cand_spike_.resize(n);
      cand_row_.resize(n);
    }
  }

  /// Sets in bits_ the unprotected rows with the largest non-zero long-range spike (ties:
  /// the newer row), leaving at least `need` rows evictable. The spikes of the candidates
  /// are packed into a float array and the k-th largest found with the library's top-k
  /// select; only rows equal to that threshold need the seq tie rule.
  ///
  /// Incremental (RecallRank::spike without dedup): spikes never decrease, so the last
  /// decision's threshold is a lower bound for this one's as long as at least k candidates
  /// still reach it; only those are packed and ranked then (rows below it cannot be among
  /// the k largest), else every candidate is (the first decision, a changed capacity,
  /// reserve rows evicted by a larger `need`). The threshold is a hint: the rows kept are
  /// the same either way.
  ///
  /// `gathered`: protect() already gathered the candidates at the last threshold (floor_).
  template <class S>
  void keep_recalled(const HeadView<S>& v, bool gathered) {
    const auto& sp = spikes_.of(v.layer, v.kv_head);
    const std::size_t h = head_index(v.layer, v.kv_head);
    const std::size_t words = bits_.size();
    const ReserveTarget target = reserve_target(v);
    const std::size_t evictable = target.evictable, limit = target.limit;
    // The candidates with rank > 0 and rank >= lo, in row order, into cand_spike_ /
    // cand_row_ [0, cand_n_) (the buffers only grow: no clearing per step).
    const auto collect = [&](float lo) {
      reserve_candidates(v.size);
      if (!ranks_draws()) {  // the spike is the rank: one dispatched pass over the open rows
        cand_n_ = kernels::gather_open(sp.data(), v.size, bits_.data(), lo, cand_spike_.data(),
                                       cand_row_.data());
        return;
      }
      std::size_t c = 0;
      for (std::size_t w = 0; w < words; ++w) {
        std::uint64_t open = ~bits_[w];
        while (open) {
          const std::size_t r = w * 64 + static_cast<std::size_t>(std::countr_zero(open));
          open &= open - 1;
          const float rank = rank_of(v.layer, v.kv_head, r);
          if (rank > 0.0f && rank >= lo) {
            cand_spike_[c] = rank;
            cand_row_[c] = static_cast<std::uint32_t>(r);
            ++c;
          }
        }
      }
      cand_n_ = c;
    };
    const auto keep = [&](std::uint32_t r) { bits_[r >> 6] |= std::uint64_t{1} << (r & 63); };
    last_evictable_ = evictable;  // for eviction_costs' memo (pooled_victims): the reserve's
    last_reserve_ = limit;        // target, min(recall rows, candidates, evictable - need)
    if (dedups()) {
      // From the last threshold first (spike rank: the value the k-th best signature had),
      // as below; keep_distinct refuses when fewer than `limit` allowed signatures reach it,
      // and every candidate is ranked then. The same rows either way.
      // `gathered` (distinct_row from decide_ahead, floor_ > 0): the candidates at floor_
      // are in the buffers.
      const float hint = ranks_draws() ? 0.0f : floor_[h];
      if (hint > 0.0f && limit > 0) {
        if (!gathered) collect(hint);
        if (keep_distinct(v, limit, true)) {
          ++hint_counts_.hinted;
          if (gathered) ++hint_counts_.from_observe;
          last_reserve_ = limit;
          return;
        }
        ++hint_counts_.refused;
      }
      if (!gathered || hint > 0.0f) collect(0.0f);
      keep_distinct(v, limit, false);
      last_reserve_ = limit;  // the reserve may keep fewer (pooled_victims: see there)
      return;
    }
    if (pairs()) {
      collect(0.0f);
      keep_pairs(v, limit, keep);
      return;
    }
    if (limit == 0) return;
    const float hint = ranks_draws() ? 0.0f : floor_[h];
    if (!gathered) collect(hint);
    if (hint > 0.0f && cand_n_ < limit) collect(0.0f);
    keep_top(v, limit);
  }
  /// Sets in bits_ the `limit` best candidates (cand_spike_ / cand_row_ [0, cand_n_): the
  /// largest rank, ties: the newer row), or all of them when fewer; floor_ takes the k-th
  /// best rank (the next decision's hint), last_reserve_ how many are kept.
  template <class S>
  void keep_top(const HeadView<S>& v, std::size_t limit) {
    const std::size_t h = head_index(v.layer, v.kv_head);
    const auto keep = [&](std::uint32_t r) { bits_[r >> 6] |= std::uint64_t{1} << (r & 63); };
    const std::size_t m = cand_n_;
    const std::size_t k = std::min(limit, m);
    last_reserve_ = k;  // m counts every candidate whenever it is below limit
    if (k == 0) return;
    // The kept rows' bits are collected per 64-row word in a register (a read-modify-write
    // of bits_ per row chains every row through a store and a reload); the candidates come
    // in row order, so a word is written once.
    KeepWords kept{bits_.data()};
    if (k == m) {
      // The minimum of positive spikes (no NaN, no -0): four running minima, the same value.
      constexpr float inf = std::numeric_limits<float>::infinity();
      float t[4] = {inf, inf, inf, inf};
      std::size_t i = 0;
      for (; i + 4 <= m; i += 4)
        for (std::size_t j = 0; j < 4; ++j) t[j] = std::min(t[j], cand_spike_[i + j]);
      for (; i < m; ++i) t[0] = std::min(t[0], cand_spike_[i]);
      for (i = 0; i < m; ++i) kept.add(cand_row_[i]);
      kept.flush();
      floor_[h] = std::min(std::min(t[0], t[1]), std::min(t[2], t[3]));
      return;
    }
    const float t = kth_largest(cand_spike_.data(), m, k);
    floor_[h] = t;
    // Every candidate above the threshold is kept; of those equal to it, the newest.
    std::size_t above = 0;
    ties_.clear();
    for (std::size_t i = 0; i < m; ++i) {
      if (cand_spike_[i] > t) {
        kept.add(cand_row_[i]);
        ++above;
      } else if (cand_spike_[i] == t) {
        ties_.push_back({v.seqs[cand_row_[i]], cand_row_[i]});
      }
    }
    kept.flush();
    const std::size_t take = k - above;
    if (take < ties_.size())
      std::nth_element(ties_.begin(), ties_.begin() + static_cast<std::ptrdiff_t>(take),
                       ties_.end(), [](const Tie& a, const Tie& b) { return a.seq > b.seq; });
    for (std::size_t i = 0; i < take; ++i) keep(ties_[i].row);
  }
  /// The k-th largest of s[0, m) counting repeats (0 < k < m): the (m - k + 1)-th smallest.
  /// When the reserve is ranked from its last threshold, m exceeds k by a few rows, so those
  /// few smallest are kept in a small sorted buffer in one pass; otherwise the library's
  /// top-k select. Either way the same value.
  KVEVICT_DEFER float kth_largest(const float* s, std::size_t m, std::size_t k) {
    constexpr std::size_t kSmall = 32;
    const std::size_t j = m - k + 1;
    if (j <= kSmall) {
      float low[kSmall];  // the c smallest so far, ascending
      std::size_t c = 0;
      for (std::size_t i = 0; i < m; ++i) {
        const float x = s[i];
        std::size_t p;
        if (c < j) {
          p = c++;
        } else if (x < low[j - 1]) {
          p = j - 1;
        } else {
          continue;
        }
        for (; p > 0 && low[p - 1] > x; --p) low[p] = low[p - 1];
        low[p] = x;
      }
      return low[j - 1];
    }
    top_.resize(k);
    kernels::topk_indices(s, m, k, top_.data());
    float t = s[top_[0]];
    for (std::uint32_t i : top_) t = std::min(t, s[i]);
    return t;
  }
  /// Sets bits in a bit array, one 64-row word held in a register until a row of another
  /// word comes (flush() writes the last).
  struct KeepWords {
    std::uint64_t* bits;
    std::size_t word = 0;
    std::uint64_t acc = 0;
    void add(std::uint32_t r) {
      const std::size_t w = r >> 6;
      if (w != word) {
        bits[word] |= acc;
        word = w;
        acc = 0;
      }
      acc |= std::uint64_t{1} << (r & 63);
    }
    void flush() const { bits[word] |= acc; }
  };
  /// Set bits of x, without std::popcount's library call (no POPCNT without -mpopcnt).
  static std::size_t popcount64(std::uint64_t x) {
    x = x - ((x >> 1) & 0x5555555555555555ULL);
    x = (x & 0x3333333333333333ULL) + ((x >> 2) & 0x3333333333333333ULL);
    x = (x + (x >> 4)) & 0x0F0F0F0F0F0F0F0FULL;
    return static_cast<std::size_t>((x * 0x0101010101010101ULL) >> 56);
  }
  struct Tie {
    std::uint64_t seq;
    std::uint32_t row;
  };
  /// The `v.need` victims among the rows `bits` leaves open: the lowest scores, the oldest
  /// among equal scores.
  /// One victim: the arrival indices are read from seqs_ when it is kept (the view's seqs,
  /// mirrored in this policy's columns, which the decision has just read: the view's own
  /// are cold at this point of a small model's step).
  template <class S>
  void pick(const HeadView<S>& v, const std::uint64_t* bits, std::vector<std::uint32_t>& out) const {
    const float* sc = scores_.of(v.layer, v.kv_head).data();
    if (v.need == 1 && recalls()) {
      out.push_back(static_cast<std::uint32_t>(
          detail::lowest_masked(sc, seqs_.of(v.layer, v.kv_head).data(), v.size, bits, label_)));
      return;
    }
    detail::evict_lowest_masked(v, sc, bits, out, label_);
  }
  /// choose_victims with RecallDedup, one victim: the victim is the open row (outside the
  /// sinks and the recent band) with the lowest (score, seq) that the reserve does not hold.
  /// The reserve R is the `limit` best (spike, then newer) of B, the best candidate of each
  /// allowed signature (keep_distinct). The open rows are tried from the lowest up:
  ///  - a row that cannot be in R — no positive spike (not a candidate), (protected_rows) a
  ///    signature a protected row has, or an open row of its signature ranked before it
  ///    (outranked) — is the victim;
  ///  - else the row is in B, and it is in R when |B| <= limit. |B| is bounded from the last
  ///    decision that computed the reserve (keep_distinct: |B| then, plus the open rows that
  ///    were not candidates), plus 2 per append since: each append moves one row out of the
  ///    recent band (one new open row, and at most one signature whose last protected row
  ///    it was). When the bound shows |B| <= limit the row is in R: the next open row is
  ///    tried. Otherwise the reserve is computed (protect's path) and the victim searched.
  /// The first row comes from kernels::lowest_open (no protection bits); the protection
  /// bits are computed only when that row is in B.
  /// The same victim as protect + pick in every case.
  template <class S>
  void distinct_victim(const HeadView<S>& v, std::vector<std::uint32_t>& out) {
    const std::size_t h = head_index(v.layer, v.kv_head);
    decay_[h] = decay_for(v.capacity);
    capacity_[h] = v.capacity;
    const std::size_t row = distinct_row(v, false);
    if (row != kernels::npos) {
      out.push_back(static_cast<std::uint32_t>(row));
      return;
    }
    pick(v, bits_.data(), out);  // no evictable row: pick's error
  }
  /// distinct_victim's victim (npos when no row is evictable). `gathered`: bits_ holds the
  /// view's protection bits (decay_spike_gather's, at the end of observe: decide_ahead); the
  /// first row then comes from those bits (kernels::lowest_masked_seq: the same row as
  /// lowest_open). `cands` (with a threshold, floor_ > 0): cand_spike_ / cand_row_
  /// [0, cand_n_) also hold the open candidates at floor_, which beyond_reserve and
  /// keep_recalled then use instead of gathering them again.
  template <class S>
  std::size_t distinct_row(const HeadView<S>& v, bool gathered, bool cands = false) {
    const std::size_t h = head_index(v.layer, v.kv_head);
    const std::size_t recent = recent_for(v.capacity);
    const float* sc = scores_.of(v.layer, v.kv_head).data();
    const float* sp = spikes_.of(v.layer, v.kv_head).data();
    const std::uint64_t* seqs = seqs_.of(v.layer, v.kv_head).data();
    const std::uint64_t hi = detail::open_below(v, recent);
    // The lowest open row (the row protect's bits and lowest_masked_seq give); usually the
    // victim. Without the gathered bits it comes from the arrival indices in one pass
    // (kernels::lowest_open), and the protection bits are computed only when it is not.
    std::size_t row = gathered ? kernels::lowest_masked_seq(sc, seqs, v.size, bits_.data())
                               : kernels::lowest_open(sc, seqs, v.size, config_.sinks, hi);
    bool bits_set = gathered, marked = false;  // bits_: the protection; rows of R set in it
    if (row != kernels::npos) {
      prepare_distinct(v);
      const std::uint32_t* id = ids_.of(v.layer, v.kv_head).data();
      const std::uint32_t* band =
          config_.recall_dedup == RecallDedup::protected_rows ? bands_[h].count.data() : nullptr;
      const Interned& in = interned_[h];
      const auto not_in_r = [&](std::size_t r) {
        return !(sp[r] > 0.0f) || (band && band[id[r]] != 0) ||
               (shared_number(in, id[r]) && outranked(v.size, sp, seqs, id, r, hi));
      };
      if (not_in_r(row)) return row;
      if (!bits_set) detail::protection_bits(v, config_.sinks, recent, bits_);
      bits_set = true;
      const bool holds = reserve_holds_b(v);
      if (!holds && beyond_reserve(v, row, cands)) return row;
      // In B; in R while the bound holds: then the next open rows, 4 at a time
      // (kernels::lowest_masked_seq4).
      if (holds) {
        std::size_t low[4];
        std::size_t c = 0;
        for (;;) {
          bits_[row >> 6] |= std::uint64_t{1} << (row & 63);
          marked = true;
          if (c == 0) {
            c = kernels::lowest_masked_seq4(sc, seqs, v.size, bits_.data(), low);
            if (c == 0) {  // every open row in R: cannot be (the bound keeps one open); decide fully
              row = kernels::npos;
              break;
            }
            std::reverse(low, low + c);  // taken from the back
          }
          row = low[--c];
          if (not_in_r(row)) return row;
        }
      }
    }
    if (!bits_set || marked) detail::protection_bits(v, config_.sinks, recent, bits_);
    keep_recalled(v, cands && !marked);
    if (row != kernels::npos && ((bits_[row >> 6] >> (row & 63)) & 1u) == 0) return row;
    return kernels::lowest_masked_seq(sc, seqs, v.size, bits_.data());
  }
  /// distinct_victim, `row` in B (its signature's best candidate, allowed) and the bound
  /// failing: true when `row` is shown outside R without computing R. With the last
  /// threshold T (floor_, spike rank) above row's spike, every allowed signature with a
  /// candidate reaching T ranks before row; when at least the reserve's size of them do,
  /// row is not among R's. The candidates reaching T are gathered (bits_: the protection;
  /// `gathered`: they are in cand_spike_ / cand_row_ already, at T) and their signatures
  /// counted until that size. False (nothing shown) otherwise.
  template <class S>
  bool beyond_reserve(const HeadView<S>& v, std::size_t row, bool gathered) {
    const std::size_t h = head_index(v.layer, v.kv_head);
    const float hint = floor_[h];
    const float* sp = spikes_.of(v.layer, v.kv_head).data();
    if (ranks_draws() || !(hint > 0.0f) || !(sp[row] < hint)) return false;
    const std::size_t limit = reserve_target(v).limit;
    if (limit == 0) return false;
    std::size_t m = cand_n_;
    if (!gathered) {
      reserve_candidates(v.size);
      m = kernels::gather_open(sp, v.size, bits_.data(), hint, cand_spike_.data(), cand_row_.data());
    }
    if (m < limit) return false;
    Interned& in = interned_[h];
    // At least m - in.repeats allowed signatures reach T, so when that is the reserve's size
    // no count is needed (keys that do not repeat: repeats stays 0). Per number d with
    // c_d candidates among n_d rows numbered d since the renumbering (c_d <= n_d), the
    // candidates bring one allowed signature when no protected row has d, and then
    // c_d - (n_d - 1) <= 1; none when one has, and then c_d <= n_d - 1 (that row is not
    // open). Summed: m - sum (n_d - 1) = m - repeats <= the allowed signatures at T.
    if (in.repeats <= m && m - in.repeats >= limit) {
      ++hint_counts_.beyond;
      ++hint_counts_.uncounted;
      if (gathered) ++hint_counts_.from_observe;
      return true;
    }
    const std::uint32_t epoch = next_epoch(in);
    Met* met = in.met.data();
    const std::uint32_t* id = ids_.of(v.layer, v.kv_head).data();
    const std::uint32_t* band =
        config_.recall_dedup == RecallDedup::protected_rows ? bands_[h].count.data() : nullptr;
    std::size_t count = 0;
    for (std::size_t i = 0; i < m; ++i) {
      const std::uint32_t d = id[cand_row_[i]];
      if ((band && band[d] != 0) || met[d].stamp == epoch) continue;
      met[d].stamp = epoch;
      if (++count == limit) {
        ++hint_counts_.beyond;
        if (gathered) ++hint_counts_.from_observe;
        return true;
      }
    }
    return false;
  }
  /// The rows bits_ leaves open (bits past size are set) and the reserve's target for the
  /// view, min(recall rows, open - need): keep_recalled's, distinct_victim's bound's and
  /// beyond_reserve's.
  struct ReserveTarget {
    std::size_t evictable, limit;
  };
  template <class S>
  ReserveTarget reserve_target(const HeadView<S>& v) const {
    std::size_t evictable = 0;
    for (std::uint64_t w : bits_) evictable += popcount64(~w);
    return {evictable, std::min(recall_for(v.capacity), evictable > v.need ? evictable - v.need : 0)};
  }
  /// distinct_victim's bound: true when |B| <= the reserve's size for this view, shown from
  /// the head's Bound (bits_ holds the protection bits alone).
  template <class S>
  bool reserve_holds_b(const HeadView<S>& v) const {
    const Bound& b = bounds_[head_index(v.layer, v.kv_head)];
    if (!b.valid || b.capacity != v.capacity || v.incoming_seq < b.incoming_seq) return false;
    const std::size_t limit = reserve_target(v).limit;
    if (b.count > limit) return false;
    return v.incoming_seq - b.incoming_seq <= (limit - b.count) / 2;
  }
  /// True when an open row (arrival index in [sinks, hi)) other than `row` has row's
  /// signature number and a positive spike that ranks before row's in reserve order
  /// (larger; equal and newer): then `row` is not its signature's best candidate, so not in
  /// the reserve. The rows with the number are found by kernels::find_u32.
  bool outranked(std::size_t n, const float* sp, const std::uint64_t* seqs,
                 const std::uint32_t* id, std::size_t row, std::uint64_t hi) const {
    const std::uint32_t d = id[row];
    for (std::size_t r = kernels::find_u32(id, n, d, 0); r != kernels::npos;
         r = kernels::find_u32(id, n, d, r + 1)) {
      if (r == row || seqs[r] < config_.sinks || seqs[r] >= hi || !(sp[r] > 0.0f)) continue;
      if (sp[r] > sp[row] || (sp[r] == sp[row] && seqs[r] > seqs[row])) return true;
    }
    return false;
  }
  /// RecallDedup: brings the head's signature numbers and (protected_rows) its band up to
  /// this decision (keep_distinct's first step; a second call changes nothing).
  template <class S>
  void prepare_distinct(const HeadView<S>& v) {
    const std::size_t h = head_index(v.layer, v.kv_head);
    Interned& in = interned_[h];
    const auto& ids = ids_.of(v.layer, v.kv_head);
    settle(v.layer, v.kv_head);
    // Renumbered when unset (bind, load_state) or when numbers of rows long gone pile up
    // (every ~size appends: amortised O(1) per step); the band counts by number, so it is
    // rebuilt with them.
    if (!in.valid || in.n > 2 * ids.size() + 64) {
      renumber(in, sigs_.of(v.layer, v.kv_head), ids_.of(v.layer, v.kv_head));
      bands_[h].valid = false;
    }
    if (config_.recall_dedup == RecallDedup::protected_rows) update_band(v);
  }
  /// RecallDedup: walks the candidates (cand_spike_ / cand_row_) from the largest rank down
  /// (ties: the newer row first) and keeps up to `k` of them, skipping a row whose key
  /// signature a kept row already has (with protected_rows: or a sink or recent row has).
  /// The first row of each signature in that order is the signature's best candidate, so
  /// the rows kept are the k best of the signatures' best candidates: one pass over the
  /// candidates groups them by signature number (ids_, arrays indexed by number: no hashing
  /// per decision, no sort), then keep_top selects the k best of them.
  ///
  /// `hinted`: the candidates are those whose rank reaches a threshold T (the last
  /// decision's k-th best, floor_). A signature's best candidate reaches T iff one of its
  /// candidates does, and is then found among them; ranks are compared first, so when at
  /// least k allowed signatures reach T the k best signatures are among them: the same rows.
  /// With fewer, nothing is kept and false is returned (the caller ranks every candidate).
  template <class S>
  bool keep_distinct(const HeadView<S>& v, std::size_t k, bool hinted) {
    const std::size_t m = cand_n_;
    const bool prot = config_.recall_dedup == RecallDedup::protected_rows;
    const std::size_t h = head_index(v.layer, v.kv_head);
    Interned& in = interned_[h];
    const auto& ids = ids_.of(v.layer, v.kv_head);
    prepare_distinct(v);
    if (k == 0) return true;
    if (m == 0) return !hinted;
    const std::uint32_t epoch = next_epoch(in);
    const std::uint32_t* band = prot ? bands_[h].count.data() : nullptr;
    const std::uint32_t* id = ids.data();
    const std::uint64_t* seqs = v.seqs;
    Met* met = in.met.data();
    // The signatures' best candidates, packed to the front of the candidate arrays in the
    // order their signatures are met (met[d].place: signature d's); a place is at
    // most the index being read, so no candidate is overwritten before it is read.
    float* cs = cand_spike_.data();
    std::uint32_t* cr = cand_row_.data();
    std::size_t nb = 0;  // |B| (hinted: the signatures reaching the threshold)
    for (std::size_t i = 0; i < m; ++i) {
      const float s = cs[i];
      const std::uint32_t row = cr[i];
      const std::uint32_t d = id[row];
      if (band && band[d] != 0) continue;
      if (met[d].stamp != epoch) {
        met[d] = Met{epoch, static_cast<std::uint32_t>(nb)};
        cs[nb] = s;
        cr[nb] = row;
        ++nb;
        continue;
      }
      const std::uint32_t j = met[d].place;
      if (s > cs[j] || (s == cs[j] && seqs[row] > seqs[cr[j]])) {
        cs[j] = s;
        cr[j] = row;
      }
    }
    if (hinted && nb < k) return false;
    // |B| and the open rows that are not candidates, for distinct_victim's bound on later
    // decisions; unknown when hinted (|B| >= k then: no bound would hold).
    if (hinted) bounds_[h].valid = false;
    else bounds_[h] = Bound{v.incoming_seq, v.capacity, nb + (last_evictable_ - m), true};
    cand_n_ = nb;
    keep_top(v, k);
    // All of B kept (|B| <= k): the next decision's B may be smaller than k, so it ranks
    // every candidate rather than try a threshold first.
    if (nb <= k && !hinted) floor_[h] = 0.0f;
    return true;
  }
  /// RecallDedup, per (layer, KV head): the distinct signatures of the head's rows numbered
  /// 0, 1, ... (ids_ holds each row's number) through a flat open-addressing table, and
  /// per number keep_distinct's scratch (Met).
  struct Met {
    std::uint32_t stamp = 0;  ///< the decision that last met the number
    std::uint32_t place = 0;  ///< where its best candidate is packed in that decision
  };
  /// A slot of the number table: a signature and its number + 1 (0: empty slot), side by
  /// side so that a lookup reads one line.
  struct Slot {
    std::uint64_t key = 0;
    std::uint32_t slot = 0;
  };
  struct Interned {
    std::vector<Slot> table;  ///< open addressing, linear probing, load at most 1/2
    std::uint32_t n = 0;      ///< numbers handed out
    /// Per number: how many rows were numbered with it since the last renumbering (appends
    /// and the renumbering's rows), saturating at 2. At most that many rows hold it: a
    /// number handed out once is no other row's (distinct_row skips outranked's scan).
    std::vector<std::uint8_t> uses;
    /// Rows numbered with a number handed out before, since the last renumbering: the sum
    /// over numbers of (rows numbered with it - 1). Rows removed are not taken off
    /// (beyond_reserve uses it as an upper bound).
    std::size_t repeats = 0;
    std::vector<Met> met;
    std::uint32_t epoch = 0;
    bool valid = false;  ///< ids_ numbers the head's rows by this table
    /// The last appended row is not numbered yet (ids_ holds 0 for it, the band lacks it):
    /// settle numbers it; every reader of ids_ and the band settles first.
    bool pending = false;
    std::size_t pending_row = 0;
    std::uint64_t pending_seq = 0;  ///< its arrival index
  };
  /// Numbers the head's pending row (on_append's) and counts it in the band.
  KVEVICT_DEFER void settle(int layer, int kv_head) {
    Interned& in = interned_[head_index(layer, kv_head)];
    if (!in.pending) return;
    in.pending = false;
    const std::uint32_t id = intern(in, sigs_.of(layer, kv_head)[in.pending_row]);
    ids_.of(layer, kv_head)[in.pending_row] = id;
    if (config_.recall_dedup == RecallDedup::protected_rows)
      band_append(layer, kv_head, in.pending_seq, id);
  }
  /// keep_distinct's scratch for a new pass: the head's Met entries cover its numbers, and
  /// the returned stamp is one no entry holds.
  static std::uint32_t next_epoch(Interned& in) {
    if (in.met.size() < in.n) in.met.resize(in.n);
    if (++in.epoch == 0) {  // wrapped: no stamp may equal a later epoch by accident
      std::fill(in.met.begin(), in.met.end(), Met{});
      in.epoch = 1;
    }
    return in.epoch;
  }
  /// True unless number d was handed out to one row only since the last renumbering (then
  /// no row but that one holds it).
  static bool shared_number(const Interned& in, std::uint32_t d) {
    return d >= in.uses.size() || in.uses[d] > 1;
  }
  /// The number of signature `sig` in `in` (a new one if it has none), counted in `uses`.
  static std::uint32_t intern(Interned& in, std::uint64_t sig) {
    if (2 * (static_cast<std::size_t>(in.n) + 1) > in.table.size()) {  // load at most 1/2
      std::vector<Slot> table(std::max<std::size_t>(64, 2 * in.table.size()));
      for (const Slot& e : in.table)
        if (e.slot != 0) place(table, e);
      in.table.swap(table);
    }
    const std::size_t mask = in.table.size() - 1;
    for (std::size_t i = slot_of(sig, mask);; i = (i + 1) & mask) {
      Slot& e = in.table[i];
      if (e.slot == 0) {
        e.key = sig;
        e.slot = ++in.n;
        if (in.uses.size() < in.n) in.uses.resize(std::max<std::size_t>(in.n, 2 * in.uses.size()));
        in.uses[in.n - 1] = 1;
        return in.n - 1;
      }
      if (e.key == sig) {
        std::uint8_t& u = in.uses[e.slot - 1];
        ++in.repeats;
        u = u < 2 ? static_cast<std::uint8_t>(u + 1) : u;
        return e.slot - 1;
      }
    }
  }
  static std::size_t slot_of(std::uint64_t sig, std::size_t mask) {
    std::uint64_t x = sig * 0x9E3779B97F4A7C15ULL;
    return static_cast<std::size_t>(x ^ (x >> 32)) & mask;
  }
  static void place(std::vector<Slot>& table, const Slot& e) {
    const std::size_t mask = table.size() - 1;
    std::size_t i = slot_of(e.key, mask);
    while (table[i].slot != 0) i = (i + 1) & mask;
    table[i] = e;
  }
  /// Numbers the signatures of a head's rows afresh (ids: each row's number).
  static void renumber(Interned& in, const std::vector<std::uint64_t>& sigs,
                       std::vector<std::uint32_t>& ids) {
    std::fill(in.table.begin(), in.table.end(), Slot{});
    in.n = 0;
    in.repeats = 0;  // counted again over the rows numbered here
    in.pending = false;  // numbered here with the rest
    ids.resize(sigs.size());
    for (std::size_t r = 0; r < sigs.size(); ++r) {
      if (r + 8 < sigs.size() && !in.table.empty())  // the slot read 8 rows on
        __builtin_prefetch(&in.table[slot_of(sigs[r + 8], in.table.size() - 1)]);
      ids[r] = intern(in, sigs[r]);
    }
    std::fill(in.met.begin(), in.met.end(), Met{});
    in.epoch = 0;
    in.valid = true;
  }

  /// recall_successor: walks the candidates from the largest rank down (ties: the newer row
  /// first) and keeps each, then its successor (arrival index + 1) when that row is held and
  /// still open, until `k` rows are kept. A row already kept as a successor still brings its
  /// own successor when its turn comes. One hashed pass over the rows per decision.
  template <class S, class Keep>
  void keep_pairs(const HeadView<S>& v, std::size_t k, Keep keep) {
    const std::size_t m = cand_n_;
    if (k == 0 || m == 0) return;
    order_.clear();
    for (std::uint32_t i = 0; i < m; ++i) order_.push_back(i);
    std::sort(order_.begin(), order_.end(), [&](std::uint32_t a, std::uint32_t b) {
      if (cand_spike_[a] != cand_spike_[b]) return cand_spike_[a] > cand_spike_[b];
      return v.seqs[cand_row_[a]] > v.seqs[cand_row_[b]];
    });
    row_of_.clear();
    for (std::size_t r = 0; r < v.size; ++r) row_of_[v.seqs[r]] = static_cast<std::uint32_t>(r);
    const auto open = [&](std::uint32_t r) { return ((bits_[r >> 6] >> (r & 63)) & 1u) == 0; };
    std::size_t kept = 0;
    for (std::uint32_t i : order_) {
      const std::uint32_t r = cand_row_[i];
      if (open(r)) {
        keep(r);
        if (++kept == k) return;
      }
      const auto it = row_of_.find(v.seqs[r] + 1);
      if (it != row_of_.end() && open(it->second)) {
        keep(it->second);
        if (++kept == k) return;
      }
    }
  }

  /// RecallDedup::protected_rows: brings the head's band (how many of its protected rows,
  /// sinks and the rows at or after the band's first arrival, have each signature number)
  /// up to this decision. Rows enter it in on_append; rows that left the band are dropped
  /// here, oldest first; it is rebuilt from the rows when unset (bind, load_state, a
  /// renumbering) or when the band widened (a larger budget), since rows of the wider band
  /// arrived before it was tracked.
  template <class S>
  void update_band(const HeadView<S>& v) {
    const std::size_t h = head_index(v.layer, v.kv_head);
    Band& b = bands_[h];
    const std::size_t recent = recent_for(v.capacity);
    const std::uint64_t lo = v.incoming_seq >= recent ? v.incoming_seq - recent : 0;
    if (!b.valid || lo < b.lo) {
      const auto& id = ids_.of(v.layer, v.kv_head);
      b.count.assign(interned_[h].n, 0u);
      b.recent.clear();
      b.first = 0;
      for (std::size_t r = 0; r < v.size; ++r) {
        if (v.seqs[r] >= config_.sinks && v.seqs[r] < lo) continue;
        ++b.count[id[r]];
        if (v.seqs[r] >= config_.sinks) b.recent.push_back({v.seqs[r], id[r]});
      }
      std::sort(b.recent.begin(), b.recent.end());
      b.valid = true;
    }
    // The band's rows in arrival order from b.first on; the consumed front is dropped in
    // one move once it is half the vector (amortised O(1) per row).
    const std::size_t end = b.recent.size();
    std::size_t f = b.first;
    for (; f < end && b.recent[f].first < lo; ++f) --b.count[b.recent[f].second];
    if (f >= 64 && 2 * f >= end) {
      b.recent.erase(b.recent.begin(), b.recent.begin() + static_cast<std::ptrdiff_t>(f));
      f = 0;
    }
    b.first = f;
    b.lo = lo;
  }
  KVEVICT_DEFER void band_append(int layer, int kv_head, std::uint64_t seq, std::uint32_t id) {
    const std::size_t h = head_index(layer, kv_head);
    Band& b = bands_[h];
    if (!b.valid) return;  // rebuilt from the rows at the next decision
    if (b.count.size() < interned_[h].n) b.count.resize(interned_[h].n, 0u);
    ++b.count[id];
    if (seq >= config_.sinks) b.recent.push_back({seq, id});
  }

  /// The head's rows or scores changed: its kept protection no longer holds.
  void forget(int layer, int kv_head) {
    const std::size_t h = head_index(layer, kv_head);
    if (h < memo_.size()) memo_[h].valid = false;
    if (h < ahead_.size()) ahead_[h].valid = false;
  }
  std::size_t head_index(int layer, int kv_head) const {
    return static_cast<std::size_t>(layer) * hkv_ + static_cast<std::size_t>(kv_head);
  }

  Config config_{};
  detail::RowColumn<float> scores_;
  std::size_t hkv_ = 1;
  std::vector<float> decay_;  ///< per (layer, KV head)
  std::vector<std::size_t> capacity_;  ///< per (layer, KV head), as last seen
  // Recall reserve (only bound when recall_fraction > 0).
  detail::RowColumn<float> spikes_;  ///< largest attention drawn while long-range
  detail::RowColumn<std::uint64_t> seqs_;  ///< arrival index, for the row's age in observe
  std::vector<std::uint64_t> latest_;  ///< per head: arrival index of the newest row
  std::vector<float> floor_;  ///< per head: the reserve's last threshold (keep_recalled's hint)
  detail::RowColumn<float> draws_;           ///< RecallRank::excess: sum of long-range draws
  detail::RowColumn<std::uint32_t> counts_;  ///< RecallRank::excess: number of them
  detail::RowColumn<std::uint64_t> sigs_;    ///< RecallDedup: key signature of each row
  std::size_t head_dim_ = 0;
  // Scratch for choose_victims and observe (no allocation per step once warm).
  std::vector<std::uint64_t> bits_;  ///< protected (and reserved) rows, one bit each
  std::vector<std::uint64_t> outside_;  ///< eviction_costs: the sinks and the recent band
  std::size_t last_evictable_ = 0, last_reserve_ = 0;  ///< keep_recalled's, for the memo
  /// Pooled budgets, per (layer, KV head): the protection eviction_costs computed last
  /// and the view it was computed for, reused by pooled_victims.
  struct Memo {
    std::vector<std::uint64_t> bits;
    std::size_t size = 0, capacity = 0, need = 0;
    std::size_t evictable = 0, reserve = 0;  ///< unprotected rows before the reserve; its target
    std::uint64_t incoming_seq = 0;
    bool valid = false;
  };
  std::vector<Memo> memo_;
  /// Per (layer, KV head): 1 once eviction_costs ranked it (its decisions come from the
  /// costs: observe skips decide_ahead for it); 2 once choose_victims was asked for it after
  /// that (observe decides ahead for a capacity of its rows). A speed hint only:
  /// choose_victims decides the same rows without the early decision.
  std::vector<std::uint8_t> costed_;
  std::size_t pooled_ahead_ = 0;  ///< pooled_ahead_taken()
  /// Per (layer, KV head): the next append's decision taken by decide_ahead and the view
  /// it was taken for.
  struct Ahead {
    std::size_t size = 0, capacity = 0;
    std::uint64_t incoming_seq = 0;
    std::uint32_t row = 0;
    bool valid = false;
  };
  std::vector<Ahead> ahead_;
  std::vector<float> cand_spike_, sum_;
  std::vector<std::uint32_t> cand_row_, top_;
  std::size_t cand_n_ = 0;  ///< candidates in cand_spike_ / cand_row_ (keep_recalled)
  HintCounts hint_counts_;  ///< RecallDedup: hint_counts()
  std::vector<Tie> ties_;
  std::vector<std::uint32_t> order_;  ///< recall_successor: the candidates in reserve order
  detail::RowColumn<std::uint32_t> ids_;  ///< RecallDedup: signature number of each row
  std::vector<Interned> interned_;        ///< RecallDedup: per (layer, KV head)
  std::unordered_map<std::uint64_t, std::uint32_t> row_of_;  ///< recall_successor: arrival index -> row
  /// RecallDedup::protected_rows, per (layer, KV head): the protected rows' signature numbers.
  struct Band {
    /// (seq, number), oldest first, from `first` on (the entries before it left the band)
    std::vector<std::pair<std::uint64_t, std::uint32_t>> recent;
    std::size_t first = 0;
    std::vector<std::uint32_t> count;  ///< per signature number: protected rows with it
    std::uint64_t lo = 0;  ///< the band's first arrival at the last decision
    bool valid = false;
  };
  std::vector<Band> bands_;
  /// RecallDedup, per (layer, KV head): what the last reserve computation (keep_distinct)
  /// saw, for distinct_victim's bound on |B|: the view's next arrival and capacity, |B|
  /// plus the open rows that were not candidates.
  struct Bound {
    std::uint64_t incoming_seq = 0;
    std::size_t capacity = 0, count = 0;
    bool valid = false;
  };
  std::vector<Bound> bounds_;
  const char* label_ = name();  ///< the policy named in errors (H2O when it wraps this)
};

}  // namespace kvevict::policies

// Compiled-kernels mode: extern template declarations of the common caches (extern_templates.hpp).
#define KVEVICT_HAVE_DECAYED_ATTENTION_HPP 1
#include "../extern_templates.hpp"
