#pragma once
// The decisions KVCache and IndexCache share, written once so the two containers run a
// policy identically: validating the caller's arguments, resolving a budget into
// capacities, checking them against the policy, when an append must evict, and
// validating what a policy returned.
#include <Eigen/Core>
#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "checked.hpp"
#include "errors.hpp"
#include "geometry.hpp"
#include "kernels/select.hpp"
#include "policy.hpp"

namespace kvevict::detail {

/// Arrival clock of one layer: tokens appended so far and the last position seen.
struct LayerClock {
  std::uint64_t next_seq = 0;
  std::int64_t last_position = 0;
};

/// Most tokens a layer may see (2^62): the arrival counter can never wrap, and a saved
/// state claiming more is rejected. At 10^9 tokens a second it lasts 146 years.
inline constexpr std::uint64_t kMaxTokensSeen = std::uint64_t{1} << 62;

/// The thread-safety contract (docs/reliability.md): calls that change one container
/// (append, prefill, observe, attend, set_budget, load) must not overlap, not even on
/// different layers, because the policy's state is shared by all layers. With
/// KVEVICT_CHECK_CONCURRENCY (on by default when NDEBUG is not defined) an overlapping
/// call throws kvevict::Error instead of racing. The member exists in every build (one
/// byte), so translation units compiled with and without the check agree on the layout.
#ifndef KVEVICT_CHECK_CONCURRENCY
#ifdef NDEBUG
#define KVEVICT_CHECK_CONCURRENCY 0
#else
#define KVEVICT_CHECK_CONCURRENCY 1
#endif
#endif
class ExclusiveUse {
 public:
  ExclusiveUse() = default;
  ExclusiveUse(const ExclusiveUse&) noexcept {}  // a copy is a new container: not in use
  ExclusiveUse& operator=(const ExclusiveUse&) noexcept { return *this; }

  class Scope {
   public:
    explicit Scope(std::atomic<bool>* busy) : busy_(busy) {}
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;
    ~Scope() {
      if (busy_) busy_->store(false, std::memory_order_release);
    }

   private:
    std::atomic<bool>* busy_;
  };
  /// Marks the container in use for the scope's lifetime; throws if it already is.
  [[nodiscard]] Scope enter(const char* what) {
#if KVEVICT_CHECK_CONCURRENCY
    if (busy_.exchange(true, std::memory_order_acquire))
      fail(what, ": another call is changing this cache (calls that change one cache must "
                 "not overlap, even on different layers: docs/reliability.md)");
    return Scope(&busy_);
#else
    (void)what;
    return Scope(nullptr);
#endif
  }

