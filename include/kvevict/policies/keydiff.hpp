#pragma once
// KeyDiff (Park et al. 2025, arXiv 2504.15364; reference: NVIDIA kvpress, KeyDiffPress):
// keep the keys that differ from the rest. The anchor is the mean of the L2-normalised keys
// of the head; a key's score is its cosine similarity to the anchor, and the key most
// similar to it (the most redundant) is evicted. No attention and no queries are needed.
//
// Per KV head (GQA-native by construction: keys are per KV head, the G query heads play no
// part). The anchor is taken over the live rows and the incoming key, the set the paper's
// block-wise rule chooses from; the incoming row itself is never a victim here (the
// container decides before it is written). A zero key has no direction: it is normalised
// to zero (cosine 0). Optional sinks and a recent band are never evicted (the paper has
// neither; both default to 0).
//
// kvevict extension `rescore_every` = R (1 = the rule above, every decision): the anchor
// and every row's score are recomputed on every R-th decision of a head only; a row
// appended in between is scored on arrival against the last anchor, and a decision is the
// victim search over the kept scores, O(n).
//
// rescore_every = 1 without `exhaustive` (the default) evicts the row the exhaustive
// search evicts (the same row for every input, ties included: tested against it) by a
// bounded candidate search. Per head the anchor is kept as exact fixed-point integers (each
// unit key truncated to 2^-40, added on arrival, subtracted when the row leaves: no
// drift), and each row keeps base_r (in float, negated in the column): an upper bound of its
// similarity to the anchor A0 of the last rebase, exact to rounding for the rows rescored
// then. With D = A - A0 split into its part along A0 and
// the rest Dp (beta = 1 + D . A0 / |A0|^2), k_hat_r . A <= beta base_r + |Dp| (+ the
// rounding bounds of the float bases, of the fixed point and of the exhaustive search's
// own double sums); the exact score S of the best open base bounds the victim's from
// below, so only the open rows with beta base_r + |Dp| within those bounds of S can be the
// exhaustive search's victim (kernels::gather_open_at_most). They are scored in double
// against A; the best is taken when it beats every candidate with another key by twice the
// bounds of both computations (rows with the same key bit for bit score the same in the
// exhaustive search too: the oldest of them goes). Otherwise, and for need > 1, a budget
// shrink, 2^22 rows, or a key norm outside [2^-40, 2^40], the exhaustive search decides
// (its similarities become the bases). When the candidates scored since the last rebase
// outweigh one, a partial rebase moves A0 to A: every base grows by |A - A0| (still an
// upper bound) and the rows whose bound comes near S are rescored (kernels::
// scaled_row_dots_at); more than half the rows, or keys not stored as float: a full rebase
// (kernels::scaled_row_dots, AVX2 / AVX-512 bodies). The tracked anchor is checked each
// decision against the live rows (count and two sums of their arrival indices) and rebuilt
// when rows left another way. Cost: O(n) scans + the candidates' O(c d) + the rebases; for
// random keys in high dimension the window (Cauchy-Schwarz, tight only for rows along D)
// holds many rows where the top scores are dense, and rebases are frequent at 1K rows
// (docs/policies/keydiff.md, "Cost").
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <type_traits>
#include <vector>

#include "../errors.hpp"
#include "../kernels/row_dots.hpp"
#include "common.hpp"

namespace kvevict::policies {

class KeyDiff {
 public:
  struct Config {
    std::size_t sinks = 0;         ///< first rows never evicted
    std::size_t recent = 0;        ///< rows that arrived last, never evicted
    float recent_fraction = 0.0f;  ///< protect max(recent, floor(fraction x capacity)) rows
    std::size_t rescore_every = 1;  ///< rescore all rows every R-th decision (1..2^20)
    /// rescore_every = 1: score every row at every decision (the reference the bounded
    /// candidate search reproduces; same victims, O(n d) per decision).
    bool exhaustive = false;
  };
  KeyDiff() = default;
  KVEVICT_DEFER explicit KeyDiff(Config c) : config_(c) {
    detail::require_fraction(name(), "recent_fraction", c.recent_fraction);
    kvevict::detail::require(c.rescore_every >= 1 && c.rescore_every <= (1u << 20), name(),
                             ": rescore_every = ", c.rescore_every, ", expected 1..", 1u << 20);
  }

