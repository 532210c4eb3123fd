#pragma once
// ExpectedAttention (Devoto et al. 2025, arXiv 2510.00636; reference: NVIDIA kvpress,
// ExpectedAttentionPress): score each cached key by the attention that *future* queries are
// expected to pay it, in closed form from Gaussian statistics of recent queries, without
// ever reading attention probabilities.
//
// Per query head, the queries of the last `query_window` tokens (un-rotated to position 0)
// give a mean mu and a covariance S. A query at a future position t is R(t) q, so over the
// next `future_positions` positions p .. p + n - 1 (p = the incoming token's position) its
// mean is Rbar mu and its covariance about Rbar S Rbar^T, with Rbar the average RoPE
// rotation. For a stored (rotated) key k the expected logit is
//     z(k) = (Rbar mu) . k / sqrt(d) + k^T (Rbar S Rbar^T) k / (2 d)
// (the second term is the Gaussian moment-generating correction). The scores are a softmax
// of z over the scored rows, averaged over the G query heads of the KV head's group, then
// multiplied by ||v|| (optionally after adding `epsilon`). The row with the lowest score
// goes; sinks and an optional recent band are never evicted.
//
// GQA: statistics are kept per query head; each of the G heads of a group gives its own
// softmax over the group's rows, and the G distributions are averaged (kvpress's rule).
//
// RoPE: the policy needs the queries (Signals::query) as the engine attends with them,
// rotated at the incoming token's position, and assumes the stored keys were rotated at
// their own positions by the same RoPE (`rope`, `rope_base`; every dimension rotated). It
// un-rotates each query by its position before the statistics. `RopeLayout::none` is for
// engines without RoPE or that pass un-rotated queries and keys.
//
// Differences from the reference, which compresses a prompt once (or every N decode steps
// with a buffer of the hidden states since the last compression): here the decision is
// made per decode step, before attention, over the rows of one head (the incoming row is
// in the softmax's normaliser but never a victim); the statistics are of the queries
// themselves (the reference projects hidden states with W_q: the same thing for a linear
// projection); queries of the first `sinks` tokens are left out of the statistics, as the
// reference leaves out the first n_sink hidden states.
//
// Cost (kvevict extensions, both off by default): `float_logits` computes the mean term's
// logits in float through the dispatched attention kernel (kernels::attention_probs_as, one
// read of the keys for the G heads) instead of a scalar double loop; `rescore_every` = R
// rescores every row only on every R-th decision of a head (kvpress's decoding press
// likewise compresses every N steps). Between rescorings a row gets its score once, when it
// is appended, from the last rescoring's query statistics and softmax normaliser, and a
// decision is the decay and the victim search over the kept scores, O(n).
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "../attention_core.hpp"
#include "../kernels/row_dots.hpp"
#include "../errors.hpp"
#include "common.hpp"

namespace kvevict::policies {

class ExpectedAttention {
 public:
  /// What part of the query covariance enters the expected logit.
  enum class Covariance {
    full,  ///< k^T S' k / (2d) with the full d x d covariance (the paper; O(d^2) per key)
    none,  ///< mean only (O(d) per key)
  };
  struct Config {
    std::size_t sinks = 4;        ///< first rows never evicted (the reference's n_sink)
    std::size_t recent = 0;       ///< rows that arrived last, never evicted
    float recent_fraction = 0.0f; ///< protect max(recent, floor(fraction x capacity)) rows
    std::size_t query_window = 128;     ///< queries whose mean / covariance are used
    std::size_t future_positions = 512; ///< positions the rotation is averaged over
    Covariance covariance = Covariance::full;
    bool value_norm = true;  ///< multiply the score by ||v|| (the reference's use_vnorm)
    float epsilon = 0.0f;    ///< added to the score before the value norm
    RopeLayout rope = RopeLayout::interleaved;
    float rope_base = 10000.0f;  ///< theta_i = base^(-2i / d)
    /// kvevict extension (0 = off, the paper): rank by the scores decayed over steps,
    /// acc <- (1 - horizon / capacity) x acc + score, as DecayedAttention does with attention.
    float horizon = 0.0f;
    /// kvevict extension (1 = every decision, the rule above): rescore all rows on every
    /// R-th decision of a head only; rows appended in between are scored on arrival against
    /// the last rescoring's statistics and normaliser (1..2^20).
    std::size_t rescore_every = 1;
    /// kvevict extension (off = scalar double logits): float logits through the dispatched
    /// attention kernel. Covariance::none only; storage other than float / fp16 / bf16, or
    /// a step whose float scores overflow or underflow, falls back to the double loop.
    bool float_logits = false;
    /// kvevict extension (0 = off): rescore every R = max(rescore_every, floor(fraction x
    /// capacity)) decisions, so that the scores' staleness is a fixed share of the cache's
    /// turnover (unbounded heads: rescore_every). In [0, 1).
    float rescore_fraction = 0.0f;
    /// kvevict extension (0 = off): heads of at most this many rows rescore on every
    /// decision (R 1) whatever rescore_every and rescore_fraction say; larger heads use
    /// R = max(rescore_every, floor(rescore_fraction x capacity)). Small caches, where a
    /// full rescoring costs little and one stale step costs quality, stay exact; large ones
    /// amortise the rescoring.
    std::size_t rescore_all_up_to = 0;
  };

