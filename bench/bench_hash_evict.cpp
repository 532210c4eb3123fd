// HashEvict benchmarks.
//
// BM_Decision: per decode step at a full cache of N rows (head dim 128, Hkv 8, G 4), the
// HashEvict decision for all 8 KV heads (hash + Hamming scan + select: choose_victims), the
// whole cache.append of that step (decision again + eviction + K/V/code write), and the
// reference attention kvevict::attend over the same cache, all timed in the same iteration.
// The benchmark's time is the decision; counters give attention, append and their ratios.
//
// BM_Recall: attention-mass recall (kvevict::metrics) on a synthetic topic stream, averaged
// over the steps after the cache fills, for 20 projection seeds on one fixed stream: the
// seed-to-seed spread of m = 1 versus m > 1, key versus query mode, and the baselines.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <ctime>
#include <kvevict/attention.hpp>
#include <kvevict/cache.hpp>
#include <kvevict/metrics.hpp>
#include <kvevict/policies/full_cache.hpp>
#include <kvevict/policies/h2o.hpp>
#include <kvevict/policies/hash_evict.hpp>
#include <kvevict/policies/knorm.hpp>
#include <kvevict/policies/random.hpp>
#include <kvevict/policies/streaming_llm.hpp>
#include <random>
#include <vector>

namespace {

using kvevict::Budget;
using kvevict::Geometry;
using kvevict::KVCache;
using kvevict::policies::HashEvictSimHash;
using kvevict::policies::HashMode;
using kvevict::policies::QueryCombine;

// Cheap uniform noise for filling large caches (timing does not depend on the distribution).
struct XorShift {
  std::uint64_t s;
  float next() {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    return static_cast<float>(static_cast<std::int64_t>(s >> 40) - (1 << 23)) * 0x1.0p-23f;
  }
  void fill(std::vector<float>& v) {
    for (auto& x : v) x = next();
  }
};

double median(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
  return v[v.size() / 2];
}

// Thread CPU time: the machine is shared, and wall time would count other processes' turns.
double now() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// Args: rows N, bits b, mode (0 key, 1 query mean, 2 query sum).
template <HashMode M>
void decision_bench(benchmark::State& state, QueryCombine combine) {
  const auto rows = static_cast<std::size_t>(state.range(0));
  const int bits = static_cast<int>(state.range(1));
  const Geometry g{1, 32, 8, 128};
  const auto d = static_cast<std::size_t>(g.head_dim);
  typename HashEvictSimHash<M>::Config c;
  c.bits = bits;
  c.combine = combine;
  KVCache<HashEvictSimHash<M>> cache(g, Budget::uniform(static_cast<long long>(rows)),
                                     HashEvictSimHash<M>(c));
  XorShift rng{0x12345678u + rows};
  // A pool of tokens, reused cyclically: filling 128K x 8 heads with fresh noise is slow.
  constexpr std::size_t kPool = 257;
  std::vector<std::vector<float>> pk(kPool), pv(kPool), pq(kPool);
  for (std::size_t i = 0; i < kPool; ++i) {
    pk[i].resize(8 * d);
    pv[i].resize(8 * d);
    pq[i].resize(32 * d);
    rng.fill(pk[i]);
    rng.fill(pv[i]);
    rng.fill(pq[i]);
    for (std::size_t j = 0; j < 8 * d; ++j) pk[i][j] += 0.3f;  // a shared offset, as real keys
  }
  // Fresh noise on each filled key keeps the codes varied; values may repeat.
  std::vector<float> k(8 * d);
  std::int64_t pos = 0;
  for (; static_cast<std::size_t>(pos) < rows; ++pos) {
    rng.fill(k);
    for (auto& x : k) x += 0.3f;
    const std::size_t i = static_cast<std::size_t>(pos) % kPool;
    cache.append(0, pos, k, pv[i], pq[i]);
  }
  std::vector<std::uint32_t> victims;
  std::vector<double> dec, app, att;
  for (auto _ : state) {
    const std::size_t i = static_cast<std::size_t>(pos) % kPool;
    const double t0 = now();
    for (int kh = 0; kh < g.n_kv_heads; ++kh) {
      kvevict::HeadView<float> v;
      v.layer = 0;
      v.kv_head = kh;
      v.head_dim = g.head_dim;
      v.group = g.group();
      v.size = cache.size(0, kh);
      v.capacity = rows;
      v.need = 1;
      v.keys = cache.keys(0, kh).data();
      v.values = cache.values(0, kh).data();
      v.positions = cache.positions(0, kh).data();
      v.seqs = cache.seqs(0, kh).data();
      v.incoming_seq = cache.tokens_seen(0);
      v.incoming_position = pos;
      v.incoming_key = pk[i].data() + static_cast<std::size_t>(kh) * d;
      if constexpr (M == HashMode::query)
        v.queries = pq[i].data() + static_cast<std::size_t>(kh * g.group()) * d;
      victims.clear();
      cache.policy().choose_victims(v, victims);
      benchmark::DoNotOptimize(victims.data());
    }
    const double t1 = now();
    cache.append(0, pos, pk[i], pv[i], pq[i]);
    const double t2 = now();
    auto r = kvevict::attend(cache, 0, pq[i], {.observe = false});
    benchmark::DoNotOptimize(r.out.data());
    const double t3 = now();
    ++pos;
    dec.push_back(t1 - t0);
    app.push_back(t2 - t1);
    att.push_back(t3 - t2);
    state.SetIterationTime(t1 - t0);
  }
  // Medians: the machine is shared, and a preempted step should not move the figures.
  const double md = median(dec), ma = median(app), mt = median(att);
  state.counters["decision_us"] = 1e6 * md;
  state.counters["append_us"] = 1e6 * ma;
  state.counters["attention_us"] = 1e6 * mt;
  state.counters["decision/attn"] = md / mt;
  state.counters["append/attn"] = ma / mt;
  state.counters["code_B/row"] = static_cast<double>(cache.policy().code_bytes());
  state.counters["kv_B/row"] = static_cast<double>(2 * d * sizeof(float));
}

void BM_DecisionKey(benchmark::State& s) { decision_bench<HashMode::key>(s, QueryCombine::mean); }
void BM_DecisionQueryMean(benchmark::State& s) {
  decision_bench<HashMode::query>(s, QueryCombine::mean);
}
void BM_DecisionQuerySum(benchmark::State& s) {
  decision_bench<HashMode::query>(s, QueryCombine::sum);
}

// Registered per size: the iteration count is fixed (the manual time is the decision, far
// shorter than the attention that runs beside it, so automatic iteration counts would explode).
void register_decision() {
  for (int bits : {16, 64})
    for (long rows : {1024L, 4096L, 32768L, 131072L}) {
      const long iters = rows >= 131072 ? 10 : rows >= 32768 ? 30 : rows >= 4096 ? 200 : 400;
      auto reg = [&](const char* name, void (*fn)(benchmark::State&)) {
        benchmark::RegisterBenchmark(name, fn)
            ->ArgNames({"rows", "bits"})
            ->Args({rows, bits})
            ->Iterations(iters)
            ->UseManualTime()
            ->Unit(benchmark::kMicrosecond);
      };
      reg("BM_DecisionKey", BM_DecisionKey);
      reg("BM_DecisionQueryMean", BM_DecisionQueryMean);
      reg("BM_DecisionQuerySum", BM_DecisionQuerySum);
    }
}

// --- quality: attention-mass recall on a synthetic topic stream ----------------------------

// Tokens come in topic runs; a query head looks for the current topic, or (retrieval) for
// an earlier one. Keys carry a shared offset, as real keys do. Logit gap ~ 40/sqrt(64) = 5.
struct TopicStream {
  Geometry g{1, 8, 2, 64};
  std::size_t tokens = 1024;
  std::vector<std::vector<float>> k, v, q;  // per token: Hkv*d, Hkv*d, H*d

