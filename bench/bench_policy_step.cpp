// Per-decode-step cost of each eviction policy next to kvevict's own attention step, at a
// full cache of n rows per KV head, one layer, head dim 128, G = 4 query heads per KV head.
//   policy step = cache.append (incl. the eviction decision and the K/V copy)
//               + cache.observe for every KV head (only for policies that read attention)
//   attend step = kvevict::attend(cache, 0, q, {.observe = false}) over the same geometry.
// BUZZ rebuilds only when its sample region overflows: its amortised per-step cost is the
// steady step (BM_buzz_steady) plus the rebuild step (BM_buzz_rebuild) divided by the
// number of steps between rebuilds (reported as the counter `period`).
// Thread CPU time (the machine is shared), run with --benchmark_repetitions=5 and read the
// medians; scripts: bench/run_policy_step_bench.sh writes the table in docs/benchmarks.md.
#include <benchmark/benchmark.h>

#include <cstdio>
#include <fstream>
#include <kvevict/kvevict.hpp>
#include <random>
#include <string>
#include <vector>

#include "bench_main.hpp"
#include "policy_step_pool.hpp"

using namespace kvevict;

namespace {

using namespace policy_step;

// Draws the next batch of probability windows when the stream is due, outside `timed`'s
// timer when one is given (BM_policy's observe and BM_draw_pause share this cadence).
void draw_when_due(ProbStream& probs, std::size_t width, benchmark::State* timed) {
  if (!probs.due(width)) return;
  if (timed) timed->PauseTiming();
  probs.refill(width);
  if (timed) timed->ResumeTiming();
}

template <class Policy>
struct Run {
  KVCache<Policy> cache;
  int hkv;
  std::size_t rows;  ///< the budget per KV head: probability windows are drawn this wide
  std::size_t t = 0;
  ProbStream probs;
  benchmark::State* timed = nullptr;  ///< set: probability draws are paused out of its timer
  /// Fresh keys: token t's key is the pool's with its coordinate pairs rotated by
  /// (t / 509) mod 64 places, so no two keys within 64 x 509 = 32576 tokens are equal or
  /// have equal signatures (DecayedAttention's RecallDedup: text that does not repeat);
  /// the copy is made for every policy run this way, inside the timer.
  bool fresh = false;
  std::vector<float> key_copy;
  /// Warm input (BM_policy_warm): the K/V/Q of the next few tokens are copied from the
  /// pool into a small staging buffer inside the timer's pauses, at the probability
  /// stream's cadence (a batch of m = max(1, 16384 / (4 n)) steps; attention policies
  /// draw their probabilities in the same pause), so the append reads them warm as an
  /// engine's append reads the K/V/Q its projections just wrote. Every policy run this way
  /// pays BM_draw_pause's cost per step, whether it observes attention or not.
  bool warm = false;
  std::vector<float> warm_k, warm_v, warm_q;
  std::size_t staged_from = 0, staged_end = 0;  // tokens [from, end) are staged
  Run(int h, std::size_t n, Policy p, bool fresh_keys = false)
      : cache(geometry(h), Budget::uniform(static_cast<long long>(n)), std::move(p)), hkv(h), rows(n),
        fresh(fresh_keys), key_copy(static_cast<std::size_t>(h) * kDim) {}

  /// Copies the next m tokens' K/V/Q (m: the probability stream's batch) when they are due;
  /// the attention policies' probability draw shares the pause.
  void stage_when_due() {
    const std::size_t width = rows * kGroup;
    constexpr bool draws = has(Policy::signals, Signals::attention);
    const bool stage = t < staged_from || t >= staged_end;
    if (!stage && !(draws && probs.due(width))) return;
    if (timed) timed->PauseTiming();
    if (stage) {
      const std::size_t m = std::max<std::size_t>(1, ProbStream::kBatchFloats / std::max<std::size_t>(width, 1));
      const std::size_t kw = static_cast<std::size_t>(hkv) * kDim, qw = kw * kGroup;
      warm_k.resize(m * kw);
      warm_v.resize(m * kw);
      warm_q.resize(m * qw);
      const Pool& P = pool();
      for (std::size_t j = 0; j < m; ++j) {
        const auto k = P.key(t + j, hkv), v = P.value(t + j, hkv), q = P.query(t + j, hkv);
        std::copy(k.begin(), k.end(), warm_k.begin() + static_cast<std::ptrdiff_t>(j * kw));
        std::copy(v.begin(), v.end(), warm_v.begin() + static_cast<std::ptrdiff_t>(j * kw));
        std::copy(q.begin(), q.end(), warm_q.begin() + static_cast<std::ptrdiff_t>(j * qw));
      }
      staged_from = t;
      staged_end = t + m;
    }
    if (draws && probs.due(width)) probs.refill(width);
    if (timed) timed->ResumeTiming();
  }
  void append_warm() {
    const std::size_t kw = static_cast<std::size_t>(hkv) * kDim, qw = kw * kGroup;
    const std::size_t j = t - staged_from;
    const std::span<const float> k(warm_k.data() + j * kw, kw), v(warm_v.data() + j * kw, kw);
    if constexpr (has(Policy::signals, Signals::query))
      cache.append(0, static_cast<std::int64_t>(t), k, v, std::span<const float>(warm_q.data() + j * qw, qw));
    else
      cache.append(0, static_cast<std::int64_t>(t), k, v);
  }