  KVEVICT_DEFER ExpectedAttention() : ExpectedAttention(Config{}) {}
  KVEVICT_DEFER explicit ExpectedAttention(Config c) : config_(c) {
    detail::require_fraction(name(), "recent_fraction", c.recent_fraction);
    kvevict::detail::require(c.query_window >= 1 && c.query_window <= (1u << 20), name(),
                             ": query_window = ", c.query_window, ", expected 1..", 1u << 20);
    kvevict::detail::require(c.future_positions >= 1 && c.future_positions <= (1u << 24), name(),
                             ": future_positions = ", c.future_positions, ", expected 1..",
                             1u << 24);
    kvevict::detail::require(std::isfinite(c.epsilon) && c.epsilon >= 0.0f, name(),
                             ": epsilon = ", c.epsilon, ", expected finite and >= 0");
    kvevict::detail::require(std::isfinite(c.horizon) && c.horizon >= 0.0f, name(),
                             ": horizon = ", c.horizon, ", expected finite and >= 0");
    kvevict::detail::require(c.rescore_every >= 1 && c.rescore_every <= (1u << 20), name(),
                             ": rescore_every = ", c.rescore_every, ", expected 1..", 1u << 20);
    detail::require_fraction(name(), "rescore_fraction", c.rescore_fraction);
    kvevict::detail::require(!c.float_logits || c.covariance == Covariance::none, name(),
                             ": float_logits with Covariance::full, expected Covariance::none");
    kvevict::detail::require(
        c.rope == RopeLayout::none || (std::isfinite(c.rope_base) && c.rope_base > 1.0f), name(),
        ": rope_base = ", c.rope_base, ", expected finite and > 1");
  }

  static constexpr Signals signals = Signals::query;
  static constexpr const char* name() { return "ExpectedAttention"; }
  [[nodiscard]] const Config& config() const { return config_; }
  [[nodiscard]] std::size_t min_capacity() const {
    return detail::protected_plus_one(name(), {{"sinks", config_.sinks}, {"recent", config_.recent}});
  }
  /// Whether rows are rescored less often than every decision (rescore_every, fraction).
  [[nodiscard]] bool amortised() const {
    return config_.rescore_every > 1 || config_.rescore_fraction > 0.0f;
  }
  /// R at a head of `capacity` rows: 1 up to rescore_all_up_to rows, else
  /// max(rescore_every, floor(rescore_fraction x capacity)).
  [[nodiscard]] std::size_t every(std::size_t capacity) const {
    if (capacity == Budget::kUnbounded) return config_.rescore_every;
    if (capacity <= config_.rescore_all_up_to) return 1;
    const auto f = static_cast<std::size_t>(static_cast<double>(config_.rescore_fraction) *
                                            static_cast<double>(capacity));
    return std::max(config_.rescore_every, f);
  }
  [[nodiscard]] std::size_t recent_for(std::size_t capacity) const {
    return detail::recent_rows(config_.recent, config_.recent_fraction, config_.sinks, capacity);
  }

  KVEVICT_DEFER void bind(const CacheShape& shape) {
    const Geometry& g = shape.geometry;
    kvevict::detail::require(config_.rope == RopeLayout::none || g.head_dim % 2 == 0, name(),
                             ": head_dim = ", g.head_dim, ", expected even with RoPE");
    d_ = static_cast<std::size_t>(g.head_dim);
    group_ = static_cast<std::size_t>(g.group());
    hkv_ = static_cast<std::size_t>(g.n_kv_heads);
    vnorms_.bind(shape);
    if (config_.horizon > 0.0f && !amortised()) acc_.bind(shape);  // amortised: accf_
    stats_.assign(static_cast<std::size_t>(g.n_layers) * static_cast<std::size_t>(g.n_heads),
                  QueryStats{});
    const bool full = config_.covariance == Covariance::full;
    for (auto& s : stats_) s.reset(d_, config_.query_window, full);
    const std::size_t heads = static_cast<std::size_t>(g.n_layers) * hkv_;
    if (amortised()) {
      stale_.bind(shape);
      keys_.bind(shape);
      if (config_.horizon > 0.0f) accf_.bind(shape);
      decisions_.assign(heads, 0);
      frozen_.assign(heads, 0);
      frozen_mean_.assign(heads * group_ * d_, 0.0);
      frozen_cov_.assign(full ? heads * group_ * d_ * d_ : 0, 0.0);
      frozen_norm_.assign(heads * group_, 0.0);
      frozen_lanes_.assign(!full && group_ <= kArrivalLanes ? heads * group_ * d_ : 0, 0.0);
    }
    // Per rotated pair: theta and the sum over t = 0..n-1 of exp(i t theta).
    theta_.clear();
    unrot_valid_ = false;
    future_re_.clear();
    future_im_.clear();
    if (config_.rope != RopeLayout::none) {
      for (std::size_t j = 0; j < d_ / 2; ++j) {
        const double th = std::pow(static_cast<double>(config_.rope_base),
                                   -2.0 * static_cast<double>(j) / static_cast<double>(d_));
        double re = 0.0, im = 0.0;
        for (std::size_t t = 0; t < config_.future_positions; ++t) {
          re += std::cos(static_cast<double>(t) * th);
          im += std::sin(static_cast<double>(t) * th);
        }
        theta_.push_back(th);
        future_re_.push_back(re / static_cast<double>(config_.future_positions));
        future_im_.push_back(im / static_cast<double>(config_.future_positions));
      }
    }
    last_added_.assign(static_cast<std::size_t>(g.n_layers) * hkv_, kNone);
    rank_.assign(last_added_.size(), {});
    ranked_.assign(last_added_.size(), Ranked{});
  }

