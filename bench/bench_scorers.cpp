// Probability-free scorers: per-step policy cost (append = the eviction decision, which is
// where ExpectedAttention and KeyDiff score the rows, + the storage copy) at a full cache of
// C rows, next to the attention step over the same cache (kvevict::attend into a reused
// workspace, no observe). One layer, Hkv 8, G 4, head dim 128, no RoPE. Thread CPU time per
// phase. One iteration = a fixed number of decode steps (the second argument: 64 x max(1,
// 16384 / C), 16 at 64K rows; 128 for the paper's ExpectedAttention), starting on a
// rescoring; see BM_step for how R > 1 is averaged.
//   bench_scorers --benchmark_repetitions=3 --benchmark_report_aggregates_only=true
// policy_over_attend = the append's mean time per step over the rescoring schedule (see
// BM_step) / the attention step's mean time.
#include <benchmark/benchmark.h>

#include "bench_main.hpp"
#include "step_tokens.hpp"

#include <cstdio>
#include <kvevict/attention.hpp>
#include <kvevict/cache.hpp>
#include <kvevict/kernels/kernels.hpp>
#include <kvevict/policies/expected_attention.hpp>
#include <kvevict/policies/keydiff.hpp>
#include <kvevict/policies/streaming_llm.hpp>
#include <string>
#include <type_traits>
#include <vector>

using namespace kvevict;