  std::span<const float> key() {
    const auto k = pool().key(t, hkv);
    if (!fresh) return k;
    const std::size_t shift = 2 * ((t / Pool::kTokens) % (kDim / 2));
    for (std::size_t h = 0; h < static_cast<std::size_t>(hkv); ++h)
      for (std::size_t i = 0; i < kDim; ++i)
        key_copy[h * kDim + i] = k[h * kDim + (i + shift) % kDim];
    return key_copy;
  }
  void append() {
    const Pool& P = pool();
    if constexpr (has(Policy::signals, Signals::query))
      cache.append(0, static_cast<std::int64_t>(t), key(), P.value(t, hkv), P.query(t, hkv));
    else
      cache.append(0, static_cast<std::int64_t>(t), key(), P.value(t, hkv));
  }
  // Every KV head reads (a prefix of) the step's window.
  void observe() {
    if constexpr (has(Policy::signals, Signals::attention)) {
      draw_when_due(probs, rows * kGroup, timed);
      for (int h = 0; h < hkv; ++h) cache.observe(0, h, probs.window(cache.size(0, h) * kGroup));
      probs.advance();
    }
  }
  void step() {
    if (warm) {
      stage_when_due();
      append_warm();
    } else {
      append();
    }
    observe();
    ++t;
  }
  // Fill without attention (cheap), then observe a few hundred steps so scores differ.
  void fill(std::size_t n) {
    while (cache.size(0, 0) < n) {
      append();
      ++t;
    }
    for (int i = 0; i < 256; ++i) step();
  }
};

template <class Policy>
void policy_steps(benchmark::State& state, Policy policy, bool fresh_keys) {
  const auto n = static_cast<std::size_t>(state.range(0));
  const int hkv = static_cast<int>(state.range(1));
  Run<Policy> run(hkv, n, std::move(policy), fresh_keys);
  run.fill(n);
  run.timed = &state;
  for (auto _ : state) run.step();
  state.counters["n"] = static_cast<double>(n);
  state.counters["hkv"] = hkv;
}
template <class Policy>
void BM_policy(benchmark::State& state, Policy policy) {
  policy_steps(state, std::move(policy), false);
}
// BM_policy with warm input (Run::warm: each token's K/V/Q copied into a small buffer a
// few steps before its append, in timer pauses at BM_draw_pause's cadence for every
// policy). Its figures include BM_draw_pause's per-step cost (the pauses' clock reads):
// read it less BM_draw_pause from the same run. bench/run_policy_step_bench.sh runs it but
// does not put it in its table (docs/benchmarks.md, "The 1K step and the benchmarks'
// artefacts, stop 42"). For StreamingLLM the staging pauses cost more than BM_draw_pause
// shows: use bench_scorers' BM_step_warm / BM_block_warm there.
template <class Policy>
void BM_policy_warm(benchmark::State& state, Policy policy) {
  const auto n = static_cast<std::size_t>(state.range(0));
  const int hkv = static_cast<int>(state.range(1));
  Run<Policy> run(hkv, n, std::move(policy));
  run.warm = true;
  run.fill(n);
  run.timed = &state;
  for (auto _ : state) run.step();
  state.counters["n"] = static_cast<double>(n);
  state.counters["hkv"] = hkv;
}
// BM_policy on fresh keys (Run::fresh: no key repeats within 32576 tokens).
template <class Policy>
void BM_policy_fresh(benchmark::State& state, Policy policy) {
  policy_steps(state, std::move(policy), true);
}

// What BM_policy's timer keeps of its pauses around the probability draws: the same
// refill cadence with no policy work (per step; BM_policy's figures include it).
void BM_draw_pause(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  ProbStream probs;
  const std::size_t width = n * kGroup;
  for (auto _ : state) {
    draw_when_due(probs, width, &state);
    benchmark::DoNotOptimize(probs.window(width).data());
    probs.advance();
  }
  state.counters["n"] = static_cast<double>(n);
}

void BM_attend(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  const int hkv = static_cast<int>(state.range(1));
  Run<policies::StreamingLLM> run(hkv, n, policies::StreamingLLM{});
  run.fill(n);
  const auto q = pool().query(3, hkv);
  for (auto _ : state) {
    auto r = attend(run.cache, 0, q, {.observe = false});
    benchmark::DoNotOptimize(r.out.data());
  }
  state.counters["n"] = static_cast<double>(n);
  state.counters["hkv"] = hkv;
}

policies::BuzzBeehive buzz() {
  return policies::BuzzBeehive({.sinks = 4, .budget_mode = true});
}

// BUZZ between rebuilds (its head is not full: append only writes the row).
void BM_buzz_steady(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  const int hkv = static_cast<int>(state.range(1));
  Run<policies::BuzzBeehive> run(hkv, n, buzz());
  run.fill(n);  // includes at least one rebuild, so the head now has room
  run.timed = &state;
  for (auto _ : state) {
    if (run.cache.size(0, 0) + 1 >= n) {  // next step would rebuild: refill elsewhere
      state.PauseTiming();
      run.timed = nullptr;
      run.step();
      run.timed = &state;
      state.ResumeTiming();
    }
    run.step();
  }
  state.counters["n"] = static_cast<double>(n);
  state.counters["hkv"] = hkv;
}

// The rebuild step, and the period between rebuilds (steps from one rebuild to the next).
void BM_buzz_rebuild(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  const int hkv = static_cast<int>(state.range(1));
  Run<policies::BuzzBeehive> run(hkv, n, buzz());
  run.fill(n);
  run.timed = &state;
  double period = 0;
  std::size_t rebuilds = 0;
  for (auto _ : state) {
    state.PauseTiming();
    std::size_t steps = 0;
    while (run.cache.size(0, 0) < n) {
      run.append();
      ++run.t;
      ++steps;
    }
    state.ResumeTiming();
    run.step();  // the head is full: this append rebuilds
    period += static_cast<double>(steps + 1);
    ++rebuilds;
  }
  state.counters["period"] = period / static_cast<double>(rebuilds);
  state.counters["n"] = static_cast<double>(n);
  state.counters["hkv"] = hkv;
}

void sizes(benchmark::internal::Benchmark* b) {
  for (int hkv : {1, 8})
    for (long n : {1024L, 4096L, 16384L, 65536L}) b->Args({n, hkv});
  b->Unit(benchmark::kMicrosecond);
}

policies::HashEvictKey hash_key(int bits) {
  return policies::HashEvictKey({.bits = bits});
}
policies::HashEvictQuery hash_query(int bits) {
  return policies::HashEvictQuery({.bits = bits});
}

}  // namespace