  template <class S>
  void choose_victims(const HeadView<S>& v, std::vector<std::uint32_t>& out) {
    add_queries(v);
    if (amortised()) {
      amortised_victims(v, out);
      return;
    }
    score_rows(v, false);
    decay_scores(v);
    detail::evict_lowest_protected(v, score_, config_.sinks, recent_for(v.capacity), out, name());
  }
  /// Per-row costs for BlockGranular (a block's cost = the sum / mean / max of its rows')
  /// and pooled budgets: each row's score as this decision ranks it (its expected attention
  /// times ||v||, decayed when horizon > 0; between rescorings the kept scores), lower =
  /// evicted first; +infinity for the sinks and the recent band (never evicted). The call
  /// is the decision's step, as choose_victims' is: the queries are added, the rows
  /// rescored and the decayed sums advanced, so a caller ranks by these costs instead of
  /// calling choose_victims on the same view; pooled_victims then picks from them.
  template <class S>
  void eviction_costs(const HeadView<S>& v, std::vector<float>& out) {
    add_queries(v);
    const std::size_t n = v.size, h = head_index(v.layer, v.kv_head);
    auto& rank = rank_[h];
    if (amortised()) {
      const float* r = amortised_rank(v);
      rank.assign(r, r + n);
    } else {
      score_rows(v, false);
      decay_scores(v);
      rank.assign(score_.begin(), score_.begin() + static_cast<std::ptrdiff_t>(n));
    }
    const std::uint64_t hi = detail::open_below(v, recent_for(v.capacity));
    out.resize(n);
    for (std::size_t r = 0; r < n; ++r)
      out[r] = v.seqs[r] < config_.sinks || v.seqs[r] >= hi ? std::numeric_limits<float>::infinity()
                                                            : static_cast<float>(rank[r]);
    ranked_[h] = Ranked{n, v.capacity, v.incoming_seq, true};
  }
  /// Pooled budgets: the victims choose_victims would take on the scores the last
  /// eviction_costs call on this head ranked by (its view, need aside; no call since),
  /// without a second step; otherwise choose_victims.
  template <class S>
  void pooled_victims(const HeadView<S>& v, std::vector<std::uint32_t>& out) {
    const std::size_t h = head_index(v.layer, v.kv_head);
    if (h < ranked_.size()) {
      Ranked& m = ranked_[h];
      if (m.valid && m.size == v.size && m.capacity == v.capacity && m.incoming_seq == v.incoming_seq) {
        m.valid = false;
        detail::evict_lowest_protected(v, rank_[h], config_.sinks, recent_for(v.capacity), out, name());
        return;
      }
    }
    choose_victims(v, out);
  }
  template <class S>
  void on_append(const HeadView<S>& v, std::size_t row) {
    forget(v.layer, v.kv_head);
    add_queries(v);
    // Mean-only arrivals of a frozen head: the value norm and the G logits in one pass over
    // the row (float storage: arrival_lanes, each sum in 8 lanes; otherwise
    // arrival_one_pass: G + 1 independent sums, each in the order of the loops here and in
    // arrival_score, so the same values).
    const bool one_pass = amortised() && lanes_arrival(v, row);
    float vn = 0.0f;
    double score = 0.0;
    if (one_pass) {
      if constexpr (std::is_same_v<S, float>)
        score = arrival_lanes(v, row, vn);
      else
        score = group_ == 4 ? arrival_one_pass<4>(v, row, vn) : arrival_one_pass<0>(v, row, vn);
    } else {
      double s = 0.0;
      for (const S& x : v.value(row)) s += static_cast<double>(x) * static_cast<double>(x);
      vn = static_cast<float>(std::sqrt(s));
    }
    vnorms_.set(v.layer, v.kv_head, row, vn);
    if (config_.horizon > 0.0f && !amortised()) acc_.set(v.layer, v.kv_head, row, 0.0);
    if (amortised()) {
      if (!one_pass) score = arrival_score(v, row, vn);
      stale_.set(v.layer, v.kv_head, row, static_cast<float>(score));
      keys_.set(v.layer, v.kv_head, row, seq_key(v.seqs[row]));
      if (config_.horizon > 0.0f) accf_.set(v.layer, v.kv_head, row, 0.0f);
    }
  }
  KVEVICT_DEFER void on_move(int layer, int kv_head, std::size_t from, std::size_t to) {
    forget(layer, kv_head);
    vnorms_.move(layer, kv_head, from, to);
    if (config_.horizon > 0.0f && !amortised()) acc_.move(layer, kv_head, from, to);
    if (amortised()) {
      stale_.move(layer, kv_head, from, to);
      keys_.move(layer, kv_head, from, to);
      if (config_.horizon > 0.0f) accf_.move(layer, kv_head, from, to);
    }
  }

  /// The scores the last choose_victims call ranked by (decayed when horizon > 0), one per
  /// live row (for tests and tools). With rescore_every > 1: the last rescoring's scores
  /// (not decayed), one per row live then.
  [[nodiscard]] const std::vector<double>& last_scores() const { return score_; }
  /// Un-rotated query statistics of query head `head` (0..n_heads) of `layer`: how many
  /// queries, their sum and the sum of their outer products (row-major d x d).
  struct Moments {
    std::size_t count;
    const std::vector<double>* sum;
    const std::vector<double>* outer;
  };
  [[nodiscard]] Moments moments(int layer, int head) const {
    const auto& s = stats_[static_cast<std::size_t>(layer) * hkv_ * group_ +
                           static_cast<std::size_t>(head)];
    return {s.count, &s.sums(), &s.outer};
  }

 private:
  static constexpr std::uint64_t kNone = ~std::uint64_t{0};
  static constexpr std::size_t kArrivalLanes = 16;  ///< groups up to this size: arrival_one_pass
  static constexpr std::uint64_t kKeyMax = std::numeric_limits<std::uint32_t>::max();

  // A row's 32-bit seq key (amortised decisions): 0 for the sinks (never open), seq - sinks
  // + 1 above them, saturated at 2^32 - 1. While the head's incoming seq is below 2^32 - 1
  // every row that can be open (sinks <= seq < incoming) has its exact key, so lo <= seq <
  // hi iff 1 <= key < seq_key(hi) and keys order those rows as their seqs do.
  [[nodiscard]] std::uint32_t seq_key(std::uint64_t seq) const {
    if (seq < config_.sinks) return 0;
    return static_cast<std::uint32_t>(std::min<std::uint64_t>(seq - config_.sinks + 1, kKeyMax));
  }