  explicit TopicStream(std::uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> n01;
    const auto d = static_cast<std::size_t>(g.head_dim);
    constexpr int kTopics = 32;
    std::vector<std::vector<float>> topic(kTopics, std::vector<float>(d));
    for (auto& u : topic) {
      float s = 0.0f;
      for (auto& x : u) s += (x = n01(rng)) * x;
      for (auto& x : u) x /= std::sqrt(s);
    }
    std::vector<float> bias(d);
    for (auto& x : bias) x = 0.5f * n01(rng);  // norm ~ 4
    std::uniform_real_distribution<double> u01;
    std::vector<int> seen;
    int z = 0;
    for (std::size_t t = 0; t < tokens; ++t) {
      if (t > 0 && u01(rng) < 0.05) z = static_cast<int>(rng() % kTopics);
      seen.push_back(z);
      std::vector<float> kt(2 * d), vt(2 * d), qt(8 * d);
      for (std::size_t h = 0; h < 2; ++h)
        for (std::size_t j = 0; j < d; ++j) {
          kt[h * d + j] = bias[j] + 4.0f * topic[static_cast<std::size_t>(z)][j] + n01(rng);
          vt[h * d + j] = n01(rng);
        }
      for (std::size_t h = 0; h < 8; ++h) {
        const int y = u01(rng) < 0.7 ? z : seen[rng() % seen.size()];
        for (std::size_t j = 0; j < d; ++j)
          qt[h * d + j] = 10.0f * topic[static_cast<std::size_t>(y)][j] + n01(rng);
      }
      k.push_back(std::move(kt));
      v.push_back(std::move(vt));
      q.push_back(std::move(qt));
    }
  }
};

// Mean attention-mass recall over steps once the cache is full, over KV heads and query heads.
template <class Policy>
double mean_recall(const TopicStream& s, std::size_t budget, Policy policy) {
  KVCache<kvevict::policies::FullCache> full(s.g, Budget::unbounded());
  KVCache<Policy> cache(s.g, Budget::uniform(static_cast<long long>(budget)), std::move(policy));
  double sum = 0.0;
  std::size_t count = 0;
  std::vector<std::uint8_t> kept;
  const int G = s.g.group();
  for (std::size_t t = 0; t < s.tokens; ++t) {
    const auto pos = static_cast<std::int64_t>(t);
    full.append(0, pos, s.k[t], s.v[t], s.q[t]);
    cache.append(0, pos, s.k[t], s.v[t], s.q[t]);
    // The compressed cache attends too: H2O observes it; the others ignore it.
    (void)kvevict::attend(cache, 0, s.q[t]);
    if (t < budget) continue;
    const auto ref = kvevict::attend(full, 0, s.q[t], {.observe = false});
    for (int kh = 0; kh < s.g.n_kv_heads; ++kh) {
      kept.assign(t + 1, 0);
      for (auto seq : cache.seqs(0, kh)) kept[seq] = 1;  // full-cache row == seq
      const auto& p = ref.probs[static_cast<std::size_t>(kh)];
      for (int gi = 0; gi < G; ++gi) {
        sum += kvevict::metrics::mass_recall(
            std::span<const float>(p.data() + static_cast<std::size_t>(gi) * (t + 1), t + 1), kept);
        ++count;
      }
    }
  }
  return sum / static_cast<double>(count);
}

void report(benchmark::State& state, const std::vector<double>& r) {
  double mean = 0.0;
  for (double x : r) mean += x;
  mean /= static_cast<double>(r.size());
  double var = 0.0;
  for (double x : r) var += (x - mean) * (x - mean);
  const double sd = r.size() > 1 ? std::sqrt(var / static_cast<double>(r.size() - 1)) : 0.0;
  state.counters["recall_mean"] = mean;
  state.counters["recall_sd"] = sd;
  state.counters["recall_min"] = *std::min_element(r.begin(), r.end());
  state.counters["recall_max"] = *std::max_element(r.begin(), r.end());
  state.counters["seeds"] = static_cast<double>(r.size());
}

constexpr int kSeeds = 20;
constexpr std::uint64_t kDataSeed = 2024;

std::size_t budget_of(benchmark::State& state, const TopicStream& s) {
  return static_cast<std::size_t>(static_cast<double>(s.tokens) *
                                  static_cast<double>(state.range(0)) / 100.0);
}

// Args: budget %, bits, m, mode (0 key, 1 query mean, 2 query sum).
void BM_RecallHashEvict(benchmark::State& state) {
  const TopicStream s(kDataSeed);
  const std::size_t budget = budget_of(state, s);
  std::vector<double> r;
  for (auto _ : state) {
    for (int seed = 0; seed < kSeeds; ++seed) {
      const auto mode = state.range(3);
      auto cfg = [&](auto c) {
        c.bits = static_cast<int>(state.range(1));
        c.ensemble = static_cast<int>(state.range(2));
        c.seed = static_cast<std::uint64_t>(seed) * 7919u + 1;
        c.combine = mode == 2 ? QueryCombine::sum : QueryCombine::mean;
        return c;
      };
      if (mode == 0)
        r.push_back(mean_recall(
            s, budget,
            HashEvictSimHash<HashMode::key>(cfg(HashEvictSimHash<HashMode::key>::Config{}))));
      else
        r.push_back(mean_recall(
            s, budget,
            HashEvictSimHash<HashMode::query>(cfg(HashEvictSimHash<HashMode::query>::Config{}))));
    }
  }
  report(state, r);
}
BENCHMARK(BM_RecallHashEvict)
    ->ArgNames({"budget%", "bits", "m", "mode"})
    ->ArgsProduct({{30, 50}, {16}, {1, 2, 4}, {0, 1, 2}})
    ->Args({30, 8, 1, 1})
    ->Args({30, 64, 1, 1})
    ->Iterations(1)
    ->Unit(benchmark::kMillisecond);

// Baselines on the same stream: Random over the same 20 seeds; the rest are deterministic.
// Arg 1: 0 Random, 1 KNorm, 2 StreamingLLM, 3 H2O. All keep 4 sinks and 10 recent tokens.
void BM_RecallBaseline(benchmark::State& state) {
  namespace P = kvevict::policies;
  const TopicStream s(kDataSeed);
  const std::size_t budget = budget_of(state, s);
  std::vector<double> r;
  for (auto _ : state) {
    switch (state.range(1)) {
      case 0:
        for (int seed = 0; seed < kSeeds; ++seed)
          r.push_back(mean_recall(
              s, budget, P::Random(P::Random::Config{static_cast<std::uint64_t>(seed), 4, 10})));
        break;
      case 1:
        r.push_back(mean_recall(s, budget, P::KNorm(P::KNorm::Config{4, 10})));
        break;
      case 2:
        r.push_back(mean_recall(s, budget, P::StreamingLLM{4}));
        break;
      default:
        r.push_back(mean_recall(s, budget, P::H2O(P::H2O::Config{10, 4})));
        break;
    }
  }
  report(state, r);
}
BENCHMARK(BM_RecallBaseline)
    ->ArgNames({"budget%", "policy"})
    ->ArgsProduct({{30, 50}, {0, 1, 2, 3}})
    ->Iterations(1)
    ->Unit(benchmark::kMillisecond);

}  // namespace

int main(int argc, char** argv) {
  register_decision();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