namespace {

const Geometry kGeometry{1, 32, 8, 128};

using kvbench::cpu_ns;
using Pool = kvbench::StepTokens;

using policies::ExpectedAttention;
using policies::KeyDiff;

// R: how many decisions of a head share one rescoring of all rows (1 for every step).
template <class Policy>
std::size_t period(const Policy& p, std::size_t cap) {
  if constexpr (std::is_same_v<Policy, ExpectedAttention>) return p.amortised() ? p.every(cap) : 1;
  else if constexpr (std::is_same_v<Policy, KeyDiff>) return p.config().rescore_every;
  else return 1;
}

// One step's append: token t's K/V/Q from the pool, or (staged) from the staging buffer
// the caller filled for t.
template <class Policy>
void append_token(KVCache<Policy>& cache, const Pool& pool, const kvbench::StagedToken* staged,
                  std::size_t t) {
  if (staged != nullptr)
    cache.append(0, static_cast<std::int64_t>(t), staged->key(), staged->value(), staged->query());
  else
    cache.append(0, static_cast<std::int64_t>(t), pool.key(t), pool.value(t), pool.query(t));
}
// Fills the cache, then a multiple of R decisions (at least 8): the next decision rescores.
// Returns the next token.
template <class Policy>
std::size_t fill_to_rescoring(KVCache<Policy>& cache, const Pool& pool, kvbench::StagedToken* staged,
                              std::size_t cap, std::size_t R) {
  const std::size_t decided = R * ((8 + R - 1) / R);
  std::size_t t = 0;
  for (; t < cap + decided; ++t) {
    if (staged != nullptr) staged->stage(pool, t);
    append_token(cache, pool, staged, t);
  }
  return t;
}

// The timed window starts on a rescoring (every head decides once per step, so all heads
// rescore on the same steps: those with decision index % R == 0). Append times of the
// rescoring steps and of the others are kept apart, and the per-step policy cost is the
// schedule's mean, (rescoring + (R - 1) x between) / R: exact for R dividing the window,
// and the only way to time R = C / 16 at 64K rows (a 4096-step cycle) in seconds.
// BM_step: step_loop(.., warm = false, timer = false); BM_step_cold / BM_step_warm below.
template <class Policy>
void step_loop(benchmark::State& state, const Policy& policy, bool warm, bool timer) {
  const auto cap = static_cast<std::size_t>(state.range(0));
  const auto steps = static_cast<std::size_t>(state.range(1));
  const std::size_t R = period(policy, cap);
  static const Pool pool;
  KVCache<Policy> cache(kGeometry, Budget::uniform(static_cast<long long>(cap)), policy);
  AttendWorkspace ws;
  std::vector<float> out(static_cast<std::size_t>(kGeometry.n_heads * kGeometry.head_dim));
  kvbench::StagedToken staging;
  kvbench::StagedToken* staged = warm ? &staging : nullptr;
  std::size_t t = fill_to_rescoring(cache, pool, staged, cap, R);
  double resc_ns = 0, between_ns = 0, attend_ns = 0, timer_ns = 0;
  std::size_t n_resc = 0, n_between = 0, done = 0;
  for (auto _ : state) {
    for (std::size_t s = 0; s < steps; ++s) {
      if (staged != nullptr) staged->stage(pool, t);
      if (timer) {  // a back-to-back pair: what the two reads around the append cost
        const double z0 = cpu_ns();
        timer_ns += cpu_ns() - z0;
      }
      const double a = cpu_ns();
      append_token(cache, pool, staged, t++);
      const double b = cpu_ns();
      attend(cache, 0, pool.query(t - 1), out, ws, {.observe = false});
      benchmark::DoNotOptimize(out.data());
      const double c = cpu_ns();
      if (s % R == 0) {
        resc_ns += b - a;
        ++n_resc;
      } else {
        between_ns += b - a;
        ++n_between;
      }
      attend_ns += c - b;
    }
    done += steps;
  }
  const double resc = resc_ns / static_cast<double>(n_resc);
  const double between = n_between > 0 ? between_ns / static_cast<double>(n_between) : resc;
  const double per_step = (resc + static_cast<double>(R - 1) * between) / static_cast<double>(R);
  const double attend_step = attend_ns / static_cast<double>(done);
  state.counters["R"] = static_cast<double>(R);
  state.counters["rescore_us"] = resc / 1e3;
  state.counters["between_us"] = between / 1e3;
  state.counters["attend_us"] = attend_step / 1e3;
  state.counters["policy_over_attend"] = per_step / attend_step;
  if (timer) {
    const double pair = timer_ns / static_cast<double>(done);
    state.counters["timer_us"] = pair / 1e3;
    state.counters["policy_over_attend_net"] = (per_step - pair) / attend_step;
  }
}
template <class Policy>
void BM_step(benchmark::State& state, Policy policy) {
  step_loop(state, policy, false, false);
}

// BM_step's two artefacts, reported next to its own measure (BM_step is unchanged).
//  - Cold input: BM_step reads the token's K/V/Q from a 12 MB pool that the step's 8 MB
//    attention pass evicts, so the append's first reader (the input checks) waits on DRAM.
//    An engine's K/V/Q were just written by its projections. BM_step_warm copies the
//    token's K/V/Q into a 24 KB staging buffer before the append's timer starts (the copy is
//    not timed), so the append reads them from L1/L2 as an engine's would.
//  - The timer: BM_step reads the thread CPU clock twice per step around the append (a
//    system call on this VM). BM_step_cold and BM_step_warm time a back-to-back clock pair
//    every step in the same run (timer_us) and report the append less it
//    (policy_over_attend_net). BM_block_warm reads no clock per step: it times blocks of
//    16 warm steps (staging copy + append + attend) against blocks of 16 attention-only
//    steps over the same cache (staging copy + attend), alternating, and reports the
//    difference over the attention-only step: what an engine meets (its attention steps
//    interleave with the policy's, nothing reads a clock, K/V/Q are warm).
// Counters of BM_step_cold / BM_step_warm: BM_step's, plus timer_us, policy_over_attend_net.
template <class Policy>
void BM_step_cold(benchmark::State& state, Policy policy) {
  step_loop(state, policy, false, true);
}
template <class Policy>
void BM_step_warm(benchmark::State& state, Policy policy) {
  step_loop(state, policy, true, true);
}

// Blocks of L = 16 warm steps (stage + append + attend) alternating with blocks of 16
// attention-only steps over the same cache (stage + attend), one clock pair per block on
// both sides, so the clock reads cancel in the difference and cost a pair per 16 steps.
// A block's policy cost is its time less the attention-only block's that follows it. With
// R > 16 (R a multiple of 16 here) only the blocks whose first step is a decision index
// multiple of R hold a rescoring: the per-step cost is the schedule's mean as in BM_step,
// ((rescoring blocks) + (R / 16 - 1) x (other blocks)) / R. Counters: block_us and
// attend_block_us per step (means), policy_us the schedule's per-step policy cost,
// policy_over_attend = policy_us / attend_block_us.
template <class Policy>
void BM_block_warm(benchmark::State& state, Policy policy) {
  constexpr std::size_t L = 16;
  const auto cap = static_cast<std::size_t>(state.range(0));
  const auto steps = static_cast<std::size_t>(state.range(1));
  const std::size_t R = period(policy, cap);
  if (steps % L != 0 || (R > L ? R % L != 0 : L % R != 0)) {
    state.SkipWithError("steps must be a multiple of 16 and R divide or be a multiple of 16");
    return;
  }
  static const Pool pool;
  KVCache<Policy> cache(kGeometry, Budget::uniform(static_cast<long long>(cap)), policy);
  AttendWorkspace ws;
  std::vector<float> out(static_cast<std::size_t>(kGeometry.n_heads * kGeometry.head_dim));
  kvbench::StagedToken staged;
  std::size_t t = fill_to_rescoring(cache, pool, &staged, cap, R);
  double block_ns = 0, attend_ns = 0, resc_extra = 0, between_extra = 0;
  std::size_t n_resc = 0, n_between = 0, done = 0, blocks = 0;
  for (auto _ : state) {
    for (std::size_t s0 = 0; s0 < steps; s0 += L) {
      const double a = cpu_ns();
      for (std::size_t s = 0; s < L; ++s) {
        staged.stage(pool, t);
        append_token(cache, pool, &staged, t++);
        attend(cache, 0, staged.query(), out, ws, {.observe = false});
        benchmark::DoNotOptimize(out.data());
      }
      const double b = cpu_ns();
      for (std::size_t s = 0; s < L; ++s) {  // the same work without the append
        staged.stage(pool, t + s);
        attend(cache, 0, staged.query(), out, ws, {.observe = false});
        benchmark::DoNotOptimize(out.data());
      }
      const double c = cpu_ns();
      block_ns += b - a;
      attend_ns += c - b;
      if ((blocks * L) % R == 0) {
        resc_extra += (b - a) - (c - b);
        ++n_resc;
      } else {
        between_extra += (b - a) - (c - b);
        ++n_between;
      }
      ++blocks;
    }
    done += steps;
  }
  const double resc = resc_extra / static_cast<double>(n_resc);
  const double between = n_between > 0 ? between_extra / static_cast<double>(n_between) : resc;
  const double per_block = R > L ? (resc + static_cast<double>(R / L - 1) * between) / static_cast<double>(R / L)
                                 : resc;
  const double per_step = per_block / static_cast<double>(L);
  const double attend_step = attend_ns / static_cast<double>(done);
  state.counters["R"] = static_cast<double>(R);
  state.counters["block_us"] = block_ns / static_cast<double>(done) / 1e3;
  state.counters["attend_block_us"] = attend_step / 1e3;
  state.counters["policy_us"] = per_step / 1e3;
  state.counters["policy_over_attend"] = per_step / attend_step;
}

// The registry's `probfree` (no RoPE here), with the two cost knobs.
ExpectedAttention probfree(std::size_t every, bool float_logits, float fraction = 0.0f,
                           std::size_t all_up_to = 0) {
  return ExpectedAttention({.sinks = 1,
                            .recent_fraction = 0.375f,
                            .query_window = 1,
                            .future_positions = 16,
                            .covariance = ExpectedAttention::Covariance::none,
                            .rope = policies::RopeLayout::none,
                            .horizon = 3.0f,
                            .rescore_every = every,
                            .float_logits = float_logits,
                            .rescore_fraction = fraction,
                            .rescore_all_up_to = all_up_to});
}
// The registry's `expected` (paper settings: covariance, W 128), no RoPE.
ExpectedAttention paper(std::size_t every) {
  return ExpectedAttention({.rope = policies::RopeLayout::none, .rescore_every = every});
}
KeyDiff keydiff(std::size_t every) { return KeyDiff({.rescore_every = every}); }

void sizes(benchmark::internal::Benchmark* b) {
  for (long long n : {1024, 4096, 16384, 65536})
    b->Args({n, n >= 65536 ? 16 : 64 * std::max(1LL, 16384 / n)});
  b->Iterations(1)->Unit(benchmark::kMillisecond);
}
// The paper's settings (full covariance: O(G d^2) per row and per query) at 1K and 4K only:
// at 16K and more its fill alone (W 128 moments, O(G d^2) per appended token) takes minutes.
void paper_sizes(benchmark::internal::Benchmark* b) {
  for (long long n : {1024, 4096}) b->Args({n, 128});
  b->Iterations(1)->Unit(benchmark::kMillisecond);
}

}  // namespace

