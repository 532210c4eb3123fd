// One decode step of one layer (issue 13): for n = 1K, 4K, 16K, 64K rows and Hkv = 1 and 8
// KV heads (d = 128, G = 4 query heads per KV head), in one run:
//   read_bw/<bytes>   the read-bandwidth pass over that step's K+V bytes (-march=native TU)
//   anchor_f32/f16    a hand-written decode attention at the best ISA -march=native gives
//                     (AVX-512, else AVX2+FMA+F16C; bench/decode_native.cpp) over the same rows
//   reference_f32/f16 (Hkv = 1 only) the Eigen attend this kernel replaced
//   attend_q8/q4/e4m3 kvevict::attend over KVCache<FullCache, Q8<32> | Q4<32> | E4M3>
//                     (dequantised in registers, docs/quantized.md)
//   attend_f32/f16/bf16  kvevict::attend (workspace overload, no allocation) over a
//                     KVCache<FullCache, float | Eigen::half | Eigen::bfloat16>; this file and
//                     the library are built WITHOUT -march (runtime dispatch)
// Arguments of every benchmark: {n, Hkv}. bench/run_decode_bench.sh turns the medians into
// the ratios and plot of docs/benchmarks.md.
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdio>
#include <vector>

#include "decode_fixture.hpp"

namespace kvevict_bench_native {
bool have_anchor();
const char* anchor_isa();
std::uint64_t read_bandwidth(const void* a, std::size_t a_bytes, const void* b,
                             std::size_t b_bytes);
void decode_attention_f32(const float* q, int G, const float* K, const float* V, std::size_t n,
                          std::size_t d, float scale, float* scores, float* out);
void decode_attention_f16(const float* q, int G, const void* K, const void* V, std::size_t n,
                          std::size_t d, float scale, float* scores, float* out);
}  // namespace kvevict_bench_native

namespace {
namespace nat = kvevict_bench_native;
using namespace decode_bench;

/// K+V bytes of one row (both sides) in storage type S.
template <class S>
double row_bytes() {
  if constexpr (kvevict::detail::QuantizedStorage<S>) {
    using St = kvevict::detail::StorageOf<S>;
    return double(St::key_codec::row_bytes(kHeadDim) + St::value_codec::row_bytes(kHeadDim));
  } else {
    return 2.0 * kHeadDim * sizeof(S);
  }
}

template <class S>
void set_counters(benchmark::State& state, std::size_t n, int hkv) {
  const double bytes = double(n) * hkv * row_bytes<S>();
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes) * state.iterations());
  state.counters["rows"] = double(n);
  state.counters["hkv"] = hkv;
}

template <class S>
void BM_read_bw(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  const int hkv = static_cast<int>(state.range(1));
  auto& cache = full_cache<S>(n, hkv);
  const std::size_t bytes = n * kHeadDim * sizeof(S);
  for (auto _ : state) {
    std::uint64_t r = 0;
    for (int h = 0; h < hkv; ++h)
      r ^= nat::read_bandwidth(cache.keys(0, h).data(), bytes, cache.values(0, h).data(), bytes);
    benchmark::DoNotOptimize(r);
  }
  set_counters<S>(state, n, hkv);
}

