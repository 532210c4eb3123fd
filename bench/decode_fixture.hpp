// Shared set-up of the decode-step benchmarks (bench_decode.cpp; a per-policy cost benchmark
// may include it too): one layer's K/V of n rows x Hkv KV heads, d = 128, G = 4 query heads per
// KV head, in a KVCache<FullCache, S>, filled with uniform(-1, 1) values. One cache per
// storage type is kept alive (the benchmarks run grouped by shape), so the 64K x 8-head fp32
// case (512 MiB) is built once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <kvevict/kvevict.hpp>

#include "cpu_model.hpp"

namespace decode_bench {

inline constexpr int kHeadDim = 128;
inline constexpr int kGroup = 4;

/// Deterministic uniform(-1, 1) floats (an LCG: filling 512 MiB must not take a minute).
inline void fill_uniform(std::vector<float>& v, std::uint64_t& state) {
  for (auto& x : v) {
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    x = static_cast<float>(static_cast<std::int64_t>(state >> 11) - (std::int64_t{1} << 52)) *
        (1.0f / 4503599627370496.0f);
  }
}

inline kvevict::Geometry geometry(int hkv) { return {1, hkv * kGroup, hkv, kHeadDim}; }

/// The cache of storage type S holding n rows per KV head (rebuilt when the shape changes).
template <class S>
kvevict::KVCache<kvevict::policies::FullCache, S>& full_cache(std::size_t n, int hkv) {
  using Cache = kvevict::KVCache<kvevict::policies::FullCache, S>;
  static std::unique_ptr<Cache> cache;
  static std::size_t have_n = 0;
  static int have_h = 0;
  if (!cache || have_n != n || have_h != hkv) {
    cache.reset();
    cache = std::make_unique<Cache>(geometry(hkv), kvevict::Budget::unbounded());
    std::uint64_t state = 42;
    const std::size_t chunk = 2048, row = static_cast<std::size_t>(hkv) * kHeadDim;
    std::vector<float> k, v;
    for (std::size_t t = 0; t < n; t += chunk) {
      const std::size_t m = n - t < chunk ? n - t : chunk;
      k.resize(m * row);
      v.resize(m * row);
      fill_uniform(k, state);
      fill_uniform(v, state);
      cache->prefill(0, static_cast<std::int64_t>(t), m, k, v);
    }
    have_n = n;
    have_h = hkv;
  }
  return *cache;
}

/// One step's queries (n_heads x d), N(0,1)-like scale so the softmax is not flat.
inline std::vector<float> queries(int hkv) {
  std::vector<float> q(static_cast<std::size_t>(hkv) * kGroup * kHeadDim);
  std::uint64_t state = 7;
  fill_uniform(q, state);
  for (auto& x : q) x *= 3.0f;
  return q;
}

using kvevict::examples::cpu_model;

}  // namespace decode_bench