BENCHMARK_CAPTURE(BM_step, streaming_llm, policies::StreamingLLM{.sinks = 1})->Apply(sizes);
BENCHMARK_CAPTURE(BM_step, probfree_r1_double, probfree(1, false))->Apply(sizes);
BENCHMARK_CAPTURE(BM_step, probfree_r1_float, probfree(1, true))->Apply(sizes);
BENCHMARK_CAPTURE(BM_step, probfree_r16_float, probfree(16, true))->Apply(sizes);
BENCHMARK_CAPTURE(BM_step, probfree_r64_float, probfree(64, true))->Apply(sizes);
// R = floor(C / 16) (64 at 1K rows, 4096 at 64K) and floor(C / 8).
BENCHMARK_CAPTURE(BM_step, probfree_frac16_float, probfree(1, true, 1.0f / 16))->Apply(sizes);
BENCHMARK_CAPTURE(BM_step, probfree_frac8_float, probfree(1, true, 1.0f / 8))->Apply(sizes);
// The registry's `probfree`: R 1 up to 128 rows, floor(C / 8) beyond (= frac8 from 1K rows).
BENCHMARK_CAPTURE(BM_step, probfree_registry, probfree(1, true, 1.0f / 8, 128))->Apply(sizes);
// The artefacts' variants (see step_loop, BM_block_warm) for StreamingLLM and the
// registry's probfree.
BENCHMARK_CAPTURE(BM_step_cold, streaming_llm, policies::StreamingLLM{.sinks = 1})->Apply(sizes);
BENCHMARK_CAPTURE(BM_step_warm, streaming_llm, policies::StreamingLLM{.sinks = 1})->Apply(sizes);
BENCHMARK_CAPTURE(BM_block_warm, streaming_llm, policies::StreamingLLM{.sinks = 1})->Apply(sizes);
BENCHMARK_CAPTURE(BM_step_cold, probfree_registry, probfree(1, true, 1.0f / 8, 128))->Apply(sizes);
BENCHMARK_CAPTURE(BM_step_warm, probfree_registry, probfree(1, true, 1.0f / 8, 128))->Apply(sizes);
BENCHMARK_CAPTURE(BM_block_warm, probfree_registry, probfree(1, true, 1.0f / 8, 128))->Apply(sizes);
BENCHMARK_CAPTURE(BM_step, expected_paper_r32, paper(32))->Apply(paper_sizes);
BENCHMARK_CAPTURE(BM_step, keydiff_r1, keydiff(1))->Apply(sizes);
BENCHMARK_CAPTURE(BM_step, keydiff_r32, keydiff(32))->Apply(sizes);
BENCHMARK_CAPTURE(BM_step, keydiff_r64, keydiff(64))->Apply(sizes);

int main(int argc, char** argv) { return kvbench::run_benchmarks(argc, argv); }
