#pragma once
// XKV: personalised per-layer KV-cache budgets (Li, Wang, Gu, Yu, arXiv 2412.05896;
// reference code github.com/CN-LWZ/XKV). NOT "xKV" (abdelfattah-lab), the cross-layer
// SVD compression method: this one only decides how many tokens each layer keeps.
//
// Per layer l, the observation-window importance of every prompt token (observation.hpp)
// gives the retention ratio R_l(n) = sum over KV heads of the head's top-n pooled scores,
// divided by the layer's pooled mass. The allocator hands out tokens one at a time to
// the layer with the largest next gain (a heap): with a total N it maximises the mean R
// (budget mode); with a target mean R it finds the smallest total reaching it (target
// mode). Each layer's gains are non-increasing, so greedy is exactly optimal in both
// modes (tests check it against a dynamic programme). Selection inside a layer is
// SnapKV's (snapkv.hpp) with XKV's window 8 and pooling kernel 7.
//
// Also here: PyramidKV and uniform budgets at the same total (baselines), calibration
// profiles (average allocations over sample prompts, save, load, reuse with no
// allocation pass per request), and the two prefill paths (deferred, calibrated) with
// their peak memory.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iterator>
#include <memory>
#include <optional>
#include <queue>
#include <sstream>
#include <string>
#include <vector>

#include "../cache.hpp"
#include "../config.hpp"
#include "observation.hpp"
#include "snapkv.hpp"
#if !KVEVICT_KERNELS_DECLARE_ONLY
#include <fstream>

#include "../file.hpp"
#endif

namespace kvevict::policies {

/// Tokens per layer (per KV head, observation window excluded) and the mean R they reach.
struct Allocation {
  std::vector<long long> tokens;
  double mean_retention = 0.0;  ///< recomputed directly from the statistics
  [[nodiscard]] long long total() const {
    long long s = 0;
    for (long long t : tokens) s += t;
    return s;
  }
};

/// A per-layer selection size turned into cache capacities: each layer holds its n_l
/// selected tokens, the W-token window and the decode reserve.
KVEVICT_DEFER inline Budget selection_budget(const std::vector<long long>& tokens, std::size_t window,
                               std::size_t decode_reserve = 0) {
  std::vector<long long> caps(tokens.size());
  for (std::size_t l = 0; l < tokens.size(); ++l) {
    kvevict::detail::require(tokens[l] > 0, "selection_budget: layer ", l, " has ", tokens[l],
                             " tokens, expected > 0");
    caps[l] = tokens[l] + static_cast<long long>(window + decode_reserve);
  }
  return Budget::per_layer(caps);
}

class XkvLayerAllocator {
 public:
  struct Config {
    std::size_t window = 8;  ///< XKV's observation window (ows)
    std::size_t kernel = 7;  ///< XKV's pooling size
    Pooling pooling = Pooling::avg;
    /// Floor per layer. The reference allocates zero to some layers and then crashes;
    /// here every layer keeps at least this many selected tokens besides its window.
    long long min_tokens = 1;
    /// Reference-exact allocation (off by default), as the reference's wait list does it:
    /// no floor (min_tokens is ignored, a layer may get 0); with GQA the statistics are
    /// per query head after repeating K/V (observe_layer; set_layer_scores then takes
    /// n_heads vectors), not per KV head with the group summed; budget mode hands out all
    /// N tokens even when every candidate is taken (an exhausted layer's gain is 0, ties go
    /// to the lowest layer, so the overflow lands on layer 0); target mode sums the gains
    /// from 0 until the mean reaches the target and throws kvevict::Error where the
    /// reference would loop forever (target out of reach). Gains are computed in double
    /// (the reference: float32), and a layer with zero mass has gain 0 (the reference: NaN).
    bool reference = false;
  };

  KVEVICT_DEFER explicit XkvLayerAllocator(const Geometry& g) : XkvLayerAllocator(g, Config{}) {}
  KVEVICT_DEFER XkvLayerAllocator(const Geometry& g, Config c) : geometry_(g), config_(c) {
    geometry_.validate();
    observation().validate("XkvLayerAllocator");
    kvevict::detail::require(config_.reference || config_.min_tokens > 0,
                             "XkvLayerAllocator: min_tokens = ", config_.min_tokens,
                             ", expected > 0 (a layer never gets zero)");
    layers_.resize(static_cast<std::size_t>(g.n_layers));
  }

  [[nodiscard]] const Config& config() const { return config_; }
  [[nodiscard]] const Geometry& geometry() const { return geometry_; }
  [[nodiscard]] ObservationConfig observation() const {
    return {config_.window, config_.kernel, config_.pooling};
  }
  /// The SnapKV selection XKV uses inside each layer.
  [[nodiscard]] SnapKV::Config selection(std::size_t decode_reserve = 0) const {
    return {config_.window, config_.kernel, config_.pooling, decode_reserve};
  }

  /// Records layer statistics from its prefill: keys T x n_kv_heads x d, queries
  /// T x n_heads x d (only the last W rows are read). Costs W x T x H dot products.
  KVEVICT_DEFER void observe_layer(int layer, std::size_t tokens, std::span<const float> keys,
                     std::span<const float> queries) {
    check_layer(layer, "observe_layer");
    const auto d = static_cast<std::size_t>(geometry_.head_dim);
    kvevict::detail::require(
        keys.size() == tokens * static_cast<std::size_t>(geometry_.n_kv_heads) * d,
        "observe_layer: keys has ", keys.size(), " floats, expected ",
        tokens * static_cast<std::size_t>(geometry_.n_kv_heads) * d,
        " (tokens x n_kv_heads x head_dim)");
    kvevict::detail::require(
        queries.size() == tokens * static_cast<std::size_t>(geometry_.n_heads) * d,
        "observe_layer: queries has ", queries.size(), " floats, expected ",
        tokens * static_cast<std::size_t>(geometry_.n_heads) * d, " (tokens x n_heads x head_dim)");
    if (config_.reference) {
      observe_layer_repeated(layer, tokens, keys, queries);
      return;
    }
    std::vector<std::vector<float>> pooled(static_cast<std::size_t>(geometry_.n_kv_heads));
    for (int kh = 0; kh < geometry_.n_kv_heads; ++kh) {
      PrefillView v{layer,
                    kh,
                    geometry_.head_dim,
                    geometry_.group(),
                    geometry_.n_kv_heads,
                    geometry_.n_heads,
                    tokens,
                    Budget::kUnbounded,
                    0,
                    0,
                    keys.data(),
                    queries.data()};
      observation_scores(v, observation(), pooled[static_cast<std::size_t>(kh)]);
    }
    set_layer_scores(layer, pooled);
  }

