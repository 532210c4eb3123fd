// BuzzBeehive: amortised per-step policy cost (score accumulation + rebuilds, through the
// real KVCache path) next to the reference attention over the same cache, 4K..128K tokens,
// head dim 128, Hkv 8, G 4. Extra modes (no timing) for docs/policies/buzz.md:
//   bench_buzz --curve [every] [tokens]   cache size (min/max per bucket), both forms (CSV)
//   bench_buzz --quality  mass recall / output error vs the full cache, both forms (CSV)
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <kvevict/attention.hpp>
#include <kvevict/cache.hpp>
#include <kvevict/metrics.hpp>
#include <kvevict/policies/buzz.hpp>
#include <random>
#include <string>
#include <vector>

using kvevict::Budget;
using kvevict::Geometry;
using kvevict::KVCache;
using kvevict::policies::BuzzBeehive;

namespace {

// A pool of random tokens, cycled: generating 6K normals per step would cost as much as
// the policy work being measured.
struct TokenPool {
  std::size_t n, kv, q;
  std::vector<float> keys, values, queries;
  TokenPool(const Geometry& g, std::size_t tokens, unsigned seed)
      : n(tokens),
        kv(static_cast<std::size_t>(g.n_kv_heads * g.head_dim)),
        q(static_cast<std::size_t>(g.n_heads * g.head_dim)) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> d;
    keys.resize(n * kv);
    values.resize(n * kv);
    queries.resize(n * q);
    for (auto& x : keys) x = d(rng);
    for (auto& x : values) x = d(rng);
    for (auto& x : queries) x = d(rng);
  }
  std::span<const float> key(std::size_t t) const { return {keys.data() + (t % n) * kv, kv}; }
  std::span<const float> value(std::size_t t) const { return {values.data() + (t % n) * kv, kv}; }
  // A different rotation for queries, so query t never pairs with key t's pool slot only.
  std::span<const float> query(std::size_t t) const {
    return {queries.data() + ((t * 7 + 3) % n) * q, q};
  }
};

const Geometry kGeometry{1, 32, 8, 128};

// Thread CPU time, not wall time: the machine is shared, and a preempted step would be
// charged to whichever phase it was in.
double cpu_ns() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e9 + static_cast<double>(ts.tv_nsec);
}

// One whole sequence per iteration, through the real container path. The policy's share
// is timed as append (storage copy + choose_victims, i.e. every rebuild) plus observe
// (score accumulation). The reference attention (kvevict::attend) runs and is timed on
// every kSample-th step, its probabilities going to observe; the other steps hand observe
// a fixed random distribution instead: cache sizes and the rebuild schedule do not depend
// on the scores, so the policy's work is the same and the run stays within minutes.
constexpr std::size_t kSample = 16;

