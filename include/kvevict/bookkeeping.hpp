#pragma once
// The decisions KVCache and IndexCache share, written once so the two containers run a
// policy identically: validating the caller's arguments, resolving a budget into
// capacities, checking them against the policy, when an append must evict, and
// validating what a policy returned.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

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

/// Flat index of (layer, kv_head) in per-head arrays (layer-major, as CacheShape::at).
inline std::size_t head_index(const Geometry& g, int layer, int kv_head) {
  return static_cast<std::size_t>(layer) * static_cast<std::size_t>(g.n_kv_heads) +
         static_cast<std::size_t>(kv_head);
}

inline void check_layer(const Geometry& g, int layer) {
  require(layer >= 0 && layer < g.n_layers, "layer = ", layer, ", expected 0 <= layer < ",
          g.n_layers);
}

inline void check_head(const Geometry& g, int layer, int kv_head) {
  check_layer(g, layer);
  require(kv_head >= 0 && kv_head < g.n_kv_heads, "kv_head = ", kv_head,
          ", expected 0 <= kv_head < ", g.n_kv_heads);
}

/// A non-finite input would poison every score a policy accumulates from it: reject it.
inline void check_finite(std::span<const float> x, const char* what) {
  // A float is finite iff its exponent bits are not all ones; adding one to the exponent
  // of |x| then carries into the sign bit. OR-ing that over all values is branch-free and
  // vectorises (a per-element isfinite branch cost more than some policies' own work per
  // step); the slow loop only runs to name the bad value.
  std::uint32_t carry = 0;
  for (float v : x) carry |= (std::bit_cast<std::uint32_t>(v) & 0x7fffffffu) + 0x00800000u;
  if ((carry & 0x80000000u) == 0) return;
  for (std::size_t i = 0; i < x.size(); ++i)
    require(std::isfinite(x[i]), what, "[", i, "] = ", x[i], ", expected a finite value");
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
  const std::size_t expect =
      tokens * static_cast<std::size_t>(g.n_kv_heads) * static_cast<std::size_t>(g.head_dim);
  require(x.size() == expect, what, " has ", x.size(), " floats, expected ", expect, " (", tokens,
          " tokens x n_kv_heads x head_dim)");
}

/// Queries of `tokens` tokens (tokens x n_heads x head_dim), or none when not `required`.
template <class Policy>
void check_queries(const Geometry& g, std::span<const float> q, std::size_t tokens,
                   const char* what, bool required = has(Policy::signals, Signals::query)) {
  const std::size_t expect =
      tokens * static_cast<std::size_t>(g.n_heads) * static_cast<std::size_t>(g.head_dim);
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

/// One step's attention probabilities of a head holding `size` rows: group x size floats.
inline void check_probs_size(const Geometry& g, std::span<const float> probs, std::size_t size) {
  const std::size_t expect = static_cast<std::size_t>(g.group()) * size;
  require(probs.size() == expect, "observe: probs has ", probs.size(), " floats, expected ", expect,
          " (group ", g.group(), " x size ", size, ")");
}
inline void check_probs(const Geometry& g, std::span<const float> probs, std::size_t size) {
  check_probs_size(g, probs, size);
  check_finite(probs, "observe: probs");
}

/// observe() of both containers: checks one step's probabilities and returns the view the
/// policy receives. For a policy that reads attention the G rows are summed per row in the
/// same pass that checks finiteness (one read of the probabilities, into `sums`); nothing
/// but `sums` is written before the check has passed.
template <class Policy>
AttentionView observed_view(const Geometry& g, int layer, int kv_head,
                            std::span<const float> probs, std::size_t size,
                            std::vector<float>& sums) {
  AttentionView view{layer, kv_head, g.group(), size, probs.data()};
  if constexpr (has(Policy::signals, Signals::attention)) {
    check_probs_size(g, probs, size);
    sums.resize(size);
    if (!kernels::group_sum_checked(probs.data(), static_cast<std::size_t>(g.group()), size,
                                    sums.data()))
      check_finite(probs, "observe: probs");  // names the bad value and throws
    view.sums = sums.data();
  } else {
    check_probs(g, probs, size);
  }
  return view;
}

/// capacity[l * Hkv + h] of every (layer, KV head) under `b`.
inline std::vector<std::size_t> resolve_capacities(const Geometry& g, const Budget& b) {
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
