#pragma once
// BlockGranular<Policy>: block-granular eviction for any policy, through the one container
// core (KVCache, IndexCache, PagedCache run it unchanged). Tokens are grouped into blocks
// of `block_tokens` consecutive arrivals (block = arrival index / block_tokens: a paged
// engine's block of a table that only ever drops whole blocks). When the head needs room,
// every row of one block leaves at once: the unprotected block with the lowest aggregate
// (sum, mean or max) of the wrapped policy's own per-token costs; ties go to the oldest.
//
// Per-token costs, lower = evicted first (`BlockSource`):
//   costs  the policy's eviction_costs (H2O, DecayedAttention: the accumulated or decayed
//          attention each row drew; ExpectedAttention: the attention the coming queries are
//          expected to pay it; +inf / FLT_MAX where the policy protects a row: its
//          sinks, recent band, recall reserve)
//   votes  any policy: its choose_victims asked for block_tokens victims; those rows cost 0,
//          the others 1 (StreamingLLM: the oldest block; KeyDiff, ExpectedAttention (with
//          source = votes), HashEvict, KNorm: the block holding most of the rows the policy would drop next)
//   automatic (default): costs when the policy has eviction_costs, else votes.
// A block containing a row the policy will not evict now (cost +inf: its sinks, its recent
// band) is never chosen; a row it evicts last (FLT_MAX: DecayedAttention's recall reserve)
// counts as just above the head's highest open cost. The first `sink_blocks` blocks and the
// `recent_blocks` newest held blocks are never chosen. Whole blocks leave even when
// fewer rows are needed, so a head holds between capacity - block_tokens + 1 and capacity
// rows, as a block table of capacity / block_tokens blocks. When no unprotected block can
// supply the rows needed (a budget shrink below the protected blocks, rows of a prompt
// selection, every evictable block holding a row the policy will not evict now), the
// wrapped policy's own per-token choice is used and counted in fallbacks().
//
// Shared decisions (`shared = true`): one keep/evict decision per token for all KV heads of
// a layer, as llama.cpp's cells need. ContainerCore asks every head of the layer for its
// token costs (token_costs), combines them per token over the KV heads (`HeadCombine`:
// sum, max or mean of the raw costs, or of each head's rank- or mass-normalised costs) and
// applies the victims chosen from the combined costs (victims_from_costs)
// to every head. Heads then always hold the same tokens in the same row order. The
// wrapped policy's prompt selection (prefill_keep) is not used: prompts go token by token.
// block_tokens = 1 with shared = false chooses, per head, the lowest-cost row.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "../errors.hpp"
#include "../paged.hpp"
#include "../policy.hpp"

namespace kvevict::policies {

/// Where BlockGranular's per-token costs come from.
enum class BlockSource : std::uint8_t { automatic, costs, votes };
/// How shared decisions combine one token's costs over the KV heads of a layer.
///   sum, max, mean  the raw costs (heads whose costs run larger weigh more)
///   rank_sum        each head's open costs replaced by their rank among that head's open
///                   rows, scaled to [0, 1] (0: the head's cheapest), then summed: every
///                   head weighs the same whatever the scale of its costs
///   rank_max        the largest scaled rank over the heads: a token is cheap only when it
///                   is cheap in every head (each head's most valued tokens survive)
///   mass_sum        each head's open costs divided by their sum over the head's open rows,
///                   then summed (heads equalised by their total, not their order)
///   quota           rank_sum, but a token among the top ceil(open / heads) of any head
///                   (its quota of the shared cells) ranks above every token in none
/// The normalised modes (rank_sum .. quota) count a row one head keeps last (FLT_MAX:
/// DecayedAttention's recall reserve) as that head's highest open cost instead of keeping
/// it in every head; a row a head will not evict now (+inf) stays protected in all modes.
enum class HeadCombine : std::uint8_t { sum, max, mean, rank_sum, rank_max, mass_sum, quota };

inline const char* to_string(HeadCombine c) {
  switch (c) {
    case HeadCombine::sum: return "sum";
    case HeadCombine::max: return "max";
    case HeadCombine::mean: return "mean";
    case HeadCombine::rank_sum: return "rank sum";
    case HeadCombine::rank_max: return "rank max";
    case HeadCombine::mass_sum: return "mass sum";
    case HeadCombine::quota: return "quota";
  }
  return "?";
}

struct BlockGranularConfig {
  std::uint32_t block_tokens = 16;  ///< a power of two, 1..256
  std::uint32_t sink_blocks = 1;    ///< the first blocks, never evicted
  std::uint32_t recent_blocks = 1;  ///< the newest held blocks, never evicted
  BlockScore score = BlockScore::sum;
  BlockSource source = BlockSource::automatic;
  bool shared = false;  ///< one decision per token for all KV heads of a layer
  HeadCombine combine = HeadCombine::sum;
};

template <class Policy>
class BlockGranular {
 public:
  using Config = BlockGranularConfig;
  BlockGranular() = default;
  explicit BlockGranular(Policy inner, Config c = {}) : inner_(std::move(inner)), config_(c) {}