  static constexpr Signals signals = Signals::none;
  static constexpr const char* name() { return "KeyDiff"; }
  [[nodiscard]] const Config& config() const { return config_; }
  [[nodiscard]] std::size_t min_capacity() const {
    return detail::protected_plus_one(name(), {{"sinks", config_.sinks}, {"recent", config_.recent}});
  }
  [[nodiscard]] std::size_t recent_for(std::size_t capacity) const {
    return detail::recent_rows(config_.recent, config_.recent_fraction, config_.sinks, capacity);
  }
  KVEVICT_DEFER void bind(const CacheShape& shape) {
    inv_norms_.bind(shape);
    d_ = static_cast<std::size_t>(shape.geometry.head_dim);
    hkv_ = static_cast<std::size_t>(shape.geometry.n_kv_heads);
    if (config_.rescore_every > 1) {
      const std::size_t heads = static_cast<std::size_t>(shape.geometry.n_layers) * hkv_;
      stale_.bind(shape);
      decisions_.assign(heads, 0);
      frozen_.assign(heads, 0);
      frozen_anchor_.assign(heads * d_, 0.0);
    } else if (!config_.exhaustive) {
      const std::size_t heads = static_cast<std::size_t>(shape.geometry.n_layers) * hkv_;
      base_.bind(shape);
      track_.assign(heads, Track{});
      anchor_now_.assign(d_, 0.0);
      dx_.assign(d_, 0.0);
      for (auto& t : track_) {
        t.live.assign(d_, 0);
        t.a0i.assign(d_, 0);
        t.a0.assign(d_, 0.0);
        t.a0f.assign(d_, 0.0f);
      }
    }
  }

  template <class S>
  void choose_victims(const HeadView<S>& v, std::vector<std::uint32_t>& out) {
    if (config_.rescore_every > 1) {
      // Amortised: rescore on every R-th decision of the head (freezing the anchor for
      // arrivals), then the lowest kept float score among the open rows (masked argmin).
      const std::size_t h = head_index(v.layer, v.kv_head);
      auto& kept = stale_.of(v.layer, v.kv_head);
      if (decisions_[h]++ % config_.rescore_every == 0) {
        score_rows(v);
        for (std::size_t r = 0; r < v.size; ++r) kept[r] = static_cast<float>(score_[r]);
        std::copy(anchor_.begin(), anchor_.end(),
                  frozen_anchor_.begin() + static_cast<std::ptrdiff_t>(h * d_));
        frozen_[h] = 1;
      }
      const std::size_t recent = recent_for(v.capacity);
      if (v.need == 1) {  // one pass (kernels::lowest_open): the row evict_lowest_masked finds
        out.push_back(detail::open_victim(
            kernels::lowest_open(kept.data(), v.seqs, v.size, config_.sinks,
                                 detail::open_below(v, recent)),
            name()));
        return;
      }
      detail::evict_lowest_masked(v, kept.data(),
                                  detail::protection_bits(v, config_.sinks, recent, bits_), out,
                                  name());
      return;
    }
    if (!config_.exhaustive) {
      bounded_victim(v, out);
      return;
    }
    score_rows(v);
    detail::evict_lowest_protected(v, score_, config_.sinks, recent_for(v.capacity), out, name());
  }
  template <class S>
  void on_append(const HeadView<S>& v, std::size_t row) {
    const double in = inverse_norm(v.key(row));
    inv_norms_.set(v.layer, v.kv_head, row, in);
    if (config_.rescore_every == 1) {
      if (!config_.exhaustive) track_append(v, row, in);
      return;
    }
    // Arrival between rescorings: the negated similarity to the last anchor.
    const std::size_t h = head_index(v.layer, v.kv_head);
    double s = 0.0;
    if (frozen_[h] != 0) {
      const auto k = v.key(row);
      const double* a = frozen_anchor_.data() + h * d_;
      double dot = 0.0;
      for (std::size_t j = 0; j < d_; ++j) dot += static_cast<double>(k[j]) * a[j];
      s = -dot * in;
    }
    stale_.set(v.layer, v.kv_head, row, static_cast<float>(s));
  }
  KVEVICT_DEFER void on_move(int layer, int kv_head, std::size_t from, std::size_t to) {
    inv_norms_.move(layer, kv_head, from, to);
    if (config_.rescore_every > 1) stale_.move(layer, kv_head, from, to);
    else if (!config_.exhaustive) base_.move(layer, kv_head, from, to);
  }

