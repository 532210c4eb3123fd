#pragma once
// Shared by the recall-reserve tests (test_recall_excess.cpp, test_recall_dedup.cpp,
// test_recall_successor.cpp): the brute-force reserve rule and the step of its comparison, probabilities with a few chosen rows, and the
// save/restore twin check.
#include <algorithm>
#include <cstdint>
#include <map>
#include <set>
#include <span>
#include <vector>

#include <kvevict/policies/decayed_attention.hpp>
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

/// Runs `cache` (layer 0, two KV heads of head dim 8 and G query heads each) for `steps`
/// random steps and compares both heads with their brute-force references every step.
template <class Cache, class Brute>
void compare_with_brute(Cache& cache, std::vector<Brute>& brute, int G, Rng& rng, int steps = 250) {
  for (int t = 0; t < steps; ++t) {
    auto k = rng.normals(16), v = rng.normals(16),
         q = rng.normals(static_cast<std::size_t>(2 * G * 8), 2.0f);
    cache.append(0, t, k, v, q);
    const auto r = attend(cache, 0, q);
    for (int h = 0; h < 2; ++h) {
      auto& b = brute[static_cast<std::size_t>(h)];
      b.step(t, static_cast<std::uint64_t>(t));
      INFO("step " << t << " head " << h);
      check_kept_then_observe(cache, r, h, G, b, static_cast<std::uint64_t>(t));
    }
  }
}

/// A brute-force reference's victim: of the positions in `open` not in `kept`, the row
/// (rows: position -> row with .score and .seq) with the lowest decayed score, the oldest
/// among equal scores. Requires one.
template <class Rows, class Open>
std::int64_t lowest_open(const Rows& rows, const Open& open, const std::set<std::int64_t>& kept) {
  std::int64_t victim = -1;
  for (auto p : open) {
    if (kept.count(p)) continue;
    if (victim < 0 || rows.at(p).score < rows.at(victim).score ||
        (rows.at(p).score == rows.at(victim).score && rows.at(p).seq < rows.at(victim).seq))
      victim = p;
  }
  REQUIRE(victim >= 0);
  return victim;
}

/// A brute-force reference of DecayedAttention's spike / excess / total-ranked reserve,
/// one head, positions = arrival indices: protected sinks and band; of the rest, the rows
/// with a positive rank (spike; excess: spike - draws / count; total: draws) from the
/// largest down (ties: newer) are kept, `recall` of them at most and leaving one
/// evictable; with `successor` (recall_successor) each is followed by the open row that
/// arrived right after it, a pair taking two. The lowest decayed score of the remainder
/// goes (ties: older).
struct RecallBrute {
  struct Row {
    std::uint64_t seq;
    double score = 0.0, spike = 0.0, draws = 0.0;
    std::size_t count = 0;
  };
  kvevict::policies::DecayedAttention::RecallRank rank;
  double decay;
  std::size_t sinks, recent, capacity, recall;
  std::map<std::int64_t, Row> rows;
  bool successor = false;
  double rank_of(const Row& r) const {
    using R = kvevict::policies::DecayedAttention::RecallRank;
    if (rank == R::total) return r.draws;
    if (rank == R::spike) return r.spike;
    return r.count ? static_cast<double>(static_cast<float>(r.spike) -
                                         static_cast<float>(r.draws) / static_cast<float>(r.count))
                   : 0.0;
  }
  void step(std::int64_t pos, std::uint64_t seq) {
    if (rows.size() >= capacity) {
      std::set<std::int64_t> open;
      for (const auto& [p, r] : rows)
        if (!(r.seq < sinks || r.seq + recent >= seq)) open.insert(p);
      std::vector<std::pair<double, std::int64_t>> ranked;
      for (auto p : open)
        if (const double e = rank_of(rows.at(p)); e > 0.0) ranked.push_back({e, p});
      std::sort(ranked.begin(), ranked.end(), [&](auto a, auto b) {
        return a.first != b.first ? a.first > b.first : rows.at(a.second).seq > rows.at(b.second).seq;
      });
      const std::size_t limit = std::min(recall, open.size() - 1);
      std::set<std::int64_t> kept;
      for (const auto& [e, p] : ranked) {
        if (kept.size() == limit) break;
        kept.insert(p);
        if (successor && kept.size() < limit && open.count(p + 1)) kept.insert(p + 1);
      }
      rows.erase(lowest_open(rows, open, kept));
    }
    rows[pos] = {seq};
  }
  void observe(std::int64_t pos, std::uint64_t latest, float x) {
    Row& r = rows.at(pos);
    r.score = static_cast<double>(static_cast<float>(decay) * static_cast<float>(r.score) + x);
    if (latest - r.seq >= recent) {
      r.spike = std::max(r.spike, static_cast<double>(x));
      r.draws = static_cast<double>(static_cast<float>(r.draws) + x);
      ++r.count;
    }
  }
};

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

/// Runs one head of 16 rows under `policy` for 400 steps (keys, values and queries
/// constant); attention(t, x) gives row x's probability at step t (negative: a share of what
/// the others leave). True iff every position of `watch` is held from its arrival on.
template <class Attention>
bool rows_survive(const kvevict::policies::DecayedAttention& policy,
                  const std::set<std::int64_t>& watch, Attention attention) {
  using namespace kvevict;
  KVCache<policies::DecayedAttention> cache(Geometry{1, 1, 1, 4}, Budget::uniform(16), policy);
  const std::vector<float> kv(4, 0.5f), q(4, 0.0f);
  std::vector<float> probs;
  for (int t = 0; t < 400; ++t) {
    cache.append(0, t, kv, kv, q);
    const auto pos = cache.positions(0, 0);
    for (std::int64_t w : watch)
      if (t > w && std::find(pos.begin(), pos.end(), w) == pos.end()) return false;
    chosen_then_rest(pos, probs, [&](std::int64_t x) { return attention(t, x); });
    cache.observe(0, 0, probs);
  }
  return true;
}

/// Twin caches fed the same steps: requires head h of layer 0 to hold the same rows in both,
/// then observes the same probabilities on both, `per_row` per kept row (G query heads per
/// KV head: G * rows values), each from draw().
template <class Cache, class Draw>
void same_rows_then_observe(Cache& a, Cache& b, int h, std::size_t per_row, Draw draw) {
  const auto pa = a.positions(0, h), pb = b.positions(0, h);
  REQUIRE(std::vector<std::int64_t>(pa.begin(), pa.end()) ==
          std::vector<std::int64_t>(pb.begin(), pb.end()));
  std::vector<float> probs(per_row * pa.size());
  for (auto& x : probs) x = draw();
  a.observe(0, h, probs);
  b.observe(0, h, probs);
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