  static constexpr Signals signals = static_cast<Signals>(
      static_cast<unsigned>(Policy::signals) & ~static_cast<unsigned>(Signals::prefill_window));
  static constexpr bool reads_stored_rows = kvevict::detail::reads_stored_rows<Policy>();
  static constexpr const char* name() { return "BlockGranular"; }
  static constexpr bool kHasCosts = kvevict::detail::HasEvictionCosts<Policy, float>;

  [[nodiscard]] const Config& config() const { return config_; }
  [[nodiscard]] Policy& inner() { return inner_; }
  [[nodiscard]] const Policy& inner() const { return inner_; }
  /// The wrapped policy's minimum, and room for the protected blocks plus one evictable.
  [[nodiscard]] std::size_t min_capacity() const {
    const std::size_t blocks = std::size_t{config_.sink_blocks} + config_.recent_blocks + 1;
    return std::max<std::size_t>(inner_.min_capacity(), blocks * config_.block_tokens);
  }
  void bind(const CacheShape& shape) {
    const std::uint32_t b = config_.block_tokens;
    kvevict::detail::require(b >= 1 && b <= 256 && (b & (b - 1)) == 0, "BlockGranular: block_tokens = ", b,
                    ", expected a power of two in [1, 256]");
    kvevict::detail::require(config_.source != BlockSource::costs || kHasCosts,
                    "BlockGranular: source = costs, expected a policy with eviction_costs "
                    "(H2O, DecayedAttention, ExpectedAttention); use votes");
    inner_.bind(shape);
  }
  [[nodiscard]] bool shared_decisions() const { return config_.shared; }
  /// Decisions that fell back to the wrapped policy's per-token choice (no whole block
  /// could go): those steps were not block-granular.
  [[nodiscard]] std::uint64_t fallbacks() const { return fallbacks_; }

  template <class A>
    requires kvevict::detail::HasObserve<Policy>
  void observe(const A& view) {
    inner_.observe(view);
  }
  template <class S>
  void on_append(const HeadView<S>& v, std::size_t row) {
    inner_.on_append(v, row);
  }
  void on_move(int layer, int kv_head, std::size_t from, std::size_t to) {
    inner_.on_move(layer, kv_head, from, to);
  }

  template <class S>
  void choose_victims(const HeadView<S>& v, std::vector<std::uint32_t>& out) {
    token_costs(v, costs_);
    victims_from_costs(v, costs_, out);
  }

