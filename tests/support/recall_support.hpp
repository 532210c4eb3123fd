#pragma once
// Shared by the recall-reserve tests (test_recall_excess.cpp, test_recall_dedup.cpp): the
// step of a brute-force comparison, probabilities with a few chosen rows, and the
// save/restore twin check.
#include <algorithm>
#include <cstdint>
#include <set>
#include <span>
#include <vector>

#include <kvevict/serialize.hpp>

#include "test_support.hpp"

namespace kvtest {

/// Requires head h of layer 0 to hold exactly the rows of `brute` (brute.rows: a map keyed by
/// position), then feeds brute.observe(position, t, attention summed over the G query heads)
/// for every kept row, from this step's attend result.
template <class Cache, class Brute>
void check_kept_then_observe(const Cache& cache, const kvevict::AttentionResult& r, int h, int G,
                             Brute& brute, std::uint64_t t) {
  const auto pos = cache.positions(0, h);
  std::set<std::int64_t> kept(pos.begin(), pos.end()), want;
  for (const auto& [p, row] : brute.rows) want.insert(p);
  REQUIRE(kept == want);
  const auto& p = r.probs[static_cast<std::size_t>(h)];
  for (std::size_t i = 0; i < pos.size(); ++i) {
    float s = 0.0f;
    for (int gq = 0; gq < G; ++gq) s += p(gq, static_cast<Eigen::Index>(i));
    brute.observe(pos[i], t, s);
  }
}

/// Probabilities over rows at `pos`: chosen(position) returns a row's probability, or a
/// negative value for a row that shares what the chosen rows leave, equally.
template <class Chosen>
void chosen_then_rest(std::span<const std::int64_t> pos, std::vector<float>& probs, Chosen chosen) {
  probs.assign(pos.size(), 0.0f);
  float used = 0.0f;
  std::size_t special = 0;
  std::vector<bool> rest(pos.size(), false);
  for (std::size_t i = 0; i < pos.size(); ++i) {
    const float x = chosen(pos[i]);
    if (x < 0.0f) {
      rest[i] = true;
      continue;
    }
    probs[i] = x;
    used += x;
    ++special;
  }
  for (std::size_t i = 0; i < pos.size(); ++i)
    if (rest[i]) probs[i] = (1.0f - used) / static_cast<float>(pos.size() - special);
}

/// Runs `cache` (layer 0, head dim 4, one KV head and two query heads) for 40 steps, saves it,
/// restores the bytes into a cache built from `policy`, then runs both 40 more steps on the
/// same input and requires the same kept rows at every step. key(t) gives step t's key.
/// Returns the saved bytes.
template <class Policy, class Key>
std::vector<std::uint8_t> check_restore_twin(kvevict::KVCache<Policy>& cache, const Policy& policy,
                                             std::size_t budget, Rng& rng, Key key) {
  using namespace kvevict;
  for (int t = 0; t < 40; ++t) {
    auto k = key(t), v = rng.normals(4), q = rng.normals(8);
    cache.append(0, t, k, v, q);
    attend(cache, 0, q);
  }
  const auto bytes = save_bytes(cache);
  KVCache<Policy> restored(cache.geometry(), Budget::uniform(static_cast<long long>(budget)), policy);
  load_bytes(restored, bytes);
  KVCache<Policy> twin = cache;
  for (int t = 40; t < 80; ++t) {
    auto k = key(t), v = rng.normals(4), q = rng.normals(8);
    twin.append(0, t, k, v, q);
    restored.append(0, t, k, v, q);
    attend(twin, 0, q);
    attend(restored, 0, q);
    const auto a = twin.positions(0, 0), b = restored.positions(0, 0);
    REQUIRE(std::vector<std::int64_t>(a.begin(), a.end()) ==
            std::vector<std::int64_t>(b.begin(), b.end()));
  }
  return bytes;
}

}  // namespace kvtest
