#pragma once
// What the per-step policy benchmarks share (bench_decayed, bench_scorers,
// bench_layer_pool): thread CPU time, and a fixed pool of random tokens for H 32, Hkv 8,
// head dim 128 (keys / values / queries of token t, cycling over 509 tokens).
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

}  // namespace kvbench