  /// Records a layer's pooled scores directly, one vector per KV head (same length,
  /// finite, >= 0): for engines that compute the window attention themselves. With
  /// Config::reference, one vector per query head (n_heads), as the reference ranks them.
  KVEVICT_LAZY void set_layer_scores(int layer, const std::vector<std::vector<float>>& pooled);

  KVEVICT_DEFER [[nodiscard]] bool ready() const {
    return std::all_of(layers_.begin(), layers_.end(), [](const auto& s) { return s.observed; });
  }
  /// Prompt tokens a layer can select from (T - W), once observed.
  [[nodiscard]] long long candidates(int layer) const {
    return static_cast<long long>(observed(layer).prefix.size()) - 1;
  }

  /// R_l(n): the share of layer l's pooled mass that its top-n tokens per head keep.
  /// A layer with nothing to select (prompt no longer than the window) keeps it all: 1.
  [[nodiscard]] double retention(int layer, long long n) const {
    const auto& s = observed(layer);
    const double total = s.prefix.back();
    if (total <= 0.0) return 1.0;
    const auto k = static_cast<std::size_t>(std::clamp<long long>(n, 0, candidates(layer)));
    return s.prefix[k] / total;
  }
  [[nodiscard]] double mean_retention(const std::vector<long long>& tokens) const {
    kvevict::detail::require(tokens.size() == layers_.size(), "mean_retention: ", tokens.size(),
                             " layers, expected ", layers_.size());
    double r = 0.0;
    for (std::size_t l = 0; l < tokens.size(); ++l) r += retention(static_cast<int>(l), tokens[l]);
    return r / static_cast<double>(tokens.size());
  }

  /// Budget mode: `total` selected tokens (per KV head, windows excluded) over all
  /// layers, maximising the mean R. Stops early only when every candidate is taken.
  KVEVICT_DEFER [[nodiscard]] Allocation allocate(long long total) const {
    if (config_.reference) {
      kvevict::detail::require(total >= 0, "XkvLayerAllocator::allocate: total = ", total,
                               " tokens, expected >= 0");
      return run_reference(total, std::nullopt);
    }
    const long long floor_total = config_.min_tokens * static_cast<long long>(layers_.size());
    kvevict::detail::require(total >= floor_total, "XkvLayerAllocator::allocate: total = ", total,
                             " tokens, expected >= ", floor_total, " (", layers_.size(),
                             " layers x min_tokens ", config_.min_tokens, ")");
    return run(total - floor_total, std::nullopt);
  }

  /// Target mode: the smallest allocation whose mean R reaches `target` (or all
  /// candidates, if the target is out of reach).
  KVEVICT_DEFER [[nodiscard]] Allocation allocate_for_retention(double target) const {
    kvevict::detail::require(std::isfinite(target) && target > 0.0 && target <= 1.0,
                             "XkvLayerAllocator::allocate_for_retention: target = ", target,
                             ", expected in (0, 1]");
    return config_.reference ? run_reference(-1, target) : run(-1, target);
  }

 private:
  struct LayerStats {
    std::vector<double> prefix{0.0};  ///< prefix[k] = sum of the k largest layer gains
    std::vector<double> gains;        ///< gains[k]: sum over heads of the (k+1)-th largest
    bool observed = false;
  };
  struct Candidate {
    double gain;
    int layer;
    // max-heap on gain; ties go to the lowest layer, as in the reference
    bool operator<(const Candidate& o) const {
      return gain < o.gain || (gain == o.gain && layer > o.layer);
    }
  };

  void check_layer(int layer, const char* what) const {
    kvevict::detail::require(layer >= 0 && layer < geometry_.n_layers, what, ": layer = ", layer,
                             ", expected 0 <= layer < ", geometry_.n_layers);
  }
  const LayerStats& observed(int layer) const {
    check_layer(layer, "XkvLayerAllocator");
    const auto& s = layers_[static_cast<std::size_t>(layer)];
    kvevict::detail::require(s.observed, "XkvLayerAllocator: layer ", layer,
                             " has no statistics yet, expected observe_layer or "
                             "set_layer_scores first");
    return s;
  }
  double gain(int layer, long long n) const {  // normalised gain of token n + 1
    const auto& s = layers_[static_cast<std::size_t>(layer)];
    const auto k = static_cast<std::size_t>(n);
    return (s.prefix[k + 1] - s.prefix[k]) / s.prefix.back();
  }

  KVEVICT_LAZY Allocation run(long long extra, std::optional<double> target) const;

  // Reference mode: K/V repeated to every query head, so each query head is ranked on its
  // own pooled scores (the G-fold copy lives only for this call).
  KVEVICT_DEFER void observe_layer_repeated(int layer, std::size_t tokens, std::span<const float> keys,
                              std::span<const float> queries) {
    const auto d = static_cast<std::size_t>(geometry_.head_dim);
    const auto H = static_cast<std::size_t>(geometry_.n_heads);
    const auto Hkv = static_cast<std::size_t>(geometry_.n_kv_heads);
    const auto G = static_cast<std::size_t>(geometry_.group());
    std::vector<float> repeated(tokens * H * d);
    for (std::size_t t = 0; t < tokens; ++t)
      for (std::size_t h = 0; h < H; ++h)
        std::copy_n(keys.data() + (t * Hkv + h / G) * d, d, repeated.data() + (t * H + h) * d);
    std::vector<std::vector<float>> pooled(H);
    for (std::size_t h = 0; h < H; ++h) {
      PrefillView v{layer,
                    static_cast<int>(h),
                    geometry_.head_dim,
                    1,
                    geometry_.n_heads,
                    geometry_.n_heads,
                    tokens,
                    Budget::kUnbounded,
                    0,
                    0,
                    repeated.data(),
                    queries.data()};
      observation_scores(v, observation(), pooled[h]);
    }
    set_layer_scores(layer, pooled);
  }

