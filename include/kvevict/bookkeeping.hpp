#pragma once
// The decisions KVCache and IndexCache share, written once so the two containers run a
// policy identically: resolving a budget into capacities, checking them against the
// policy, when an append must evict, and validating what a policy returned.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "errors.hpp"
#include "geometry.hpp"
#include "policy.hpp"

namespace kvevict::detail {

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
