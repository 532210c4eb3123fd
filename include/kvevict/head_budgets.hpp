#pragma once
// Per-head budgets from observed attention. KV heads differ a lot in how far back they
// look: on stories260K the last 16 tokens carry almost all of some heads' attention and
// well under half of others' (docs/quality.md, diagnosis). A uniform budget starves the
// far-looking heads and wastes rows on the local ones. AttentionAgeProfile accumulates,
// per (layer, KV head), the attention mass at each token age (query position - row
// position) over calibration steps; allocate() then spreads a total number of rows over the
// heads greedily, each next row going to the head whose window would gain the most mass
// (the mass at its next age). The result is a Budget::per_head with the same total memory
// as Budget::uniform(mean_rows).
//
// Calibrate with the full cache (attend() or the engine's own probabilities) on text like
// the text to serve; store the resulting budgets with the model.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <queue>
#include <span>
#include <tuple>
#include <vector>

#include "attention.hpp"
#include "errors.hpp"
#include "geometry.hpp"

namespace kvevict {

/// Options of AttentionAgeProfile::allocate.
struct HeadAllocation {
  long long floor = 4;         ///< rows every head gets at least (>= the policy's minimum)
  double uniform_share = 0.0;  ///< 0: follow the profile; 1: uniform; between: a blend
  /// true: every layer keeps its own total (KV heads x mean_rows) and rows move only
  /// between the KV heads of a layer (what a pooled budget can do at run time)
  bool per_layer = false;
};

/// Options of AttentionAgeProfile::type_heads (DuoAttention-style head typing, arXiv
/// 2410.10819): a share of the KV heads keeps a long cache (retrieval heads), the others a
/// sink + window of `stream_fraction` x mean_rows rows (streaming heads); same total rows.
struct HeadTyping {
  double retrieval_fraction = 0.25;  ///< share of all KV heads typed retrieval (at least one)
  double stream_fraction = 0.5;      ///< a streaming head's rows / mean_rows
  long long floor = 4;               ///< rows a streaming head gets at least
};

class AttentionAgeProfile {
 public:
  /// Ages 0..max_age-1 are told apart; older rows are pooled in the last bucket.
  KVEVICT_LAZY AttentionAgeProfile(const Geometry& g, std::size_t max_age);

  /// One step of one (layer, KV head): `probs` is group x rows (row-major) over rows at
  /// `positions`, attended from `query_position`. The group's query heads are averaged.
  /// Mass on the first sink_positions() positions (the attention sink) is also kept apart
  /// by age, for type_heads.
  KVEVICT_LAZY void add(int layer, int kv_head, std::int64_t query_position,
                        std::span<const std::int64_t> positions, std::span<const float> probs);

  /// Every KV head of `layer` at once, from a cache and the result of attend() on it.
  template <class Cache>
  void add(const Cache& cache, int layer, std::int64_t query_position, const AttentionResult& r) {
    detail::require(cache.geometry() == geometry_,
                    "AttentionAgeProfile::add: the cache's geometry differs from the profile's");
    detail::require(r.probs.size() == static_cast<std::size_t>(geometry_.n_kv_heads),
                    "AttentionAgeProfile::add: ", r.probs.size(), " probability blocks, expected ",
                    geometry_.n_kv_heads);
    for (int h = 0; h < geometry_.n_kv_heads; ++h) {
      const auto& p = r.probs[static_cast<std::size_t>(h)];
      add(layer, h, query_position, cache.positions(layer, h),
          std::span<const float>(p.data(), static_cast<std::size_t>(p.size())));
    }
  }

  /// Mean attention mass per step at `age` (the last age pools everything older).
  [[nodiscard]] double mass(int layer, int kv_head, std::size_t age) const {
    check_head(layer, kv_head);
    detail::require(age < max_age_, "AttentionAgeProfile::mass: age = ", age, ", expected < ",
                    max_age_);
    const auto s = steps_[index(layer, kv_head)];
    return s ? mass_[index(layer, kv_head)][age] / static_cast<double>(s) : 0.0;
  }
  [[nodiscard]] std::size_t steps(int layer, int kv_head) const {
    check_head(layer, kv_head);
    return steps_[index(layer, kv_head)];
  }
  [[nodiscard]] const Geometry& geometry() const { return geometry_; }
  [[nodiscard]] std::size_t max_age() const { return max_age_; }