  /// Bounded candidate search (rescore_every = 1, not exhaustive): decisions taken by it,
  /// full rebases of the bases, and decisions left to the exhaustive search.
  struct SearchCounts {
    std::uint64_t bounded = 0, rebases = 0, exhaustive = 0, rebuilds = 0, partial = 0;
  };
  [[nodiscard]] const SearchCounts& search_counts() const { return counts_; }

  /// Negated anchor similarities of the last exhaustive scoring, one per live row (with
  /// rescore_every > 1: of the last rescoring; with the bounded search: of its last
  /// exhaustive decision).
  [[nodiscard]] const std::vector<double>& last_scores() const { return score_; }

 private:
  std::size_t head_index(int layer, int kv_head) const {
    return static_cast<std::size_t>(layer) * hkv_ + static_cast<std::size_t>(kv_head);
  }
  // anchor_ and score_ for every live row (the rule in the header).
  template <class S>
  void score_rows(const HeadView<S>& v) {
    const auto& inv = inv_norms_.of(v.layer, v.kv_head);
    const std::size_t d = d_;
    // Anchor direction: the sum of the unit keys (its length does not change the ranking).
    anchor_.assign(d, 0.0);
    for (std::size_t r = 0; r < v.size; ++r) {
      const auto k = v.key(r);
      for (std::size_t j = 0; j < d; ++j) anchor_[j] += static_cast<double>(k[j]) * inv[r];
    }
    if (v.incoming_key != nullptr) {
      const double in = inverse_norm(std::span<const float>(v.incoming_key, d));
      for (std::size_t j = 0; j < d; ++j) anchor_[j] += static_cast<double>(v.incoming_key[j]) * in;
    }
    // Rank by the negated similarity k_hat . anchor: the most similar row is evicted first.
    score_.resize(v.size);
    for (std::size_t r = 0; r < v.size; ++r) {
      const auto k = v.key(r);
      double dot = 0.0;
      for (std::size_t j = 0; j < d; ++j) dot += static_cast<double>(k[j]) * anchor_[j];
      score_[r] = -dot * inv[r];
    }
  }

  // --- bounded candidate search (rescore_every = 1) ---------------------------------------
  static constexpr int kShift = 40;                            // fixed point: 2^-40 per unit
  static constexpr std::size_t kMaxRows = std::size_t{1} << 22;  // |anchor| < 2^62
  static constexpr double kU = 0x1p-53;                         // double unit roundoff
  // A partial rebase rescores the rows within kNear candidate windows of the best.
  // Rebase budgets and the partial rebase's reach (cost only: any values give the same
  // victims). Chosen on bench_scorers' keydiff_r1 at 1K-16K rows (d 128): after a full
  // rebase, candidate work up to n / 4; after a partial one, up to its rows + n / 8; a
  // partial rebase rescores the rows within 1.25 candidate windows (+ the shift) of the best.
  static constexpr std::size_t kFullBudget = 4, kPartBudget = 1;
  static constexpr double kNear = 1.25;

  struct Track {
    std::vector<std::int64_t> live;  // sum of the fixed-point unit keys of the tracked rows
    std::vector<std::int64_t> a0i;   // the anchor of the last rebase (fixed point)
    std::vector<double> a0;          // the same in double
    std::vector<float> a0f;          // and in float (what base_ was computed against)
    double a0norm = 0.0;             // |a0|
    std::size_t work = 0;            // candidates scored since the last rebase
    std::size_t count = 0, n0 = 0;   // tracked rows; most rows at a rebase since the full one
    std::size_t budget = 0;          // candidate work (weighted) that triggers a rebase
    std::uint64_t sum = 0, sq = 0;   // sums of the tracked rows' seqs and squared low halves
    bool valid = false;              // live/count/sums describe the head's rows
    bool based = false;              // a0 and base_ are set
  };

