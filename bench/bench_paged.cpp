// Paged bookkeeping against the decode attention step it serves. One layer, Hkv 8, G 4,
// head dim 128, 16-token blocks, 256 tokens of budget per (sequence, KV head) (every 16th
// token evicts a block). Per decode token of one layer:
//   tables_append    PagedTables::append (block table bookkeeping, eviction included)
//   tables_observe   PagedTables::observe (the score update, per KV head)
//   paged_attention  attention over the table: per KV head, G queries x 256 keys read
//                    from the pool's blocks, softmax, weighted sum of values (float)
//   dense_attend     kvevict::attend (the library's dispatched SIMD decode kernel, workspace
//                    overload) over a dense KVCache<FullCache> of the same 256 rows per KV
//                    head: what a vectorised engine kernel costs, the fairer denominator
//   pool_alloc_free  one BlockAllocator allocate + release, at two pool sizes (O(1))
//   compaction_step  the token-level alternative at the same 256 tokens per (sequence, KV
//                    head): PagedCache<DecayedAttention::recommended()> append (decision,
//                    row copy into the pool, the compaction move) + observe for the 8 KV
//                    heads; compare with tables_append + tables_observe (whole blocks)
//   dense_step       the same step on a dense KVCache (the layout's own cost is the
//                    difference)
//   decode_{dense,paged,copy}/<fmt>/<n>   one decode step of attention for 8 KV heads over n
//                    rows each (G 4, d 128): decode_attention on contiguous rows (dense);
//                    decode_attention_paged reading 16-token blocks in place from a pool,
//                    the blocks of a table scattered (no two consecutive: the worst case,
//                    no run merged) (paged); and the copy the serving example did before
//                    (every block memcpy'd into a scratch, then decode_attention) (copy)
//   decode_{dense,paged,copy}/{q8,q4,e4m3}/<n>   the same over quantized rows (Q8<32>, Q4<32>,
//                    E4M3): the quantized kernels on contiguous rows (dense), through
//                    decode_attention_paged<S> (paged), after the per-block copy (copy)
// Thread CPU time (Google Benchmark's CPU column); compare ratios within one run.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <kvevict/attention.hpp>
#include <kvevict/cache.hpp>
#include <kvevict/paged.hpp>
#include <kvevict/policies/full_cache.hpp>
#include <kvevict/paged_cache.hpp>
#include <kvevict/policies/decayed_attention.hpp>
#include <random>
#include <string>
#include <vector>

#include "cpu_model.hpp"

