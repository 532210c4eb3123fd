// Pooled budgets (Budget::pooled(), layer_pool.hpp): per-step cost of run-time per-head
// budgets against the uniform budget, in one run. Four caches of DecayedAttention::
// recommended() run in lockstep on the same tokens: the uniform budget B; pooled per layer
// and pooled over the whole cache (floor 1/4, the share capacity); and the recommended
// run-time setting (llama2c_headline --adaptive: whole cache, floor 1/4, share capacity,
// share_exponent 1/2); and that setting with the split re-decided on some steps of the pool
// only (the amortised split, stop 39; every step in the others): its frozen steps follow
// the eviction schedule (PoolOptions::Frozen::schedule, stop 40; stop 39's binary measured
// Frozen::own every 32 appends there), re-split once they took in --rebalance_fraction (default 1/40) of the
// pool's rows (PoolOptions::rebalance_fraction). Per decode token every layer appends (the eviction decision +
// storage), attends (the reference kernel) and observes. Thread CPU time per phase, summed
// over the layers; the counters are per token. The caches of one B are filled once (B + 256
// tokens, so the shares have moved) and kept across repetitions (at 4096 rows the fill
// takes minutes). 4 layers, H 32, Hkv 8, head dim 128.
//   bench_layer_pool --benchmark_repetitions=5 --benchmark_report_aggregates_only=true
#include <benchmark/benchmark.h>

#include "step_tokens.hpp"

#include <algorithm>
#include <ctime>
#include <fstream>
#include <map>
#include <memory>
#include <kvevict/attention.hpp>
#include <kvevict/cache.hpp>
#include <kvevict/policies/decayed_attention.hpp>
#include <random>
#include <string>
#include <vector>

using namespace kvevict;

namespace {

const Geometry kGeometry{4, 32, 8, 128};
// PoolOptions::rebalance_every of the `amortised` cache, in appends of any layer (a whole-
// cache pool): 32 = every 8th token of these 4 layers (chosen before the quality runs, in
// stop 39 for Frozen::own). Stop 40 (Frozen::schedule): the split re-decided once the frozen
// steps took in 1/40 of the pool's rows (PoolOptions::rebalance_fraction; chosen on
// stories260K's tuning streams, llama2c_headline --adaptive --tune --rebalance-grid): every
// floor(32 B / 40 / 8) appends here, 102 at 1024 rows, 409 at 4096.
// Stop 41: --rebalance_fraction=F and --rebalance_min=M (PoolOptions::rebalance_min; no
// effect at these pools' sizes for M <= 100) set the amortised cache instead.
double g_rebalance_fraction = 1.0 / 40;
std::size_t g_rebalance_min = 0;

using kvbench::cpu_ns;
using Tokens = kvbench::StepTokens;

using Cache = KVCache<policies::DecayedAttention>;

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

// The caches of one B, filled once and kept across repetitions.
struct Caches {
  Cache uniform, layer, model, scaled, amortised;
  std::size_t t = 0;
  static PoolOptions options(PoolOptions::Scope scope, double exponent, double fraction = 0.0,
                             std::size_t min = 0) {
    return {.floor_fraction = 0.25, .capacity = PoolOptions::Capacity::share, .scope = scope,
            .share_exponent = exponent,
            .frozen = fraction > 0.0 ? PoolOptions::Frozen::schedule : PoolOptions::Frozen::own,
            .rebalance_fraction = fraction, .rebalance_min = min};
  }
  explicit Caches(long long cap)
      : uniform(kGeometry, Budget::uniform(cap), policies::DecayedAttention::recommended()),
        layer(kGeometry, Budget::uniform(cap).pooled(options(PoolOptions::Scope::layer, 0.0)),
              policies::DecayedAttention::recommended()),
        model(kGeometry, Budget::uniform(cap).pooled(options(PoolOptions::Scope::model, 0.0)),
              policies::DecayedAttention::recommended()),
        scaled(kGeometry, Budget::uniform(cap).pooled(options(PoolOptions::Scope::model, 0.5)),
               policies::DecayedAttention::recommended()),
        amortised(kGeometry,
                  Budget::uniform(cap).pooled(
                      options(PoolOptions::Scope::model, 0.5, g_rebalance_fraction, g_rebalance_min)),
                  policies::DecayedAttention::recommended()) {}
  void all(const Tokens& tk, Times* tu, Times* tl, Times* tm, Times* ts, Times* ta) {
    token(uniform, tk, t, tu);
    token(layer, tk, t, tl);
    token(model, tk, t, tm);
    token(scaled, tk, t, ts);
    token(amortised, tk, t, ta);
    ++t;
  }
};

void BM_pool_step(benchmark::State& state) {
  const auto cap = static_cast<long long>(state.range(0));
  static const Tokens tk;
  static std::map<long long, std::unique_ptr<Caches>> kept;
  auto& cs = kept[cap];
  if (!cs) {
    cs = std::make_unique<Caches>(cap);
    while (cs->t < static_cast<std::size_t>(cap + 256))  // fill, then let the shares move
      cs->all(tk, nullptr, nullptr, nullptr, nullptr, nullptr);
  }
  Times tu, tl, tm, ts, ta;
  std::size_t steps = 0;
  for (auto _ : state) {
    cs->all(tk, &tu, &tl, &tm, &ts, &ta);
    ++steps;
  }
  const double n = static_cast<double>(steps);
  const auto step = [](const Times& x) { return x.append + x.attend + x.observe; };
  state.counters["uniform_append_ns"] = tu.append / n;
  state.counters["layer_append_ns"] = tl.append / n;
  state.counters["model_append_ns"] = tm.append / n;
  state.counters["scaled_append_ns"] = ts.append / n;
  state.counters["amortised_append_ns"] = ta.append / n;
  state.counters["attend_ns"] = tu.attend / n;
  // Whole token (append + attend + observe), pooled over uniform; and the extra append
  // cost as a share of the attention step.
  state.counters["layer_over_uniform"] = step(tl) / step(tu);
  state.counters["model_over_uniform"] = step(tm) / step(tu);
  state.counters["scaled_over_uniform"] = step(ts) / step(tu);
  state.counters["amortised_over_uniform"] = step(ta) / step(tu);
  state.counters["layer_extra_over_attend"] = (tl.append - tu.append) / tu.attend;
  state.counters["model_extra_over_attend"] = (tm.append - tu.append) / tu.attend;
  state.counters["scaled_extra_over_attend"] = (ts.append - tu.append) / tu.attend;
  state.counters["amortised_extra_over_attend"] = (ta.append - tu.append) / tu.attend;
}

}  // namespace

BENCHMARK(BM_pool_step)->Arg(256)->Arg(1024)->Arg(4096)->MinTime(2.0)->Unit(benchmark::kMillisecond);

int main(int argc, char** argv) {
  std::ifstream cpuinfo("/proc/cpuinfo");
  for (std::string line; std::getline(cpuinfo, line);)
    if (line.rfind("model name", 0) == 0) {
      benchmark::AddCustomContext("cpu", line.substr(line.find(':') + 2));
      break;
    }
  // Our flags, removed before the benchmark library reads the rest.
  int kept = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--rebalance_fraction=", 0) == 0) g_rebalance_fraction = std::stod(a.substr(21));
    else if (a.rfind("--rebalance_min=", 0) == 0) g_rebalance_min = std::stoul(a.substr(16));
    else argv[kept++] = argv[i];
  }
  argc = kept;
  benchmark::AddCustomContext("amortised", "rebalance_fraction " + std::to_string(g_rebalance_fraction) +
                                               ", rebalance_min " + std::to_string(g_rebalance_min));
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