  // A dot product accumulated in T (double for the exact candidate scores, float for the
  // bases) with eight independent partial sums: the bounds below hold for any order.
  template <class T, class S>
  static T dot8(const S* k, const T* a, std::size_t d) {
    T acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    std::size_t j = 0;
    for (; j + 8 <= d; j += 8)
      for (std::size_t t = 0; t < 8; ++t) acc[t] += static_cast<T>(k[j + t]) * a[j + t];
    T s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; j < d; ++j) s += static_cast<T>(k[j]) * a[j];
    return s;
  }
  // Anchor `a` (fixed point) of a rebase into t.a0i / a0 / a0f.
  KVEVICT_DEFER void set_anchor(Track& t, const std::int64_t* a) const {
    std::copy(a, a + d_, t.a0i.begin());
    for (std::size_t j = 0; j < d_; ++j) {
      t.a0[j] = static_cast<double>(a[j]) * 0x1p-40;
      t.a0f[j] = static_cast<float>(t.a0[j]);
    }
    double nn = 0.0;
    for (std::size_t j = 0; j < d_; ++j) nn += t.a0[j] * t.a0[j];
    t.a0norm = std::sqrt(nn);
    t.work = 0;
  }
  // Adds (sign +1) or subtracts (-1) the fixed-point unit key of `k` (inverse norm `in`).
  // Each component is truncated: below 2^-40 + one rounding of k x in from the real unit key.
  template <class S>
  void accumulate(std::int64_t* acc, const S* k, double in, std::int64_t sign) const {
    for (std::size_t j = 0; j < d_; ++j)
      acc[j] += sign * static_cast<std::int64_t>(static_cast<double>(k[j]) * in * 0x1p40);
  }
  // A key with a norm outside [2^-40, 2^40] (inverse norm `in`; 0 for a zero key): its
  // float base could overflow or lose digits to underflow; such heads use the exhaustive
  // search while they hold one.
  static bool extreme(double in) { return in != 0.0 && (in > 0x1p40 || in < 0x1p-40); }
  static void fingerprint(const std::uint64_t* seqs, std::size_t n, std::uint64_t& sum,
                          std::uint64_t& sq) {
    std::uint64_t a = 0, b = 0;
    for (std::size_t r = 0; r < n; ++r) {
      const std::uint64_t lo = seqs[r] & 0xffffffffu;
      a += seqs[r];
      b += lo * lo;
    }
    sum = a;
    sq = b;
  }

  template <class S>
  void track_append(const HeadView<S>& v, std::size_t row, double in) {
    Track& t = track_[head_index(v.layer, v.kv_head)];
    const auto k = v.key(row);
    float base = 0.0f;
    if (t.valid && extreme(in)) t.valid = false;  // rebuilt (and refused) at the next decision
    if (t.valid) {
      accumulate(t.live.data(), k.data(), in, 1);
      ++t.count;
      const std::uint64_t seq = v.seqs[row], lo = seq & 0xffffffffu;
      t.sum += seq;
      t.sq += lo * lo;
      if (t.based) base = -(dot8<float>(k.data(), t.a0f.data(), d_) * static_cast<float>(in));
    }
    base_.set(v.layer, v.kv_head, row, base);
  }

  // The exhaustive decision; its similarities (-score_) become the bases, against the
  // anchor `a_dec` (fixed point) of this decision when the tracked state is valid.
  template <class S>
  void exhaustive_victims(const HeadView<S>& v, Track& t, const std::int64_t* a_dec,
                          std::vector<std::uint32_t>& out) {
    ++counts_.exhaustive;
    score_rows(v);
    detail::evict_lowest_protected(v, score_, config_.sinks, recent_for(v.capacity), out, name());
    if (!t.valid || a_dec == nullptr) {
      t.based = false;
      return;
    }
    auto& base = base_.of(v.layer, v.kv_head);
    for (std::size_t r = 0; r < v.size; ++r) base[r] = static_cast<float>(score_[r]);
    set_anchor(t, a_dec);
    t.n0 = v.size;
    t.based = true;
  }

