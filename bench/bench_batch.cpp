// Decode throughput of a batch of independent sequences spread over this machine's cores:
// each sequence owns a KVCache (prefilled to its budget, so every step evicts), each step
// appends one token to every layer and runs reference attention over it. Threads own
// disjoint slices of the batch; the token stream is shared read-only.
// Counters: steps_per_s (decode steps summed over the batch, per wall second), threads,
// kv_bytes_per_token (allocated K/V + positions per cached token, per layer and KV head).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <kvevict/kvevict.hpp>
#include <kvevict/policies/hash_evict.hpp>
#include <memory>
#include <random>
#include <thread>
#include <vector>

namespace {

using kvevict::Budget;
using kvevict::Geometry;
using kvevict::KVCache;
namespace pol = kvevict::policies;

// A small llama-like stack: 8 layers, GQA 8/2, d = 64, 512-token budget.
const Geometry kGeo{8, 8, 2, 64};
constexpr long long kBudget = 512;
constexpr int kStepsPerIteration = 4;
constexpr int kDistinctTokens = 64;

struct Tokens {
  std::vector<std::vector<float>> k, v, q;
  Tokens() {
    std::mt19937_64 gen(7);
    std::normal_distribution<float> n(0.0f, 1.0f);
    const auto kv = static_cast<std::size_t>(kGeo.n_kv_heads * kGeo.head_dim);
    const auto qn = static_cast<std::size_t>(kGeo.n_heads * kGeo.head_dim);
    for (int t = 0; t < kDistinctTokens; ++t) {
      k.emplace_back(kv);
      v.emplace_back(kv);
      q.emplace_back(qn);
      for (auto* vec : {&k.back(), &v.back(), &q.back()})
        for (auto& x : *vec) x = n(gen);
    }
  }
};
const Tokens& tokens() {
  static const Tokens t;
  return t;
}

template <class Cache>
void decode_step(Cache& c, std::int64_t pos) {
  const Tokens& tk = tokens();
  const auto i = static_cast<std::size_t>(pos % kDistinctTokens);
  for (int l = 0; l < kGeo.n_layers; ++l) {
    c.append(l, pos, tk.k[i], tk.v[i], tk.q[i]);
    benchmark::DoNotOptimize(kvevict::attend(c, l, tk.q[i]).out.data());
  }
}

template <class Policy, class Scalar>
void BM_batch_decode(benchmark::State& state, Policy policy) {
  const auto n_seq = static_cast<int>(state.range(0));
  const int cores = std::max(1u, std::thread::hardware_concurrency());
  const int n_threads = std::min(cores, n_seq);
  using Cache = KVCache<Policy, Scalar>;
  std::vector<std::unique_ptr<Cache>> batch;
  for (int s = 0; s < n_seq; ++s) {
    batch.push_back(std::make_unique<Cache>(kGeo, Budget::uniform(kBudget), policy));
    for (std::int64_t p = 0; p < kBudget; ++p) decode_step(*batch.back(), p);
  }
  std::int64_t pos = kBudget;
  for (auto _ : state) {
    std::vector<std::thread> pool;
    for (int t = 0; t < n_threads; ++t)
      pool.emplace_back([&, t] {
        for (int s = t; s < n_seq; s += n_threads)
          for (int k = 0; k < kStepsPerIteration; ++k) decode_step(*batch[std::size_t(s)], pos + k);
      });
    for (auto& th : pool) th.join();
    pos += kStepsPerIteration;
  }
  const double steps = double(state.iterations()) * n_seq * kStepsPerIteration;
  state.counters["steps_per_s"] = benchmark::Counter(steps, benchmark::Counter::kIsRate);
  state.counters["threads"] = n_threads;
  const Cache& c = *batch.front();
  double rows = 0;
  for (int l = 0; l < kGeo.n_layers; ++l)
    for (int h = 0; h < kGeo.n_kv_heads; ++h) rows += double(c.size(l, h));
  state.counters["kv_bytes_per_token"] = double(c.allocated_bytes()) / rows;
}

void batch_sizes(benchmark::internal::Benchmark* b) {
  for (int n : {1, 2, 4, 8, 16, 32, 64}) b->Arg(n);
  b->UseRealTime()->Unit(benchmark::kMillisecond)->MinTime(0.5);
}

void BM_batch_streaming_llm_f32(benchmark::State& s) {
  BM_batch_decode<pol::StreamingLLM, float>(s, pol::StreamingLLM{4});
}
void BM_batch_streaming_llm_f16(benchmark::State& s) {
  BM_batch_decode<pol::StreamingLLM, Eigen::half>(s, pol::StreamingLLM{4});
}
void BM_batch_streaming_llm_bf16(benchmark::State& s) {
  BM_batch_decode<pol::StreamingLLM, Eigen::bfloat16>(s, pol::StreamingLLM{4});
}
void BM_batch_h2o_f32(benchmark::State& s) {
  BM_batch_decode<pol::H2O, float>(s, pol::H2O(pol::H2O::Config{32, 4}));
}
void BM_batch_hash_evict_f32(benchmark::State& s) {
  BM_batch_decode<pol::HashEvictSimHash<>, float>(s, pol::HashEvictSimHash<>());
}
BENCHMARK(BM_batch_streaming_llm_f32)->Apply(batch_sizes);
BENCHMARK(BM_batch_streaming_llm_f16)->Apply(batch_sizes);
BENCHMARK(BM_batch_streaming_llm_bf16)->Apply(batch_sizes);
BENCHMARK(BM_batch_h2o_f32)->Apply(batch_sizes);
BENCHMARK(BM_batch_hash_evict_f32)->Apply(batch_sizes);

}  // namespace

BENCHMARK_MAIN();
