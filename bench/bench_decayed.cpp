// DecayedAttention: per-step policy cost (append = eviction decision + storage copy,
// observe = score update) at a full cache of C rows, next to the reference attention over
// the same cache, for the setting without the recall reserve, recommended() (with it) and
// H2O. One layer, Hkv 8, G 4, head dim 128. Thread CPU time, summed per phase.
//   bench_decayed --benchmark_filter=BM_step
#include <benchmark/benchmark.h>

#include "step_tokens.hpp"

#include <ctime>
#include <cmath>
#include <kvevict/attention.hpp>
#include <kvevict/bookkeeping.hpp>
#include <kvevict/cache.hpp>
#include <kvevict/policies/decayed_attention.hpp>
#include <kvevict/policies/h2o.hpp>
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
  auto step = [&](double* append_ns, double* attend_ns, double* observe_ns) {
    const double a = cpu_ns();
    cache.append(0, static_cast<std::int64_t>(t), pool.key(t), pool.value(t));
    const double b = cpu_ns();
    const auto r = attend(cache, 0, pool.query(t), {.observe = false});
    const double c = cpu_ns();
    for (int kh = 0; kh < kGeometry.n_kv_heads; ++kh) {
      const auto& p = r.probs[static_cast<std::size_t>(kh)];
      cache.observe(0, kh, {p.data(), static_cast<std::size_t>(p.size())});
    }
    const double d = cpu_ns();
    if (append_ns) {
      *append_ns += b - a;
      *attend_ns += c - b;
      *observe_ns += d - c;
    }
    ++t;
  };
  // Fill, then run long enough that the recall reserve holds rows that went far.
  for (std::size_t i = 0; i < 2 * cap; ++i) step(nullptr, nullptr, nullptr);
  double append_ns = 0, attend_ns = 0, observe_ns = 0;
  std::size_t steps = 0;
  for (auto _ : state) {
    step(&append_ns, &attend_ns, &observe_ns);
    ++steps;
  }
  const double n = static_cast<double>(steps);
  state.counters["append_ns"] = append_ns / n;
  state.counters["observe_ns"] = observe_ns / n;
  state.counters["attend_ns"] = attend_ns / n;
  state.counters["policy_over_attend"] = (append_ns + observe_ns) / attend_ns;
}

}  // namespace

BENCHMARK_CAPTURE(BM_step, no_recall,
                  policies::DecayedAttention({.sinks = 1, .horizon = 3.0f, .recent_fraction = 0.5f}))
    ->Arg(256)->Arg(1024)->Arg(4096)->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_step, recommended, policies::DecayedAttention::recommended())
    ->Arg(256)->Arg(1024)->Arg(4096)->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_step, h2o, policies::H2O({.recent = 64}))
    ->Arg(256)->Arg(1024)->Arg(4096)->Unit(benchmark::kMicrosecond);

// The finiteness check every observe() runs on the probabilities (bookkeeping.hpp),
// against the per-element isfinite loop it replaced, on one step's 4 x 1024 floats.
void BM_check_finite(benchmark::State& state, bool library) {
  std::vector<float> v(4 * 1024);
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(0.0f, 1e-3f);
  for (auto& x : v) x = u(rng);
  for (auto _ : state) {
    if (library) {
      kvevict::detail::check_finite(v, "probs");
    } else {
      for (std::size_t i = 0; i < v.size(); ++i)
        kvevict::detail::require(std::isfinite(v[i]), "probs[", i, "] = ", v[i],
                                 ", expected a finite value");
    }
    benchmark::ClobberMemory();
  }
}
BENCHMARK_CAPTURE(BM_check_finite, library, true);
BENCHMARK_CAPTURE(BM_check_finite, isfinite_loop, false);

BENCHMARK_MAIN();
