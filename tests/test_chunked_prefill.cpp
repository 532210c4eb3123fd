// Chunked prefill with bounded memory (issue 14): SnapKV (and XKV / PyramidKV, which are
// SnapKV's selection under per-layer budgets) select again after every chunk from the rows
// a head holds plus the chunk. Checked here: the rule against a brute-force reference in
// double, one chunk == whole-prompt selection, rows never above the capacity (the pool /
// cells / storage sized to the budget exactly), kept rows bit-exact and every dropped row
// reported once, the earlier first-chunk behaviour still available, bad chunks rejected
// with the cache unchanged. IndexCache under chunked prefill: tests/test_index_cache.cpp.
#include <kvevict/index_cache.hpp>
#include <kvevict/paged_cache.hpp>
#include <kvevict/serialize.hpp>

#include "support/test_support.hpp"

namespace {

using kvevict::Budget;
using kvevict::Geometry;
using kvevict::KVCache;
namespace pol = kvevict::policies;

struct Stream {
  std::size_t tokens = 0;
  std::vector<float> k, v, q;  // tokens x Hkv x d, tokens x Hkv x d, tokens x H x d
};

Stream make_stream(const Geometry& g, std::size_t T, std::uint64_t seed) {
  kvtest::Rng rng(seed);
  Stream s;
  s.tokens = T;
  const std::size_t kv = std::size_t(g.n_kv_heads * g.head_dim), qn = std::size_t(g.n_heads * g.head_dim);
  // Keys with a few strong directions so the window's attention is peaked, not uniform.
  s.k = rng.normals(T * kv);
  for (std::size_t t = 0; t < T; ++t)
    if (t % 5 == 2)
      for (std::size_t j = 0; j < kv; ++j) s.k[t * kv + j] *= 2.5f;
  s.v = rng.normals(T * kv);
  s.q = rng.normals(T * qn, 1.5f);
  return s;
}

template <class Cache>
void prefill_chunk(Cache& c, const Geometry& g, const Stream& s, int l, std::size_t first, std::size_t n) {
  const std::size_t kv = std::size_t(g.n_kv_heads * g.head_dim), qn = std::size_t(g.n_heads * g.head_dim);
  c.prefill(l, std::int64_t(first), n, std::span<const float>(s.k.data() + first * kv, n * kv),
            std::span<const float>(s.v.data() + first * kv, n * kv),
            std::span<const float>(s.q.data() + first * qn, n * qn));
}

template <class Cache>
std::vector<std::uint64_t> sorted_seqs(const Cache& c, int l, int h) {
  const auto s = c.seqs(l, h);
  std::vector<std::uint64_t> v(s.begin(), s.end());
  std::sort(v.begin(), v.end());
  return v;
}

// The per-chunk rule in plain double loops, one (layer, KV head). `held`: the arrival
// indices the head holds before the chunk (ascending). Returns the kept set and the gap
// from the cut to the nearest distinct pooled score (how safe a float comparison is).
struct Reference {
  std::vector<std::uint64_t> kept;
  double margin = 1e30;
};
Reference reference_select(const Geometry& g, const Stream& s, int kh, const std::vector<std::uint64_t>& held,
                           std::size_t first, std::size_t n, std::size_t capacity,
                           const pol::SnapKV::Config& c) {
  std::vector<std::uint64_t> cand = held;
  for (std::size_t t = first; t < first + n; ++t) cand.push_back(t);
  const std::size_t N = cand.size(), budget = capacity - c.decode_reserve, W = c.window;
  if (N <= budget) return {cand, 1e30};
  const std::size_t P = N - W, d = std::size_t(g.head_dim), G = std::size_t(g.group());
  auto key = [&](std::uint64_t seq) { return &s.k[(seq * std::size_t(g.n_kv_heads) + std::size_t(kh)) * d]; };
  std::vector<double> raw(P, 0.0);
  for (std::size_t i = P; i < N; ++i)  // window token i: every arrival's query is known here
    for (std::size_t gi = 0; gi < G; ++gi) {
      const float* q = &s.q[(cand[i] * std::size_t(g.n_heads) + std::size_t(kh) * G + gi) * d];
      std::vector<double> logit(i + 1);
      double mx = -1e300, z = 0.0;
      for (std::size_t j = 0; j <= i; ++j) {
        double dot = 0.0;
        for (std::size_t x = 0; x < d; ++x) dot += double(q[x]) * key(cand[j])[x];
        logit[j] = dot / std::sqrt(double(d));
        mx = std::max(mx, logit[j]);
      }
      for (auto& x : logit) z += std::exp(x - mx);
      for (std::size_t j = 0; j < P; ++j) raw[j] += std::exp(logit[j] - mx) / z;
    }
  // Pooling along arrival indices; a dropped token is padding.
  std::vector<double> pooled(P);
  const std::uint64_t half = c.kernel / 2;
  for (std::size_t j = 0; j < P; ++j) {
    double sum = 0.0, mx = -1e300;
    for (std::size_t k = 0; k < P; ++k)
      if (cand[k] + half >= cand[j] && cand[k] <= cand[j] + half) {
        sum += raw[k];
        mx = std::max(mx, raw[k]);
      }
    pooled[j] = c.pooling == pol::Pooling::avg ? sum / double(c.kernel) : mx;
  }
  std::vector<std::size_t> idx(P);
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](std::size_t a, std::size_t b) { return pooled[a] > pooled[b]; });
  const std::size_t top = budget - W;
  Reference r;
  for (std::size_t i = 0; i < top; ++i) r.kept.push_back(cand[idx[i]]);
  for (std::size_t i = P; i < N; ++i) r.kept.push_back(cand[i]);
  std::sort(r.kept.begin(), r.kept.end());
  // Exact ties (max pooling, or two tokens pooling the same neighbours across a gap) fall
  // to the lower index in float as here; the risk is a distinct value within rounding of
  // the cut.
  if (top < P)
    for (double cut : {pooled[idx[top - 1]], pooled[idx[top]]})
      for (double x : pooled)
        if (x != cut) r.margin = std::min(r.margin, std::abs(x - cut));
  return r;
}

}  // namespace