  /// One cost per live row of the view (lower = evicted first; +inf or FLT_MAX: the
  /// wrapped policy protects the row).
  template <class S>
  void token_costs(const HeadView<S>& v, std::vector<float>& out) {
    if constexpr (kHasCosts) {
      if (config_.source != BlockSource::votes) {
        inner_.eviction_costs(v, out);
        return;
      }
    }
    HeadView<S> ask = v;
    ask.need = std::max<std::size_t>(v.need, std::min<std::size_t>(config_.block_tokens, v.size / 2));
    votes_.clear();
    inner_.choose_victims(ask, votes_);
    out.assign(v.size, 1.0f);
    for (std::uint32_t r : votes_)
      if (r < v.size) out[r] = 0.0f;
  }
  /// Combines the KV heads' token costs (rows aligned: shared decisions keep every head's
  /// rows in the same order) into one cost per row.
  /// A row one head will not evict now (+inf) stays +inf; else a row some head keeps last
  /// (FLT_MAX) stays FLT_MAX; else the open costs combine (HeadCombine: raw, or each head's
  /// open costs normalised first).
  void combine_costs(std::span<const std::vector<float>> heads, std::vector<float>& out) const {
    constexpr float kLast = std::numeric_limits<float>::max();
    const std::size_t n = heads.empty() ? 0 : heads[0].size();
    const HeadCombine mode = config_.combine;
    const bool normalised = mode != HeadCombine::sum && mode != HeadCombine::max && mode != HeadCombine::mean;
    if (normalised) normalise_heads(heads, mode);
    out.assign(n, 0.0f);
    for (std::size_t r = 0; r < n; ++r) {
      float acc = 0.0f;
      bool inf = false, last = false, quota = false;
      for (std::size_t h = 0; h < heads.size(); ++h) {
        const float c = heads[h][r];
        // Normalised modes rank a row the head keeps last (FLT_MAX) as its highest, so one
        // head's reserve does not pin the row in every head's cells.
        if (!(c < kLast) && !(normalised && c == kLast)) {
          inf |= !(c == kLast);
          last = true;
          continue;
        }
        const float x = normalised ? norm_[h][r] : c;
        if (mode == HeadCombine::quota) quota |= x >= quota_cut_[h];
        acc = mode == HeadCombine::max || mode == HeadCombine::rank_max ? std::max(acc, x) : acc + x;
      }
      if (mode == HeadCombine::mean) acc /= static_cast<float>(heads.size());
      if (quota) acc += static_cast<float>(heads.size());  // above every sum of ranks <= 1
      out[r] = inf ? std::numeric_limits<float>::infinity() : last ? kLast : std::min(acc, std::nextafter(kLast, 0.0f));
    }
  }
  /// The rows of the chosen block(s): at least v.need of them (see the header).
  template <class S>
  void victims_from_costs(const HeadView<S>& v, std::span<const float> costs,
                          std::vector<std::uint32_t>& out) {
    out.clear();
    const std::uint64_t B = config_.block_tokens;
    if (v.size == 0) return;
    std::uint64_t lo = std::numeric_limits<std::uint64_t>::max(), hi = 0;
    for (std::size_t r = 0; r < v.size; ++r) {
      lo = std::min(lo, v.seqs[r] / B);
      hi = std::max(hi, v.seqs[r] / B);
    }
    const std::size_t span = static_cast<std::size_t>(hi - lo + 1);
    acc_.assign(span, Acc{});
    // Rows the policy keeps last (FLT_MAX: DecayedAttention's recall reserve) count as just
    // above the head's highest open cost; a row it will not evict now (+inf: sinks, recent band)
    // protects its block.
    float top = 0.0f;
    for (std::size_t r = 0; r < v.size; ++r)
      if (costs[r] < std::numeric_limits<float>::max()) top = std::max(top, costs[r]);
    for (std::size_t r = 0; r < v.size; ++r) {
      Acc& a = acc_[static_cast<std::size_t>(v.seqs[r] / B - lo)];
      float c = costs[r];
      ++a.present;
      if (std::isinf(c) || std::isnan(c)) {
        ++a.guarded;
        continue;
      }
      if (c >= std::numeric_limits<float>::max()) c = std::nextafter(top, std::numeric_limits<float>::max());
      if (config_.score == BlockScore::max) a.agg = a.present == 1 + a.guarded ? c : std::max(a.agg, c);
      else a.agg += c;
    }
    order_.clear();
    for (std::size_t i = 0; i < span; ++i) {
      const std::uint64_t b = lo + i;
      if (acc_[i].present == 0 || acc_[i].guarded > 0 || b < config_.sink_blocks ||
          b + config_.recent_blocks > hi)
        continue;
      const std::uint32_t finite = acc_[i].present - acc_[i].guarded;
      if (config_.score == BlockScore::mean && finite > 0) acc_[i].agg /= static_cast<float>(finite);
      order_.push_back(static_cast<std::uint32_t>(i));
    }
    std::stable_sort(order_.begin(), order_.end(),
                     [&](std::uint32_t a, std::uint32_t b) { return acc_[a].agg < acc_[b].agg; });
    std::size_t take = 0, rows = 0;
    while (take < order_.size() && rows < std::max<std::size_t>(v.need, 1)) rows += acc_[order_[take++]].present;
    if (rows < v.need) {  // the protected blocks hold too much: the policy's own choice
      ++fallbacks_;
      // After eviction_costs (a policy whose costs call is its decision's step, as
      // ExpectedAttention's is), the choice from those costs' pass, not a second step.
      if constexpr (kHasCosts && kvevict::detail::HasPooledVictims<Policy, S>)
        if (config_.source != BlockSource::votes) {
          inner_.pooled_victims(v, out);
          return;
        }
      inner_.choose_victims(v, out);
      return;
    }
    chosen_.assign(span, 0);
    for (std::size_t j = 0; j < take; ++j) chosen_[order_[j]] = 1;
    for (std::size_t r = 0; r < v.size; ++r)
      if (chosen_[static_cast<std::size_t>(v.seqs[r] / B - lo)]) out.push_back(static_cast<std::uint32_t>(r));
  }