 private:
  std::atomic<bool> busy_{false};
};

/// Flat index of (layer, kv_head) in per-head arrays (layer-major, as CacheShape::at).
inline std::size_t head_index(const Geometry& g, int layer, int kv_head) {
  return static_cast<std::size_t>(layer) * static_cast<std::size_t>(g.n_kv_heads) +
         static_cast<std::size_t>(kv_head);
}

/// A moved-from container has no layers: name that instead of an empty range.
inline void check_live(const Geometry& g, const char* what) {
  require(g.n_layers > 0, what,
          ": this cache has no layers (it was moved from); assign a constructed cache to it");
}

inline void check_layer(const Geometry& g, int layer) {
  check_live(g, "layer access");
  require(layer >= 0 && layer < g.n_layers, "layer = ", layer, ", expected 0 <= layer < ",
          g.n_layers);
}

inline void check_head(const Geometry& g, int layer, int kv_head) {
  check_layer(g, layer);
  require(kv_head >= 0 && kv_head < g.n_kv_heads, "kv_head = ", kv_head,
          ", expected 0 <= kv_head < ", g.n_kv_heads);
}

/// A non-finite input would poison every score a policy accumulates from it: reject it.
/// The bound kernels::abs_below tests finiteness with: +inf's bit pattern.
inline constexpr std::uint32_t kFiniteLimit = 0x7f800000u;
inline void check_finite(std::span<const float> x, const char* what) {
  // A float is finite iff its exponent bits are not all ones, i.e. |x|'s bit pattern lies
  // below +inf's: one branch-free pass (kernels::abs_below, 8 values a step at AVX2; a
  // per-element isfinite branch cost more than some policies' own work per step); the slow
  // loop only runs to name the bad value.
  const float* data = x.data();
  const std::size_t n = x.size();
  if (kernels::abs_below(&data, &n, &kFiniteLimit, 1)) return;
  for (std::size_t i = 0; i < x.size(); ++i)
    require(std::isfinite(x[i]), what, "[", i, "] = ", x[i], ", expected a finite value");
}

/// Storage types narrower than float overflow to infinity on conversion; a finite float
/// at or beyond this magnitude does (round to nearest even: the midpoint between the
/// largest finite value and the next power of two rounds up). Infinity for float/double.
template <class Scalar>
float storage_limit() {
  if constexpr (sizeof(Scalar) >= sizeof(float)) {
    return std::numeric_limits<float>::infinity();
  } else {
    const double mx = static_cast<double>(static_cast<float>(std::numeric_limits<Scalar>::max()));
    const double next_pow2 = std::ldexp(1.0, std::ilogb(mx) + 1);
    return static_cast<float>((mx + next_pow2) / 2);
  }
}
template <class Scalar>
const char* storage_name() {
  if constexpr (std::is_same_v<Scalar, Eigen::half>) return "Eigen::half";
  else if constexpr (std::is_same_v<Scalar, Eigen::bfloat16>) return "Eigen::bfloat16";
  else if constexpr (std::is_same_v<Scalar, double>) return "double";
  else return "float";
}

/// Values to be stored as `Scalar`: finite, and within the storage type's range, so a
/// kept row is never an infinity the caller did not pass (bf16/fp16 caches). One
/// branch-free pass like check_finite (for float it is exactly the finiteness test).
template <class Scalar>
std::uint32_t storage_limit_bits() {
  return std::bit_cast<std::uint32_t>(storage_limit<Scalar>());
}
template <class Scalar>
void check_storable(std::span<const float> x, const char* what) {
  const std::uint32_t limit = storage_limit_bits<Scalar>();
  const float* data = x.data();
  const std::size_t n = x.size();
  if (kernels::abs_below(&data, &n, &limit, 1)) return;
  check_finite(x, what);
  for (std::size_t i = 0; i < x.size(); ++i)
    require(std::fabs(x[i]) < storage_limit<Scalar>(), what, "[", i, "] = ", x[i],
            " does not fit ", storage_name<Scalar>(), " (largest finite ",
            static_cast<float>(std::numeric_limits<Scalar>::max()), "), expected |value| < ",
            storage_limit<Scalar>());
}

/// One token's keys or values: n_kv_heads x head_dim floats.
inline void check_token_rows(const Geometry& g, std::span<const float> x, const char* what) {
  const std::size_t expect =
      static_cast<std::size_t>(g.n_kv_heads) * static_cast<std::size_t>(g.head_dim);
  require(x.size() == expect, what, " has ", x.size(), " floats, expected ", expect,
          " (n_kv_heads x head_dim)");
}

/// A prefill block's keys or values: tokens x n_kv_heads x head_dim floats.
inline void check_block_rows(const Geometry& g, std::span<const float> x, std::size_t tokens,
                             const char* what) {
  const std::size_t expect = checked_mul(
      tokens, static_cast<std::size_t>(g.n_kv_heads) * static_cast<std::size_t>(g.head_dim), what,
      ": tokens x n_kv_heads x head_dim");
  require(x.size() == expect, what, " has ", x.size(), " floats, expected ", expect, " (", tokens,
          " tokens x n_kv_heads x head_dim)");
}

/// Queries of `tokens` tokens (tokens x n_heads x head_dim), or none when not `required`.
template <class Policy>
void check_queries(const Geometry& g, std::span<const float> q, std::size_t tokens,
                   const char* what, bool required = has(Policy::signals, Signals::query)) {
  const std::size_t expect =
      checked_mul(tokens, static_cast<std::size_t>(g.n_heads) * static_cast<std::size_t>(g.head_dim),
                  what, ": tokens x n_heads x head_dim");
  if (q.empty()) {
    require(!required, what, ": policy ", Policy::name(), " needs queries (", expect,
            " floats), got none");
    return;
  }
  require(q.size() == expect, what, ": queries has ", q.size(), " floats, expected ", expect, " (",
          tokens, " tokens x n_heads x head_dim)");
}

/// Positions must increase within a layer (the first token of a layer may be anything).
inline void check_position(const LayerClock& clock, int layer, std::int64_t position) {
  require(clock.next_seq == 0 || position > clock.last_position, "position = ", position,
          " in layer ", layer, ", expected > ", clock.last_position, " (positions must increase)");
}

/// A block of `tokens` >= 1 arrivals starting at `first_position`: positions must
/// increase (check_position), the last one must not pass INT64_MAX, and the layer's
/// arrival counter must stay <= kMaxTokensSeen.
inline void check_arrivals(const LayerClock& clock, int layer, std::int64_t first_position,
                           std::size_t tokens, const char* what) {
  check_position(clock, layer, first_position);
  (void)checked_last_position(first_position, tokens, what);
  require(tokens <= kMaxTokensSeen - std::min(clock.next_seq, kMaxTokensSeen), what, ": layer ",
          layer, " has seen ", clock.next_seq, " tokens, ", tokens, " more pass the limit of ",
          kMaxTokensSeen);
}

/// Probabilities may exceed 1 by this much: an engine's softmax in bf16 rounds to 2^-7
/// steps near 1 (fp16: 2^-10) and fast exp approximations add a few float ulps, so two
/// bf16 steps of slack. Anything larger (or negative, NaN, inf) is not a probability; with
/// every addend <= group x (1 + slack), a float score saturates (the addend falls below
/// half an ulp) long before it could reach infinity, so H2O, DecayedAttention and BUZZ
/// scores stay finite forever and a saved state always loads again.
inline constexpr float kProbabilitySlack = 1.0f / 64;

/// One step's attention probabilities of a head holding `size` rows: group x size floats.
inline void check_probs_size(const Geometry& g, std::span<const float> probs, std::size_t size) {
  const std::size_t expect = static_cast<std::size_t>(g.group()) * size;
  require(probs.size() == expect, "observe: probs has ", probs.size(), " floats, expected ", expect,
          " (group ", g.group(), " x size ", size, ")");
}

/// Every value in [0, 1 + kProbabilitySlack] (-0 included): rejects negatives, values above
/// 1 + slack, inf and NaN.
inline void check_prob_range(std::span<const float> probs) {
  // Branch-free like check_finite: a non-negative float's bits order like its value, so
  // one unsigned compare rejects > 1 + slack, +inf and NaN; the sign bit rejects negatives
  // (except -0). The slow loop only runs to name the bad value.
  constexpr std::uint32_t hi = std::bit_cast<std::uint32_t>(1.0f + kProbabilitySlack);
  std::uint32_t bad = 0;
  for (float p : probs) {
    const std::uint32_t u = std::bit_cast<std::uint32_t>(p);
    bad |= static_cast<std::uint32_t>((u & 0x7fffffffu) > hi) | static_cast<std::uint32_t>(u > 0x80000000u);
  }
  if (bad == 0) return;
  for (std::size_t i = 0; i < probs.size(); ++i)
    require(probs[i] == 0.0f || (probs[i] > 0.0f && probs[i] <= 1.0f + kProbabilitySlack),
            "observe: probs[", i, "] = ", probs[i], ", expected a probability in [0, 1] (",
            kProbabilitySlack, " of rounding slack above 1)");
}

/// One step's attention probabilities of a head holding `size` rows: group x size floats,
/// each in [0, 1 + kProbabilitySlack] (-0 included).
inline void check_probs(const Geometry& g, std::span<const float> probs, std::size_t size) {
  check_probs_size(g, probs, size);
  check_prob_range(probs);
}

/// observe() of both containers: checks one step's probabilities and returns the view the
/// policy receives. For a policy that reads attention the G rows are summed per row in the
/// same pass that checks the range (one read of the probabilities, into `sums`); nothing
/// but `sums` is written before the check has passed.
template <class Policy>
AttentionView observed_view(const Geometry& g, int layer, int kv_head,
                            std::span<const float> probs, std::size_t size,
                            std::vector<float>& sums) {
  AttentionView view{layer, kv_head, g.group(), size, probs.data()};
  if constexpr (has(Policy::signals, Signals::attention)) {
    check_probs_size(g, probs, size);
    sums.resize(size);
    if (!kernels::group_sum_bounded(probs.data(), static_cast<std::size_t>(g.group()), size,
                                    1.0f + kProbabilitySlack, sums.data())) {
      check_prob_range(probs);  // names the bad value and throws
      check_finite(probs, "observe: probs");
    }
    view.sums = sums.data();
  } else {
    check_probs(g, probs, size);
  }
  return view;
}

/// capacity[l * Hkv + h] of every (layer, KV head) under `b`.
KVEVICT_DEFER inline std::vector<std::size_t> resolve_capacities(const Geometry& g, const Budget& b) {
  std::vector<std::size_t> caps;
  caps.reserve(static_cast<std::size_t>(g.n_layers) * static_cast<std::size_t>(g.n_kv_heads));
  for (int l = 0; l < g.n_layers; ++l)
    for (int h = 0; h < g.n_kv_heads; ++h) caps.push_back(b.capacity(l, h, g.n_kv_heads));
  return caps;
}

/// A budget below what the policy protects could never make room: reject it up front.
template <class Policy>
void check_capacities(const Policy& policy, const Geometry& g,
                      const std::vector<std::size_t>& caps) {
  // set_budget must re-check what bind() checked once (FullCache/Oracle: unbounded only).
  if constexpr (HasCheckBudget<Policy>) policy.check_budget(CacheShape{g, caps});
  const std::size_t need = policy.min_capacity();
  const auto hkv = static_cast<std::size_t>(g.n_kv_heads);
  for (std::size_t i = 0; i < caps.size(); ++i)
    require(caps[i] >= need, "budget for layer ", i / hkv, " KV head ", i % hkv, " = ", caps[i],
            " tokens, expected >= ", need, " (", Policy::name(), " protects ", need - 1,
            " rows and needs one slot to evict)");
}

/// Rows a head may hold before an append must evict: the capacity, or the policy's own
/// (possibly changing) row_limit when it declares one.
template <class Policy>
std::size_t append_limit(const Policy& policy, std::size_t capacity, int layer, int kv_head) {
  if constexpr (HasRowLimit<Policy>)
    return std::min(capacity, std::max<std::size_t>(policy.row_limit(layer, kv_head), 1));
  else
    return capacity;
}

/// Checks a policy's victims (a policy bug must not corrupt a cache: check before anything
/// moves) and sorts them descending, the order swap-remove applies them in.
template <class Policy>
void validate_victims(std::vector<std::uint32_t>& victims, std::size_t size, std::size_t need) {
  if (victims.size() < need || victims.size() > size)
    throw std::logic_error(std::string("kvevict: policy ") + Policy::name() + " returned " +
                           std::to_string(victims.size()) + " victims, expected between " +
                           std::to_string(need) + " and " + std::to_string(size));
  std::sort(victims.begin(), victims.end(), std::greater<>());
  for (std::size_t i = 0; i < victims.size(); ++i) {
    if (victims[i] >= size || (i > 0 && victims[i] == victims[i - 1]))
      throw std::logic_error(std::string("kvevict: policy ") + Policy::name() +
                             " returned victim row " + std::to_string(victims[i]) +
                             " (out of range or repeated; size " + std::to_string(size) + ")");
  }
}

/// Checks a prefill_keep selection and sorts it ascending (token order).
template <class Policy>
void validate_prefill_keep(std::vector<std::uint32_t>& keep, std::size_t tokens,
                           std::size_t capacity) {
  std::sort(keep.begin(), keep.end());
  if (keep.size() > capacity || std::adjacent_find(keep.begin(), keep.end()) != keep.end() ||
      (!keep.empty() && keep.back() >= tokens))
    throw std::logic_error(std::string("kvevict: policy ") + Policy::name() +
                           " prefill_keep returned an invalid selection of " +
                           std::to_string(keep.size()) + " rows from " + std::to_string(tokens) +
                           " tokens (capacity " + std::to_string(capacity) + ")");
}

}  // namespace kvevict::detail