TEST_CASE("chunked SnapKV selects by the per-chunk rule (brute-force reference)", "[chunked]") {
  const Geometry g{2, 4, 2, 8};
  const std::size_t T = 90;
  const std::size_t chunk = GENERATE(std::size_t{3}, std::size_t{4}, std::size_t{11}, std::size_t{40});
  const auto pooling = GENERATE(pol::Pooling::avg, pol::Pooling::max);
  const std::size_t reserve = GENERATE(std::size_t{0}, std::size_t{3});
  CAPTURE(chunk, int(pooling), reserve);
  const pol::SnapKV::Config c{.window = 4, .kernel = 3, .pooling = pooling, .decode_reserve = reserve};
  const Budget budget = Budget::per_head({{17, 12}, {14, 20}});
  KVCache<pol::SnapKV> cache(g, budget, pol::SnapKV(c));
  const Stream s = make_stream(g, T, 31);
  std::size_t compared = 0, near_ties = 0;
  for (std::size_t first = 0; first < T; first += chunk) {
    const std::size_t n = std::min(chunk, T - first);
    for (int l = 0; l < g.n_layers; ++l) {
      std::vector<std::vector<std::uint64_t>> before;
      for (int h = 0; h < g.n_kv_heads; ++h) before.push_back(sorted_seqs(cache, l, h));
      prefill_chunk(cache, g, s, l, first, n);
      for (int h = 0; h < g.n_kv_heads; ++h) {
        const Reference ref = reference_select(g, s, h, before[std::size_t(h)], first, n, cache.capacity(l, h), c);
        // A near tie may fall either way in float; the reference continues from the cache's
        // held rows, so one such chunk does not hide the rest.
        if (ref.margin < 1e-5) {
          ++near_ties;
          continue;
        }
        INFO("chunk at " << first << " layer " << l << " head " << h << " margin " << ref.margin);
        REQUIRE(sorted_seqs(cache, l, h) == ref.kept);
        ++compared;
      }
    }
  }
  CHECK(near_ties * 10 <= compared);
  REQUIRE(compared > 0);
}