 private:
  // norm_[h][r]: head h's open cost of row r normalised (rank in [0, 1], or share of the
  // head's open total); quota_cut_[h]: the smallest normalised rank inside head h's quota.
  void normalise_heads(std::span<const std::vector<float>> heads, HeadCombine mode) const {
    constexpr float kLast = std::numeric_limits<float>::max();
    norm_.resize(heads.size());
    quota_cut_.assign(heads.size(), 2.0f);
    for (std::size_t h = 0; h < heads.size(); ++h) {
      const auto& c = heads[h];
      auto& x = norm_[h];
      x.assign(c.size(), 0.0f);
      rank_order_.clear();
      double total = 0.0;
      for (std::size_t r = 0; r < c.size(); ++r)
        if (c[r] <= kLast) {  // open, or kept last (ranked highest; mass: the head's top open cost)
          rank_order_.push_back(static_cast<std::uint32_t>(r));
          if (c[r] < kLast) total += c[r];
        }
      const std::size_t open = rank_order_.size();
      if (open == 0) continue;
      if (mode == HeadCombine::mass_sum) {
        float top = 0.0f;
        for (std::uint32_t r : rank_order_)
          if (c[r] < kLast) top = std::max(top, c[r]);
        for (std::uint32_t r : rank_order_)
          x[r] = total > 0.0 ? static_cast<float>(std::min(c[r], top) / total) : 0.0f;
        continue;
      }
      // Rank among the head's open rows (equal costs share the lower rank), scaled to [0, 1].
      std::stable_sort(rank_order_.begin(), rank_order_.end(),
                       [&](std::uint32_t a, std::uint32_t b) { return c[a] < c[b]; });
      const float scale = open > 1 ? 1.0f / static_cast<float>(open - 1) : 0.0f;
      std::size_t rank = 0;
      for (std::size_t i = 0; i < open; ++i) {
        if (i > 0 && c[rank_order_[i]] != c[rank_order_[i - 1]]) rank = i;
        x[rank_order_[i]] = static_cast<float>(rank) * scale;
      }
      if (mode == HeadCombine::quota) {
        const std::size_t q = (open + heads.size() - 1) / heads.size();  // the head's top q rows
        quota_cut_[h] = x[rank_order_[open - q]];
      }
    }
  }
  struct Acc {
    float agg = 0.0f;
    std::uint32_t present = 0;
    std::uint32_t guarded = 0;
  };
  Policy inner_;
  Config config_;
  std::vector<float> costs_;
  std::vector<std::uint32_t> votes_, order_;
  std::vector<Acc> acc_;
  std::vector<std::uint8_t> chosen_;
  mutable std::vector<std::vector<float>> norm_;  // combine_costs scratch (const: the core's hook)
  mutable std::vector<float> quota_cut_;
  mutable std::vector<std::uint32_t> rank_order_;
  std::uint64_t fallbacks_ = 0;
};

}  // namespace kvevict::policies