  // The reference's wait list: every layer starts at 0 tokens, each step gives one token to
  // the first layer with the largest gain; a layer past its candidates has gain 0.
  KVEVICT_LAZY Allocation run_reference(long long total, std::optional<double> target) const;

  Geometry geometry_;
  Config config_;
  std::vector<LayerStats> layers_;
};

// XkvLayerAllocator's members whose bodies instantiate standard templates (the sorts, the
// heaps): KVEVICT_LAZY header-only, in kvevict_kernels in separate-kernels mode (config.hpp).
#if !KVEVICT_KERNELS_DECLARE_ONLY
KVEVICT_LAZY_DEF KVEVICT_KERNEL_FN void XkvLayerAllocator::set_layer_scores(
    int layer, const std::vector<std::vector<float>>& pooled) {
  check_layer(layer, "set_layer_scores");
  const int heads = config_.reference ? geometry_.n_heads : geometry_.n_kv_heads;
  kvevict::detail::require(pooled.size() == static_cast<std::size_t>(heads),
                           "set_layer_scores: ", pooled.size(), " heads, expected ", heads,
                           config_.reference ? " (n_heads: reference mode ranks query heads)"
                                             : " (n_kv_heads)");
  const std::size_t n = pooled[0].size();
  std::vector<double> gains(n, 0.0);
  std::vector<float> sorted;
  for (std::size_t h = 0; h < pooled.size(); ++h) {
    kvevict::detail::require(pooled[h].size() == n, "set_layer_scores: head ", h, " has ",
                             pooled[h].size(), " scores, expected ", n, " like head 0");
    for (std::size_t j = 0; j < n; ++j)
      kvevict::detail::require(std::isfinite(pooled[h][j]) && pooled[h][j] >= 0.0f,
                               "set_layer_scores: head ", h, " score ", j, " = ", pooled[h][j],
                               ", expected finite and >= 0");
    sorted = pooled[h];
    std::sort(sorted.begin(), sorted.end(), std::greater<>());
    for (std::size_t k = 0; k < n; ++k) gains[k] += sorted[k];
  }
  auto& s = layers_[static_cast<std::size_t>(layer)];
  s.gains = gains;
  s.prefix.assign(n + 1, 0.0);
  for (std::size_t k = 0; k < n; ++k) s.prefix[k + 1] = s.prefix[k] + gains[k];
  s.observed = true;
}

KVEVICT_LAZY_DEF KVEVICT_KERNEL_FN Allocation XkvLayerAllocator::run(long long extra,
                                                               std::optional<double> target) const {
  const int L = geometry_.n_layers;
  for (int l = 0; l < L; ++l) (void)observed(l);
  Allocation a;
  a.tokens.assign(static_cast<std::size_t>(L), config_.min_tokens);
  std::vector<Candidate> heap;
  heap.reserve(static_cast<std::size_t>(L));
  double rsum = 0.0;
  for (int l = 0; l < L; ++l) {
    rsum += retention(l, config_.min_tokens);
    if (layers_[static_cast<std::size_t>(l)].prefix.back() > 0.0 &&
        config_.min_tokens < candidates(l))
      heap.push_back({gain(l, config_.min_tokens), l});
  }
  std::make_heap(heap.begin(), heap.end());
  const double goal = target ? *target * L : 0.0;
  while (!heap.empty() && (target ? rsum < goal : extra > 0)) {
    std::pop_heap(heap.begin(), heap.end());
    Candidate c = heap.back();
    heap.pop_back();
    long long& n = a.tokens[static_cast<std::size_t>(c.layer)];
    ++n;
    --extra;
    rsum += c.gain;
    if (n < candidates(c.layer)) {
      heap.push_back({gain(c.layer, n), c.layer});
      std::push_heap(heap.begin(), heap.end());
    }
  }
  a.mean_retention = mean_retention(a.tokens);
  return a;
}

KVEVICT_LAZY_DEF KVEVICT_KERNEL_FN Allocation XkvLayerAllocator::run_reference(
    long long total, std::optional<double> target) const {
  const int L = geometry_.n_layers;
  for (int l = 0; l < L; ++l) (void)observed(l);
  auto gain_at = [&](int l, long long n) {
    const auto& s = layers_[static_cast<std::size_t>(l)];
    const double mass = s.prefix.back();
    if (mass <= 0.0 || n >= static_cast<long long>(s.gains.size())) return 0.0;
    return s.gains[static_cast<std::size_t>(n)] / mass;
  };
  Allocation a;
  a.tokens.assign(static_cast<std::size_t>(L), 0);
  std::vector<Candidate> heap;
  for (int l = 0; l < L; ++l) heap.push_back({gain_at(l, 0), l});
  std::make_heap(heap.begin(), heap.end());
  const double goal = target ? *target * L : 0.0;
  double rsum = 0.0;
  for (long long i = 0; target ? goal > rsum : i < total; ++i) {
    std::pop_heap(heap.begin(), heap.end());
    Candidate& c = heap.back();
    if (!target && c.gain <= 0.0) {
      // Every gain is 0: the reference hands each remaining token to the lowest layer,
      // layer 0, one at a time; add them at once.
      a.tokens[0] += total - i;
      break;
    }
    kvevict::detail::require(!target || c.gain > 0.0,
                             "XkvLayerAllocator::allocate_for_retention: target = ", *target,
                             " is out of reach (mean R ", rsum / L,
                             " with every candidate taken); the reference would not stop");
    rsum += c.gain;
    long long& n = a.tokens[static_cast<std::size_t>(c.layer)];
    ++n;
    c.gain = gain_at(c.layer, n);
    std::push_heap(heap.begin(), heap.end());
  }
  a.mean_retention = mean_retention(a.tokens);
  return a;
}
#endif  // !KVEVICT_KERNELS_DECLARE_ONLY

/// Same total, split evenly (remainder to the first layers): uniform SnapKV.
KVEVICT_DEFER inline std::vector<long long> uniform_budgets(int n_layers, long long total) {
  kvevict::detail::require(n_layers > 0, "uniform_budgets: n_layers = ", n_layers,
                           ", expected > 0");
  kvevict::detail::require(total >= n_layers, "uniform_budgets: total = ", total,
                           " tokens, expected >= ", n_layers, " (one per layer)");
  std::vector<long long> b(static_cast<std::size_t>(n_layers), total / n_layers);
  for (long long i = 0; i < total % n_layers; ++i) ++b[static_cast<std::size_t>(i)];
  return b;
}

/// PyramidKV (Cai/Zhang et al., arXiv 2406.02069) layer budgets, per KV head, window
/// excluded: a linear decay with depth from max = 2B - B/beta down to min = B/beta, B the
/// mean per layer, clipped at `candidates` (T - W) when known, with the reference code's
/// integer steps. Then the rounding residue is spread (shallow layers gain, deep layers
/// lose) so the sum is exactly `total`: comparisons run at equal memory.
KVEVICT_DEFER inline std::vector<long long> pyramid_budgets(int n_layers, long long total,
                                              long long candidates = 0, double beta = 20.0,
                                              long long min_tokens = 1) {
  kvevict::detail::require(n_layers > 0, "pyramid_budgets: n_layers = ", n_layers,
                           ", expected > 0");
  kvevict::detail::require(std::isfinite(beta) && beta >= 1.0, "pyramid_budgets: beta = ", beta,
                           ", expected >= 1");
  kvevict::detail::require(min_tokens > 0, "pyramid_budgets: min_tokens = ", min_tokens,
                           ", expected > 0");
  const long long L = n_layers;
  kvevict::detail::require(total >= L * min_tokens, "pyramid_budgets: total = ", total,
                           " tokens, expected >= ", L * min_tokens, " (", L,
                           " layers x min_tokens)");
  const long long B = total / L;
  long long min_num = static_cast<long long>(std::floor(static_cast<double>(B) / beta));
  long long max_num = 2 * B - min_num;
  if (candidates > 0 && max_num >= candidates) {
    max_num = candidates;
    min_num = 2 * B - max_num;
  }
  const long long steps = L > 1 ? (max_num - min_num) / (L - 1) : 0;
  std::vector<long long> b(static_cast<std::size_t>(L));
  for (long long l = 0; l < L; ++l)
    b[static_cast<std::size_t>(l)] = std::max(min_tokens, max_num - l * steps);
  const long long cap = candidates > 0 ? std::max(candidates, min_tokens) : total;
  long long diff = total;
  for (long long v : b) diff -= v;
  // Residue: add from the shallowest layers, remove from the deepest, keeping the shape.
  for (bool moved = true; diff != 0 && moved;) {
    moved = false;
    for (long long i = 0; i < L && diff != 0; ++i) {
      auto& v = b[static_cast<std::size_t>(diff > 0 ? i : L - 1 - i)];
      if (diff > 0 && v < cap) {
        ++v;
        --diff;
        moved = true;
      } else if (diff < 0 && v > min_tokens) {
        --v;
        ++diff;
        moved = true;
      }
    }
  }
  return b;
}

/// PyramidKV's own schedule, reference-exact (the reference code's PyramidKVCluster), as
/// an option next to pyramid_budgets: tokens each layer selects besides its window, for a
/// per-layer cache of `capacity` = C tokens (window included, as the reference's
/// max_capacity_prompt), window W, a prompt of T tokens and integer beta. Three branches:
///  - T < C: the prompt is kept whole (T - W selected tokens per layer, 0 if T <= W);
///  - C <= T < 2(C - W): uniform, every layer selects C - W (no pyramid at all);
///  - otherwise min = floor((C - W) / beta), max = 2(C - W) - min; if max >= T - W then
///    max = T - W and min = 2(C - W) - max; steps = floor((max - min) / (L - 1)); layer l
///    selects max - l * steps. The total may overshoot L (C - W) (integer steps).
/// Needs L >= 2 (the reference divides by L - 1) and C > W; a negative layer budget (the
/// reference's top-k would fail) throws kvevict::Error.
KVEVICT_DEFER inline std::vector<long long> pyramid_budgets_reference(int n_layers, long long capacity,
                                                        long long window, long long tokens,
                                                        long long beta = 20) {
  kvevict::detail::require(n_layers >= 2, "pyramid_budgets_reference: n_layers = ", n_layers,
                           ", expected >= 2 (the reference divides by n_layers - 1)");
  kvevict::detail::require(window >= 0 && capacity > window,
                           "pyramid_budgets_reference: capacity = ", capacity, ", window = ",
                           window, ", expected 0 <= window < capacity");
  kvevict::detail::require(tokens >= 0, "pyramid_budgets_reference: tokens = ", tokens,
                           ", expected >= 0");
  kvevict::detail::require(beta >= 1, "pyramid_budgets_reference: beta = ", beta,
                           ", expected >= 1");
  const auto L = static_cast<std::size_t>(n_layers);
  const long long B = capacity - window;
  if (tokens < capacity) return std::vector<long long>(L, std::max(tokens - window, 0LL));
  if (tokens < 2 * B) return std::vector<long long>(L, B);
  auto floor_div = [](long long a, long long b) {  // Python's //, b > 0
    return a / b - ((a % b != 0 && a < 0) ? 1 : 0);
  };
  long long min_num = B / beta;
  long long max_num = 2 * B - min_num;
  if (max_num >= tokens - window) {
    max_num = tokens - window;
    min_num = 2 * B - max_num;
  }
  const long long steps = floor_div(max_num - min_num, n_layers - 1);
  std::vector<long long> b(L);
  for (std::size_t l = 0; l < L; ++l) {
    b[l] = max_num - static_cast<long long>(l) * steps;
    kvevict::detail::require(b[l] >= 0, "pyramid_budgets_reference: layer ", l, " gets ", b[l],
                             " tokens (capacity ", capacity, ", window ", window, ", tokens ",
                             tokens, ", beta ", beta, "), expected >= 0");
  }
  return b;
}

// --- calibration profiles ------------------------------------------------------------

/// Per-layer selection sizes averaged over sample prompts, reused for later requests so
/// no allocation pass runs per request. Stored as a small versioned text file:
///   kvevict-xkv-profile 1
///   layers <L>
///   window <W>
///   samples <S>
///   tokens <n_0> ... <n_{L-1}>
///   end
/// Lines starting with '#' are comments.
struct Profile {
  static constexpr int kVersion = 1;
  static constexpr const char* kMagic = "kvevict-xkv-profile";
  std::size_t window = 8;
  std::size_t samples = 0;
  std::vector<long long> tokens;