  // Sliding-window moments of one query head's un-rotated queries.
  struct QueryStats {
    std::vector<float> ring;      // window x d, the queries in the window
    mutable std::vector<double> sum;  // d (window 1 without outer: see sums())
    std::vector<double> outer;    // d x d
    std::size_t count = 0, next = 0, window = 1;
    mutable bool pending = false;  // window 1: sum not yet written from the ring
    /// The sum of the window's queries (window 1 without outer products: 0.0 + q, written
    /// from the kept query on the first read after add).
    [[nodiscard]] const std::vector<double>& sums() const {
      if (pending) {
        for (std::size_t i = 0; i < sum.size(); ++i) sum[i] = 0.0 + static_cast<double>(ring[i]);
        pending = false;
      }
      return sum;
    }
    KVEVICT_DEFER void reset(std::size_t d, std::size_t w, bool with_outer) {
      window = w;
      ring.assign(w * d, 0.0f);
      sum.assign(d, 0.0);
      outer.assign(with_outer ? d * d : 0, 0.0);  // only Covariance::full reads it
      count = next = 0;
      pending = false;
    }
    void add(const float* q, std::size_t d) {
      if (window == 1 && outer.empty()) {
        // One query in the window (the registry's probfree): taking the old query out
        // leaves exactly +0.0 in every sum (x + (-x)), so the sum is 0.0 + q, the values of
        // the general path below. Only a rescoring reads it (every R-th decision), so the
        // query is kept as it came (d floats, half the bytes of the sums) and the sum is
        // written from it when read (sums()).
        std::copy(q, q + d, ring.data());
        pending = true;
        count = 1;
        return;
      }
      float* slot = ring.data() + next * d;
      if (count == window) accumulate(slot, d, -1.0);
      std::copy(q, q + d, slot);
      accumulate(slot, d, 1.0);
      next = (next + 1) % window;
      count = std::min(count + 1, window);
    }
    void accumulate(const float* q, std::size_t d, double sign) {
      // The sum first, in its own loop (element-wise, so it vectorises with the same
      // results); the outer products only with Covariance::full.
      double* s = sum.data();
      for (std::size_t i = 0; i < d; ++i) s[i] += sign * static_cast<double>(q[i]);
      if (outer.empty()) return;
      for (std::size_t i = 0; i < d; ++i) {
        const double qi = sign * static_cast<double>(q[i]);
        for (std::size_t j = 0; j < d; ++j) outer[i * d + j] += qi * static_cast<double>(q[j]);
      }
    }
  };

  std::size_t rope_index(std::size_t j, bool second) const {
    // The two coordinates of rotated pair j.
    if (config_.rope == RopeLayout::halves) return second ? j + d_ / 2 : j;
    return second ? 2 * j + 1 : 2 * j;
  }

  // Adds the incoming token's G queries (un-rotated) to the statistics, once per token.
  template <class S>
  void add_queries(const HeadView<S>& v) {
    if (v.queries == nullptr) return;
    auto& last = last_added_[static_cast<std::size_t>(v.layer) * hkv_ + static_cast<std::size_t>(v.kv_head)];
    if (last == v.incoming_seq) return;
    last = v.incoming_seq;
    if (v.incoming_seq < config_.sinks) return;  // the reference leaves out the sink tokens
    buf_.resize(d_);
    for (std::size_t g = 0; g < group_; ++g) {
      const float* q = v.queries + g * d_;
      if (config_.rope == RopeLayout::none) {  // un-rotated already: no copy
        stats(v.layer, v.kv_head, g).add(q, d_);
        continue;
      }
      // cos / sin of p theta_j: computed once per position (every query head of every KV
      // head of a token shares them), the same values as computed per head.
      if (!unrot_valid_ || unrot_pos_ != v.incoming_position) {
        const double p = static_cast<double>(v.incoming_position);
        unrot_c_.resize(d_ / 2);
        unrot_s_.resize(d_ / 2);
        for (std::size_t j = 0; j < d_ / 2; ++j) {
          unrot_c_[j] = std::cos(p * theta_[j]);
          unrot_s_[j] = std::sin(p * theta_[j]);
        }
        unrot_pos_ = v.incoming_position;
        unrot_valid_ = true;
      }
      for (std::size_t j = 0; j < d_ / 2; ++j) {
        const double c = unrot_c_[j], s = unrot_s_[j];
        const std::size_t a = rope_index(j, false), b = rope_index(j, true);
        const double x = q[a], y = q[b];
        buf_[a] = static_cast<float>(x * c + y * s);  // R(-p)
        buf_[b] = static_cast<float>(-x * s + y * c);
      }
      stats(v.layer, v.kv_head, g).add(buf_.data(), d_);
    }
  }

  QueryStats& stats(int layer, int kv_head, std::size_t g) {
    return stats_[(static_cast<std::size_t>(layer) * hkv_ + static_cast<std::size_t>(kv_head)) *
                      group_ + g];
  }

  // Mean and covariance of query head g, moved to the future positions' average rotation:
  // mean_ = Rbar mu, cov_ = Rbar S Rbar^T (d x d).
  KVEVICT_DEFER void future_moments(const QueryStats& st, std::int64_t position) {
    const std::size_t d = d_;
    mean_.assign(d, 0.0);
    if (config_.covariance == Covariance::full) cov_.assign(d * d, 0.0);  // only it reads cov_
    if (st.count == 0) return;
    const double n = static_cast<double>(st.count);
    const std::vector<double>& sum = st.sums();
    for (std::size_t i = 0; i < d; ++i) mean_[i] = sum[i] / n;
    if (config_.covariance == Covariance::full)
      for (std::size_t i = 0; i < d; ++i)
        for (std::size_t j = 0; j < d; ++j)
          cov_[i * d + j] = st.outer[i * d + j] / n - mean_[i] * mean_[j];
    if (config_.rope == RopeLayout::none) return;
    // Rbar is block-diagonal: pair j is [[c, -s], [s, c]] with c + i s the mean of
    // exp(i t theta_j) over t = p .. p + n - 1, i.e. exp(i p theta_j) x the precomputed mean.
    const std::size_t pairs = d / 2;
    rc_.resize(pairs);
    rs_.resize(pairs);
    const double p = static_cast<double>(position);
    for (std::size_t j = 0; j < pairs; ++j) {
      const double c0 = std::cos(p * theta_[j]), s0 = std::sin(p * theta_[j]);
      rc_[j] = c0 * future_re_[j] - s0 * future_im_[j];
      rs_[j] = s0 * future_re_[j] + c0 * future_im_[j];
    }
    rotate_pairs(mean_.data(), 1, 1, 0);  // mean <- Rbar mean
    if (config_.covariance != Covariance::full) return;
    rotate_pairs(cov_.data(), d, d, 1);  // rows of cov: Rbar cov
    rotate_pairs(cov_.data(), d, 1, d);  // its columns: (Rbar cov) Rbar^T
  }

