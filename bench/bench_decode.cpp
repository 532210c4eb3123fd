// One decode step of one layer (issue 13): for n = 1K, 4K, 16K, 64K rows and Hkv = 1 and 8
// KV heads (d = 128, G = 4 query heads per KV head), in one run:
//   read_bw/<bytes>   the read-bandwidth pass over that step's K+V bytes (-march=native TU)
//   anchor_f32/f16    a hand-written decode attention at the best ISA -march=native gives
//                     (AVX-512, else AVX2+FMA+F16C; bench/decode_native.cpp) over the same rows
//   reference_f32/f16 (Hkv = 1 only) the Eigen attend this kernel replaced
//   attend_q8/q4/e4m3 kvevict::attend over KVCache<FullCache, Q8<32> | Q4<32> | E4M3>
//                     (dequantised in registers, docs/quantized.md)
//   attend_q8/q4_qint the same with AttendOptions::quant_qk = QuantQK::integer_query
//   qstep_q8/q4[_qint] one step over the same quantized caches through the kernels directly
//                     (quant_attention_probs or the opt-in integer q.K
//                     quant_attention_probs_qint, then quant_attention_output), issue 15
//   attend_f32/f16/bf16  kvevict::attend (workspace overload, no allocation) over a
//                     KVCache<FullCache, float | Eigen::half | Eigen::bfloat16>; this file and
//                     the library are built WITHOUT -march (runtime dispatch)
// Arguments of every benchmark: {n, Hkv}. bench/run_decode_bench.sh turns the medians into
// the ratios and plot of docs/benchmarks.md.
#include <benchmark/benchmark.h>

#include <cmath>
#include <algorithm>
#include <cstdio>
#include <string>
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