void BM_buzz_sequence(benchmark::State& state, bool log_n) {
  const auto steps = static_cast<std::size_t>(state.range(0));
  static const TokenPool pool(kGeometry, 1021, 42);
  static const std::vector<float> fake = [] {
    std::mt19937 rng(3);
    std::uniform_real_distribution<float> u(0.0f, 1e-3f);
    std::vector<float> v(4 * 8192);
    for (auto& x : v) x = u(rng);
    return v;
  }();
  BuzzBeehive::Config c;
  c.log_n = log_n;
  double attend_ns = 0, append_ns = 0, observe_ns = 0, rows = 0, rebuild_append_ns = 0;
  std::size_t peak = 0, rebuilds = 0, bytes_peak = 0, sampled = 0;
  for (auto _ : state) {
    KVCache<BuzzBeehive> cache(kGeometry, Budget::unbounded(), BuzzBeehive(c));
    attend_ns = append_ns = observe_ns = rows = rebuild_append_ns = 0;
    peak = sampled = 0;
    const std::size_t group = static_cast<std::size_t>(kGeometry.group());
    for (std::size_t t = 0; t < steps; ++t) {
      const std::size_t before = cache.policy().rebuilds(0, 0);
      const double t0 = cpu_ns();
      cache.append(0, static_cast<std::int64_t>(t), pool.key(t), pool.value(t));
      const double t1 = cpu_ns();
      append_ns += t1 - t0;
      if (cache.policy().rebuilds(0, 0) != before) rebuild_append_ns += t1 - t0;
      if (t % kSample == 0) {
        const double a0 = cpu_ns();
        const auto res = kvevict::attend(cache, 0, pool.query(t), {.observe = false});
        const double a1 = cpu_ns();
        attend_ns += a1 - a0;
        ++sampled;
        for (int kh = 0; kh < kGeometry.n_kv_heads; ++kh) {
          const auto& p = res.probs[static_cast<std::size_t>(kh)];
          cache.observe(0, kh, {p.data(), static_cast<std::size_t>(p.size())});
        }
        observe_ns += cpu_ns() - a1;
      } else {
        const double o0 = cpu_ns();
        for (int kh = 0; kh < kGeometry.n_kv_heads; ++kh)
          cache.observe(0, kh, {fake.data(), group * cache.size(0, kh)});
        observe_ns += cpu_ns() - o0;
      }
      rows += static_cast<double>(cache.size(0, 0));
      peak = std::max(peak, cache.size(0, 0));
      bytes_peak = std::max(bytes_peak, cache.allocated_bytes());
    }
    rebuilds = cache.policy().rebuilds(0, 0);
    benchmark::DoNotOptimize(cache.size(0, 0));
  }
  const double n = static_cast<double>(steps);
  const double policy_ns = append_ns + observe_ns;
  state.counters["policy_ns_per_step"] = policy_ns / n;
  state.counters["append_ns_per_step"] = append_ns / n;
  state.counters["observe_ns_per_step"] = observe_ns / n;
  const double attend_step = attend_ns / static_cast<double>(sampled);
  state.counters["attend_ns_per_step"] = attend_step;
  state.counters["policy_over_attend"] = policy_ns / n / attend_step;
  // Appends that rebuilt, minus what an ordinary append costs: the rebuilds' own share.
  const double plain = (append_ns - rebuild_append_ns) / (n - static_cast<double>(rebuilds));
  state.counters["rebuild_us"] = (rebuild_append_ns / static_cast<double>(rebuilds) - plain) / 1e3;
  state.counters["rebuild_ns_per_step"] =
      (rebuild_append_ns - static_cast<double>(rebuilds) * plain) / n;
  state.counters["mean_rows"] = rows / n;
  state.counters["peak_rows"] = static_cast<double>(peak);
  state.counters["rebuilds"] = static_cast<double>(rebuilds);
  // K + V (float) + position + seq per row in the container, + one float score in BUZZ.
  const double row_bytes = 2.0 * kGeometry.head_dim * sizeof(float) + 16 + sizeof(float);
  state.counters["bytes_per_row_per_head"] = row_bytes;
  state.counters["peak_allocated_MiB"] = static_cast<double>(bytes_peak) / (1 << 20);
}

// Score accumulation alone at a typical BUZZ size (400 rows, 8 KV heads, G 4): through
// KVCache::observe (which also validates the probabilities) and the policy's observe.
void BM_observe(benchmark::State& state, bool through_cache) {
  const std::size_t rows = static_cast<std::size_t>(state.range(0));
  static const TokenPool pool(kGeometry, 64, 5);
  KVCache<BuzzBeehive> cache(kGeometry, Budget::unbounded());
  for (std::size_t t = 0; t < rows; ++t)
    cache.append(0, static_cast<std::int64_t>(t), pool.key(t), pool.value(t));
  const std::vector<float> p(4 * rows, 1e-3f);
  for (auto _ : state) {
    for (int kh = 0; kh < kGeometry.n_kv_heads; ++kh) {
      if (through_cache)
        cache.observe(0, kh, p);
      else
        cache.policy().observe(kvevict::AttentionView{0, kh, 4, rows, p.data()});
    }
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(8 * 4 * rows));
}

void register_all() {
  benchmark::RegisterBenchmark("observe_via_cache", [](benchmark::State& s) {
    BM_observe(s, true);
  })->Arg(400);
  benchmark::RegisterBenchmark("observe_policy_only", [](benchmark::State& s) {
    BM_observe(s, false);
  })->Arg(400);
  for (bool log_n : {false, true}) {
    auto* b =
        benchmark::RegisterBenchmark(log_n ? "buzz_log_n" : "buzz_bounded",
                                     [log_n](benchmark::State& s) { BM_buzz_sequence(s, log_n); });
    for (std::int64_t n = 4096; n <= (1 << 17); n *= 2) b->Arg(n);
    b->Iterations(1)->Unit(benchmark::kMillisecond);
  }
}

// Cache size over the sequence, bounded and log-n, default shape: min and max rows over
// each bucket of `every` tokens. Sizes do not depend on the scores, so a 1-head, d = 4
// cache gives the exact curve cheaply.
int curve(std::size_t every, std::size_t steps) {
  const Geometry g{1, 1, 1, 4};
  BuzzBeehive::Config lc;
  lc.log_n = true;
  KVCache<BuzzBeehive> bounded(g, Budget::unbounded()),
      logn(g, Budget::unbounded(), BuzzBeehive(lc));
  const std::vector<float> k(4, 0.5f), v(4, 0.25f);
  std::printf("token,bounded_min,bounded_max,log_n_min,log_n_max,log_n_generations\n");
  std::size_t bmin = ~std::size_t{0}, bmax = 0, lmin = ~std::size_t{0}, lmax = 0;
  for (std::size_t t = 0; t < steps; ++t) {
    bounded.append(0, static_cast<std::int64_t>(t), k, v);
    logn.append(0, static_cast<std::int64_t>(t), k, v);
    bmin = std::min(bmin, bounded.size(0, 0));
    bmax = std::max(bmax, bounded.size(0, 0));
    lmin = std::min(lmin, logn.size(0, 0));
    lmax = std::max(lmax, logn.size(0, 0));
    if ((t + 1) % every == 0 || t + 1 == steps) {
      std::printf("%zu,%zu,%zu,%zu,%zu,%zu\n", t + 1, bmin, bmax, lmin, lmax,
                  logn.policy().generations(0, 0).size());
      bmin = lmin = ~std::size_t{0};
      bmax = lmax = 0;
    }
  }
  return 0;
}