  [[nodiscard]] int n_layers() const { return static_cast<int>(tokens.size()); }

  /// Checks the profile against a model: layer count and positive budgets.
  KVEVICT_DEFER void validate(const Geometry& g) const {
    kvevict::detail::require(static_cast<int>(tokens.size()) == g.n_layers,
                             "XKV profile: ", tokens.size(), " layers, expected ", g.n_layers,
                             " (the model's n_layers): profile is for another model");
    for (std::size_t l = 0; l < tokens.size(); ++l)
      kvevict::detail::require(tokens[l] > 0, "XKV profile: layer ", l, " budget = ", tokens[l],
                               ", expected > 0");
  }
  KVEVICT_DEFER [[nodiscard]] Budget budget(std::size_t decode_reserve = 0) const {
    return selection_budget(tokens, window, decode_reserve);
  }

  KVEVICT_DEFER [[nodiscard]] std::string to_text() const {
    // Formatted part by part as kvevict::Error messages are (errors.hpp).
    std::string out = kvevict::detail::concat(
        "# XKV per-layer budgets (arXiv 2412.05896), tokens per KV head, window excluded\n",
        kMagic, " ", kVersion, "\nlayers ", tokens.size(), "\nwindow ", window, "\nsamples ",
        samples, "\ntokens");
    for (long long t : tokens) kvevict::detail::append_parts(out, " ", t);
    out += "\nend\n";
    return out;
  }