template <class S>
void BM_anchor(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  const int hkv = static_cast<int>(state.range(1));
  if (!nat::have_anchor()) {
    state.SkipWithError("anchor needs AVX2+FMA+F16C or AVX-512 (-march=native has neither)");
    return;
  }
  auto& cache = full_cache<S>(n, hkv);
  const auto q = queries(hkv);
  std::vector<float> scores(kGroup * n), out(q.size());
  const float scale = 1.0f / std::sqrt(float(kHeadDim));
  for (auto _ : state) {
    for (int h = 0; h < hkv; ++h) {
      const float* qh = q.data() + std::size_t(h) * kGroup * kHeadDim;
      float* oh = out.data() + std::size_t(h) * kGroup * kHeadDim;
      if constexpr (std::is_same_v<S, float>)
        nat::decode_attention_f32(qh, kGroup, cache.keys(0, h).data(), cache.values(0, h).data(), n,
                                  kHeadDim, scale, scores.data(), oh);
      else
        nat::decode_attention_f16(qh, kGroup, cache.keys(0, h).data(), cache.values(0, h).data(), n,
                                  kHeadDim, scale, scores.data(), oh);
    }
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  set_counters<S>(state, n, hkv);
}

template <class S>
void BM_attend(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  const int hkv = static_cast<int>(state.range(1));
  auto& cache = full_cache<S>(n, hkv);
  const auto q = queries(hkv);
  std::vector<float> out(q.size());
  kvevict::AttendWorkspace ws;
  for (auto _ : state) {
    kvevict::attend(cache, 0, q, out, ws, kvevict::AttendOptions{false});
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  set_counters<S>(state, n, hkv);
}

// The Eigen attend this kernel replaced (detail::attend_reference: allocates its result,
// Eigen GEMMs, scalar exp; fp16/bf16 converted through Eigen's cast): the "before" figure.
template <class S>
void BM_reference(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  const int hkv = static_cast<int>(state.range(1));
  auto& cache = full_cache<S>(n, hkv);
  const auto q = queries(hkv);
  for (auto _ : state) {
    auto r = kvevict::detail::attend_reference(cache, 0, q, kvevict::AttendOptions{false});
    benchmark::DoNotOptimize(r.out.data());
  }
  set_counters<S>(state, n, hkv);
}

void shapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"n", "hkv"});
  b->Unit(benchmark::kMicrosecond);
  b->MinTime(0.2);
}

// Registered shape by shape so each KVCache is built once (benchmarks run in this order).
void register_all() {
  for (const std::int64_t hkv : {1, 8})
    for (const std::int64_t n : {1024, 4096, 16384, 65536}) {
      auto reg = [&](const char* name, void (*fn)(benchmark::State&)) {
        benchmark::RegisterBenchmark(name, fn)->Apply(shapes)->Args({n, hkv});
      };
      reg("read_bw_f32", BM_read_bw<float>);
      reg("anchor_f32", BM_anchor<float>);
      reg("attend_f32", BM_attend<float>);
      if (hkv == 1) reg("reference_f32", BM_reference<float>);
      reg("read_bw_f16", BM_read_bw<Eigen::half>);
      reg("anchor_f16", BM_anchor<Eigen::half>);
      reg("attend_f16", BM_attend<Eigen::half>);
      if (hkv == 1) reg("reference_f16", BM_reference<Eigen::half>);
      reg("attend_bf16", BM_attend<Eigen::bfloat16>);
      // Quantized storage (quantized.hpp, issue 15): the dispatched quantized kernel.
      reg("attend_q8", BM_attend<kvevict::Q8<32>>);
      reg("attend_q4", BM_attend<kvevict::Q4<32>>);
      reg("attend_e4m3", BM_attend<kvevict::E4M3>);
      // --- policy-cost hook -------------------------------------------------------------
      // Per-policy append + observe rows for the same shapes live in their own benchmark
      // file (bench_policy_cost or similar), which can include decode_fixture.hpp for the
      // same geometry, queries and CPU line; compare their medians to attend_f32 above.
    }
}

}  // namespace

int main(int argc, char** argv) {
  namespace kk = kvevict::kernels;
  const std::string cpu = cpu_model();
  std::fprintf(stderr, "CPU: %s; kvevict attention ISA: %s\n", cpu.c_str(),
               kk::isa_name(kk::attention_isa()));
  benchmark::AddCustomContext("cpu_model", cpu);
  benchmark::AddCustomContext("kvevict_attention_isa", kk::isa_name(kk::attention_isa()));
  benchmark::AddCustomContext("anchor_isa", nat::anchor_isa());
  std::fprintf(stderr, "anchor (-march=native) ISA: %s\n", nat::anchor_isa());
  register_all();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
