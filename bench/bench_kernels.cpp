// Kernel microbenchmarks. This translation unit is built WITHOUT -march flags: the kvevict
// figures are what a generically built engine gets through runtime dispatch. Comparison loops
// built for this CPU live in kernels_native_loops.cpp. Run through bench/run_kernel_bench.sh.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <ctime>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kvevict/kernels/kernels.hpp"

#if KVEVICT_BENCH_HAVE_FAISS
#include <faiss/utils/Heap.h>
#include <faiss/utils/hamming.h>
#endif
#if KVEVICT_BENCH_HAVE_HWY
#include <hwy/contrib/sort/vqsort.h>
#endif

namespace kvevict_bench_native {
std::uint64_t read_xor(const std::uint8_t* p, std::size_t bytes);
void popcount_loop_u64(const std::uint8_t* q, const std::uint8_t* codes, std::size_t n,
                       std::uint16_t* out);
void popcount_loop_u16(const std::uint8_t* q, const std::uint8_t* codes, std::size_t n,
                       std::uint16_t* out);
void read_write_u16(const std::uint8_t* codes, std::size_t n, std::uint16_t* out);
void read_write_u8(const std::uint8_t* codes, std::size_t n, std::uint8_t* out);
}  // namespace kvevict_bench_native

namespace kk = kvevict::kernels;
using kk::Isa;
namespace {

const std::vector<std::int64_t> kSweep = {1 << 10, 1 << 12, 1 << 15, 1 << 18, 1 << 22};
// Selection also at 256 rows (issue 13: >= 1.5x std::nth_element at every n >= 256).
const std::vector<std::int64_t> kSelectSweep = {1 << 8, 1 << 10, 1 << 12, 1 << 13, 1 << 14, 1 << 15, 1 << 18, 1 << 22};
// Float top-k: also the sizes between 256 and 1K rows, where the small-n paths change
// (topk_threshold up to 512 rows, topk_filter / topk_band above).
const std::vector<std::int64_t> kFloatTopkSweep = {256, 320, 384, 512, 768, 1 << 10, 1 << 12, 1 << 13, 1 << 14, 1 << 15, 1 << 18, 1 << 22};
const std::vector<std::int64_t> kFloatTopkVariedSweep = {256, 320, 384, 512, 768, 1 << 10, 1 << 12};

std::vector<std::uint8_t> random_bytes(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::uint8_t> v(n);
  for (std::size_t i = 0; i + 8 <= n; i += 8) {
    const std::uint64_t r = rng();
    std::memcpy(v.data() + i, &r, 8);
  }
  for (std::size_t i = n & ~std::size_t{7}; i < n; ++i) v[i] = static_cast<std::uint8_t>(rng());
  return v;
}

// Generic-build std::popcount loop (what an engine compiled without -march gets).
void generic_popcount_loop_u64(const std::uint8_t* q, const std::uint8_t* codes, std::size_t n,
                               std::uint16_t* out) {
  std::uint64_t qw;
  std::memcpy(&qw, q, 8);
  for (std::size_t i = 0; i < n; ++i) {
    std::uint64_t c;
    std::memcpy(&c, codes + 8 * i, 8);
    out[i] = static_cast<std::uint16_t>(std::popcount(c ^ qw));
  }
}

void set_counters(benchmark::State& st, std::size_t n, std::size_t bytes_per_item) {
  st.SetItemsProcessed(static_cast<std::int64_t>(st.iterations() * n));
  st.SetBytesProcessed(static_cast<std::int64_t>(st.iterations() * n * bytes_per_item));
}

// ---- Hamming scan ------------------------------------------------------------------------

template <class Fn>
void hamming_bench(benchmark::State& st, int bits, Fn fn) {
  const auto n = static_cast<std::size_t>(st.range(0));
  const std::size_t bytes = static_cast<std::size_t>(bits) / 8;
  const auto codes = random_bytes(n * bytes, 1);
  const auto q = random_bytes(bytes, 2);
  std::vector<std::uint16_t> out(n);
  for (auto _ : st) {
    fn(q.data(), codes.data(), n, out.data());
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  set_counters(st, n, bytes);
}

void register_hamming(int bits, bool sweep) {
  const std::string b = "hamming/b" + std::to_string(bits) + "/";
  auto reg = [&](const std::string& name, auto fn) {
    auto* r = benchmark::RegisterBenchmark((b + name).c_str(), [bits, fn](benchmark::State& st) {
      hamming_bench(st, bits, fn);
    });
    if (sweep)
      for (auto n : kSweep) r->Arg(n);
    else
      r->Arg(1 << 15);
  };
  reg("kvevict_dispatch", [bits](auto q, auto c, auto n, auto o) {
    kk::hamming_distances(q, c, n, bits, o);
  });
  reg("kvevict_scalar", [bits](auto q, auto c, auto n, auto o) {
    kk::hamming_distances<Isa::scalar>(q, c, n, bits, o);
  });
  if (kk::isa_supported(Isa::avx2))
    reg("kvevict_avx2", [bits](auto q, auto c, auto n, auto o) {
      kk::hamming_distances<Isa::avx2>(q, c, n, bits, o);
    });
  if (kk::isa_supported(Isa::avx512))
    reg("kvevict_avx512", [bits](auto q, auto c, auto n, auto o) {
      kk::hamming_distances<Isa::avx512>(q, c, n, bits, o);
    });
  reg("read_bandwidth_native", [bits](auto, auto c, auto n, auto o) {
    o[0] = static_cast<std::uint16_t>(kvevict_bench_native::read_xor(c, n * bits / 8));
  });
  if (bits == 64) {
    reg("read_write_u16_native", [](auto, auto c, auto n, auto o) {
      kvevict_bench_native::read_write_u16(c, n, o);
    });
    reg("read_write_u8_native", [](auto, auto c, auto n, auto o) {
      kvevict_bench_native::read_write_u8(c, n, reinterpret_cast<std::uint8_t*>(o));
    });
    reg("kvevict_dispatch_u8out", [bits](auto q, auto c, auto n, auto o) {
      kk::hamming_distances(q, c, n, bits, reinterpret_cast<std::uint8_t*>(o));
    });
    reg("popcount_loop_native", kvevict_bench_native::popcount_loop_u64);
    reg("popcount_loop_generic", generic_popcount_loop_u64);
  }
  if (bits == 16) reg("popcount_loop_native", kvevict_bench_native::popcount_loop_u16);
#if KVEVICT_BENCH_HAVE_FAISS
  // FAISS writes int32 distances: give it its own buffer, allocated outside the timed loop.
  // faiss::hammings needs codes of a multiple of 8 bytes.
  benchmark::internal::Benchmark* r = nullptr;
  if (bits % 64 == 0) r = benchmark::RegisterBenchmark((b + "faiss_hammings").c_str(), [bits](benchmark::State& st) {
    const auto n = static_cast<std::size_t>(st.range(0));
    const std::size_t bytes = static_cast<std::size_t>(bits) / 8;
    const auto codes = random_bytes(n * bytes, 1);
    const auto q = random_bytes(bytes, 2);
    std::vector<hamdis_t> out(n);
    for (auto _ : st) {
      faiss::hammings(q.data(), codes.data(), 1, n, bytes, out.data());
      benchmark::DoNotOptimize(out.data());
      benchmark::ClobberMemory();
    }
    set_counters(st, n, bytes);
  });
  auto* r2 = benchmark::RegisterBenchmark((b + "faiss_knn_hc_k1").c_str(), [bits](benchmark::State& st) {
    const auto n = static_cast<std::size_t>(st.range(0));
    const std::size_t bytes = static_cast<std::size_t>(bits) / 8;
    const auto codes = random_bytes(n * bytes, 1);
    const auto q = random_bytes(bytes, 2);
    std::int64_t id = 0;
    int val = 0;
    for (auto _ : st) {
      faiss::int_maxheap_array_t ha{1, 1, &id, &val};
      faiss::hammings_knn_hc(&ha, q.data(), codes.data(), n, bytes, 0);
      benchmark::DoNotOptimize(id);
    }
    set_counters(st, n, bytes);
  });
  for (auto* x : {r, r2}) {
    if (x == nullptr) continue;
    if (sweep)
      for (auto n : kSweep) x->Arg(n);
    else
      x->Arg(1 << 15);
  }
#endif
}

// ---- Fused Hamming + protected mask + argmax (HashEvict's decision) ---------------------------

void register_argmax16() {
  constexpr int bits = 16;
  auto setup = [](std::size_t n, std::vector<std::uint8_t>& codes, std::vector<std::uint8_t>& q,
                  std::vector<std::uint64_t>& prot) {
    codes = random_bytes(n * 2, 3);
    q = random_bytes(2, 4);
    prot.assign((n + 63) / 64, 0);
    // Protect a sink prefix and a recent window, as StreamingLLM/HashEvict do.
    for (std::size_t i = 0; i < n; ++i)
      if (i < 4 || i + 64 >= n) prot[i / 64] |= std::uint64_t{1} << (i % 64);
  };
  auto reg = [&](const std::string& name, auto fn) {
    auto* r = benchmark::RegisterBenchmark(("argmax/b16/" + name).c_str(),
                                           [setup, fn](benchmark::State& st) {
      const auto n = static_cast<std::size_t>(st.range(0));
      std::vector<std::uint8_t> codes, q;
      std::vector<std::uint64_t> prot;
      setup(n, codes, q, prot);
      std::vector<std::uint16_t> scratch(n);
      for (auto _ : st) benchmark::DoNotOptimize(fn(q.data(), codes.data(), n, prot.data(), scratch.data()));
      set_counters(st, n, 2);
    });
    for (auto n : kSweep) r->Arg(n);
  };
  reg("kvevict_fused_dispatch", [](auto q, auto c, auto n, auto p, auto) {
    return kk::hamming_argmax(q, c, n, bits, p);
  });
  reg("kvevict_fused_scalar", [](auto q, auto c, auto n, auto p, auto) {
    return kk::hamming_argmax<Isa::scalar>(q, c, n, bits, p);
  });
  reg("distances_then_max_element", [](auto q, auto c, auto n, auto p, std::uint16_t* d) {
    // Unfused: distances, then protected rows pushed to the bottom, then std::max_element.
    // (d + 1 keeps a row at distance 0 distinguishable from a protected row.)
    kk::hamming_distances(q, c, n, bits, d);
    for (std::size_t i = 0; i < n; ++i)
      d[i] = ((p[i / 64] >> (i % 64)) & 1) ? 0 : static_cast<std::uint16_t>(d[i] + 1);
    const auto it = std::max_element(d, d + n);
    return (n == 0 || *it == 0) ? kk::npos : static_cast<std::size_t>(it - d);
  });
  reg("read_bandwidth_native", [](auto, auto c, auto n, auto, auto) {
    return static_cast<std::size_t>(kvevict_bench_native::read_xor(c, n * 2));
  });
}

// ---- Counting select ---------------------------------------------------------------------

std::vector<std::uint16_t> hamming_like_keys(std::size_t n) {
  // Distances of random 64-bit codes: values 0..64 concentrated around 32 (many ties).
  std::mt19937_64 rng(5);
  std::vector<std::uint16_t> k(n);
  for (auto& x : k) x = static_cast<std::uint16_t>(std::popcount(rng()));
  return k;
}

void register_counting() {
  auto reg = [](const std::string& name, auto fn) {
    auto* r = benchmark::RegisterBenchmark(("counting_topk/half/" + name).c_str(),
                                           [fn](benchmark::State& st) {
      const auto n = static_cast<std::size_t>(st.range(0));
      const auto keys = hamming_like_keys(n);
      std::vector<std::uint32_t> out(n), idx(n);
      std::vector<std::uint64_t> packed(n);
      for (auto _ : st) {
        fn(keys, n / 2, out, idx, packed);
        benchmark::DoNotOptimize(out.data());
        benchmark::ClobberMemory();
      }
      set_counters(st, n, 2);
    });
    for (auto n : kSelectSweep) r->Arg(n);
  };
  reg("kvevict_dispatch", [](const auto& keys, std::size_t k, auto& out, auto&, auto&) {
    kk::counting_topk(keys.data(), keys.size(), k, out.data());
  });
  reg("kvevict_scalar", [](const auto& keys, std::size_t k, auto& out, auto&, auto&) {
    kk::counting_topk<Isa::scalar>(keys.data(), keys.size(), k, out.data());
  });
  reg("kvevict_with_histogram", [](const auto& keys, std::size_t k, auto& out, auto&, auto&) {
    // Histogram supplied (as hamming_histogram produces it); counting it is included here.
    std::uint32_t h[65] = {};
    for (auto v : keys) ++h[v];
    kk::counting_topk(keys.data(), keys.size(), k, h, 65, out.data());
  });
  reg("std_nth_element_indirect", [](const auto& keys, std::size_t k, auto& out, auto& idx, auto&) {
    std::iota(idx.begin(), idx.end(), 0u);
    std::nth_element(idx.begin(), idx.begin() + static_cast<std::ptrdiff_t>(k), idx.end(),
                     [&](std::uint32_t a, std::uint32_t b) { return keys[a] > keys[b]; });
    std::copy(idx.begin(), idx.begin() + static_cast<std::ptrdiff_t>(k), out.begin());
  });
  reg("std_nth_element_packed", [](const auto& keys, std::size_t k, auto& out, auto&, auto& packed) {
    // Strongest std baseline: (inverted key, index) packed in one integer, no indirection.
    for (std::size_t i = 0; i < keys.size(); ++i)
      packed[i] = (static_cast<std::uint64_t>(0xFFFF - keys[i]) << 32) | i;
    std::nth_element(packed.begin(), packed.begin() + static_cast<std::ptrdiff_t>(k), packed.end());
    for (std::size_t i = 0; i < k; ++i) out[i] = static_cast<std::uint32_t>(packed[i]);
  });
  reg("std_partial_sort_packed", [](const auto& keys, std::size_t k, auto& out, auto&, auto& packed) {
    for (std::size_t i = 0; i < keys.size(); ++i)
      packed[i] = (static_cast<std::uint64_t>(0xFFFF - keys[i]) << 32) | i;
    std::partial_sort(packed.begin(), packed.begin() + static_cast<std::ptrdiff_t>(k), packed.end());
    for (std::size_t i = 0; i < k; ++i) out[i] = static_cast<std::uint32_t>(packed[i]);
  });
#if KVEVICT_BENCH_HAVE_HWY
  reg("hwy_vqsort_packed", [](const auto& keys, std::size_t k, auto& out, auto&, auto& packed) {
    static const hwy::Sorter sorter;
    for (std::size_t i = 0; i < keys.size(); ++i)
      packed[i] = (static_cast<std::uint64_t>(0xFFFF - keys[i]) << 32) | i;
    sorter(packed.data(), packed.size(), hwy::SortAscending());
    for (std::size_t i = 0; i < k; ++i) out[i] = static_cast<std::uint32_t>(packed[i]);
  });
#endif
}

// ---- Float top-k -------------------------------------------------------------------------

void register_float_topk(const char* label, int k_div) {
  auto reg = [&](const std::string& name, auto fn) {
    auto* r = benchmark::RegisterBenchmark((std::string("float_topk/") + label + "/" + name).c_str(),
                                           [fn, k_div](benchmark::State& st) {
      const auto n = static_cast<std::size_t>(st.range(0));
      const std::size_t k = k_div > 0 ? n / static_cast<std::size_t>(k_div) : 64;
      std::mt19937_64 rng(6);
      std::normal_distribution<float> g;
      std::vector<float> s(n), work(n);
      for (auto& v : s) v = g(rng);
      std::vector<std::uint32_t> out(n), idx(n);
      std::vector<std::uint64_t> packed(n);
      for (auto _ : st) {
        fn(s, k, out, work, idx, packed);
        benchmark::DoNotOptimize(out.data());
        benchmark::ClobberMemory();
      }
      set_counters(st, n, 4);
    });
    for (auto n : kFloatTopkSweep) r->Arg(n);
  };
  reg("kvevict_dispatch", [](const auto& s, std::size_t k, auto& out, auto&, auto&, auto&) {
    kk::topk_indices(s.data(), s.size(), k, out.data());
  });
  reg("kvevict_scalar", [](const auto& s, std::size_t k, auto& out, auto&, auto&, auto&) {
    kk::topk_indices<Isa::scalar>(s.data(), s.size(), k, out.data());
  });
  // The previous AVX2 path below 8192 rows (MSD radix select, still the scalar level's path),
  // for a before/after ratio in one run; larger n run the sampled path in both, so skipped.
  auto* prev = benchmark::RegisterBenchmark(
      (std::string("float_topk/") + label + "/kvevict_radix_before").c_str(),
      [k_div](benchmark::State& st) {
        const auto n = static_cast<std::size_t>(st.range(0));
        const std::size_t k = k_div > 0 ? n / static_cast<std::size_t>(k_div) : 64;
        std::mt19937_64 rng(6);
        std::normal_distribution<float> g;
        std::vector<float> s(n);
        for (auto& v : s) v = g(rng);
        std::vector<std::uint32_t> out(n);
        const Isa level = kk::active_isa() == Isa::scalar ? Isa::scalar : Isa::avx2;
        for (auto _ : st) {
          if (level == Isa::avx2)
            kk::detail::topk_radix<Isa::avx2>(s.data(), n, k, out.data());
          else
            kk::detail::topk_radix<Isa::scalar>(s.data(), n, k, out.data());
          benchmark::DoNotOptimize(out.data());
          benchmark::ClobberMemory();
        }
        set_counters(st, n, 4);
      });
  for (auto n : kFloatTopkSweep)
    if (n < 8192) prev->Arg(n);
  reg("std_nth_element_values", [](const auto& s, std::size_t k, auto&, auto& work, auto&, auto&) {
    // Values only (no indices): the cheapest std::nth_element use, a lower bound for std.
    std::copy(s.begin(), s.end(), work.begin());
    std::nth_element(work.begin(), work.begin() + static_cast<std::ptrdiff_t>(k - 1), work.end(),
                     std::greater<>());
  });
  reg("std_nth_element_indirect", [](const auto& s, std::size_t k, auto& out, auto&, auto& idx, auto&) {
    std::iota(idx.begin(), idx.end(), 0u);
    std::nth_element(idx.begin(), idx.begin() + static_cast<std::ptrdiff_t>(k - 1), idx.end(),
                     [&](std::uint32_t a, std::uint32_t b) { return s[a] > s[b]; });
    std::copy(idx.begin(), idx.begin() + static_cast<std::ptrdiff_t>(k), out.begin());
  });
#if KVEVICT_BENCH_HAVE_HWY
  reg("hwy_vqsort_values", [](const auto& s, std::size_t, auto&, auto& work, auto&, auto&) {
    static const hwy::Sorter sorter;
    std::copy(s.begin(), s.end(), work.begin());
    sorter(work.data(), work.size(), hwy::SortDescending());
  });
#endif
}

// The same top-k on 16 different score vectors taken in turn (float_topk_varied/...): the
// benchmarks above select on one vector every iteration, which lets the branch predictor
// learn std::nth_element's branches for that input at small n; a decode step never sees the
// same scores twice.
void register_float_topk_varied(const char* label, int k_div) {
  auto reg = [&](const std::string& name, auto fn) {
    auto* r = benchmark::RegisterBenchmark(
        (std::string("float_topk_varied/") + label + "/" + name).c_str(),
        [fn, k_div](benchmark::State& st) {
          const auto n = static_cast<std::size_t>(st.range(0));
          const std::size_t k = k_div > 0 ? n / static_cast<std::size_t>(k_div) : 64;
          std::mt19937_64 rng(6);
          std::normal_distribution<float> g;
          std::vector<std::vector<float>> inputs(16, std::vector<float>(n));
          for (auto& s : inputs)
            for (auto& v : s) v = g(rng);
          std::vector<float> work(n);
          std::vector<std::uint32_t> out(n), idx(n);
          std::size_t i = 0;
          for (auto _ : st) {
            fn(inputs[i++ % 16], k, out, work, idx);
            benchmark::DoNotOptimize(out.data());
            benchmark::ClobberMemory();
          }
          set_counters(st, n, 4);
        });
    for (auto n : kFloatTopkVariedSweep) r->Arg(n);
  };
  reg("kvevict_dispatch", [](const auto& s, std::size_t k, auto& out, auto&, auto&) {
    kk::topk_indices(s.data(), s.size(), k, out.data());
  });
  reg("std_nth_element_values", [](const auto& s, std::size_t k, auto&, auto& work, auto&) {
    std::copy(s.begin(), s.end(), work.begin());
    std::nth_element(work.begin(), work.begin() + static_cast<std::ptrdiff_t>(k - 1), work.end(),
                     std::greater<>());
  });
  reg("std_nth_element_indirect", [](const auto& s, std::size_t k, auto& out, auto&, auto& idx) {
    std::iota(idx.begin(), idx.end(), 0u);
    std::nth_element(idx.begin(), idx.begin() + static_cast<std::ptrdiff_t>(k - 1), idx.end(),
                     [&](std::uint32_t a, std::uint32_t b) { return s[a] > s[b]; });
    std::copy(idx.begin(), idx.begin() + static_cast<std::ptrdiff_t>(k), out.begin());
  });
}

// ---- Masked argmax over float scores -----------------------------------------------------

void register_argmax_float() {
  auto reg = [](const std::string& name, auto fn) {
    auto* r = benchmark::RegisterBenchmark(("argmax_masked/f32/" + name).c_str(),
                                           [fn](benchmark::State& st) {
      const auto n = static_cast<std::size_t>(st.range(0));
      std::mt19937_64 rng(7);
      std::vector<float> s(n);
      for (auto& v : s) v = static_cast<float>(rng() % 100000);
      std::vector<std::uint64_t> prot((n + 63) / 64, 0);
      prot[0] = 0xF;
      for (auto _ : st) benchmark::DoNotOptimize(fn(s.data(), n, prot.data()));
      set_counters(st, n, 4);
    });
    for (auto n : kSweep) r->Arg(n);
  };
  reg("kvevict_dispatch", [](auto s, auto n, auto p) { return kk::argmax_masked(s, n, p); });
  reg("kvevict_scalar", [](auto s, auto n, auto p) { return kk::argmax_masked<Isa::scalar>(s, n, p); });
  reg("read_bandwidth_native", [](auto s, auto n, auto) {
    return kvevict_bench_native::read_xor(reinterpret_cast<const std::uint8_t*>(s), n * 4);
  });
}

// ---- lowest_open / decay_lowest_open (ExpectedAttention's and KeyDiff's victim) ----------

// The lowest (score, seq) open row of n rows: random positive scores, a shuffled permutation
// of keys (the arrival order of rows a policy refills in place), every key open but the
// first (a sink) and the last 64 (a recent window). decay: decay_lowest_open (s decays in
// place each call), else lowest_open. K: 32-bit keys (ExpectedAttention's narrow form) or
// 64-bit seqs. Each level's body called directly, and the dispatched entry point.
template <class K>
void register_lowest_open(const char* kname) {
  auto reg = [kname](const std::string& level, bool decay, auto fn) {
    const std::string name = std::string("lowest_open/") + kname + (decay ? "/decay/" : "/plain/") + level;
    auto* r = benchmark::RegisterBenchmark(name.c_str(), [decay, fn](benchmark::State& st) {
      const auto n = static_cast<std::size_t>(st.range(0));
      std::mt19937_64 rng(11);
      std::uniform_real_distribution<float> u(0.0f, 1.0f);
      std::vector<float> s(n), x(n);
      for (auto& v : s) v = u(rng);
      for (auto& v : x) v = u(rng);
      std::vector<K> keys(n);
      std::iota(keys.begin(), keys.end(), K{0});
      std::shuffle(keys.begin(), keys.end(), rng);
      const K lo = 1, hi = static_cast<K>(n - 64);
      for (auto _ : st) {
        benchmark::DoNotOptimize(fn(s.data(), x.data(), keys.data(), n, decay ? 0.99f : 0.0f, lo, hi, decay));
        benchmark::ClobberMemory();
      }
      set_counters(st, n, decay ? 8 + sizeof(K) : 4 + sizeof(K));
    });
    r->Arg(1 << 10)->Arg(1 << 12);
  };
  for (bool decay : {true, false}) {
    reg("kvevict_dispatch", decay, [](float* s, const float* x, const K* k, std::size_t n, float g, K lo, K hi, bool d) {
      return d ? kk::decay_lowest_open(s, x, k, n, g, lo, hi) : kk::lowest_open(s, k, n, lo, hi);
    });
    reg("kvevict_scalar", decay, [](float* s, const float* x, const K* k, std::size_t n, float g, K lo, K hi, bool d) {
      return d ? kk::detail::scalar::lowest_open<true, K>(s, x, k, n, g, lo, hi)
               : kk::detail::scalar::lowest_open<false, K>(s, nullptr, k, n, 0.0f, lo, hi);
    });
#if KVEVICT_X86
    if (kk::isa_supported(Isa::avx2))
      reg("kvevict_avx2", decay, [](float* s, const float* x, const K* k, std::size_t n, float g, K lo, K hi, bool d) {
        return d ? kk::detail::avx2::lowest_open<true, K>(s, x, k, n, g, lo, hi)
                 : kk::detail::avx2::lowest_open<false, K>(s, nullptr, k, n, 0.0f, lo, hi);
      });
    if (kk::isa_supported(Isa::avx512))
      reg("kvevict_avx512", decay, [](float* s, const float* x, const K* k, std::size_t n, float g, K lo, K hi, bool d) {
        return d ? kk::detail::avx512::lowest_open<true, K>(s, x, k, n, g, lo, hi)
                 : kk::detail::avx512::lowest_open<false, K>(s, nullptr, k, n, 0.0f, lo, hi);
      });
#endif
  }
}

// The same passes as a policy step meets them: 8 heads' columns (1K or 4K rows each: decayed
// sums, kept scores, 32-bit keys), cold (an 8 MB read between iterations, the attention
// step's share of the caches; not timed), one decay_lowest_open per head. The time is the
// thread CPU time of the 8 passes alone (manual time).
void register_lowest_open_cold() {
  auto reg = [](const std::string& level, auto fn) {
    auto* r = benchmark::RegisterBenchmark(("lowest_open_cold/k32/decay/8_heads/" + level).c_str(),
                                           [fn](benchmark::State& st) {
      const auto n = static_cast<std::size_t>(st.range(0));
      constexpr int kHeads = 8;
      std::mt19937_64 rng(12);
      std::uniform_real_distribution<float> u(0.0f, 1.0f);
      std::vector<std::vector<float>> acc(kHeads, std::vector<float>(n)), kept(kHeads, std::vector<float>(n));
      std::vector<std::vector<std::uint32_t>> keys(kHeads, std::vector<std::uint32_t>(n));
      for (int h = 0; h < kHeads; ++h) {
        for (auto& v : acc[h]) v = u(rng);
        for (auto& v : kept[h]) v = u(rng);
        std::iota(keys[h].begin(), keys[h].end(), 1u);
        std::shuffle(keys[h].begin(), keys[h].end(), rng);
      }
      std::vector<float> sweep(std::size_t{2} << 20, 1.0f);  // 8 MB
      const auto hi = static_cast<std::uint32_t>(n - n * 3 / 8);  // probfree's recent 3/8 closed
      float sum = 0.0f;
      for (auto _ : st) {
        for (std::size_t i = 0; i < sweep.size(); i += 16) sum += sweep[i];
        benchmark::DoNotOptimize(sum);
        timespec a{}, b{};
        clock_gettime(CLOCK_THREAD_CPUTIME_ID, &a);
        for (int h = 0; h < kHeads; ++h)
          benchmark::DoNotOptimize(fn(acc[h].data(), kept[h].data(), keys[h].data(), n, 0.99f, 1u, hi));
        clock_gettime(CLOCK_THREAD_CPUTIME_ID, &b);
        st.SetIterationTime(static_cast<double>(b.tv_sec - a.tv_sec) +
                            1e-9 * static_cast<double>(b.tv_nsec - a.tv_nsec));
      }
      set_counters(st, kHeads * n, 12);
    });
    r->Arg(1 << 10)->Arg(1 << 12)->UseManualTime();
  };
  using K = std::uint32_t;
  reg("kvevict_dispatch", [](float* s, const float* x, const K* k, std::size_t n, float g, K lo, K hi) {
    return kk::decay_lowest_open(s, x, k, n, g, lo, hi);
  });
#if KVEVICT_X86
  if (kk::isa_supported(Isa::avx2))
    reg("kvevict_avx2", [](float* s, const float* x, const K* k, std::size_t n, float g, K lo, K hi) {
      return kk::detail::avx2::lowest_open<true, K>(s, x, k, n, g, lo, hi);
    });
  if (kk::isa_supported(Isa::avx512))
    reg("kvevict_avx512", [](float* s, const float* x, const K* k, std::size_t n, float g, K lo, K hi) {
      return kk::detail::avx512::lowest_open<true, K>(s, x, k, n, g, lo, hi);
    });
#endif
}

// ---- SimHash -----------------------------------------------------------------------------

// 64 N(0,1) 128-d vectors, the ones simhash_one hashes in turn.
std::vector<float> simhash_inputs() {
  std::mt19937_64 rng(8);
  std::normal_distribution<float> g;
  std::vector<float> x(64 * 128);
  for (auto& v : x) v = g(rng);
  return x;
}

void register_simhash() {
  auto* r = benchmark::RegisterBenchmark("simhash/d128_b64/kvevict", [](benchmark::State& st) {
    const auto n = static_cast<std::size_t>(st.range(0));
    const kk::SimHashProjection p(128, 64, 1);
    std::mt19937_64 rng(8);
    std::normal_distribution<float> g;
    std::vector<float> x(n * 128);
    for (auto& v : x) v = g(rng);
    std::vector<std::uint8_t> codes(n * 8);
    for (auto _ : st) {
      p.hash(x.data(), n, codes.data());
      benchmark::DoNotOptimize(codes.data());
    }
    set_counters(st, n, 128 * 4);
  });
  r->Arg(1 << 10)->Arg(1 << 15);
  // One vector at a time (what a decode step hashes): the dispatched FMA path against the
  // reference Eigen product it replaced (reference_one), 128-d to 16 and 64 bits.
#if KVEVICT_X86
  // The row-major FMA kernel hash_one ran before the column-major one (still the kernel for
  // dim % 8 != 0), on the same matrix and bounds (SimHashProjection's formula), for a
  // before/after ratio in one run.
  for (int bits : {16, 64})
    benchmark::RegisterBenchmark(
        ("simhash_one/d128_b" + std::to_string(bits) + "/kvevict_rowmajor_before").c_str(),
        [bits](benchmark::State& st) {
          const kk::SimHashProjection p(128, bits, 1);
          const auto& m = p.matrix();
          std::vector<float> wt(static_cast<std::size_t>(128 * bits)), thr(static_cast<std::size_t>(bits));
          const double u = 0x1.0p-24, nd = 128 + 4.0, gamma = nd * u / (1.0 - nd * u);
          for (int j = 0; j < bits; ++j) {
            double n2 = 0;
            for (int i = 0; i < 128; ++i) {
              wt[static_cast<std::size_t>(i * bits + j)] = m(i, j);
              n2 += static_cast<double>(m(i, j)) * m(i, j);
            }
            thr[static_cast<std::size_t>(j)] = static_cast<float>(2.0 * gamma * std::sqrt(n2) * 1.01);
          }
          const std::vector<float> x = simhash_inputs();
          std::vector<std::uint8_t> code(static_cast<std::size_t>(bits) / 8);
          std::size_t i = 0;
          for (auto _ : st) {
            const float* row = x.data() + (i++ % 64) * 128;
            if (!kk::detail::simhash_fma(row, 128, bits, wt.data(), thr.data(), code.data()))
              p.reference_one(row, code.data());
            benchmark::DoNotOptimize(code.data());
          }
        });
#endif
  for (int bits : {16, 64})
    for (bool fast : {true, false}) {
      const std::string name = "simhash_one/d128_b" + std::to_string(bits) +
                               (fast ? "/kvevict" : "/eigen_reference");
      benchmark::RegisterBenchmark(name.c_str(), [bits, fast](benchmark::State& st) {
        const kk::SimHashProjection p(128, bits, 1);
        const std::vector<float> x = simhash_inputs();
        std::vector<std::uint8_t> code(static_cast<std::size_t>(bits) / 8);
        std::size_t i = 0;
        for (auto _ : st) {
          const float* row = x.data() + (i++ % 64) * 128;
          if (fast)
            p.hash_one(row, code.data());
          else
            p.reference_one(row, code.data());
          benchmark::DoNotOptimize(code.data());
        }
      });
    }
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::AddCustomContext("kvevict_detected_isa", kk::isa_name(kk::detected_isa()));
  benchmark::AddCustomContext("kvevict_active_isa", kk::isa_name(kk::active_isa()));
  register_hamming(64, true);
  register_hamming(16, false);
  for (int bits : {8, 32, 128, 256}) register_hamming(bits, false);
  register_argmax16();
  register_counting();
  register_float_topk("half", 2);
  register_float_topk("k64", 0);
  register_float_topk_varied("half", 2);
  register_float_topk_varied("k64", 0);
  register_argmax_float();
  register_lowest_open<std::uint32_t>("k32");
  register_lowest_open<std::uint64_t>("k64");
  register_lowest_open_cold();
  register_simhash();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