  KVEVICT_DEFER static Profile from_text(const std::string& text) {
    std::istringstream in(text);
    std::string line;
    int line_no = 0;
    auto next_line = [&](const char* expected) -> std::istringstream {
      while (std::getline(in, line)) {
        ++line_no;
        const auto first = line.find_first_not_of(" \t\r");
        if (first == std::string::npos || line[first] == '#') continue;
        return std::istringstream(line);
      }
      kvevict::detail::fail("XKV profile: truncated after line ", line_no, ", expected '", expected,
                            "'");
    };
    auto number = [&](std::istringstream& ls, const char* field) -> long long {
      long long v = 0;
      std::string tok;
      kvevict::detail::require(static_cast<bool>(ls >> tok), "XKV profile line ", line_no, ": '",
                               field, "' has no value, expected an integer");
      std::size_t used = 0;
      try {
        v = std::stoll(tok, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      kvevict::detail::require(used == tok.size() && used > 0, "XKV profile line ", line_no, ": ",
                               field, " = '", tok, "', expected an integer");
      return v;
    };
    auto field = [&](const char* name) -> std::istringstream {
      auto ls = next_line(name);
      std::string key;
      ls >> key;
      kvevict::detail::require(key == name, "XKV profile line ", line_no, ": found '", key,
                               "', expected '", name, "'");
      return ls;
    };
    auto no_more = [&](std::istringstream& ls) {
      std::string extra;
      kvevict::detail::require(!(ls >> extra), "XKV profile line ", line_no, ": unexpected '",
                               extra, "' at end of line");
    };
    Profile p;
    {
      auto ls = field(kMagic);
      const long long version = number(ls, "version");
      kvevict::detail::require(version == kVersion, "XKV profile: version ", version, ", expected ",
                               kVersion);
      no_more(ls);
    }
    long long layers = 0;
    {
      auto ls = field("layers");
      layers = number(ls, "layers");
      kvevict::detail::require(layers > 0, "XKV profile line ", line_no, ": layers = ", layers,
                               ", expected > 0");
      no_more(ls);
    }
    {
      auto ls = field("window");
      const long long w = number(ls, "window");
      kvevict::detail::require(w > 0, "XKV profile line ", line_no, ": window = ", w,
                               ", expected > 0");
      p.window = static_cast<std::size_t>(w);
      no_more(ls);
    }
    {
      auto ls = field("samples");
      const long long s = number(ls, "samples");
      kvevict::detail::require(s >= 0, "XKV profile line ", line_no, ": samples = ", s,
                               ", expected >= 0");
      p.samples = static_cast<std::size_t>(s);
      no_more(ls);
    }
    {
      auto ls = field("tokens");
      std::string tok;
      const int tokens_line = line_no;
      for (long long l = 0; l < layers; ++l) {
        kvevict::detail::require(static_cast<bool>(ls >> tok), "XKV profile line ", tokens_line,
                                 ": ", l, " budgets, expected ", layers, " (one per layer)");
        std::istringstream one(tok);
        const long long v = number(one, "budget");
        kvevict::detail::require(v > 0, "XKV profile line ", tokens_line, ": budget of layer ", l,
                                 " = ", v, ", expected > 0");
        p.tokens.push_back(v);
      }
      kvevict::detail::require(!(ls >> tok), "XKV profile line ", tokens_line, ": more than ",
                               layers, " budgets, expected one per layer");
    }
    {
      auto ls = field("end");
      no_more(ls);
    }
    while (std::getline(in, line)) {
      ++line_no;
      const auto first = line.find_first_not_of(" \t\r");
      kvevict::detail::require(first == std::string::npos || line[first] == '#',
                               "XKV profile line ", line_no, ": content after 'end'");
    }
    return p;
  }

  // The file forms: defined below (in kvevict_kernels in separate-kernels mode, config.hpp,
  // so that a consumer of xkv.hpp includes no <fstream>).
  void save(const std::string& path) const;
  static Profile load(const std::string& path);
};

#if !KVEVICT_KERNELS_DECLARE_ONLY
KVEVICT_KERNEL_FN void Profile::save(const std::string& path) const {
  std::ofstream out(path);
  kvevict::detail::require(static_cast<bool>(out), "XKV profile: cannot open '", path,
                           "' for writing");
  out << to_text();
  out.flush();
  kvevict::detail::require(static_cast<bool>(out), "XKV profile: writing '", path, "' failed");
}
KVEVICT_KERNEL_FN Profile Profile::load(const std::string& path) {
  const std::vector<char> bytes = kvevict::detail::read_file(path, "XKV profile");
  try {
    return from_text(std::string(bytes.begin(), bytes.end()));
  } catch (const Error& e) {
    throw Error(std::string(e.what()) + " (file '" + path + "')");
  }
}
#endif  // !KVEVICT_KERNELS_DECLARE_ONLY

/// The reference's sampling: the first ceil(fraction x requests) prompts of a task each
/// get their own allocation; their element-wise mean (rounded) becomes the profile.
class Calibrator {
 public:
  KVEVICT_DEFER Calibrator(int n_layers, std::size_t window) : window_(window) {
    kvevict::detail::require(n_layers > 0, "Calibrator: n_layers = ", n_layers, ", expected > 0");
    sums_.assign(static_cast<std::size_t>(n_layers), 0.0);
  }
  /// Sample prompts wanted for a task of `requests` prompts at the given fraction.
  KVEVICT_DEFER static std::size_t samples_wanted(std::size_t requests, double fraction = 0.1) {
    kvevict::detail::require(fraction > 0.0 && fraction <= 1.0, "Calibrator: fraction = ", fraction,
                             ", expected in (0, 1]");
    return static_cast<std::size_t>(std::ceil(fraction * static_cast<double>(requests)));
  }
  KVEVICT_DEFER void add(const Allocation& a) {
    kvevict::detail::require(a.tokens.size() == sums_.size(), "Calibrator::add: ", a.tokens.size(),
                             " layers, expected ", sums_.size());
    for (std::size_t l = 0; l < sums_.size(); ++l) sums_[l] += static_cast<double>(a.tokens[l]);
    ++samples_;
  }
  [[nodiscard]] std::size_t samples() const { return samples_; }
  KVEVICT_DEFER [[nodiscard]] Profile profile() const {
    kvevict::detail::require(samples_ > 0, "Calibrator::profile: no samples, expected >= 1");
    Profile p;
    p.window = window_;
    p.samples = samples_;
    for (double s : sums_)
      p.tokens.push_back(std::max<long long>(1, std::llround(s / static_cast<double>(samples_))));
    return p;
  }

 private:
  std::size_t window_;
  std::vector<double> sums_;
  std::size_t samples_ = 0;
};

// --- prefill paths -------------------------------------------------------------------

namespace detail {
/// One layer's prompt block held back until its selection runs (DeferredXkvPrefill: the
/// whole prompt; ChunkedXkvPrefill: one chunk): its K/V and only the last W queries, which
/// are all SnapKV's selection reads.
struct StagedBlock {
  std::int64_t first_position = 0;
  std::size_t tokens = 0;
  std::vector<float> keys, values, window_queries;

  KVEVICT_DEFER void stage(std::int64_t first, std::size_t n, std::span<const float> k, std::span<const float> v,
             std::span<const float> q, std::size_t window, std::size_t hq) {
    first_position = first;
    tokens = n;
    keys.assign(k.begin(), k.end());
    values.assign(v.begin(), v.end());
    const std::size_t w = std::min(n, window);
    window_queries.assign(q.end() - static_cast<std::ptrdiff_t>(w * hq), q.end());
  }
  [[nodiscard]] std::size_t bytes() const {
    return (keys.capacity() + values.capacity() + window_queries.capacity()) * sizeof(float);
  }
  /// The tokens x n_heads x d query block the container's prefill takes: zeros, then the
  /// window's queries.
  KVEVICT_DEFER void query_block(std::vector<float>& out, std::size_t hq) const {
    out.assign(tokens * hq, 0.0f);
    std::copy(window_queries.begin(), window_queries.end(),
              out.end() - static_cast<std::ptrdiff_t>(window_queries.size()));
  }
  template <class Cache>
  void prefill_into(Cache& cache, int layer, std::vector<float>& scratch, std::size_t hq) const {
    query_block(scratch, hq);
    cache.prefill(layer, first_position, tokens, keys, values, scratch);
  }
};
KVEVICT_DEFER inline std::size_t staged_bytes(const std::vector<StagedBlock>& staged) {
  std::size_t b = 0;
  for (const auto& s : staged) b += s.bytes();
  return b;
}
}  // namespace detail

/// Deferred prefill: every layer's prompt K/V is kept (copied here) until all layers'
/// statistics are in, then one allocation runs and each layer is compressed. Peak
/// memory is the whole uncompressed prefill: the price of a per-prompt allocation.
template <class Scalar = float>
class DeferredXkvPrefill {
 public:
  using Cache = KVCache<SnapKV, Scalar>;

  DeferredXkvPrefill(const Geometry& g, XkvLayerAllocator::Config c = {},
                     std::size_t decode_reserve = 0)
      : allocator_(g, c), reserve_(decode_reserve), staged_(static_cast<std::size_t>(g.n_layers)) {}

  /// Stages one layer's prompt (keys/values T x n_kv_heads x d, queries T x n_heads x d)
  /// and records its statistics; the engine may free its own copy afterwards.
  void add_layer(int layer, std::int64_t first_position, std::size_t tokens,
                 std::span<const float> keys, std::span<const float> values,
                 std::span<const float> queries) {
    const Geometry& g = allocator_.geometry();
    allocator_.observe_layer(layer, tokens, keys, queries);
    kvevict::detail::require(values.size() == keys.size(), "DeferredXkvPrefill: values has ",
                             values.size(), " floats, expected ", keys.size(), " like keys");
    staged_[static_cast<std::size_t>(layer)].stage(first_position, tokens, keys, values, queries,
                                                   allocator_.config().window,
                                                   static_cast<std::size_t>(g.n_heads * g.head_dim));
    peak_ = std::max(peak_, detail::staged_bytes(staged_));
  }

  /// Budget mode: allocate `total` tokens over the layers, compress, release staging.
  Cache finish(long long total) { return build(allocator_.allocate(total)); }
  /// Target mode: the smallest allocation reaching mean R >= target.
  Cache finish_for_retention(double target) {
    return build(allocator_.allocate_for_retention(target));
  }

  [[nodiscard]] const XkvLayerAllocator& allocator() const { return allocator_; }
  [[nodiscard]] const Allocation& allocation() const { return allocation_; }
  /// Largest bytes held at once: staged prompt + window queries + cache + scratch.
  [[nodiscard]] std::size_t peak_bytes() const { return peak_; }

 private:

  Cache build(Allocation a) {
    kvevict::detail::require(allocator_.ready(), "DeferredXkvPrefill: not every layer was added");
    allocation_ = std::move(a);
    const Geometry& g = allocator_.geometry();
    Cache cache(g, selection_budget(allocation_.tokens, allocator_.config().window, reserve_),
                SnapKV(allocator_.selection(reserve_)));
    const std::size_t hq = static_cast<std::size_t>(g.n_heads * g.head_dim);
    std::vector<float> queries;
    for (int l = 0; l < g.n_layers; ++l) {
      auto& s = staged_[static_cast<std::size_t>(l)];
      s.prefill_into(cache, l, queries, hq);
      peak_ = std::max(peak_, detail::staged_bytes(staged_) + cache.allocated_bytes() +
                                  queries.capacity() * sizeof(float));
      s = detail::StagedBlock{};  // this layer's uncompressed rows are released
    }
    return cache;
  }

  XkvLayerAllocator allocator_;
  std::size_t reserve_;
  std::vector<detail::StagedBlock> staged_;
  Allocation allocation_;
  std::size_t peak_ = 0;
};

/// Calibrated prefill: budgets come from a profile, so each layer is compressed as soon
/// as its prefill finishes. Peak memory is the compressed cache plus one layer's
/// uncompressed K/V (held by the engine during that layer's call).
template <class Scalar = float>
class CalibratedXkvPrefill {
 public:
  using Cache = KVCache<SnapKV, Scalar>;

  CalibratedXkvPrefill(const Geometry& g, const Profile& profile, std::size_t kernel = 7,
                       Pooling pooling = Pooling::avg, std::size_t decode_reserve = 0)
      : cache_(g, checked_budget(g, profile, decode_reserve),
               SnapKV({profile.window, kernel, pooling, decode_reserve})) {}

  void prefill_layer(int layer, std::int64_t first_position, std::size_t tokens,
                     std::span<const float> keys, std::span<const float> values,
                     std::span<const float> queries) {
    cache_.prefill(layer, first_position, tokens, keys, values, queries);
    peak_ =
        std::max(peak_, cache_.allocated_bytes() + (keys.size() + values.size()) * sizeof(float));
  }
  [[nodiscard]] Cache& cache() { return cache_; }
  [[nodiscard]] std::size_t peak_bytes() const { return peak_; }

 private:
  static Budget checked_budget(const Geometry& g, const Profile& p, std::size_t reserve) {
    g.validate();
    p.validate(g);  // a profile for another model fails here, with the profile's words
    return p.budget(reserve);
  }
  Cache cache_;
  std::size_t peak_ = 0;
};

/// Chunked prefill with XKV budgets from the chunks (issue 14): the prompt arrives in
/// chunks, each passing every layer in order (an engine's forward pass), and neither the
/// whole prompt nor a calibration profile is at hand. A fixed total of `total` selected
/// tokens per KV head (observation windows excluded) is shared by the layers of `cache` (a
/// KVCache<SnapKV> or another layout over SnapKV with set_budget, empty, with XKV's window
/// and no decode reserve). For each chunk:
///  1. add_layer(l, ...) for l = 0 .. L-1: layer l's statistics come from what its
///     reselection would rank (SnapKV::prefill_scores over the rows the layer holds plus
///     the chunk: XKV's pooled window importance, restricted to those candidates), and the
///     chunk's K/V and last W queries are staged (the engine may free its copy);
///  2. after the last layer: XkvLayerAllocator::allocate(total) over those statistics gives
///     each layer n_l; a layer that holds more than n_l + W rows first selects n_l + W rows
///     under its current capacity (SnapKV::set_selection_limit), then every layer gets
///     capacity n_l + W (nothing is above it) and the other layers select.
/// The capacities always sum to at most total + L x W per KV head (before the first chunk
/// the split is uniform; nothing is held then), so the cache never holds more than that,
/// and the staging holds one chunk: memory <= budget + one chunk (peak_rows(),
/// staged_peak_bytes()). With one
/// chunk of the whole prompt nothing is held: every layer gets its capacity first and
/// selects once, which is DeferredXkvPrefill's whole-prompt XKV exactly.
template <class Cache>
class ChunkedXkvPrefill {
 public:
  ChunkedXkvPrefill(Cache& cache, long long total, XkvLayerAllocator::Config c = {})
      : cache_(cache), allocator_(cache.geometry(), c), total_(total),
        staged_(static_cast<std::size_t>(cache.geometry().n_layers)) {
    const Geometry& g = cache.geometry();
    const SnapKV::Config& sc = cache.policy().config();
    kvevict::detail::require(sc.window == c.window && sc.kernel == c.kernel && sc.pooling == c.pooling &&
                                 sc.decode_reserve == 0 && sc.chunked == ChunkedPrefill::reselect,
                             "ChunkedXkvPrefill: the cache's SnapKV has window ", sc.window, ", kernel ",
                             sc.kernel, ", decode_reserve ", sc.decode_reserve,
                             "; expected the allocator's window ", c.window, " and kernel ", c.kernel,
                             ", no decode reserve, chunked = reselect");
    for (int l = 0; l < g.n_layers; ++l)
      kvevict::detail::require(cache.tokens_seen(l) == 0, "ChunkedXkvPrefill: layer ", l, " holds ",
                               cache.tokens_seen(l), " tokens, expected an empty cache");
    tokens_ = uniform_budgets(g.n_layers, total);  // the first chunk's split: no statistics yet
    cache_.set_budget(selection_budget(tokens_, c.window));
  }

  /// Layer `layer` of the current chunk (layers in order 0 .. L-1, every layer the same
  /// positions): keys/values tokens x n_kv_heads x d, queries tokens x n_heads x d.
  void add_layer(int layer, std::int64_t first_position, std::size_t tokens,
                 std::span<const float> keys, std::span<const float> values,
                 std::span<const float> queries) {
    const Geometry& g = cache_.geometry();
    kvevict::detail::require(layer == next_layer_, "ChunkedXkvPrefill::add_layer: layer ", layer,
                             ", expected ", next_layer_, " (each chunk passes the layers in order)");
    kvevict::detail::require(layer == 0 || (first_position == staged_[0].first_position && tokens == staged_[0].tokens),
                             "ChunkedXkvPrefill::add_layer: layer ", layer, " gets ", tokens,
                             " tokens at position ", first_position, ", expected layer 0's ",
                             staged_[0].tokens, " at ", staged_[0].first_position);
    // Every input check of the prefill apply() will run on this layer happens here, before
    // anything is staged: once a chunk's last layer arrives, only allocation can fail.
    std::vector<std::vector<float>> pooled(static_cast<std::size_t>(g.n_kv_heads));
    cache_.prefill_views(layer, first_position, tokens, keys, values, queries, [&](const PrefillView& v) {
      cache_.policy().prefill_scores(v, pooled[static_cast<std::size_t>(v.kv_head)]);
    });
    staged_[static_cast<std::size_t>(layer)].stage(first_position, tokens, keys, values, queries,
                                                   allocator_.config().window, hq());
    allocator_.set_layer_scores(layer, pooled);
    staged_peak_ = std::max(staged_peak_, detail::staged_bytes(staged_));
    if (++next_layer_ == g.n_layers) apply();
  }

  [[nodiscard]] Cache& cache() { return cache_; }
  [[nodiscard]] const XkvLayerAllocator& allocator() const { return allocator_; }
  /// Selected tokens per layer (per KV head, windows excluded) after the last chunk.
  [[nodiscard]] const std::vector<long long>& tokens() const { return tokens_; }
  /// The most rows the cache held, summed over every layer and KV head, at any point
  /// between two calls of the cache (each call keeps every head within its capacity).
  [[nodiscard]] std::size_t peak_rows() const { return peak_rows_; }
  /// The largest sum of the cache's capacities at any point: total + L x W per KV head.
  [[nodiscard]] std::size_t peak_capacity() const { return peak_capacity_; }
  /// The most bytes staged at once (one chunk's K/V for every layer, their last W queries;
  /// besides, one layer's tokens x n_heads x d query block while it is applied).
  [[nodiscard]] std::size_t staged_peak_bytes() const { return staged_peak_; }

 private:
  std::size_t hq() const { return static_cast<std::size_t>(cache_.geometry().n_heads * cache_.geometry().head_dim); }
  void measure() {
    const Geometry& g = cache_.geometry();
    std::size_t rows = 0, caps = 0;
    for (int l = 0; l < g.n_layers; ++l)
      for (int h = 0; h < g.n_kv_heads; ++h) {
        rows += cache_.size(l, h);
        caps += cache_.capacity(l, h);
      }
    peak_rows_ = std::max(peak_rows_, rows);
    peak_capacity_ = std::max(peak_capacity_, caps);
  }
  void prefill(int l) {
    auto& s = staged_[static_cast<std::size_t>(l)];
    s.prefill_into(cache_, l, query_block_, hq());  // one layer's query block at a time
    s = detail::StagedBlock{};  // this layer's chunk is in (or dropped): its staging is released
    measure();
  }
  void apply() {
    next_layer_ = 0;
    const Geometry& g = cache_.geometry();
    const std::size_t W = allocator_.config().window;
    const auto fresh = allocator_.allocate(total_).tokens;
    // Layers holding more than their new capacity select first under their current one.
    std::vector<char> first(static_cast<std::size_t>(g.n_layers), 0);
    for (int l = 0; l < g.n_layers; ++l) {
      const auto cap = static_cast<std::size_t>(fresh[static_cast<std::size_t>(l)]) + W;
      for (int h = 0; h < g.n_kv_heads; ++h) first[static_cast<std::size_t>(l)] |= cache_.size(l, h) > cap;
    }
    measure();
    for (int l = 0; l < g.n_layers; ++l)
      if (first[static_cast<std::size_t>(l)]) {  // keeps n_l + W rows under its current capacity
        cache_.policy().set_selection_limit(l, static_cast<std::size_t>(fresh[static_cast<std::size_t>(l)]) + W);
        try {
          prefill(l);
        } catch (...) {
          cache_.policy().set_selection_limit(l, Budget::kUnbounded);
          throw;
        }
        cache_.policy().set_selection_limit(l, Budget::kUnbounded);
      }
    tokens_ = fresh;
    cache_.set_budget(selection_budget(tokens_, W));  // no row above a new capacity: no eviction
    measure();
    for (int l = 0; l < g.n_layers; ++l)
      if (!first[static_cast<std::size_t>(l)]) prefill(l);
  }

  Cache& cache_;
  XkvLayerAllocator allocator_;
  long long total_;
  std::vector<long long> tokens_;
  std::vector<detail::StagedBlock> staged_;
  std::vector<float> query_block_;
  int next_layer_ = 0;
  std::size_t peak_rows_ = 0, peak_capacity_ = 0, staged_peak_ = 0;
};

}  // namespace kvevict::policies