TEST_CASE("one chunk of the whole prompt is whole-prompt SnapKV, in every layout", "[chunked]") {
  const Geometry g{2, 4, 2, 8};
  const std::size_t T = 60;
  const Stream s = make_stream(g, T, 5);
  const Budget budget = Budget::per_layer({13, 21});
  const pol::SnapKV::Config first{.window = 4, .kernel = 5, .chunked = pol::ChunkedPrefill::first_chunk};
  pol::SnapKV::Config reselect = first;
  reselect.chunked = pol::ChunkedPrefill::reselect;
  KVCache<pol::SnapKV> a(g, budget, pol::SnapKV(first)), b(g, budget, pol::SnapKV(reselect));
  kvevict::BlockPool<float> pool(64, 4, g.head_dim);
  kvevict::PagedCache<pol::SnapKV> p(g, budget, pool, 0, pol::SnapKV(reselect));
  for (int l = 0; l < g.n_layers; ++l) {
    prefill_chunk(a, g, s, l, 0, T);
    prefill_chunk(b, g, s, l, 0, T);
    prefill_chunk(p, g, s, l, 0, T);
  }
  REQUIRE(kvtest::snapshot(a) == kvtest::snapshot(b));
  for (int l = 0; l < g.n_layers; ++l)
    for (int h = 0; h < g.n_kv_heads; ++h) {
      REQUIRE(a.policy().scores(l, h) == b.policy().scores(l, h));
      REQUIRE(a.policy().scores(l, h) == p.policy().scores(l, h));
      const auto pa = a.positions(l, h), pp = p.positions(l, h);
      REQUIRE(std::equal(pa.begin(), pa.end(), pp.begin(), pp.end()));
    }
  // A prompt that fits the budget: chunks keep everything, as the whole prompt does.
  KVCache<pol::SnapKV> whole(g, Budget::uniform(40), pol::SnapKV(reselect)),
      chunked(g, Budget::uniform(40), pol::SnapKV(reselect));
  for (int l = 0; l < g.n_layers; ++l) prefill_chunk(whole, g, s, l, 0, 40);
  for (std::size_t f = 0; f < 40; f += 6)
    for (int l = 0; l < g.n_layers; ++l) prefill_chunk(chunked, g, s, l, f, std::min<std::size_t>(6, 40 - f));
  REQUIRE(kvtest::snapshot(whole) == kvtest::snapshot(chunked));
}

TEST_CASE("chunked prefill never holds more rows than the budget; kept rows are bit-exact", "[chunked]") {
  const Geometry g{2, 4, 2, 8};
  const std::size_t T = 150;
  const Stream s = make_stream(g, T + 20, 77);
  const std::size_t chunk = GENERATE(std::size_t{1}, std::size_t{5}, std::size_t{16}, std::size_t{64});
  const std::uint32_t bt = GENERATE(1u, 4u, 16u);
  CAPTURE(chunk, bt);
  const long long cap = 24;
  const pol::SnapKV::Config c{.window = 6, .kernel = 5, .decode_reserve = 2};
  // The pool holds exactly the budget's blocks: any overshoot, even for a moment while a
  // chunk is selected, throws "pool exhausted".
  const auto blocks = std::uint32_t(g.n_layers * g.n_kv_heads) * std::uint32_t((cap + bt - 1) / bt);
  kvevict::BlockPool<float> pool(blocks, bt, g.head_dim);
  kvevict::PagedCache<pol::SnapKV> paged(g, Budget::uniform(cap), pool, 0, pol::SnapKV(c));
  KVCache<pol::SnapKV> cache(g, Budget::uniform(cap), pol::SnapKV(c));
  kvtest::Ledger ledger;
  cache.set_eviction_callback(ledger.callback<float>());
  const std::size_t kv = std::size_t(g.n_kv_heads * g.head_dim);
  for (std::size_t first = 0; first < T; first += chunk) {
    const std::size_t n = std::min(chunk, T - first);
    for (int l = 0; l < g.n_layers; ++l) {
      for (std::size_t t = first; t < first + n; ++t)
        ledger.record(g, l, std::int64_t(t), t,
                      std::span<const float>(s.k.data() + t * kv, kv), std::span<const float>(s.v.data() + t * kv, kv));
      prefill_chunk(cache, g, s, l, first, n);
      prefill_chunk(paged, g, s, l, first, n);
      for (int h = 0; h < g.n_kv_heads; ++h) {
        REQUIRE(cache.size(l, h) <= std::size_t(cap));
        REQUIRE(cache.allocated_rows(l, h) <= std::size_t(cap));
        const auto pc = cache.positions(l, h), pp = paged.positions(l, h);
        REQUIRE(std::equal(pc.begin(), pc.end(), pp.begin(), pp.end()));
      }
    }
    REQUIRE(pool.allocator().in_use() <= blocks);
  }
  // After the prompt: exactly the selection size (capacity - decode_reserve), every row
  // that left reached the callback once, the kept rows are the appended bytes.
  for (int l = 0; l < g.n_layers; ++l)
    for (int h = 0; h < g.n_kv_heads; ++h) REQUIRE(cache.size(l, h) == std::size_t(cap) - c.decode_reserve);
  kvtest::check_against_ledger(cache, ledger, true);
  // Decoding continues from the prefill scores; then a second prompt (a new turn) is
  // selected from everything held, decoded rows included, with its own queries only.
  for (std::size_t t = T; t < T + 10; ++t)
    for (int l = 0; l < g.n_layers; ++l) {
      const std::span<const float> k(s.k.data() + t * kv, kv), v(s.v.data() + t * kv, kv);
      ledger.record(g, l, std::int64_t(t), t, k, v);
      cache.append(l, std::int64_t(t), k, v);
    }
  for (int l = 0; l < g.n_layers; ++l) {
    for (std::size_t t = T + 10; t < T + 20; ++t)
      ledger.record(g, l, std::int64_t(t), t,
                    std::span<const float>(s.k.data() + t * kv, kv), std::span<const float>(s.v.data() + t * kv, kv));
    prefill_chunk(cache, g, s, l, T + 10, 10);
    for (int h = 0; h < g.n_kv_heads; ++h) REQUIRE(cache.size(l, h) == std::size_t(cap) - c.decode_reserve);
  }
  kvtest::check_against_ledger(cache, ledger, true);
}

