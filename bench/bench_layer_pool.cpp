// Pooled budgets (Budget::pooled(), layer_pool.hpp): per-step cost of run-time per-head
// budgets against the uniform budget, in one run. Five caches of DecayedAttention::
// recommended() (uniform B; pooled per layer and pooled over the whole cache, both with the
// share capacity the headline uses, each once with the single protection pass
// (pooled_victims reuses eviction_costs' protection) and once with the two-pass path (the
// same policy with pooled_victims hidden, so the core calls choose_victims after
// eviction_costs)) run in lockstep on the same tokens: per decode token every layer
// appends (the eviction decision + storage), attends (the reference kernel) and observes.
// Thread CPU time per phase, summed over the layers; the counters are per token. 4 layers,
// H 32, Hkv 8, head dim 128.
//   bench_layer_pool
#include <benchmark/benchmark.h>

#include "step_tokens.hpp"

#include <algorithm>
#include <ctime>
#include <fstream>
#include <kvevict/attention.hpp>
#include <kvevict/cache.hpp>
#include <kvevict/policies/decayed_attention.hpp>
#include <random>
#include <string>
#include <vector>

using namespace kvevict;

namespace {

const Geometry kGeometry{4, 32, 8, 128};

using kvbench::cpu_ns;
using Tokens = kvbench::StepTokens;

// The two-pass path: DecayedAttention without its pooled_victims hook.
struct TwoPass : policies::DecayedAttention {
  explicit TwoPass(const policies::DecayedAttention& d) : policies::DecayedAttention(d) {}
  template <class S>
  void pooled_victims(const HeadView<S>&, std::vector<std::uint32_t>&) = delete;
};
static_assert(detail::HasPooledVictims<policies::DecayedAttention>);
static_assert(!detail::HasPooledVictims<TwoPass>);

using Cache = KVCache<policies::DecayedAttention>;
using Cache2 = KVCache<TwoPass>;

struct Times {
  double append = 0, attend = 0, observe = 0;
};

// One decode token through every layer of `cache`.
template <class Cache>
void token(Cache& cache, const Tokens& tk, std::size_t t, Times* times) {
  for (int l = 0; l < kGeometry.n_layers; ++l) {
    // Layers see different tokens, so their heads' attention differs.
    const std::size_t u = t * 3 + static_cast<std::size_t>(l) * 101;
    const double a = cpu_ns();
    cache.append(l, static_cast<std::int64_t>(t), tk.key(u), tk.value(u));
    const double b = cpu_ns();
    const auto r = attend(cache, l, tk.query(u), {.observe = false});
    const double c = cpu_ns();
    for (int kh = 0; kh < kGeometry.n_kv_heads; ++kh) {
      const auto& p = r.probs[static_cast<std::size_t>(kh)];
      cache.observe(l, kh, {p.data(), static_cast<std::size_t>(p.size())});
    }
    const double d = cpu_ns();
    if (times) {
      times->append += b - a;
      times->attend += c - b;
      times->observe += d - c;
    }
  }
}

void BM_pool_step(benchmark::State& state) {
  const auto cap = static_cast<long long>(state.range(0));
  static const Tokens tk;
  const auto policy = policies::DecayedAttention::recommended();
  const PoolOptions per_layer{.floor_fraction = 0.25, .capacity = PoolOptions::Capacity::share};
  PoolOptions whole = per_layer;
  whole.scope = PoolOptions::Scope::model;
  Cache uniform(kGeometry, Budget::uniform(cap), policy);
  Cache layer(kGeometry, Budget::uniform(cap).pooled(per_layer), policy);
  Cache model(kGeometry, Budget::uniform(cap).pooled(whole), policy);
  Cache2 layer2(kGeometry, Budget::uniform(cap).pooled(per_layer), TwoPass(policy));
  Cache2 model2(kGeometry, Budget::uniform(cap).pooled(whole), TwoPass(policy));
  std::size_t t = 0;
  const auto all = [&](Times* tu, Times* tl, Times* tm, Times* tl2, Times* tm2) {
    token(uniform, tk, t, tu);
    token(layer, tk, t, tl);
    token(model, tk, t, tm);
    token(layer2, tk, t, tl2);
    token(model2, tk, t, tm2);
  };
  for (; t < static_cast<std::size_t>(cap + 256); ++t)  // fill, then let the shares move
    all(nullptr, nullptr, nullptr, nullptr, nullptr);
  Times tu, tl, tm, tl2, tm2;
  std::size_t steps = 0;
  for (auto _ : state) {
    all(&tu, &tl, &tm, &tl2, &tm2);
    ++t;
    ++steps;
  }
  // The single pass must decide as the two passes did.
  for (int l = 0; l < kGeometry.n_layers; ++l)
    for (int kh = 0; kh < kGeometry.n_kv_heads; ++kh) {
      const auto a = layer.positions(l, kh), b = layer2.positions(l, kh);
      const auto c = model.positions(l, kh), d = model2.positions(l, kh);
      if (!std::equal(a.begin(), a.end(), b.begin(), b.end()) ||
          !std::equal(c.begin(), c.end(), d.begin(), d.end())) {
        state.SkipWithError("the single pass kept other rows than the two-pass path");
        return;
      }
    }
  const double n = static_cast<double>(steps);
  const auto step = [](const Times& x) { return x.append + x.attend + x.observe; };
  state.counters["uniform_append_ns"] = tu.append / n;
  state.counters["layer_append_ns"] = tl.append / n;
  state.counters["model_append_ns"] = tm.append / n;
  state.counters["layer_2pass_append_ns"] = tl2.append / n;
  state.counters["model_2pass_append_ns"] = tm2.append / n;
  state.counters["attend_ns"] = tu.attend / n;
  // Whole token (append + attend + observe), pooled over uniform; and the extra append
  // cost as a share of the attention step.
  state.counters["layer_over_uniform"] = step(tl) / step(tu);
  state.counters["model_over_uniform"] = step(tm) / step(tu);
  state.counters["layer_extra_over_attend"] = (tl.append - tu.append) / tu.attend;
  state.counters["model_extra_over_attend"] = (tm.append - tu.append) / tu.attend;
  state.counters["layer_2pass_extra_over_attend"] = (tl2.append - tu.append) / tu.attend;
  state.counters["model_2pass_extra_over_attend"] = (tm2.append - tu.append) / tu.attend;
}

}  // namespace

BENCHMARK(BM_pool_step)->Arg(256)->Arg(1024)->MinTime(2.0)->Unit(benchmark::kMillisecond);

int main(int argc, char** argv) {
  std::ifstream cpuinfo("/proc/cpuinfo");
  for (std::string line; std::getline(cpuinfo, line);)
    if (line.rfind("model name", 0) == 0) {
      benchmark::AddCustomContext("cpu", line.substr(line.find(':') + 2));
      break;
    }
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
