// XKV (arXiv 2412.05896) costs: the greedy allocation for 32..80 layers and totals up
// to 1M tokens; the prefill compression (observation window + SnapKV selection) against
// the causal prefill attention it follows; peak memory of the two prefill paths; and the
// mean retention of XKV, uniform SnapKV and PyramidKV budgets at equal total memory.
#include <benchmark/benchmark.h>

#include <Eigen/Core>
#include <kvevict/policies/xkv.hpp>
#include <random>
#include <vector>

using kvevict::Budget;
using kvevict::Geometry;
using kvevict::KVCache;
using namespace kvevict::policies;

namespace {

// Synthetic statistics: one head per layer, candidates 2N/L, power-law scores whose
// sparsity varies with depth so the greedy has real choices to make.
XkvLayerAllocator synthetic_allocator(int L, long long total) {
  const auto n = static_cast<std::size_t>(2 * total / L + 1);
  XkvLayerAllocator a(Geometry{L, 1, 1, 8});
  std::mt19937 rng(static_cast<std::uint32_t>(L * 7 + total));
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  std::vector<std::vector<float>> s(1, std::vector<float>(n));
  for (int l = 0; l < L; ++l) {
    const float e = 1.0f + 4.0f * static_cast<float>(l % 9) / 8.0f;
    for (auto& x : s[0]) x = std::pow(u(rng), e);
    a.set_layer_scores(l, s);
  }
  return a;
}

void BM_AllocateBudget(benchmark::State& state) {
  const int L = static_cast<int>(state.range(0));
  const long long total = state.range(1);
  const auto a = synthetic_allocator(L, total);
  for (auto _ : state) {
    auto alloc = a.allocate(total);
    benchmark::DoNotOptimize(alloc.tokens.data());
  }
  state.counters["ns_per_token"] =
      benchmark::Counter(static_cast<double>(total), benchmark::Counter::kIsIterationInvariantRate |
                                                         benchmark::Counter::kInvert);
}
BENCHMARK(BM_AllocateBudget)
    ->ArgsProduct({{32, 48, 64, 80}, {32768, 262144, 1048576}})
    ->Unit(benchmark::kMillisecond);

void BM_AllocateTarget(benchmark::State& state) {
  const int L = static_cast<int>(state.range(0));
  const long long total = state.range(1);
  const auto a = synthetic_allocator(L, total);
  long long tokens = 0;
  for (auto _ : state) {
    auto alloc = a.allocate_for_retention(0.9);
    tokens = alloc.total();
    benchmark::DoNotOptimize(alloc.tokens.data());
  }
  state.counters["tokens"] = static_cast<double>(tokens);
}
BENCHMARK(BM_AllocateTarget)
    ->ArgsProduct({{32, 80}, {262144, 1048576}})
    ->Unit(benchmark::kMillisecond);

// One Llama-3-8B-shaped layer: 32 query heads, 8 KV heads, d = 128.
const Geometry kLayer{1, 32, 8, 128};

struct LayerPrompt {
  std::size_t T;
  std::vector<float> k, v, q;
};
LayerPrompt make_prompt(const Geometry& g, std::size_t T, std::uint32_t seed = 1) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0.0f, 1.0f);
  LayerPrompt p{T, {}, {}, {}};
  p.k.resize(T * static_cast<std::size_t>(g.n_kv_heads * g.head_dim));
  p.v.resize(p.k.size());
  p.q.resize(T * static_cast<std::size_t>(g.n_heads * g.head_dim));
  for (auto& x : p.k) x = n(rng);
  for (auto& x : p.v) x = n(rng);
  for (auto& x : p.q) x = n(rng);
  return p;
}

// The prefill attention the compression follows: causal softmax(QK^T/sqrt d)V for every
// query head, in blocks of 128 queries (Eigen GEMMs, float), GQA without repeating K/V.
void causal_attention(const Geometry& g, const LayerPrompt& p, std::vector<float>& out) {
  using M = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using S = Eigen::Map<const M, 0, Eigen::OuterStride<>>;
  const auto T = static_cast<Eigen::Index>(p.T), d = static_cast<Eigen::Index>(g.head_dim);
  out.assign(p.q.size(), 0.0f);
  const float scale = 1.0f / std::sqrt(static_cast<float>(g.head_dim));
  M scores, o;
  for (int h = 0; h < g.n_heads; ++h) {
    const int kh = h / g.group();
    S K(p.k.data() + kh * d, T, d, Eigen::OuterStride<>(g.n_kv_heads * d));
    S V(p.v.data() + kh * d, T, d, Eigen::OuterStride<>(g.n_kv_heads * d));
    S Q(p.q.data() + h * d, T, d, Eigen::OuterStride<>(g.n_heads * d));
    for (Eigen::Index b = 0; b < T; b += 128) {
      const Eigen::Index rows = std::min<Eigen::Index>(128, T - b), cols = b + rows;
      scores.noalias() = Q.middleRows(b, rows) * K.topRows(cols).transpose();
      for (Eigen::Index r = 0; r < rows; ++r) {
        auto row = scores.row(r).head(b + r + 1);
        row *= scale;
        row = (row.array() - row.maxCoeff()).exp().matrix();
        row /= row.sum();
        scores.row(r).tail(cols - b - r - 1).setZero();
      }
      o.noalias() = scores * V.topRows(cols);
      for (Eigen::Index r = 0; r < rows; ++r)
        for (Eigen::Index j = 0; j < d; ++j)
          out[static_cast<std::size_t>(((b + r) * g.n_heads + h) * d + j)] = o(r, j);
    }
  }
}