TEST_CASE("ChunkedPrefill::first_chunk keeps the decode rule for later chunks", "[chunked]") {
  // The earlier behaviour: the first block is selected, later blocks go token by token
  // through the decode rule, exactly as appending them would.
  const Geometry g{1, 4, 2, 8};
  const Stream s = make_stream(g, 80, 3);
  const pol::SnapKV::Config c{.window = 4, .kernel = 3, .chunked = pol::ChunkedPrefill::first_chunk};
  KVCache<pol::SnapKV> chunked(g, Budget::uniform(16), pol::SnapKV(c)), appended(g, Budget::uniform(16), pol::SnapKV(c));
  prefill_chunk(chunked, g, s, 0, 0, 30);
  prefill_chunk(appended, g, s, 0, 0, 30);
  prefill_chunk(chunked, g, s, 0, 30, 50);
  const std::size_t kv = std::size_t(g.n_kv_heads * g.head_dim);
  for (std::size_t t = 30; t < 80; ++t)
    appended.append(0, std::int64_t(t), std::span<const float>(s.k.data() + t * kv, kv),
                    std::span<const float>(s.v.data() + t * kv, kv));
  REQUIRE(kvtest::snapshot(chunked) == kvtest::snapshot(appended));
  // ... and differs from reselection on the same chunks.
  KVCache<pol::SnapKV> re(g, Budget::uniform(16), pol::SnapKV(pol::SnapKV::Config{.window = 4, .kernel = 3}));
  prefill_chunk(re, g, s, 0, 0, 30);
  prefill_chunk(re, g, s, 0, 30, 50);
  REQUIRE(sorted_seqs(re, 0, 0) != sorted_seqs(chunked, 0, 0));
}