  // Applies Rbar (rc_, rs_) to `count` vectors of `m`: coordinate i of vector k is
  // m[i * coord_stride + k * vector_stride].
  void rotate_pairs(double* m, std::size_t count, std::size_t coord_stride,
                    std::size_t vector_stride) const {
    for (std::size_t j = 0; j < d_ / 2; ++j) {
      const std::size_t a = rope_index(j, false) * coord_stride;
      const std::size_t b = rope_index(j, true) * coord_stride;
      for (std::size_t k = 0; k < count; ++k) {
        double& x = m[a + k * vector_stride];
        double& y = m[b + k * vector_stride];
        const double x0 = x, y0 = y;
        x = rc_[j] * x0 - rs_[j] * y0;
        y = rs_[j] * x0 + rc_[j] * y0;
      }
    }
  }

  // The expected logit of `key` (any storage type, read in double) under mean `mean` and,
  // when `cov` is not null, covariance `cov` (d x d).
  template <class K>
  double logit(const double* mean, const double* cov, const K* key) const {
    const std::size_t d = d_;
    double lin = 0.0;
    for (std::size_t i = 0; i < d; ++i) lin += mean[i] * static_cast<double>(key[i]);
    double z = lin / std::sqrt(static_cast<double>(d));
    if (cov != nullptr) {
      double quad = 0.0;
      for (std::size_t i = 0; i < d; ++i) {
        double row = 0.0;
        for (std::size_t j = 0; j < d; ++j) row += cov[i * d + j] * static_cast<double>(key[j]);
        quad += static_cast<double>(key[i]) * row;
      }
      z += quad / (2.0 * static_cast<double>(d));
    }
    return z;
  }
  [[nodiscard]] const double* cov_or_null() const {
    return config_.covariance == Covariance::full ? cov_.data() : nullptr;
  }
  std::size_t head_index(int layer, int kv_head) const {
    return static_cast<std::size_t>(layer) * hkv_ + static_cast<std::size_t>(kv_head);
  }
  // rescore_every > 1: every R-th decision of a head rescores all rows (and freezes the
  // statistics for arrivals); each decision decays the kept float scores and takes the
  // lowest open row, both with the dispatched kernels (decay_spike with no spike band,
  // masked argmin): O(n) between rescorings.
  template <class S>
  void amortised_victims(const HeadView<S>& v, std::vector<std::uint32_t>& out) {
    const std::size_t n = v.size;
    const float* rank = amortised_kept(v);
    const std::size_t recent = recent_for(v.capacity);
    const std::uint64_t lo = config_.sinks, hi = detail::open_below(v, recent);
    // One victim with the head's 32-bit seq keys (seq_key) in place of the 64-bit seqs: half
    // the bytes of the open test, the same rows open and the same order among them.
    const std::vector<std::uint32_t>& keys = keys_.of(v.layer, v.kv_head);
    const bool narrow = v.need == 1 && keys.size() == n && v.incoming_seq < kKeyMax;
    const std::uint32_t lo32 = 1, hi32 = narrow && hi > lo ? seq_key(hi) : lo32;
    if (config_.horizon > 0.0f) {
      // acc = decay x acc + kept (amortised_decay's values) and, for one victim, the lowest
      // (acc, seq) among the open rows in the same pass (kernels::decay_lowest_open: the row
      // that the decay loop, protection bits, masked argmin and tie scan below would find).
      if (v.need == 1) {
        prefetch_arrival(v);
        float* acc = accf_.of(v.layer, v.kv_head).data();
        const float decay = float_decay(v.capacity);
        out.push_back(detail::open_victim(
            narrow ? kernels::decay_lowest_open(acc, rank, keys.data(), n, decay, lo32, hi32)
                   : kernels::decay_lowest_open(acc, rank, v.seqs, n, decay, lo, hi),
            name()));
        return;
      }
      rank = amortised_decay(v, rank);
    } else if (v.need == 1) {
      out.push_back(detail::open_victim(
          narrow ? kernels::lowest_open(rank, keys.data(), n, lo32, hi32)
                 : kernels::lowest_open(rank, v.seqs, n, lo, hi),
          name()));
      return;
    }
    detail::evict_lowest_masked(
        v, rank, detail::protection_bits(v, config_.sinks, recent, bits_), out, name());
  }
  // The amortised decision's scores: the kept ones, all rows rescored on every R-th
  // decision of the head (the decision is counted).
  template <class S>
  const float* amortised_kept(const HeadView<S>& v) {
    auto& count = decisions_[head_index(v.layer, v.kv_head)];
    auto& kept = stale_.of(v.layer, v.kv_head);
    if (count++ % every(v.capacity) == 0) {
      score_rows(v, true);
      for (std::size_t r = 0; r < v.size; ++r) kept[r] = static_cast<float>(score_[r]);
    }
    return kept.data();
  }
  // acc = decay x acc + kept (a multiply then an add, the values of kernels::decay_spike
  // without its spike band); returns acc.
  template <class S>
  const float* amortised_decay(const HeadView<S>& v, const float* kept) {
    float* a = accf_.of(v.layer, v.kv_head).data();
    const float decay = float_decay(v.capacity);
    for (std::size_t r = 0; r < v.size; ++r) {
      const float prod = decay * a[r];
      a[r] = prod + kept[r];
    }
    return a;
  }
  // The scores an amortised decision ranks by (eviction_costs): kept, decayed when horizon > 0.
  template <class S>
  const float* amortised_rank(const HeadView<S>& v) {
    const float* kept = amortised_kept(v);
    return config_.horizon > 0.0f ? amortised_decay(v, kept) : kept;
  }
  [[nodiscard]] double decay_for(std::size_t capacity) const {
    return capacity == Budget::kUnbounded
               ? 1.0
               : std::clamp(1.0 - static_cast<double>(config_.horizon) / static_cast<double>(capacity), 0.0, 1.0);
  }
  [[nodiscard]] float float_decay(std::size_t capacity) const {
    return capacity == Budget::kUnbounded ? 1.0f : static_cast<float>(decay_for(capacity));
  }
  // horizon > 0: score_ <- acc <- decay x acc + score_ (the every-decision rule).
  template <class S>
  void decay_scores(const HeadView<S>& v) {
    if (config_.horizon <= 0.0f) return;
    auto& acc = acc_.of(v.layer, v.kv_head);
    const double decay = decay_for(v.capacity);
    for (std::size_t r = 0; r < v.size; ++r) score_[r] = acc[r] = decay * acc[r] + score_[r];
  }
  KVEVICT_DEFER void forget(int layer, int kv_head) {
    const std::size_t h = head_index(layer, kv_head);
    if (h < ranked_.size()) ranked_[h].valid = false;
  }