  /// Per-head row counts summing to mean_rows x (layers x KV heads). Greedy: every head
  /// starts at `floor`; each further row goes to the head with the largest mean mass at
  /// its next age (ties: the lower head index). With uniform_share u, each head then gets
  /// (1 - u) x its greedy count + u x mean_rows, rounded so the total stays exact.
  KVEVICT_LAZY [[nodiscard]] std::vector<std::vector<long long>> allocate_rows(
      long long mean_rows, HeadAllocation o = {}) const;
  KVEVICT_DEFER [[nodiscard]] Budget allocate(long long mean_rows, HeadAllocation o = {}) const {
    return Budget::per_head(allocate_rows(mean_rows, o));
  }

  /// Positions counted as the attention sink by type_heads (the first token).
  static constexpr std::int64_t kSinkPositions = 1;

  /// Mean mass per step a sink + window of `rows` rows would not hold in (layer, kv_head):
  /// everything at ages >= rows - 1 except what falls on the sink.
  [[nodiscard]] double mass_beyond_window(int layer, int kv_head, std::size_t rows) const {
    check_head(layer, kv_head);
    const std::size_t i = index(layer, kv_head);
    if (steps_[i] == 0) return 0.0;
    double beyond = 0.0;
    for (std::size_t age = rows > 0 ? rows - 1 : 0; age < max_age_; ++age)
      beyond += mass_[i][age] - sink_[i][age];
    return std::max(0.0, beyond) / static_cast<double>(steps_[i]);
  }

  /// DuoAttention-style head typing at the same total as Budget::uniform(mean_rows): the
  /// round(retrieval_fraction x heads) KV heads (at least one) with the most mass beyond a
  /// sink + window of W = max(floor, round(stream_fraction x mean_rows)) rows are retrieval
  /// heads and share the rest of the rows equally (the remainder one row each, lowest
  /// index first); every other head gets W rows. Ties: the lower head index is retrieval.
  KVEVICT_LAZY [[nodiscard]] std::vector<std::vector<long long>> type_heads_rows(
      long long mean_rows, HeadTyping o = {}) const;
  KVEVICT_DEFER [[nodiscard]] Budget type_heads(long long mean_rows, HeadTyping o = {}) const {
    return Budget::per_head(type_heads_rows(mean_rows, o));
  }

 private:
  // (1 - u) x greedy + u x mean, floored, then the rows lost to flooring go one each to
  // the heads with the largest fractional parts (ties: lower index): the total is exact.
  KVEVICT_LAZY static void blend(std::vector<long long>& rows, long long mean, double u);
  /// Every head has calibration steps (what allocate / type_heads need).
  void check_calibrated(const char* what) const {
    for (std::size_t i = 0; i < mass_.size(); ++i)
      detail::require(steps_[i] > 0, "AttentionAgeProfile::", what, ": layer ",
                      i / static_cast<std::size_t>(geometry_.n_kv_heads), " KV head ",
                      i % static_cast<std::size_t>(geometry_.n_kv_heads),
                      " has no calibration steps, expected add() before ", what, "()");
  }
  void check_head(int layer, int kv_head) const {
    detail::require(layer >= 0 && layer < geometry_.n_layers, "AttentionAgeProfile: layer = ", layer,
                    ", expected 0 <= layer < ", geometry_.n_layers);
    detail::require(kv_head >= 0 && kv_head < geometry_.n_kv_heads,
                    "AttentionAgeProfile: KV head = ", kv_head, ", expected 0 <= head < ",
                    geometry_.n_kv_heads);
  }
  [[nodiscard]] std::size_t index(int layer, int kv_head) const {
    return static_cast<std::size_t>(layer) * static_cast<std::size_t>(geometry_.n_kv_heads) +
           static_cast<std::size_t>(kv_head);
  }