void BM_PrefillAttention(benchmark::State& state) {
  const auto p = make_prompt(kLayer, static_cast<std::size_t>(state.range(0)));
  std::vector<float> out;
  for (auto _ : state) {
    causal_attention(kLayer, p, out);
    benchmark::DoNotOptimize(out.data());
  }
}
BENCHMARK(BM_PrefillAttention)->Arg(1024)->Arg(2048)->Arg(4096)->Unit(benchmark::kMillisecond);

// XKV statistics of one layer: window importance, pooling, per-head sort into gains.
void BM_XkvObserveLayer(benchmark::State& state) {
  const auto p = make_prompt(kLayer, static_cast<std::size_t>(state.range(0)));
  XkvLayerAllocator a(kLayer);
  for (auto _ : state) a.observe_layer(0, p.T, p.k, p.q);
}
BENCHMARK(BM_XkvObserveLayer)->Arg(1024)->Arg(2048)->Arg(4096)->Unit(benchmark::kMillisecond);

// SnapKV compression of one layer into a cache of T/4 rows per KV head (scoring,
// selection, copying the kept rows): the per-layer work after attention.
void BM_SnapKVPrefillLayer(benchmark::State& state) {
  const auto p = make_prompt(kLayer, static_cast<std::size_t>(state.range(0)));
  const auto cap = static_cast<long long>(p.T / 4);
  for (auto _ : state) {
    KVCache<SnapKV> cache(kLayer, Budget::uniform(cap), SnapKV({8, 7, Pooling::avg, 0}));
    cache.prefill(0, 0, p.T, p.k, p.v, p.q);
    benchmark::DoNotOptimize(cache.allocated_bytes());
  }
}
BENCHMARK(BM_SnapKVPrefillLayer)->Arg(1024)->Arg(2048)->Arg(4096)->Unit(benchmark::kMillisecond);

// Peak bytes of the deferred and calibrated paths, 8 layers of the same shape, 1/4 kept.
void BM_PrefillPathsPeak(benchmark::State& state) {
  const Geometry g{8, 32, 8, 128};
  const auto T = static_cast<std::size_t>(state.range(0));
  std::vector<LayerPrompt> prompt;
  for (int l = 0; l < g.n_layers; ++l)
    prompt.push_back(make_prompt(g, T, 10u + static_cast<std::uint32_t>(l)));
  const long long total = g.n_layers * static_cast<long long>(T / 4 - 8);
  std::size_t deferred_peak = 0, calibrated_peak = 0, cache_bytes = 0;
  for (auto _ : state) {
    DeferredXkvPrefill<> deferred(g);
    for (int l = 0; l < g.n_layers; ++l) {
      const auto& p = prompt[static_cast<std::size_t>(l)];
      deferred.add_layer(l, 0, T, p.k, p.v, p.q);
    }
    auto cache = deferred.finish(total);
    Profile profile;
    profile.tokens = deferred.allocation().tokens;
    CalibratedXkvPrefill<> calibrated(g, profile);
    for (int l = 0; l < g.n_layers; ++l) {
      const auto& p = prompt[static_cast<std::size_t>(l)];
      calibrated.prefill_layer(l, 0, T, p.k, p.v, p.q);
    }
    deferred_peak = deferred.peak_bytes();
    calibrated_peak = calibrated.peak_bytes();
    cache_bytes = cache.allocated_bytes();
  }
  state.counters["deferred_peak_MiB"] = static_cast<double>(deferred_peak) / (1 << 20);
  state.counters["calibrated_peak_MiB"] = static_cast<double>(calibrated_peak) / (1 << 20);
  state.counters["cache_MiB"] = static_cast<double>(cache_bytes) / (1 << 20);
}
BENCHMARK(BM_PrefillPathsPeak)->Arg(2048)->Unit(benchmark::kMillisecond)->Iterations(1);

// Mean R at equal total memory: XKV's greedy, uniform SnapKV, PyramidKV (beta 20), on
// a synthetic 16-layer prompt whose query sharpness grows with depth. Synthetic data:
// it shows the allocator does what it optimises, not end-to-end model quality.
void BM_RetentionAtEqualMemory(benchmark::State& state) {
  const Geometry g{16, 8, 2, 64};
  const std::size_t T = 1024;
  XkvLayerAllocator a(g);
  std::mt19937 rng(3);
  std::normal_distribution<float> n(0.0f, 1.0f);
  for (int l = 0; l < g.n_layers; ++l) {
    LayerPrompt p = make_prompt(g, T, 100u + static_cast<std::uint32_t>(l));
    const float sharp = 0.3f + 0.25f * static_cast<float>((l * 5) % g.n_layers);
    for (auto& x : p.q) x *= sharp;
    a.observe_layer(l, T, p.k, p.q);
  }
  const long long total = g.n_layers * state.range(0);
  double rx = 0, ru = 0, rp = 0;
  for (auto _ : state) {
    rx = a.allocate(total).mean_retention;
    ru = a.mean_retention(uniform_budgets(g.n_layers, total));
    rp = a.mean_retention(pyramid_budgets(g.n_layers, total, a.candidates(0)));
  }
  state.counters["R_xkv"] = rx;
  state.counters["R_uniform"] = ru;
  state.counters["R_pyramid"] = rp;
}
BENCHMARK(BM_RetentionAtEqualMemory)->Arg(32)->Arg(128)->Iterations(1);

}  // namespace

BENCHMARK_MAIN();