  // Keeps query head g's moved statistics (mean_, cov_) and log-normaliser for arrivals.
  KVEVICT_DEFER void freeze(std::size_t h, std::size_t g, const double* mean, double log_norm) {
    const std::size_t d = d_, i = h * group_ + g;
    std::copy(mean, mean + d, frozen_mean_.begin() + static_cast<std::ptrdiff_t>(i * d));
    if (!frozen_lanes_.empty())
      for (std::size_t c = 0; c < d; ++c) frozen_lanes_[(h * d + c) * group_ + g] = mean[c];
    if (config_.covariance == Covariance::full)
      std::copy(cov_.begin(), cov_.end(), frozen_cov_.begin() + static_cast<std::ptrdiff_t>(i * d * d));
    frozen_norm_[i] = log_norm;
    frozen_[h] = 1;
  }
  // The frozen means the head's arrival will read (arrival_lanes or arrival_one_pass, after every head of the
  // step decided): requested now, so that they arrive while the decisions run.
  template <class S>
  void prefetch_arrival(const HeadView<S>& v) const {
    if (frozen_lanes_.empty()) return;
    const std::vector<double>& m = std::is_same_v<S, float> ? frozen_mean_ : frozen_lanes_;
    const auto* p = reinterpret_cast<const char*>(m.data() + head_index(v.layer, v.kv_head) * d_ * group_);
    for (std::size_t o = 0; o < d_ * group_ * sizeof(double); o += 64) __builtin_prefetch(p + o);
  }
  // Whether an arrival is scored by arrival_one_pass (mean-only logits, G <= 16 lanes,
  // statistics frozen, not a sink) rather than arrival_score.
  template <class S>
  bool lanes_arrival(const HeadView<S>& v, std::size_t row) const {
    return frozen_[head_index(v.layer, v.kv_head)] != 0 && v.seqs[row] >= config_.sinks &&
           config_.covariance == Covariance::none && group_ <= kArrivalLanes;
  }
  // on_append's value norm and an arrival's G mean-only logits in one loop over the row: the
  // squares of the value and the G products with the frozen means (frozen_lanes_, laid out
  // coordinate-major so that the G means of a coordinate are adjacent) go into G + 1
  // independent sums, each added in coordinate order as the separate loops add them, so
  // the norm and the score are the values of those loops. Gc: the group size when known
  // at compile time (0: group_).
  template <std::size_t Gc, class S>
  double arrival_one_pass(const HeadView<S>& v, std::size_t row, float& vn) const {
    const std::size_t G = Gc != 0 ? Gc : group_, d = d_, h = head_index(v.layer, v.kv_head);
    const S* key = v.key(row).data();
    const S* val = v.value(row).data();
    const double* m = frozen_lanes_.data() + h * d * G;
    double sq = 0.0;
    double lin[Gc != 0 ? Gc : kArrivalLanes] = {};
    for (std::size_t i = 0; i < d; ++i) {
      const double x = static_cast<double>(val[i]);
      sq += x * x;
      const double k = static_cast<double>(key[i]);
      for (std::size_t g = 0; g < G; ++g) lin[g] += m[i * G + g] * k;
    }
    vn = static_cast<float>(std::sqrt(sq));
    const double root = std::sqrt(static_cast<double>(d));
    double s = 0.0;
    for (std::size_t g = 0; g < G; ++g) s += std::exp(lin[g] / root - frozen_norm_[h * group_ + g]);
    return with_value_norm(s / static_cast<double>(group_), vn);
  }
  // arrival_one_pass for float storage through kernels::arrival_dots: the squared value
  // norm and the G products with the frozen means (frozen_mean_, g-major) each summed in 8
  // lanes (coordinate i into lane i % 8, then a tree), so that no sum is a chain of d
  // dependent adds (the ordered sums' latency was most of an arrival's time). The values
  // differ from the ordered sums' by the rounding of the additions (about 1e-16 relative).
  template <class S>
  double arrival_lanes(const HeadView<S>& v, std::size_t row, float& vn) const {
    const std::size_t d = d_, h = head_index(v.layer, v.kv_head);
    double lin[kArrivalLanes] = {};
    const double sq = kernels::arrival_dots(v.key(row).data(), v.value(row).data(),
                                            frozen_mean_.data() + h * group_ * d, group_, d, lin);
    vn = static_cast<float>(std::sqrt(sq));
    const double root = std::sqrt(static_cast<double>(d));
    double s = 0.0;
    for (std::size_t g = 0; g < group_; ++g) s += std::exp(lin[g] / root - frozen_norm_[h * group_ + g]);
    return with_value_norm(s / static_cast<double>(group_), vn);
  }
  // A row appended between rescorings: exp(z - log-normaliser) under the last rescoring's
  // statistics, averaged over the group, times ||v||. 0 before the first rescoring (which
  // rescores it anyway) and for the sinks, as score_rows leaves them. Mean-only logits of
  // a group of at most kArrivalLanes go through arrival_one_pass instead.
  template <class S>
  double arrival_score(const HeadView<S>& v, std::size_t row, float vn) const {
    const std::size_t h = head_index(v.layer, v.kv_head), d = d_;
    double s = 0.0;
    if (frozen_[h] != 0 && v.seqs[row] >= config_.sinks) {
      const S* key = v.key(row).data();
      for (std::size_t g = 0; g < group_; ++g) {
        const std::size_t i = h * group_ + g;
        const double* cov = config_.covariance == Covariance::full ? frozen_cov_.data() + i * d * d : nullptr;
        s += std::exp(logit(frozen_mean_.data() + i * d, cov, key) - frozen_norm_[i]);
      }
      s /= static_cast<double>(group_);
    }
    return with_value_norm(s, vn);
  }
  // An arrival's group-mean score times ||v|| (plus epsilon) when value_norm is on.
  [[nodiscard]] double with_value_norm(double s, float vn) const {
    return config_.value_norm ? (s + static_cast<double>(config_.epsilon)) * static_cast<double>(vn) : s;
  }