  Geometry geometry_;
  std::size_t max_age_;
  std::vector<std::vector<double>> mass_;  ///< per head: summed mass per age
  std::vector<std::vector<double>> sink_;  ///< per head: the part of mass_ on the sink
  std::vector<std::size_t> steps_;         ///< per head: add() calls
};

// The members whose bodies instantiate standard templates (the greedy heap, the sorts):
// KVEVICT_LAZY header-only (compiled only where called), in kvevict_kernels in
// separate-kernels mode (config.hpp), so an includer pays for neither.
#if !KVEVICT_KERNELS_DECLARE_ONLY
KVEVICT_LAZY_DEF KVEVICT_KERNEL_FN AttentionAgeProfile::AttentionAgeProfile(const Geometry& g,
                                                                         std::size_t max_age)
    : geometry_(g), max_age_(max_age) {
  g.validate();
  detail::require(max_age >= 1, "AttentionAgeProfile: max_age = 0, expected >= 1");
  const auto heads = static_cast<std::size_t>(g.n_layers) * static_cast<std::size_t>(g.n_kv_heads);
  mass_.assign(heads, std::vector<double>(max_age, 0.0));
  sink_.assign(heads, std::vector<double>(max_age, 0.0));
  steps_.assign(heads, 0);
}

KVEVICT_LAZY_DEF KVEVICT_KERNEL_FN void AttentionAgeProfile::add(int layer, int kv_head,
                                                          std::int64_t query_position,
                                                          std::span<const std::int64_t> positions,
                                                          std::span<const float> probs) {
  check_head(layer, kv_head);
  const auto group = static_cast<std::size_t>(geometry_.group());
  detail::require(probs.size() == group * positions.size(), "AttentionAgeProfile::add: probs has ",
                  probs.size(), " values, expected group x rows = ", group, " x ",
                  positions.size());
  for (std::int64_t p : positions)
    detail::require(p >= 0 && p <= query_position, "AttentionAgeProfile::add: row position ", p,
                    ", expected in [0, query position ", query_position, "]");
  for (float x : probs)
    detail::require(std::isfinite(x) && x >= 0.0f, "AttentionAgeProfile::add: probability ", x,
                    ", expected finite and >= 0");
  auto& m = mass_[index(layer, kv_head)];
  auto& sk = sink_[index(layer, kv_head)];
  const double w = 1.0 / static_cast<double>(group);
  for (std::size_t g = 0; g < group; ++g)
    for (std::size_t r = 0; r < positions.size(); ++r) {
      const auto age = std::min(static_cast<std::size_t>(query_position - positions[r]), max_age_ - 1);
      const double x = w * probs[g * positions.size() + r];
      m[age] += x;
      if (positions[r] < kSinkPositions) sk[age] += x;
    }
  ++steps_[index(layer, kv_head)];
}

KVEVICT_LAZY_DEF KVEVICT_KERNEL_FN std::vector<std::vector<long long>>
AttentionAgeProfile::allocate_rows(long long mean_rows, HeadAllocation o) const {
  detail::require(o.floor >= 1, "AttentionAgeProfile::allocate: floor = ", o.floor,
                  ", expected >= 1");
  detail::require(mean_rows >= o.floor, "AttentionAgeProfile::allocate: mean_rows = ", mean_rows,
                  ", expected >= floor = ", o.floor);
  detail::require(std::isfinite(o.uniform_share) && o.uniform_share >= 0.0 &&
                      o.uniform_share <= 1.0,
                  "AttentionAgeProfile::allocate: uniform_share = ", o.uniform_share,
                  ", expected in [0, 1]");
  const std::size_t n = mass_.size();
  check_calibrated("allocate");
  std::vector<long long> rows(n, o.floor);
  auto gain = [&](std::size_t i) {
    const auto age = static_cast<std::size_t>(rows[i]);
    return age < max_age_ ? mass_[i][age] / static_cast<double>(steps_[i]) : 0.0;
  };
  // Greedy over heads [first, last): max-heap of (gain of the head's next row, -head
  // index), O(total log heads).
  auto greedy = [&](std::size_t first, std::size_t last) {
    using Entry = std::tuple<double, long long>;
    std::priority_queue<Entry> heap;
    for (std::size_t i = first; i < last; ++i) heap.emplace(gain(i), -static_cast<long long>(i));
    for (long long left = static_cast<long long>(last - first) * (mean_rows - o.floor); left > 0;
         --left) {
      const auto i = static_cast<std::size_t>(-std::get<1>(heap.top()));
      heap.pop();
      ++rows[i];
      heap.emplace(gain(i), -static_cast<long long>(i));
    }
  };
  const auto hkv = static_cast<std::size_t>(geometry_.n_kv_heads);
  if (o.per_layer)
    for (std::size_t first = 0; first < n; first += hkv) greedy(first, first + hkv);
  else
    greedy(0, n);
  if (o.uniform_share > 0.0) blend(rows, mean_rows, o.uniform_share);
  std::vector<std::vector<long long>> out(static_cast<std::size_t>(geometry_.n_layers));
  for (std::size_t i = 0; i < n; ++i)
    out[i / static_cast<std::size_t>(geometry_.n_kv_heads)].push_back(rows[i]);
  return out;
}

KVEVICT_LAZY_DEF KVEVICT_KERNEL_FN std::vector<std::vector<long long>>
AttentionAgeProfile::type_heads_rows(long long mean_rows, HeadTyping o) const {
  detail::require(std::isfinite(o.retrieval_fraction) && o.retrieval_fraction > 0.0 &&
                      o.retrieval_fraction <= 1.0,
                  "AttentionAgeProfile::type_heads: retrieval_fraction = ", o.retrieval_fraction,
                  ", expected in (0, 1]");
  detail::require(std::isfinite(o.stream_fraction) && o.stream_fraction > 0.0 &&
                      o.stream_fraction <= 1.0,
                  "AttentionAgeProfile::type_heads: stream_fraction = ", o.stream_fraction,
                  ", expected in (0, 1]");
  detail::require(o.floor >= 1, "AttentionAgeProfile::type_heads: floor = ", o.floor,
                  ", expected >= 1");
  detail::require(mean_rows >= o.floor, "AttentionAgeProfile::type_heads: mean_rows = ",
                  mean_rows, ", expected >= floor = ", o.floor);
  const std::size_t n = mass_.size();
  check_calibrated("type_heads");
  const long long window = std::min(
      mean_rows, std::max(o.floor, std::llround(o.stream_fraction * static_cast<double>(mean_rows))));
  const auto retrieval = std::clamp<std::size_t>(
      static_cast<std::size_t>(std::llround(o.retrieval_fraction * static_cast<double>(n))), 1, n);
  std::vector<std::pair<double, std::size_t>> rank;
  const auto hkv = static_cast<std::size_t>(geometry_.n_kv_heads);
  for (std::size_t i = 0; i < n; ++i)
    rank.emplace_back(-mass_beyond_window(static_cast<int>(i / hkv), static_cast<int>(i % hkv),
                                          static_cast<std::size_t>(window)),
                      i);
  std::sort(rank.begin(), rank.end());
  std::vector<long long> rows(n, window);
  const long long total = static_cast<long long>(n) * mean_rows;
  const long long left = total - static_cast<long long>(n - retrieval) * window;
  std::vector<std::size_t> chosen;
  for (std::size_t k = 0; k < retrieval; ++k) chosen.push_back(rank[k].second);
  std::sort(chosen.begin(), chosen.end());
  const auto r = static_cast<long long>(retrieval);
  for (std::size_t k = 0; k < chosen.size(); ++k)
    rows[chosen[k]] = left / r + (static_cast<long long>(k) < left % r ? 1 : 0);
  std::vector<std::vector<long long>> out(static_cast<std::size_t>(geometry_.n_layers));
  for (std::size_t i = 0; i < n; ++i) out[i / hkv].push_back(rows[i]);
  return out;
}

KVEVICT_LAZY_DEF KVEVICT_KERNEL_FN void AttentionAgeProfile::blend(std::vector<long long>& rows,
                                                            long long mean, double u) {
  std::vector<std::pair<double, std::size_t>> frac;
  long long total = 0, want = 0;
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const double x = (1.0 - u) * static_cast<double>(rows[i]) + u * static_cast<double>(mean);
    want += rows[i];
    rows[i] = static_cast<long long>(std::floor(x));
    total += rows[i];
    frac.emplace_back(-(x - std::floor(x)), i);
  }
  std::sort(frac.begin(), frac.end());
  for (std::size_t k = 0; total < want; ++k, ++total) ++rows[frac[k].second];
}
#endif  // !KVEVICT_KERNELS_DECLARE_ONLY

}  // namespace kvevict