// Quality as the sequence grows: a synthetic stream with long-range structure (16 topic
// directions; 5% of tokens carry one strongly; every query looks for one topic), so heavy
// hitters are spread over the whole past. From each checkpoint on, 16 queries are scored
// against the full cache (all tokens kept aside): attention-mass recall and output error of
// the kept set, averaged over queries and heads. Not a language model: a relative measure.
int quality(std::size_t steps) {
  const Geometry g{1, 4, 1, 64};
  const std::size_t d = 64, topics = 16;
  std::mt19937 rng(7);
  std::normal_distribution<float> nd;
  std::uniform_real_distribution<float> ud;
  std::vector<std::vector<float>> u(topics, std::vector<float>(d));
  for (auto& t : u) {
    float n = 0;
    for (auto& x : t) n += (x = nd(rng)) * x;
    for (auto& x : t) x /= std::sqrt(n);
  }
  BuzzBeehive::Config lc;
  lc.log_n = true;
  KVCache<BuzzBeehive> bounded(g, Budget::unbounded()),
      logn(g, Budget::unbounded(), BuzzBeehive(lc));
  std::vector<float> all_k, all_v;  // the full cache, seq-indexed
  std::vector<float> k(d), v(d), q(4 * d);
  std::printf("checkpoint,token,form,rows,mass_recall,output_rel_error\n");
  std::size_t next_check = 4096;
  for (std::size_t t = 0; t < steps + 15 * 64; ++t) {
    const bool heavy = ud(rng) < 0.05f;
    const std::size_t topic = rng() % topics;
    for (std::size_t j = 0; j < d; ++j) {
      k[j] = 0.5f * nd(rng) + (heavy ? 4.0f * u[topic][j] : 0.0f);
      v[j] = nd(rng);
    }
    for (std::size_t h = 0; h < 4; ++h) {
      const std::size_t qt = (rng() % topics);
      for (std::size_t j = 0; j < d; ++j) q[h * d + j] = 0.5f * nd(rng) + 3.0f * u[qt][j];
    }
    all_k.insert(all_k.end(), k.begin(), k.end());
    all_v.insert(all_v.end(), v.begin(), v.end());
    // 16 queries 64 tokens apart span about three rebuild periods, so the sawtooth's
    // phase at the checkpoint does not decide the comparison.
    const bool check =
        t + 1 >= next_check && (t + 1 - next_check) % 64 == 0 && (t + 1 - next_check) / 64 < 16;
    int form = 0;
    for (auto* cache : {&bounded, &logn}) {
      cache->append(0, static_cast<std::int64_t>(t), k, v);
      kvevict::attend(*cache, 0, q);
      if (!check) {
        ++form;
        continue;
      }
      const std::size_t n = t + 1;
      std::vector<float> probs(4 * n);
      kvevict::detail::group_probabilities(all_k.data(), n, d, q.data(), 4, probs.data());
      std::vector<std::uint8_t> kept(n, 0);
      for (auto s : cache->seqs(0, 0)) kept[s] = 1;
      double recall = 0, err = 0;
      for (std::size_t h = 0; h < 4; ++h) {
        std::span<const float> p(probs.data() + h * n, n);
        recall += kvevict::metrics::mass_recall(p, kept) / 4;
        err += kvevict::metrics::output_relative_error(p, kept, all_v, d) / 4;
      }
      std::printf("%zu,%zu,%s,%zu,%.5f,%.5f\n", next_check, n, form == 0 ? "bounded" : "log_n",
                  cache->size(0, 0), recall, err);
      ++form;
    }
    if (t + 1 == next_check + 15 * 64) next_check *= 2;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--curve") == 0) {
      const std::size_t every = i + 1 < argc ? std::stoul(argv[i + 1]) : 256;
      const std::size_t steps = i + 2 < argc ? std::stoul(argv[i + 2]) : std::size_t{1} << 17;
      return curve(every, steps);
    }
    if (std::strcmp(argv[i], "--quality") == 0) return quality(1 << 17);
  }
  register_all();
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