  // score_[r] for every live row: the group's mean softmax of z over the scored rows (all
  // but the sinks, plus the incoming key), times ||v|| when value_norm is on. With `keep`
  // the moved statistics and normalisers are frozen for arrivals (rescore_every > 1).
  template <class S>
  void score_rows(const HeadView<S>& v, bool keep) {
    const std::size_t n = v.size;
    // Shrinking a budget there is no incoming token: the next position stands in for it.
    std::int64_t position = v.incoming_position;
    if (v.incoming_key == nullptr)
      for (std::size_t r = 0; r < n; ++r) position = std::max(position, v.positions[r] + 1);
    bool done = false;
    if constexpr (kvevict::detail::kernel_scalar<S>)
      if (config_.float_logits) done = score_rows_float(v, position, keep);
    if (!done) score_rows_double(v, position, keep);
    const float* vn = vnorms_.of(v.layer, v.kv_head).data();
    double* sc = score_.data();
    const auto group = static_cast<double>(group_);
    const auto eps = static_cast<double>(config_.epsilon);
    if (config_.value_norm) {
      for (std::size_t r = 0; r < n; ++r) sc[r] = (sc[r] / group + eps) * static_cast<double>(vn[r]);
    } else {
      for (std::size_t r = 0; r < n; ++r) sc[r] /= group;
    }
  }

  template <class S>
  void score_rows_double(const HeadView<S>& v, std::int64_t position, bool keep) {
    const std::size_t n = v.size;
    score_.assign(n, 0.0);
    const bool incoming = v.incoming_key != nullptr;
    const std::size_t m = n + (incoming ? 1 : 0);
    z_.resize(m);
    const std::size_t h = head_index(v.layer, v.kv_head);
    for (std::size_t g = 0; g < group_; ++g) {
      future_moments(stats(v.layer, v.kv_head, g), position);
      double zmax = -HUGE_VAL;
      for (std::size_t r = 0; r < m; ++r) {
        if (r < n && v.seqs[r] < config_.sinks) continue;
        z_[r] = r < n ? logit(mean_.data(), cov_or_null(), v.key(r).data())
                      : logit(mean_.data(), cov_or_null(), v.incoming_key);
        zmax = std::max(zmax, z_[r]);
      }
      double total = 0.0;
      for (std::size_t r = 0; r < m; ++r) {
        if (r < n && v.seqs[r] < config_.sinks) continue;
        z_[r] = std::exp(z_[r] - zmax);
        total += z_[r];
      }
      for (std::size_t r = 0; r < n; ++r)
        if (v.seqs[r] >= config_.sinks) score_[r] += z_[r] / total;
      if (keep) freeze(h, g, mean_.data(), zmax + std::log(total));
    }
  }

