// The token rows and attention probabilities of bench_policy_step (and of
// policy_step_count.cpp, its callgrind driver): one pool, so both step the same data.
#pragma once

#include <cstddef>
#include <kvevict/geometry.hpp>
#include <random>
#include <span>
#include <vector>

namespace policy_step {

using kvevict::Geometry;

constexpr int kDim = 128;
constexpr int kGroup = 4;

inline Geometry geometry(int hkv) { return Geometry{1, kGroup * hkv, hkv, kDim}; }

// Random token rows (keys, values, queries) and probability rows, reused cyclically.
// A step's probabilities are a window of the pool at offset 37 t mod kOffsets. The offsets
// span 2^18 values: with 4096 (before 2026-12-01) every row's running maximum came from the
// same few thousand values, so 100+ rows shared the reserve's threshold spike exactly (a
// tie real attention does not produce) and DecayedAttention's reserve ranked twice the
// rows it would on continuous data.
struct Pool {
  static constexpr std::size_t kTokens = 509;
  static constexpr std::size_t kOffsets = std::size_t{1} << 18;
  static constexpr std::size_t kProbs = (std::size_t{1} << 16) * kGroup + kOffsets;
  std::vector<float> k, v, q, p;
  Pool() {
    std::mt19937 rng(7);
    std::normal_distribution<float> d;
    k.resize(kTokens * 8 * kDim);
    v.resize(k.size());
    q.resize(kTokens * 8 * kGroup * kDim);
    for (auto* vec : {&k, &v, &q})
      for (auto& x : *vec) x = d(rng);
    p.resize(kProbs);
    std::exponential_distribution<float> e(1.0f);
    for (auto& x : p) x = e(rng) * 1e-4f;
  }
  std::span<const float> key(std::size_t t, int hkv) const {
    const std::size_t w = static_cast<std::size_t>(hkv) * kDim;
    return {k.data() + (t % kTokens) * 8 * kDim, w};
  }
  std::span<const float> value(std::size_t t, int hkv) const {
    const std::size_t w = static_cast<std::size_t>(hkv) * kDim;
    return {v.data() + (t % kTokens) * 8 * kDim, w};
  }
  std::span<const float> query(std::size_t t, int hkv) const {
    const std::size_t w = static_cast<std::size_t>(hkv) * kGroup * kDim;
    return {q.data() + ((t * 7 + 3) % kTokens) * 8 * kGroup * kDim, w};
  }
  std::span<const float> probs(std::size_t t, std::size_t size) const {
    return {p.data() + (t * 37) % kOffsets, size * kGroup};
  }
};
inline const Pool& pool() {
  static const Pool p;
  return p;
}

}  // namespace policy_step