TEST_CASE("a bad chunk is a kvevict::Error and leaves the cache unchanged", "[chunked]") {
  const Geometry g{1, 4, 2, 8};
  const Stream s = make_stream(g, 40, 9);
  KVCache<pol::SnapKV> cache(g, Budget::uniform(12), pol::SnapKV(pol::SnapKV::Config{.window = 4, .kernel = 3}));
  prefill_chunk(cache, g, s, 0, 0, 20);
  const auto before = kvtest::snapshot(cache);
  const auto scores = cache.policy().scores(0, 0);
  const std::size_t kv = std::size_t(g.n_kv_heads * g.head_dim), qn = std::size_t(g.n_heads * g.head_dim);
  const std::span<const float> k(s.k.data() + 20 * kv, 5 * kv), v(s.v.data() + 20 * kv, 5 * kv),
      q(s.q.data() + 20 * qn, 5 * qn);
  using Catch::Contains;
  REQUIRE_THROWS_WITH(cache.prefill(0, 20, 0, {}, {}, {}), Contains("tokens = 0"));
  REQUIRE_THROWS_WITH(cache.prefill(0, 20, 6, k, v, q), Contains("keys has 80 floats, expected 96"));
  REQUIRE_THROWS_WITH(cache.prefill(0, 20, 5, k, v.first(4 * kv), q), Contains("values has 64 floats"));
  REQUIRE_THROWS_WITH(cache.prefill(0, 20, 5, k, v, {}), Contains("needs queries"));
  REQUIRE_THROWS_WITH(cache.prefill(0, 20, 5, k, v, q.first(4 * qn)), Contains("queries has 128 floats"));
  REQUIRE_THROWS_WITH(cache.prefill(0, 19, 5, k, v, q), Contains("19"));  // overlaps the last chunk
  REQUIRE_THROWS_AS(cache.prefill(1, 20, 5, k, v, q), kvevict::Error);   // no layer 1
  REQUIRE(kvtest::snapshot(cache) == before);
  REQUIRE(cache.policy().scores(0, 0) == scores);
  // The same chunk, well formed, still goes through, and continues the selection.
  cache.prefill(0, 20, 5, k, v, q);
  REQUIRE(cache.size(0, 0) == 12);
  REQUIRE(cache.tokens_seen(0) == 25);

  // PagedCache: a chunk whose selection needs more blocks than the pool has free throws
  // before anything moves; the pool and the sequence are unchanged.
  kvevict::BlockPool<float> pool(3, 4, g.head_dim);  // 3 blocks of 4 rows, 2 KV heads
  kvevict::PagedCache<pol::SnapKV> paged(g, Budget::uniform(12), pool, 0,
                                         pol::SnapKV(pol::SnapKV::Config{.window = 4, .kernel = 3}));
  prefill_chunk(paged, g, s, 0, 0, 4);
  REQUIRE(pool.allocator().in_use() == 2);
  const auto pos0 = paged.positions(0, 0);
  const std::vector<std::int64_t> held(pos0.begin(), pos0.end());
  REQUIRE_THROWS_WITH(prefill_chunk(paged, g, s, 0, 4, 4), Contains("pool exhausted"));
  REQUIRE(pool.allocator().in_use() == 2);
  REQUIRE(paged.tokens_seen(0) == 4);
  const auto pos1 = paged.positions(0, 0);
  REQUIRE(std::vector<std::int64_t>(pos1.begin(), pos1.end()) == held);
}

TEST_CASE("SnapKV: save, restore, then the next chunk selects as the original does", "[chunked]") {
  // A chunk shorter than the window continues the previous chunk's last queries, which
  // SnapKV keeps; a save must carry them, or the restored cache selects differently.
  const Geometry g{2, 4, 2, 8};
  const Stream s = make_stream(g, 60, 21);
  const pol::SnapKV::Config c{.window = 6, .kernel = 3};
  for (const std::size_t next : {std::size_t{2}, std::size_t{5}, std::size_t{9}}) {
    CAPTURE(next);
    KVCache<pol::SnapKV> a(g, Budget::per_layer({10, 13}), pol::SnapKV(c));
    for (int l = 0; l < 2; ++l) {
      prefill_chunk(a, g, s, l, 0, 17);
      prefill_chunk(a, g, s, l, 17, 3);  // the kept window now spans two chunks
    }
    const auto bytes = kvevict::save_bytes(a);
    KVCache<pol::SnapKV> b(g, Budget::per_layer({10, 13}), pol::SnapKV(c));
    kvevict::load_bytes(b, bytes);
    REQUIRE(kvevict::save_bytes(b) == bytes);
    for (int l = 0; l < 2; ++l) {
      prefill_chunk(a, g, s, l, 20, next);
      prefill_chunk(b, g, s, l, 20, next);
      prefill_chunk(a, g, s, l, 20 + next, 2);
      prefill_chunk(b, g, s, l, 20 + next, 2);
    }
    REQUIRE(kvtest::snapshot(b) == kvtest::snapshot(a));
    REQUIRE(kvevict::save_bytes(b) == kvevict::save_bytes(a));
  }
  // A save whose window part is corrupt (more rows than the window) is refused.
  KVCache<pol::SnapKV> a(g, Budget::uniform(10), pol::SnapKV(c));
  prefill_chunk(a, g, s, 0, 0, 12);
  auto state = kvevict::save_bytes(a);
  KVCache<pol::SnapKV> other(g, Budget::uniform(10), pol::SnapKV(pol::SnapKV::Config{
                                                         .window = 6, .kernel = 3, .chunked = pol::ChunkedPrefill::first_chunk}));
  REQUIRE_THROWS_WITH(kvevict::load_bytes(other, state), Catch::Contains("chunked rule"));
}