  template <class S>
  void bounded_victim(const HeadView<S>& v, std::vector<std::uint32_t>& out) {
    Track& t = track_[head_index(v.layer, v.kv_head)];
    const std::size_t n = v.size, d = d_, first = out.size();
    const auto& inv = inv_norms_.of(v.layer, v.kv_head);
    auto& base = base_.of(v.layer, v.kv_head);
    // Is the tracked anchor still the sum over the live rows?
    if (t.valid) {
      std::uint64_t sum = 0, sq = 0;
      fingerprint(v.seqs, n, sum, sq);
      if (t.count != n || sum != t.sum || sq != t.sq) t.valid = false;
    }
    if (!t.valid && n + 2 < kMaxRows &&
        std::none_of(inv.begin(), inv.begin() + static_cast<std::ptrdiff_t>(n), extreme)) {
      ++counts_.rebuilds;  // rebuild from the rows
      std::fill(t.live.begin(), t.live.end(), 0);
      for (std::size_t r = 0; r < n; ++r) accumulate(t.live.data(), v.key(r).data(), inv[r], 1);
      t.count = n;
      fingerprint(v.seqs, n, t.sum, t.sq);
      t.valid = true;
      t.based = false;
    }
    const double in_inv =
        v.incoming_key != nullptr ? inverse_norm(std::span<const float>(v.incoming_key, d)) : 0.0;
    if (!t.valid || v.need != 1 || v.incoming_key == nullptr || extreme(in_inv)) {
      exhaustive_victims(v, t, nullptr, out);  // not tracked: rebuilt at the next decision
      t.valid = false;
      return;
    }
    // The anchor of this decision: the live rows and the incoming key.
    a_dec_.assign(t.live.begin(), t.live.end());
    accumulate(a_dec_.data(), v.incoming_key, in_inv, 1);
    const std::size_t recent = recent_for(v.capacity);
    const std::uint64_t lo = config_.sinks, hi = detail::open_below(v, recent);
    // Rounding bounds (similarities are at most N in size; u = 2^-53; see the header).
    const double N = static_cast<double>(std::max(n, t.n0) + 2);
    const double dq = std::sqrt(static_cast<double>(d)) * N * (0x1p-40 + kU);  // |a - A|
    const double et = (N + static_cast<double>(d) + 8.0) * kU * N * 1.1;  // exhaustive's error
    const double es = (static_cast<double>(d) + 8.0) * kU * N * 1.1 + 1.01 * dq;  // exact scores
    // bases: in float (dot, anchor and inverse norm in float, stored as float), or the
    // exhaustive search's similarities rounded to float
    // (+ 1e-20 for float underflow: keys have norms in [2^-40, 2^40], see extreme()).
    const double eb =
        et + 1.01 * dq + (static_cast<double>(d) + 12.0) * 0x1p-24 * N * 1.1 + 1e-20;
    // Rebase when the candidates exceed n / 4 + 8, or when the candidates scored since the
    // last rebase (weighted 4: double, rows out of order) would exceed its cost.
    std::size_t limit = 8 + n / 4;
    for (int pass = 0; pass < 2; ++pass) {
      if (!t.based) {  // full rebase: every row against this decision's anchor
        ++counts_.rebases;
        set_anchor(t, a_dec_.data());
        if constexpr (std::is_same_v<S, float>) {  // dispatched (AVX2 / AVX-512 bodies)
          kernels::scaled_row_dots(v.keys, n, d, t.a0f.data(), inv.data(), -1.0f, base.data());
        } else {
          for (std::size_t r = 0; r < n; ++r)
            base[r] = -(dot8<float>(v.key(r).data(), t.a0f.data(), d) * static_cast<float>(inv[r]));
        }
        t.n0 = n;
        t.budget = n / kFullBudget + 16;
        t.based = true;
        limit = n;  // the window is the rounding bound alone: no second rebase
      }
      // D = A - A0 (exact: fixed point), split into its part along A0 and the rest:
      // k_hat_r . A = beta b_r + k_hat_r . Dp with b_r = k_hat_r . A0, beta = 1 + (D . e) /
      // |A0| (e = A0 / |A0|) and Dp = D - (D . e) e, so |k_hat_r . A - beta b_r| <= |Dp|
      // (+ the bounds): the drift of A along A0 (victims lie along it) widens nothing.
      double dd = 0.0, da = 0.0;  // |D|^2, D . A0
      for (std::size_t j = 0; j < d; ++j) {
        dx_[j] = static_cast<double>(a_dec_[j] - t.a0i[j]) * 0x1p-40;
        dd += dx_[j] * dx_[j];
        da += dx_[j] * t.a0[j];
      }
      double beta = 1.0, dp = std::sqrt(dd);
      if (t.a0norm > 1e-6) {
        const double alpha = da / t.a0norm, b = 1.0 + alpha / t.a0norm;
        if (b >= 0.25) {  // otherwise Cauchy-Schwarz on D alone (beta 1)
          double pp = 0.0;
          for (std::size_t j = 0; j < d; ++j) {
            const double x = dx_[j] - alpha * (t.a0[j] / t.a0norm);
            pp += x * x;
          }
          beta = b;
          dp = std::sqrt(pp) + 1e-9 * std::sqrt(dd);  // + the rounding of e, alpha and Dp
        }
      }
      // |k_hat_r . A_true - beta base_r| <= mb (A_true: the exact anchor, within dq of A).
      const double mb = 1.01 * (dp * (1.0 + 1e-9) + dq) + 1.01 * beta * eb + 1e-12 * N;
      // The best open base; its exact score S (within es of k_hat . A_true, the exhaustive
      // search's within et) bounds the exhaustive victim's score from below, so a row with
      // beta base_r + mb + et < S - es - et cannot be it.
      // (base_ holds the negated bases: the best open base is the lowest open entry.)
      const std::size_t bi0 = kernels::lowest_open(base.data(), v.seqs, n, lo, hi);
      if (bi0 == kernels::npos) {  // no open row: it throws
        exhaustive_victims(v, t, a_dec_.data(), out);
        return;
      }
      for (std::size_t j = 0; j < d; ++j) anchor_now_[j] = static_cast<double>(a_dec_[j]) * 0x1p-40;
      const double s_best = dot8<double>(v.key(bi0).data(), anchor_now_.data(), d) * inv[bi0];
      const double floor = (s_best - (mb + es + 2.0 * et) * 1.001) / beta - 1e-12 * (N + 1.0);
      // The open rows with base >= floor, i.e. negated base <= -floor (rounded up to float).
      float cut = static_cast<float>(-floor);
      if (static_cast<double>(cut) < -floor) cut = std::nextafter(cut, std::numeric_limits<float>::infinity());
      cand_.resize(n);
      cand_.resize(kernels::gather_open_at_most(base.data(), v.seqs, n, lo, hi, cut, cand_.data()));
      if (pass == 0 && (cand_.size() > limit || t.work + 4 * cand_.size() > t.budget)) {
        partial_rebase(v, t, inv, base, std::sqrt(dd), N,
                       s_best - kNear * (s_best - beta * floor));
        limit = n;
        continue;
      }
      t.work += 4 * cand_.size();
      // Exact similarities of the candidates against this decision's anchor.
      cand_score_.resize(cand_.size());
      std::size_t bi = 0;
      for (std::size_t i = 0; i < cand_.size(); ++i) {
        const std::uint32_t r = cand_[i];
        cand_score_[i] = dot8<double>(v.key(r).data(), anchor_now_.data(), d) * inv[r];
        if (cand_score_[i] > cand_score_[bi]) bi = i;
      }
      // Taken when every candidate with another key is beaten by the rounding bounds of
      // both searches; rows with the very same key (bit for bit) score the same in the
      // exhaustive search too, and its tie rule takes the oldest of them.
      std::size_t b = cand_[bi];
      const auto kb = v.key(b);
      const double gap = 2.0 * (es + et) * 1.001;
      bool clear = true;
      for (std::size_t i = 0; i < cand_.size() && clear; ++i) {
        if (i == bi) continue;
        const std::uint32_t r = cand_[i];
        if (cand_score_[bi] - cand_score_[i] > gap) continue;
        const auto kr = v.key(r);
        if (std::equal(kb.begin(), kb.end(), kr.begin(), [](const S& x, const S& y) {
              return std::memcmp(&x, &y, sizeof(S)) == 0;
            })) {
          if (v.seqs[r] < v.seqs[b]) b = r;
        } else {
          clear = false;
        }
      }
      if (!clear) {  // too close to call: exhaustive
        exhaustive_victims(v, t, a_dec_.data(), out);
        subtract_victims(v, t, inv, out, first);
        return;
      }
      ++counts_.bounded;
      out.push_back(static_cast<std::uint32_t>(b));
      subtract_victims(v, t, inv, out, first);
      return;
    }
  }
  // Partial rebase at this decision's anchor A (a_dec_), previous anchor A0 (|A - A0| =
  // dnorm): every stored base is an upper bound of k_hat_r . A0 (to within eb), so base_r +
  // |A - A0| is one of k_hat_r . A (Cauchy-Schwarz). The rows whose shifted bound reaches
  // `keep` (a score) are scored against A afresh; the others keep the shifted bound. Every
  // base stays an upper bound of its row's similarity to the new anchor: the search above
  // uses them as such only (the lower bound is an exact score). More than half the rows
  // to rescore: a full rebase instead.
  template <class S>
  void partial_rebase(const HeadView<S>& v, Track& t, const std::vector<double>& inv,
                      std::vector<float>& base, double dnorm, double N, double keep) {
    const std::size_t n = v.size;
    // The shift, rounded up with room for the float subtraction's rounding (at most
    // 2^-24 (N + shift)).
    const double shift = 1.01 * dnorm * (1.0 + 1e-9) + 0x1p-22 * (N + dnorm + 1.0);
    // Negated: rows with -base_r - shift... i.e. base_r (negated) <= shift - keep.
    const double c = shift - keep;
    float cut = static_cast<float>(c);
    if (static_cast<double>(cut) < c) cut = std::nextafter(cut, std::numeric_limits<float>::infinity());
    near_.resize(n);
    near_.resize(kernels::gather_open_at_most(base.data(), v.seqs, n, 0,
                                              std::numeric_limits<std::uint64_t>::max(), cut,
                                              near_.data()));
    if (near_.size() > n / 2 || !std::is_same_v<S, float>) {
      t.based = false;  // the full rebase (pass 1)
      return;
    }
    ++counts_.partial;
    float fs = static_cast<float>(shift);
    if (static_cast<double>(fs) < shift) fs = std::nextafter(fs, std::numeric_limits<float>::infinity());
    for (std::size_t r = 0; r < n; ++r) base[r] -= fs;
    set_anchor(t, a_dec_.data());
    if constexpr (std::is_same_v<S, float>)
      kernels::scaled_row_dots_at(v.keys, d_, near_.data(), near_.size(), t.a0f.data(),
                                  inv.data(), -1.0f, base.data());
    t.n0 = std::max(t.n0, n);
    t.budget = kPartBudget * near_.size() + n / 8 + 16;
  }