BENCHMARK(BM_attend)->Apply(sizes);
// A fixed count: its timed work is tiny, so a minimum time would mean minutes of draws.
BENCHMARK(BM_draw_pause)
    ->Arg(1024)
    ->Arg(4096)
    ->Arg(16384)
    ->Arg(65536)
    ->Iterations(4096)
    ->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_policy, streaming_llm, policies::StreamingLLM{})->Apply(sizes);
BENCHMARK_CAPTURE(BM_policy, h2o, policies::H2O({.recent = 64}))->Apply(sizes);
BENCHMARK_CAPTURE(BM_policy, decayed_recommended, policies::DecayedAttention::recommended())
    ->Apply(sizes);
// recommended() with the distinct-key recall reserve (RecallDedup::protected_rows, step 0.1;
// the pool's 509 keys repeat, so signatures repeat as in repeated text), at recall fraction
// 1/8 and 1/4 (docs/quality.md, "The filler measure at 128 rows, stop 38").
namespace {
policies::DecayedAttention decayed_distinct(float recall) {
  return policies::DecayedAttention(
      {.sinks = 1,
       .horizon = 3.0f,
       .recent_fraction = 0.375f,
       .recall_fraction = recall,
       .recall_dedup = policies::DecayedAttention::RecallDedup::protected_rows,
       .dedup_step = 0.1f});
}
}  // namespace
BENCHMARK_CAPTURE(BM_policy, decayed_distinct, decayed_distinct(0.125f))->Apply(sizes);
BENCHMARK_CAPTURE(BM_policy, decayed_distinct_quarter, decayed_distinct(0.25f))->Apply(sizes);
BENCHMARK_CAPTURE(BM_policy_warm, streaming_llm, policies::StreamingLLM{})->Apply(sizes);
BENCHMARK_CAPTURE(BM_policy_warm, decayed_recommended, policies::DecayedAttention::recommended())
    ->Apply(sizes);
BENCHMARK_CAPTURE(BM_policy_fresh, decayed_recommended, policies::DecayedAttention::recommended())
    ->Apply(sizes);
BENCHMARK_CAPTURE(BM_policy_fresh, decayed_distinct_quarter, decayed_distinct(0.25f))
    ->Apply(sizes);
BENCHMARK(BM_buzz_steady)->Apply(sizes);
BENCHMARK(BM_buzz_rebuild)->Apply(sizes)->Iterations(3);
BENCHMARK_CAPTURE(BM_policy, hashevict_key_b16, hash_key(16))->Apply(sizes);
BENCHMARK_CAPTURE(BM_policy, hashevict_key_b64, hash_key(64))->Apply(sizes);
BENCHMARK_CAPTURE(BM_policy, hashevict_query_b16, hash_query(16))->Apply(sizes);
BENCHMARK_CAPTURE(BM_policy, hashevict_query_b64, hash_query(64))->Apply(sizes);

int main(int argc, char** argv) { return kvbench::run_benchmarks(argc, argv); }