  // The float path (Covariance::none): the kernel's softmax over the stored rows, p_r, for
  // the G moved means at once; then renormalised over the scored rows and the incoming key:
  // score_r = p_r / T with T = sum of p over the non-sink rows + p_j exp(z_in - z_j), j the
  // most probable row (z_j, z_in recomputed in double from the float mean). Returns false
  // (nothing kept) when the kernel reports a non-finite logit or T is not a normal number.
  template <class S>
  bool score_rows_float(const HeadView<S>& v, std::int64_t position, bool keep) {
    const std::size_t n = v.size, d = d_, G = group_;
    score_.assign(n, 0.0);
    qf_.resize(G * d);
    means_.resize(G * d);
    probs_.resize(G * n);
    norms_.resize(G);
    for (std::size_t g = 0; g < G; ++g) {
      future_moments(stats(v.layer, v.kv_head, g), position);
      std::copy(mean_.begin(), mean_.end(), means_.begin() + static_cast<std::ptrdiff_t>(g * d));
      for (std::size_t i = 0; i < d; ++i) qf_[g * d + i] = static_cast<float>(mean_[i]);
    }
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    if (!kernels::attention_probs_as<kvevict::detail::kv_format_of<S>()>(
            qf_.data(), d, G, v.keys, d, n, d, scale, probs_.data()))
      return false;
    auto dot = [&](const float* q, const auto* k) {
      double s = 0.0;
      for (std::size_t i = 0; i < d; ++i) s += static_cast<double>(q[i]) * static_cast<double>(k[i]);
      return s * static_cast<double>(scale);
    };
    // Per head g: j_g, its most probable row (the first of the largest), and the total over
    // the scored rows, added in row order. The G heads side by side in one pass over the
    // rows (G independent sums: the values of one loop per head, several times the
    // throughput of one dependent chain of double additions).
    most_.assign(G, 0);
    totals_.assign(G, 0.0);
    if (G == 4) {
      most_totals<4>(v, n);
    } else {
      most_totals<0>(v, n);
    }
    inv_.resize(G);
    for (std::size_t g = 0; g < G; ++g) {
      const float* q = qf_.data() + g * d;
      const std::size_t j = most_[g];
      const double pj = static_cast<double>(probs_[g * n + j]);
      double total = totals_[g];
      const double zj = dot(q, v.key(j).data());
      if (v.incoming_key != nullptr) total += pj * std::exp(dot(q, v.incoming_key) - zj);
      if (!(total > 1e-20 && total < HUGE_VAL)) return false;
      inv_[g] = 1.0 / total;
      norms_[g] = zj - std::log(pj) + std::log(total);
    }
    // score_r = sum over g of p_g[r] / T_g, one pass per head (already independent per row;
    // rows-outer with the G products inner compiles to other values when the compiler may
    // contract a multiply and an add).
    // Every row in the G passes (no branch: the loop vectorises), then the sinks back to
    // +0.0, their value when skipped: the scored rows get the same operations in the same
    // order, and a sink's sum (0.0 plus finite products) is discarded.
    double* sc = score_.data();
    for (std::size_t g = 0; g < G; ++g) {
      const float* pg = probs_.data() + g * n;
      const double ig = inv_[g];
      for (std::size_t r = 0; r < n; ++r) sc[r] += static_cast<double>(pg[r]) * ig;
    }
    for (std::size_t r = 0; r < n; ++r)
      if (v.seqs[r] < config_.sinks) sc[r] = 0.0;
    if (keep)
      for (std::size_t g = 0; g < G; ++g)
        freeze(head_index(v.layer, v.kv_head), g, means_.data() + g * d, norms_[g]);
    return true;
  }

  // score_rows_float's pass for most_ and totals_: per head g, the first row of the largest
  // probability and the total of the scored rows' probabilities, added in row order (G
  // independent sums). Kept in locals (Gc: the group size when known at compile time, 0:
  // group_ up to kArrivalLanes, else the members), so that the sums and indices do not go
  // through memory on every row.
  template <std::size_t Gc, class S>
  void most_totals(const HeadView<S>& v, std::size_t n) {
    const std::size_t G = Gc != 0 ? Gc : group_;
    const float* p = probs_.data();
    const std::uint64_t* seqs = v.seqs;
    const std::uint64_t sinks = config_.sinks;
    if (Gc == 0 && G > kArrivalLanes) {
      for (std::size_t r = 0; r < n; ++r) {
        const bool scored = seqs[r] >= sinks;
        for (std::size_t g = 0; g < G; ++g) {
          const float pr = p[g * n + r];
          if (pr > p[g * n + most_[g]]) most_[g] = r;
          if (scored) totals_[g] += static_cast<double>(pr);
        }
      }
      return;
    }
    constexpr std::size_t L = Gc != 0 ? Gc : kArrivalLanes;
    std::size_t most[L] = {};
    float top[L];
    double total[L] = {};
    for (std::size_t g = 0; g < G; ++g) top[g] = n > 0 ? p[g * n] : 0.0f;
    for (std::size_t r = 0; r < n; ++r) {
      const bool scored = seqs[r] >= sinks;
      for (std::size_t g = 0; g < G; ++g) {
        const float pr = p[g * n + r];
        if (pr > top[g]) {
          top[g] = pr;
          most[g] = r;
        }
        if (scored) total[g] += static_cast<double>(pr);
      }
    }
    for (std::size_t g = 0; g < G; ++g) {
      most_[g] = most[g];
      totals_[g] = total[g];
    }
  }

  // eviction_costs: per (layer, KV head), the scores it ranked by and the view they were
  // for, which pooled_victims picks from (valid until the head changes).
  struct Ranked {
    std::size_t size = 0, capacity = 0;
    std::uint64_t incoming_seq = 0;
    bool valid = false;
  };
  std::vector<std::vector<double>> rank_;
  std::vector<Ranked> ranked_;
  Config config_;
  std::size_t d_ = 0, group_ = 1, hkv_ = 1;
  detail::RowColumn<float> vnorms_;
  detail::RowColumn<double> acc_;  ///< decayed scores (horizon > 0, not amortised)
  std::vector<QueryStats> stats_;            ///< per (layer, query head)
  std::vector<std::uint64_t> last_added_;    ///< per (layer, KV head): seq whose queries are in
  std::vector<double> theta_, future_re_, future_im_;  ///< per rotated pair
  // cos / sin of position x theta_j for the last incoming position (add_queries).
  std::vector<double> unrot_c_, unrot_s_;
  std::int64_t unrot_pos_ = 0;
  bool unrot_valid_ = false;
  // rescore_every > 1: per row, its score as of the last rescoring or its arrival; per
  // (layer, KV head), decisions so far and whether statistics are frozen; per (layer, KV
  // head, query head), the frozen moved mean (covariance) and log-normaliser.
  detail::RowColumn<float> stale_, accf_;  ///< kept scores; their decayed sums (horizon > 0)
  detail::RowColumn<std::uint32_t> keys_;   ///< per row, seq_key(seq)
  std::vector<std::uint64_t> decisions_, bits_;
  std::vector<unsigned char> frozen_;
  std::vector<double> frozen_mean_, frozen_cov_, frozen_norm_;
  std::vector<double> frozen_lanes_;  ///< frozen means, (layer, KV head, coordinate, g)
  // Scratch (no allocation per step once warm).
  std::vector<float> buf_, qf_, probs_;
  std::vector<double> mean_, cov_, rc_, rs_, z_, score_, means_, norms_, totals_, inv_;
  std::vector<std::size_t> most_;
};

}  // namespace kvevict::policies