  template <class S>
  void subtract_victims(const HeadView<S>& v, Track& t, const std::vector<double>& inv,
                        const std::vector<std::uint32_t>& out, std::size_t first) {
    for (std::size_t i = first; i < out.size(); ++i) {
      const std::uint32_t r = out[i];
      accumulate(t.live.data(), v.key(r).data(), inv[r], -1);
      --t.count;
      const std::uint64_t seq = v.seqs[r], lo = seq & 0xffffffffu;
      t.sum -= seq;
      t.sq -= lo * lo;
    }
  }

  template <class S>
  static double inverse_norm(std::span<const S> key) {
    double s = 0.0;
    for (const S& x : key) s += static_cast<double>(x) * static_cast<double>(x);
    return s > 0.0 ? 1.0 / std::sqrt(s) : 0.0;
  }

  Config config_{};
  std::size_t d_ = 0, hkv_ = 1;
  detail::RowColumn<double> inv_norms_;
  // rescore_every > 1: per row, its score as of the last rescoring or its arrival; per
  // (layer, KV head), decisions so far, whether an anchor is frozen, and the anchor.
  detail::RowColumn<float> stale_;
  std::vector<std::uint64_t> decisions_, bits_;
  std::vector<unsigned char> frozen_;
  std::vector<double> frozen_anchor_;
  std::vector<double> anchor_, score_;
  // Bounded candidate search: per row its base; per (layer, KV head) the tracked anchor.
  detail::RowColumn<float> base_;
  std::vector<Track> track_;
  std::vector<std::int64_t> a_dec_;
  std::vector<double> anchor_now_, dx_;
  std::vector<std::uint32_t> cand_, near_;
  std::vector<double> cand_score_;
  SearchCounts counts_{};
};

}  // namespace kvevict::policies