namespace {

using kvevict::BlockLayout;
using kvevict::Geometry;
using kvevict::PagedKV;
using kvevict::PoolConfig;
using kvevict::SequenceBudget;

constexpr int kHkv = 8, kG = 4, kD = 128;
constexpr std::uint32_t kBlock = 16, kBudgetTokens = 256;
const Geometry kGeo{1, kHkv * kG, kHkv, kD};

using kvevict::examples::cpu_model;

// A pool with one sequence at its budget (the steady state of a long decode).
struct Fixture {
  PagedKV<float> kv{PoolConfig{kGeo, kBlock, 4096, BlockLayout::per_kv_head}};
  std::uint32_t id = kv.add_sequence(SequenceBudget::tokens(kBudgetTokens, kBlock, 1, 1));
  std::vector<float> k = std::vector<float>(kHkv * kD), q = std::vector<float>(kHkv * kG * kD);
  std::int64_t pos = 0;
  Fixture() {
    std::mt19937 gen(1);
    std::normal_distribution<float> nd;
    for (auto& x : k) x = nd(gen);
    for (auto& x : q) x = nd(gen);
    for (std::uint32_t t = 0; t < kBudgetTokens + 8; ++t) kv.append(id, 0, pos++, k, k);
  }
};

void BM_tables_append(benchmark::State& st) {
  Fixture f;
  for (auto _ : st) benchmark::DoNotOptimize(f.kv.PagedTables::append(f.id, 0, f.pos++).size());
}
BENCHMARK(BM_tables_append);

void BM_tables_observe(benchmark::State& st) {
  Fixture f;
  std::vector<float> probs(kG * f.kv.tokens(f.id, 0, 0), 1.0f / 256.0f);
  for (auto _ : st)
    for (int h = 0; h < kHkv; ++h) f.kv.observe(f.id, 0, h, probs);
}
BENCHMARK(BM_tables_observe);

void BM_paged_attention(benchmark::State& st) {
  Fixture f;
  std::vector<float> scores, out(kG * kD);
  const float scale = 1.0f / std::sqrt(float(kD));
  for (auto _ : st) {
    for (int h = 0; h < kHkv; ++h) {
      const auto table = f.kv.table(f.id, 0, h);
      const std::size_t n = f.kv.tokens(f.id, 0, h);
      scores.resize(n);
      for (int g = 0; g < kG; ++g) {
        const float* qg = f.q.data() + (std::size_t(h) * kG + std::size_t(g)) * kD;
        float mx = -INFINITY;
        for (std::size_t i = 0; i < n; ++i) {
          const float* kr = f.kv.key_block(table[i / kBlock]) + (i % kBlock) * kD;
          float s = 0.0f;
          for (int j = 0; j < kD; ++j) s += qg[j] * kr[j];
          scores[i] = s * scale;
          mx = std::max(mx, scores[i]);
        }
        float z = 0.0f;
        for (std::size_t i = 0; i < n; ++i) z += scores[i] = std::exp(scores[i] - mx);
        float* o = out.data() + std::size_t(g) * kD;
        std::fill(o, o + kD, 0.0f);
        for (std::size_t i = 0; i < n; ++i) {
          const float* vr = f.kv.value_block(table[i / kBlock]) + (i % kBlock) * kD;
          const float w = scores[i] / z;
          for (int j = 0; j < kD; ++j) o[j] += w * vr[j];
        }
      }
    }
    benchmark::DoNotOptimize(out.data());
  }
}
BENCHMARK(BM_paged_attention);

void BM_pool_alloc_free(benchmark::State& st) {
  kvevict::BlockAllocator pool(static_cast<std::uint32_t>(st.range(0)));
  for (std::uint32_t i = 0; i + 1 < pool.total(); ++i) pool.allocate(0);  // nearly full
  for (auto _ : st) pool.release(pool.allocate(1));
}
BENCHMARK(BM_pool_alloc_free)->Arg(1 << 10)->Arg(1 << 20);

void BM_dense_attend(benchmark::State& st) {
  kvevict::KVCache<kvevict::policies::FullCache> cache(kGeo, kvevict::Budget::unbounded());
  std::vector<float> k(kHkv * kD), q(kHkv * kG * kD), out(kHkv * kG * kD);
  std::mt19937 gen(1);
  std::normal_distribution<float> nd;
  for (auto& x : q) x = nd(gen);
  for (std::uint32_t t = 0; t < kBudgetTokens; ++t) {
    for (auto& x : k) x = nd(gen);
    cache.append(0, t, k, k);
  }
  kvevict::AttendWorkspace ws;
  for (auto _ : st) {
    kvevict::attend(cache, 0, q, out, ws, kvevict::AttendOptions{false});
    benchmark::DoNotOptimize(out.data());
  }
}
BENCHMARK(BM_dense_attend);

// Token-level eviction inside blocks with compaction (PagedCache): one eviction per step
// (the cache is at its budget), the evicted row's hole filled by the head's last row, a
// block returned whenever the last one empties. Same geometry, block size and budget.
// The same step on a dense KVCache (dense_step) separates the paged layout's own cost
// (block lookups, the compaction move within the pool) from the policy's.
template <class Cache>
void token_level_step(benchmark::State& st, Cache& cache) {
  std::vector<float> k(kHkv * kD), q(kHkv * kG * kD), probs;
  std::mt19937 gen(1);
  std::normal_distribution<float> nd;
  for (auto& x : k) x = nd(gen);
  for (auto& x : q) x = nd(gen);
  std::int64_t pos = 0;
  // Fixed probabilities at the steady-state size (random weights normalised per query
  // head, so decisions are not ties); during warm-up a uniform vector of the live size.
  std::exponential_distribution<float> ex;
  std::vector<float> steady(kG * kBudgetTokens);
  for (int g = 0; g < kG; ++g) {
    float z = 0.0f;
    for (std::uint32_t i = 0; i < kBudgetTokens; ++i) z += steady[g * kBudgetTokens + i] = ex(gen);
    for (std::uint32_t i = 0; i < kBudgetTokens; ++i) steady[g * kBudgetTokens + i] /= z;
  }
  auto step = [&] {
    cache.append(0, pos++, k, k, q);
    for (int h = 0; h < kHkv; ++h) {
      const std::size_t n = cache.size(0, h);
      if (n == kBudgetTokens) {
        cache.observe(0, h, steady);
      } else {
        probs.assign(kG * n, 1.0f / float(n));
        cache.observe(0, h, probs);
      }
    }
  };
  for (std::uint32_t t = 0; t < kBudgetTokens + 8; ++t) step();
  for (auto _ : st) step();
}

using Decayed = kvevict::policies::DecayedAttention;

void BM_compaction_step(benchmark::State& st) {
  kvevict::BlockPool<float> pool(4096, kBlock, kD);
  kvevict::PagedCache<Decayed> cache(kGeo, kvevict::Budget::uniform(kBudgetTokens), pool, 0,
                                     Decayed::recommended());
  token_level_step(st, cache);
  st.counters["blocks"] = double(cache.blocks_in_use());
}
BENCHMARK(BM_compaction_step);

void BM_dense_step(benchmark::State& st) {
  kvevict::KVCache<Decayed> cache(kGeo, kvevict::Budget::uniform(kBudgetTokens),
                                  Decayed::recommended());
  token_level_step(st, cache);
}
BENCHMARK(BM_dense_step);

// Paged decode attention read in place against the dense kernel on the same rows.
enum class Decode { dense, paged, copy };

template <class S, Decode How>
void BM_decode(benchmark::State& st) {
  const std::size_t n = static_cast<std::size_t>(st.range(0)), B = kBlock, d = kD;
  const std::size_t nb = (n + B - 1) / B, pool_blocks = 2 * nb + 1;
  const std::size_t region = pool_blocks * B * d;  // one KV head's part of the pool
  std::mt19937 gen(3);
  std::normal_distribution<float> nd;
  std::vector<S> K(kHkv * region), V(K.size());
  for (auto& x : K) x = static_cast<S>(nd(gen));
  for (auto& x : V) x = static_cast<S>(nd(gen));
  std::vector<std::uint32_t> table(nb);  // 2b x 7919 + 1 mod an odd count: never consecutive
  for (std::size_t b = 0; b < nb; ++b)
    table[b] = static_cast<std::uint32_t>((2 * b * 7919 + 1) % pool_blocks);
  auto gather = [&](int h, S* kd, S* vd) {
    for (std::size_t b = 0; b < nb; ++b) {
      const std::size_t rows = std::min(B, n - b * B);
      std::copy_n(K.data() + h * region + table[b] * B * d, rows * d, kd + b * B * d);
      std::copy_n(V.data() + h * region + table[b] * B * d, rows * d, vd + b * B * d);
    }
  };
  // dense: every head's rows gathered once, before timing (the same bytes as the pool's);
  // copy: one scratch reused by the heads, filled inside the timed loop.
  std::vector<S> Kd((How == Decode::dense ? kHkv : 1) * n * d), Vd(Kd.size());
  if constexpr (How == Decode::dense)
    for (int h = 0; h < kHkv; ++h) gather(h, Kd.data() + h * n * d, Vd.data() + h * n * d);
  std::vector<float> q(kHkv * kG * d), out(kG * d), probs(kG * n);
  for (auto& x : q) x = nd(gen);
  for (auto _ : st) {
    for (int h = 0; h < kHkv; ++h) {
      const float* qh = q.data() + std::size_t(h) * kG * d;
      if constexpr (How == Decode::paged) {
        kvevict::decode_attention_paged(
            qh, kG, kvevict::PagedRows<S>{K.data() + h * region, B * d, d},
            kvevict::PagedRows<S>{V.data() + h * region, B * d, d}, table, B, n, d, 0.0f,
            out.data(), probs.data());
      } else {
        const std::size_t at = How == Decode::dense ? h * n * d : 0;
        if constexpr (How == Decode::copy) gather(h, Kd.data(), Vd.data());
        kvevict::decode_attention(qh, kG, Kd.data() + at, d, Vd.data() + at, d, n, d, 0.0f,
                                  out.data(), probs.data());
      }
      benchmark::DoNotOptimize(out.data());
    }
  }
}
BENCHMARK(BM_decode<float, Decode::dense>)->Name("decode_dense/f32")->Arg(256)->Arg(4096)->Arg(32768);
BENCHMARK(BM_decode<float, Decode::paged>)->Name("decode_paged/f32")->Arg(256)->Arg(4096)->Arg(32768);
BENCHMARK(BM_decode<float, Decode::copy>)->Name("decode_copy/f32")->Arg(256)->Arg(4096)->Arg(32768);
BENCHMARK(BM_decode<Eigen::half, Decode::dense>)->Name("decode_dense/f16")->Arg(4096)->Arg(32768);
BENCHMARK(BM_decode<Eigen::half, Decode::paged>)->Name("decode_paged/f16")->Arg(4096)->Arg(32768);

// The same over quantized rows (quantized.hpp's Q8<32>, Q4<32>, E4M3; exact q.K): dense runs
// the quantized kernels attend() runs on a quantized KVCache (kernels::quant_attention_probs /
// _output) on contiguous rows; paged decode_attention_paged<S> over the scattered table (its
// argument checks included); copy the serving example's former per-block memcpy into a
// scratch, then the dense kernels. Rows: 1024 distinct encoded rows repeated (encoding every
// row of a 32K pool would take seconds; the bytes read are the same).
template <class S, Decode How>
void BM_qdecode(benchmark::State& st) {
  using KC = typename kvevict::detail::StorageOf<S>::key_codec;
  using VC = typename kvevict::detail::StorageOf<S>::value_codec;
  const std::size_t n = static_cast<std::size_t>(st.range(0)), B = kBlock, d = kD;
  const std::size_t nb = (n + B - 1) / B, pool_blocks = 2 * nb + 1;
  const std::size_t kb = KC::row_bytes(d), vb = VC::row_bytes(d);
  const std::size_t rk = pool_blocks * B * kb, rv = pool_blocks * B * vb;  // one KV head's part
  std::mt19937 gen(3);
  std::normal_distribution<float> nd;
  constexpr std::size_t kDistinct = 1024;
  std::vector<std::uint8_t> ek(kDistinct * kb), ev(kDistinct * vb);
  std::vector<float> x(d);
  for (std::size_t r = 0; r < kDistinct; ++r) {
    for (auto& e : x) e = nd(gen);
    KC::encode(x.data(), d, ek.data() + r * kb);
    for (auto& e : x) e = nd(gen);
    VC::encode(x.data(), d, ev.data() + r * vb);
  }
  std::vector<std::uint8_t> K(kHkv * rk), V(kHkv * rv);
  for (std::size_t r = 0; r < K.size() / kb; ++r) std::copy_n(ek.data() + (r % kDistinct) * kb, kb, K.data() + r * kb);
  for (std::size_t r = 0; r < V.size() / vb; ++r) std::copy_n(ev.data() + (r % kDistinct) * vb, vb, V.data() + r * vb);
  std::vector<std::uint32_t> table(nb);  // as BM_decode's: never consecutive
  for (std::size_t b = 0; b < nb; ++b)
    table[b] = static_cast<std::uint32_t>((2 * b * 7919 + 1) % pool_blocks);
  auto gather = [&](int h, std::uint8_t* kd, std::uint8_t* vd) {
    for (std::size_t b = 0; b < nb; ++b) {
      const std::size_t rows = std::min(B, n - b * B);
      std::memcpy(kd + b * B * kb, K.data() + h * rk + table[b] * B * kb, rows * kb);
      std::memcpy(vd + b * B * vb, V.data() + h * rv + table[b] * B * vb, rows * vb);
    }
  };
  const std::size_t copies = How == Decode::dense ? kHkv : 1;
  std::vector<std::uint8_t> Kd(copies * n * kb), Vd(copies * n * vb);
  if constexpr (How == Decode::dense)
    for (int h = 0; h < kHkv; ++h) gather(h, Kd.data() + h * n * kb, Vd.data() + h * n * vb);
  std::vector<float> q(kHkv * kG * d), out(kG * d), probs(kG * n);
  for (auto& e : q) e = nd(gen);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  for (auto _ : st) {
    for (int h = 0; h < kHkv; ++h) {
      const float* qh = q.data() + std::size_t(h) * kG * d;
      if constexpr (How == Decode::paged) {
        kvevict::decode_attention_paged<S>(
            qh, kG, kvevict::PagedRows<std::uint8_t>{K.data() + h * rk, B * kb, kb},
            kvevict::PagedRows<std::uint8_t>{V.data() + h * rv, B * vb, vb}, table, B, n, d, scale,
            out.data(), probs.data());
      } else {
        const std::size_t at = How == Decode::dense ? h * n : 0;
        if constexpr (How == Decode::copy) gather(h, Kd.data(), Vd.data());
        kvevict::kernels::quant_attention_probs<typename KC::desc>(qh, d, kG, Kd.data() + at * kb, kb,
                                                                   n, d, scale, probs.data());
        kvevict::kernels::quant_attention_output<typename VC::desc>(probs.data(), kG, Vd.data() + at * vb,
                                                                    vb, n, d, out.data(), d);
      }
      benchmark::DoNotOptimize(out.data());
    }
  }
}
using kvevict::E4M3;
using kvevict::Q4;
using kvevict::Q8;
BENCHMARK(BM_qdecode<Q8<32>, Decode::dense>)->Name("decode_dense/q8")->Arg(4096)->Arg(32768);
BENCHMARK(BM_qdecode<Q8<32>, Decode::paged>)->Name("decode_paged/q8")->Arg(4096)->Arg(32768);
BENCHMARK(BM_qdecode<Q8<32>, Decode::copy>)->Name("decode_copy/q8")->Arg(4096)->Arg(32768);
BENCHMARK(BM_qdecode<Q4<32>, Decode::dense>)->Name("decode_dense/q4")->Arg(4096)->Arg(32768);
BENCHMARK(BM_qdecode<Q4<32>, Decode::paged>)->Name("decode_paged/q4")->Arg(4096)->Arg(32768);
BENCHMARK(BM_qdecode<Q4<32>, Decode::copy>)->Name("decode_copy/q4")->Arg(4096)->Arg(32768);
BENCHMARK(BM_qdecode<E4M3, Decode::dense>)->Name("decode_dense/e4m3")->Arg(4096)->Arg(32768);
BENCHMARK(BM_qdecode<E4M3, Decode::paged>)->Name("decode_paged/e4m3")->Arg(4096)->Arg(32768);
BENCHMARK(BM_qdecode<E4M3, Decode::copy>)->Name("decode_copy/e4m3")->Arg(4096)->Arg(32768);

}  // namespace

int main(int argc, char** argv) {
  benchmark::AddCustomContext("cpu_model", cpu_model());
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
