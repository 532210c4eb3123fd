// Probability-free scorers: per-step policy cost (append = the eviction decision, which is
// where ExpectedAttention and KeyDiff score every row, + the storage copy) at a full cache
// of C rows, next to the reference attention over the same cache (kvevict::attend, no
// observe). One layer, Hkv 8, G 4, head dim 128, no RoPE. Thread CPU time per phase.
//   bench_scorers --benchmark_repetitions=3 --benchmark_report_aggregates_only=true
#include <benchmark/benchmark.h>

#include "step_tokens.hpp"

#include <ctime>
#include <kvevict/attention.hpp>
#include <kvevict/cache.hpp>
#include <kvevict/policies/expected_attention.hpp>
#include <kvevict/policies/keydiff.hpp>
#include <kvevict/policies/streaming_llm.hpp>
#include <random>
#include <vector>

using namespace kvevict;

namespace {

const Geometry kGeometry{1, 32, 8, 128};

using kvbench::cpu_ns;
using Pool = kvbench::StepTokens;

template <class Policy>
void BM_step(benchmark::State& state, Policy policy) {
  const auto cap = static_cast<std::size_t>(state.range(0));
  static const Pool pool;
  KVCache<Policy> cache(kGeometry, Budget::uniform(static_cast<long long>(cap)), policy);
  std::size_t t = 0;
  auto step = [&](double* append_ns, double* attend_ns) {
    const double a = cpu_ns();
    cache.append(0, static_cast<std::int64_t>(t), pool.key(t), pool.value(t), pool.query(t));
    const double b = cpu_ns();
    const auto r = attend(cache, 0, pool.query(t), {.observe = false});
    benchmark::DoNotOptimize(r.out.data());
    const double c = cpu_ns();
    if (append_ns) {
      *append_ns += b - a;
      *attend_ns += c - b;
    }
    ++t;
  };
  for (std::size_t i = 0; i < cap + 8; ++i) step(nullptr, nullptr);
  double append_ns = 0, attend_ns = 0;
  std::size_t steps = 0;
  for (auto _ : state) {
    step(&append_ns, &attend_ns);
    ++steps;
  }
  const double n = static_cast<double>(steps);
  state.counters["append_ns"] = append_ns / n;
  state.counters["attend_ns"] = attend_ns / n;
  state.counters["policy_over_attend"] = append_ns / attend_ns;
}

using policies::ExpectedAttention;
const ExpectedAttention kProbabilityFree({.sinks = 1,
                                          .recent_fraction = 0.375f,
                                          .query_window = 1,
                                          .future_positions = 16,
                                          .covariance = ExpectedAttention::Covariance::none,
                                          .rope = policies::RopeLayout::none,
                                          .horizon = 3.0f});

}  // namespace

BENCHMARK_CAPTURE(BM_step, streaming_llm, policies::StreamingLLM{.sinks = 1})
    ->Arg(256)->Arg(1024)->Arg(4096)->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_step, probability_free, kProbabilityFree)
    ->Arg(256)->Arg(1024)->Arg(4096)->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_step, keydiff, policies::KeyDiff({.sinks = 1, .recent_fraction = 0.375f}))
    ->Arg(256)->Arg(1024)->Arg(4096)->Unit(benchmark::kMicrosecond);

BENCHMARK_MAIN();