template <class S, kvevict::QuantQK QK = kvevict::QuantQK::exact>
void BM_attend(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  const int hkv = static_cast<int>(state.range(1));
  auto& cache = full_cache<S>(n, hkv);
  const auto q = queries(hkv);
  std::vector<float> out(q.size());
  kvevict::AttendWorkspace ws;
  kvevict::AttendOptions opt{false};
  opt.quant_qk = QK;
  for (auto _ : state) {
    kvevict::attend(cache, 0, q, out, ws, opt);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  set_counters<S>(state, n, hkv);
}


// One step over a quantized cache through the kernels (the harness attend adds nothing
// measurable: it checks arguments and lays out the workspace): exact or integer q.K.
template <class S, bool Qint>
void BM_qstep(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  const int hkv = static_cast<int>(state.range(1));
  auto& cache = full_cache<S>(n, hkv);
  const auto q = queries(hkv);
  std::vector<float> out(q.size()), probs(std::size_t(kGroup) * n);
  const float scale = 1.0f / std::sqrt(float(kHeadDim));
  using St = kvevict::detail::StorageOf<S>;
  using DK = typename St::key_codec::desc;
  using DV = typename St::value_codec::desc;
  namespace kk = kvevict::kernels;
  const std::size_t d = kHeadDim, G = kGroup;
  for (auto _ : state) {
    for (int h = 0; h < hkv; ++h) {
      const float* qh = q.data() + std::size_t(h) * G * d;
      bool ok;
      if constexpr (Qint)
        ok = kk::quant_attention_probs_qint<DK>(qh, d, G, cache.stored_keys(0, h).data(),
                                                cache.key_row_bytes(), n, d, scale, probs.data());
      else
        ok = kk::quant_attention_probs<DK>(qh, d, G, cache.stored_keys(0, h).data(),
                                           cache.key_row_bytes(), n, d, scale, probs.data());
      if (!ok) state.SkipWithError("non-finite score");
      kk::quant_attention_output<DV>(probs.data(), G, cache.stored_values(0, h).data(),
                                     cache.value_row_bytes(), n, d, out.data() + std::size_t(h) * G * d, d);
    }
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


// One pass of one step (Hkv = 1): Pass 0 = q.K + softmax, 1 = the integer q.K + softmax,
// 2 = p.V (issue 15's profile: where the quantized step's time goes against fp16's).
template <class S, int Pass>
void BM_pass(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  auto& cache = full_cache<S>(n, 1);
  const auto q = queries(1);
  namespace kk = kvevict::kernels;
  const std::size_t d = kHeadDim, G = kGroup;
  std::vector<float> out(G * d), probs(G * n, 1.0f / float(n));
  const float scale = 1.0f / std::sqrt(float(kHeadDim));
  for (auto _ : state) {
    if constexpr (kvevict::detail::QuantizedStorage<S>) {
      using St = kvevict::detail::StorageOf<S>;
      using DK = typename St::key_codec::desc;
      using DV = typename St::value_codec::desc;
      const auto* kb = cache.stored_keys(0, 0).data();
      if constexpr (Pass == 0)
        benchmark::DoNotOptimize(kk::quant_attention_probs<DK>(q.data(), d, G, kb, cache.key_row_bytes(), n, d, scale, probs.data()));
      else if constexpr (Pass == 1)
        benchmark::DoNotOptimize(kk::quant_attention_probs_qint<DK>(q.data(), d, G, kb, cache.key_row_bytes(), n, d, scale, probs.data()));
      else
        kk::quant_attention_output<DV>(probs.data(), G, cache.stored_values(0, 0).data(), cache.value_row_bytes(), n, d, out.data(), d);
    } else {
      constexpr auto F = std::is_same_v<S, float> ? kk::KvFormat::f32 : kk::KvFormat::f16;
      if constexpr (Pass == 0)
        benchmark::DoNotOptimize(kk::attention_probs_as<F>(q.data(), d, G, cache.keys(0, 0).data(), d, n, d, scale, probs.data()));
      else
        kk::attention_output_as<F>(probs.data(), G, cache.values(0, 0).data(), d, n, d, out.data(), d);
    }
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  set_counters<S>(state, n, 1);
}

// --qint-error: output error of one step (n rows, Hkv = 1, the fixture's K/V and queries)
// for Q8<32> / Q4<32> with the exact and the integer q.K, against the fp32 cache's attend
// and against the exact quantized kernel: relative L2 (||a - b|| / ||b||) and max |a - b|.
template <class S>
void step_out(std::size_t n, bool qint, std::vector<float>& out) {
  auto& cache = full_cache<S>(n, 1);
  const auto q = queries(1);
  using St = kvevict::detail::StorageOf<S>;
  using DK = typename St::key_codec::desc;
  using DV = typename St::value_codec::desc;
  namespace kk = kvevict::kernels;
  const std::size_t d = kHeadDim, G = kGroup;
  std::vector<float> probs(G * n);
  out.assign(G * d, 0.0f);
  const float scale = 1.0f / std::sqrt(float(d));
  if (qint)
    kk::quant_attention_probs_qint<DK>(q.data(), d, G, cache.stored_keys(0, 0).data(), cache.key_row_bytes(), n, d, scale, probs.data());
  else
    kk::quant_attention_probs<DK>(q.data(), d, G, cache.stored_keys(0, 0).data(), cache.key_row_bytes(), n, d, scale, probs.data());
  kk::quant_attention_output<DV>(probs.data(), G, cache.stored_values(0, 0).data(), cache.value_row_bytes(), n, d, out.data(), d);
}

void qint_error_report() {
  for (const std::size_t n : {std::size_t(1024), std::size_t(16384), std::size_t(65536)}) {
    std::vector<float> ref(std::size_t(kGroup) * kHeadDim);
    {
      auto& fc = full_cache<float>(n, 1);
      kvevict::AttendWorkspace ws;
      kvevict::attend(fc, 0, queries(1), ref, ws, kvevict::AttendOptions{false});
    }
    auto err = [](const std::vector<float>& a, const std::vector<float>& b, double& rel, double& mx) {
      double num = 0, den = 0;
      mx = 0;
      for (std::size_t i = 0; i < a.size(); ++i) {
        const double e = double(a[i]) - double(b[i]);
        num += e * e;
        den += double(b[i]) * b[i];
        mx = std::max(mx, std::abs(e));
      }
      rel = std::sqrt(num / den);
    };
    auto one = [&](const char* name, auto tag) {
      using S = decltype(tag);
      std::vector<float> ex, qi;
      step_out<S>(n, false, ex);
      step_out<S>(n, true, qi);
      double r1, m1, r2, m2, r3, m3;
      err(ex, ref, r1, m1);
      err(qi, ref, r2, m2);
      err(qi, ex, r3, m3);
      std::printf("n=%zu %s: exact vs fp32 rel %.3e max %.3e | qint vs fp32 rel %.3e max %.3e | qint vs exact rel %.3e max %.3e\n",
                  n, name, r1, m1, r2, m2, r3, m3);
    };
    one("q8g32", kvevict::Q8<32>{});
    one("q4g32", kvevict::Q4<32>{});
  }
}

void shapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"n", "hkv"});
  b->Unit(benchmark::kMicrosecond);
  b->MinTime(0.2);
}

// --quant-32k: also n = 32K at Hkv = 8 for fp16 and the quantized attend rows (issue 15's
// "16K, 32K, 64K"; not in the default run, whose n set the decode report reads).
void register_32k() {
  auto reg = [&](const char* name, void (*fn)(benchmark::State&)) {
    benchmark::RegisterBenchmark(name, fn)->Apply(shapes)->Args({32768, 8});
  };
  reg("read_bw_f16", BM_read_bw<Eigen::half>);
  reg("attend_f16", BM_attend<Eigen::half>);
  reg("attend_q8", BM_attend<kvevict::Q8<32>>);
  reg("attend_q4", BM_attend<kvevict::Q4<32>>);
  reg("attend_q8_qint", BM_attend<kvevict::Q8<32>, kvevict::QuantQK::integer_query>);
  reg("attend_q4_qint", BM_attend<kvevict::Q4<32>, kvevict::QuantQK::integer_query>);
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
      reg("attend_q8_qint", BM_attend<kvevict::Q8<32>, kvevict::QuantQK::integer_query>);
      reg("attend_q4_qint", BM_attend<kvevict::Q4<32>, kvevict::QuantQK::integer_query>);
      reg("attend_e4m3", BM_attend<kvevict::E4M3>);
      reg("qstep_q8", BM_qstep<kvevict::Q8<32>, false>);
      reg("qstep_q8_qint", BM_qstep<kvevict::Q8<32>, true>);
      reg("qstep_q4", BM_qstep<kvevict::Q4<32>, false>);
      reg("qstep_q4_qint", BM_qstep<kvevict::Q4<32>, true>);
      if (hkv == 1) {
        reg("pass_qk_f16", BM_pass<Eigen::half, 0>);
        reg("pass_pv_f16", BM_pass<Eigen::half, 2>);
        reg("pass_qk_q8", BM_pass<kvevict::Q8<32>, 0>);
        reg("pass_qk_q8_qint", BM_pass<kvevict::Q8<32>, 1>);
        reg("pass_pv_q8", BM_pass<kvevict::Q8<32>, 2>);
        reg("pass_qk_q4", BM_pass<kvevict::Q4<32>, 0>);
        reg("pass_qk_q4_qint", BM_pass<kvevict::Q4<32>, 1>);
        reg("pass_pv_q4", BM_pass<kvevict::Q4<32>, 2>);
      }
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
  for (int a = 1; a < argc; ++a)
    if (std::string(argv[a]) == "--qint-error") {
      qint_error_report();
      return 0;
    }
  register_all();
  for (int a = 1; a < argc; ++a)
    if (std::string(argv[a]) == "--quant-32k") {
      register_32k();
      for (int b = a; b + 1 < argc; ++b) argv[b] = argv[b + 1];
      --argc;
      break;
    }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
