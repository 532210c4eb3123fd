#pragma once
// What the per-step policy benchmarks share (bench_decayed, bench_scorers,
// bench_layer_pool): thread CPU time, and a fixed pool of random tokens for H 32, Hkv 8,
// head dim 128 (keys / values / queries of token t, cycling over 509 tokens).
#include <algorithm>
#include <cstddef>
#include <ctime>
#include <random>
#include <span>
#include <vector>

namespace kvbench {

inline double cpu_ns() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e9 + static_cast<double>(ts.tv_nsec);
}

struct StepTokens {
  std::vector<float> k, v, q;
  std::size_t n = 509;
  StepTokens() {
    std::mt19937 rng(7);
    std::normal_distribution<float> d;
    k.resize(n * 8 * 128);
    v.resize(k.size());
    q.resize(n * 32 * 128);
    for (auto* vec : {&k, &v, &q})
      for (auto& x : *vec) x = d(rng);
  }
  std::span<const float> key(std::size_t t) const { return {k.data() + (t % n) * 1024, 1024}; }
  std::span<const float> value(std::size_t t) const { return {v.data() + (t % n) * 1024, 1024}; }
  std::span<const float> query(std::size_t t) const {
    return {q.data() + ((t * 7 + 3) % n) * 4096, 4096};
  }
};

/// One token's keys, values and queries copied out of a StepTokens pool into a small
/// buffer (24 KB, reused every step): after stage(), the append reads them warm, as an
/// engine's append reads the K/V/Q its projections just wrote.
struct StagedToken {
  std::vector<float> k = std::vector<float>(1024), v = std::vector<float>(1024),
                     q = std::vector<float>(4096);
  void stage(const StepTokens& pool, std::size_t t) {
    const auto pk = pool.key(t), pv = pool.value(t), pq = pool.query(t);
    std::copy(pk.begin(), pk.end(), k.begin());
    std::copy(pv.begin(), pv.end(), v.begin());
    std::copy(pq.begin(), pq.end(), q.begin());
  }
  std::span<const float> key() const { return k; }
  std::span<const float> value() const { return v; }
  std::span<const float> query() const { return q; }
};

}  // namespace kvbench
