// Chunked prefill with bounded memory (issue 14): SnapKV (and XKV / PyramidKV, which are
// SnapKV's selection under per-layer budgets) select again after every chunk from the rows
// a head holds plus the chunk. Checked here: the rule against a brute-force reference in
// double, one chunk == whole-prompt selection, rows never above the capacity (the pool /
// cells / storage sized to the budget exactly), kept rows bit-exact and every dropped row
// reported once, the earlier first-chunk behaviour still available, bad chunks rejected
// with the cache unchanged. IndexCache under chunked prefill: tests/test_index_cache.cpp.
#include <bit>

#include <kvevict/index_cache.hpp>
#include <kvevict/paged_cache.hpp>
#include <kvevict/serialize.hpp>
#include <kvevict/policies/hash_evict.hpp>
#include <kvevict/policies/xkv.hpp>

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
// Pooled window importance of the candidates (held rows, then the chunk), in double: the
// first N - W candidates' scores. Empty when N <= W.
struct Pooled {
  std::vector<std::uint64_t> cand;
  std::vector<double> pooled;
};
Pooled reference_pooled(const Geometry& g, const Stream& s, int kh, const std::vector<std::uint64_t>& held,
                        std::size_t first, std::size_t n, const pol::SnapKV::Config& c) {
  Pooled out;
  out.cand = held;
  for (std::size_t t = first; t < first + n; ++t) out.cand.push_back(t);
  const auto& cand = out.cand;
  const std::size_t N = cand.size(), W = c.window;
  if (N <= W) return out;
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
  out.pooled.resize(P);
  const std::uint64_t half = c.kernel / 2;
  for (std::size_t j = 0; j < P; ++j) {
    double sum = 0.0, mx = -1e300;
    for (std::size_t k = 0; k < P; ++k)
      if (cand[k] + half >= cand[j] && cand[k] <= cand[j] + half) {
        sum += raw[k];
        mx = std::max(mx, raw[k]);
      }
    out.pooled[j] = c.pooling == pol::Pooling::avg ? sum / double(c.kernel) : mx;
  }
  return out;
}

// The window plus the top `top` pooled candidates, and the gap from the cut to the nearest
// distinct pooled score (how safe a float comparison is).
Reference reference_top(const Pooled& p, std::size_t W, std::size_t top) {
  const auto& cand = p.cand;
  const auto& pooled = p.pooled;
  const std::size_t N = cand.size(), P = pooled.size();
  std::vector<std::size_t> idx(P);
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](std::size_t a, std::size_t b) { return pooled[a] > pooled[b]; });
  Reference r;
  for (std::size_t i = 0; i < std::min(top, P); ++i) r.kept.push_back(cand[idx[i]]);
  for (std::size_t i = P; i < N; ++i) r.kept.push_back(cand[i]);
  (void)W;
  std::sort(r.kept.begin(), r.kept.end());
  // Exact ties (max pooling, or two tokens pooling the same neighbours across a gap) fall
  // to the lower index in float as here; the risk is a distinct value within rounding of
  // the cut.
  if (top > 0 && top < P)
    for (double cut : {pooled[idx[top - 1]], pooled[idx[top]]})
      for (double x : pooled)
        if (x != cut) r.margin = std::min(r.margin, std::abs(x - cut));
  return r;
}

Reference reference_select(const Geometry& g, const Stream& s, int kh, const std::vector<std::uint64_t>& held,
                           std::size_t first, std::size_t n, std::size_t capacity,
                           const pol::SnapKV::Config& c) {
  const std::size_t budget = capacity - c.decode_reserve;
  if (held.size() + n <= budget) {
    Reference r{held, 1e30};
    for (std::size_t t = first; t < first + n; ++t) r.kept.push_back(t);
    return r;
  }
  return reference_top(reference_pooled(g, s, kh, held, first, n, c), c.window, budget - c.window);
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

// --- HashEvict: reselection after each chunk from the codes ------------------------------

namespace {
using HashKey = pol::HashEvictKey;

HashKey hash_policy(pol::PrefillRule rule, pol::ChunkedPrefill chunked) {
  HashKey::Config c;
  c.sinks = 2;
  c.recent = 3;
  c.prefill = rule;
  c.chunked = chunked;
  return HashKey(c);
}

// The decode rule simulated in plain loops on one (layer, KV head): rows start as the held
// tokens (oldest first), then each chunk token evicts, when the head is full, the
// unprotected row whose code is farthest in Hamming distance from its key's code (ties to the
// lowest row; swap-remove) and takes the last row. Codes by the projection's reference product.
std::vector<std::uint64_t> reference_decode(const Geometry& g, const Stream& s, int l, int kh,
                                            const std::vector<std::uint64_t>& held, std::size_t first,
                                            std::size_t n, std::size_t cap, const HashKey::Config& c) {
  const kvevict::kernels::SimHashProjection proj(g.head_dim, c.bits, HashKey::layer_seed(c.seed, l));
  const std::size_t d = std::size_t(g.head_dim), w = std::size_t(c.bits) / 8;
  auto code = [&](std::uint64_t t) {
    std::vector<std::uint8_t> out(w);
    proj.reference_one(&s.k[(t * std::size_t(g.n_kv_heads) + std::size_t(kh)) * d], out.data());
    return out;
  };
  std::vector<std::uint64_t> rows = held;
  for (std::size_t t = first; t < first + n; ++t) {
    if (rows.size() >= cap) {
      const auto q = code(t);
      std::size_t best = rows.size();
      int best_dist = -1;
      for (std::size_t r = 0; r < rows.size(); ++r) {
        const std::uint64_t seq = rows[r];
        if (seq < c.sinks || t - seq <= c.recent) continue;
        const auto k = code(seq);
        int dist = 0;
        for (std::size_t b = 0; b < w; ++b) dist += std::popcount(unsigned(q[b] ^ k[b]));
        if (dist > best_dist) best_dist = dist, best = r;
      }
      REQUIRE(best < rows.size());
      rows[best] = rows.back();
      rows.pop_back();
    }
    rows.push_back(t);
  }
  std::sort(rows.begin(), rows.end());
  return rows;
}

// One stream per layer, keys scaled per layer so that the layers' attention differs in
// sharpness (their retention curves, and so XKV's split, differ).
std::vector<Stream> layer_streams(const Geometry& g, std::size_t T, std::uint64_t seed) {
  std::vector<Stream> out;
  for (int l = 0; l < g.n_layers; ++l) {
    out.push_back(make_stream(g, T, seed + std::uint64_t(l)));
    for (float& x : out.back().k) x *= 0.4f + 0.9f * float(l);
  }
  return out;
}
}  // namespace

TEST_CASE("HashEvict keep-ends reselection: every chunking keeps what the whole prompt keeps", "[chunked]") {
  const Geometry g{2, 4, 2, 8};
  const std::size_t T = 70;
  const Stream s = make_stream(g, T, 41);
  const std::size_t chunk = GENERATE(std::size_t{1}, std::size_t{3}, std::size_t{7}, std::size_t{16}, std::size_t{50});
  const std::uint32_t bt = GENERATE(1u, 4u);
  CAPTURE(chunk, bt);
  const Budget budget = Budget::per_layer({13, 20});
  const auto pol_re = hash_policy(pol::PrefillRule::keep_ends, pol::ChunkedPrefill::reselect);
  KVCache<HashKey> whole(g, budget, pol_re), chunked(g, budget, pol_re);
  // The pool holds exactly the budget's blocks: a transient overshoot throws.
  const std::uint32_t blocks = std::uint32_t(g.n_kv_heads) * ((13 + bt - 1) / bt + (20 + bt - 1) / bt);
  kvevict::BlockPool<float> pool(blocks, bt, g.head_dim);
  kvevict::PagedCache<HashKey> paged(g, budget, pool, 0, pol_re);
  for (int l = 0; l < g.n_layers; ++l) prefill_chunk(whole, g, s, l, 0, T);
  for (std::size_t first = 0; first < T; first += chunk) {
    const std::size_t n = std::min(chunk, T - first);
    for (int l = 0; l < g.n_layers; ++l) {
      prefill_chunk(chunked, g, s, l, first, n);
      prefill_chunk(paged, g, s, l, first, n);
      for (int h = 0; h < g.n_kv_heads; ++h) {
        REQUIRE(chunked.size(l, h) <= chunked.capacity(l, h));
        REQUIRE(sorted_seqs(paged, l, h) == sorted_seqs(chunked, l, h));
      }
    }
  }
  for (int l = 0; l < g.n_layers; ++l)
    for (int h = 0; h < g.n_kv_heads; ++h) REQUIRE(sorted_seqs(chunked, l, h) == sorted_seqs(whole, l, h));
  // The codes followed the rows through the held rows' removals: each row's code is its key's.
  for (int l = 0; l < g.n_layers; ++l) {
    const kvevict::kernels::SimHashProjection proj(g.head_dim, 16, HashKey::layer_seed(pol_re.config().seed, l));
    for (int h = 0; h < g.n_kv_heads; ++h) {
      const auto keys = chunked.keys(l, h);
      const auto& codes = chunked.policy().codes(l, h);
      REQUIRE(codes.size() == chunked.size(l, h) * 2);
      for (Eigen::Index r = 0; r < keys.rows(); ++r) {
        std::vector<float> key(keys.row(r).data(), keys.row(r).data() + g.head_dim);
        std::uint8_t code[2];
        proj.reference_one(key.data(), code);
        REQUIRE(std::memcmp(code, codes.data() + 2 * r, 2) == 0);
      }
    }
  }
}

TEST_CASE("HashEvict decode-rule reselection continues the decode rule from the held codes (brute force)", "[chunked]") {
  const Geometry g{2, 4, 2, 8};
  const std::size_t T = 90;
  const Stream s = make_stream(g, T, 47);
  const std::size_t chunk = GENERATE(std::size_t{2}, std::size_t{9}, std::size_t{30}, std::size_t{90});
  CAPTURE(chunk);
  const Budget budget = Budget::per_head({{11, 16}, {14, 12}});
  const auto policy = hash_policy(pol::PrefillRule::decode, pol::ChunkedPrefill::reselect);
  KVCache<HashKey> cache(g, budget, policy);
  kvtest::Ledger ledger;
  cache.set_eviction_callback(ledger.callback<float>());
  const std::size_t kv = std::size_t(g.n_kv_heads * g.head_dim);
  for (std::size_t first = 0; first < T; first += chunk) {
    const std::size_t n = std::min(chunk, T - first);
    for (int l = 0; l < g.n_layers; ++l) {
      std::vector<std::vector<std::uint64_t>> before;
      for (int h = 0; h < g.n_kv_heads; ++h) {
        // The reference seeds its rows in arrival order, as the policy's simulation does.
        before.push_back(sorted_seqs(cache, l, h));
      }
      for (std::size_t t = first; t < first + n; ++t)
        ledger.record(g, l, std::int64_t(t), t, std::span<const float>(s.k.data() + t * kv, kv),
                      std::span<const float>(s.v.data() + t * kv, kv));
      prefill_chunk(cache, g, s, l, first, n);
      for (int h = 0; h < g.n_kv_heads; ++h) {
        INFO("chunk at " << first << " layer " << l << " head " << h);
        REQUIRE(cache.size(l, h) <= cache.capacity(l, h));
        REQUIRE(sorted_seqs(cache, l, h) ==
                reference_decode(g, s, l, h, before[std::size_t(h)], first, n, cache.capacity(l, h), policy.config()));
      }
    }
  }
  kvtest::check_against_ledger(cache, ledger, true);
  // The default (first_chunk) feeds later chunks through the decode rule token by token.
  KVCache<HashKey> dflt(g, budget, hash_policy(pol::PrefillRule::decode, pol::ChunkedPrefill::first_chunk));
  prefill_chunk(dflt, g, s, 0, 0, 30);
  REQUIRE_NOTHROW(prefill_chunk(dflt, g, s, 0, 30, 20));
  // reference_slots has no prompt reselection.
  HashKey::Config bad;
  bad.reference_slots = true;
  bad.chunked = pol::ChunkedPrefill::reselect;
  REQUIRE_THROWS_WITH(HashKey(bad), Catch::Contains("reference_slots"));
}

// --- XKV budgets from the chunks -------------------------------------------------------

TEST_CASE("ChunkedXkvPrefill: one chunk of the whole prompt is whole-prompt XKV", "[chunked]") {
  const Geometry g{3, 4, 2, 8};
  const std::size_t T = 64;
  const auto ls = layer_streams(g, T, 53);
  const pol::XkvLayerAllocator::Config xc{.window = 4, .kernel = 3};
  const long long total = 3 * 14;
  pol::DeferredXkvPrefill<float> deferred(g, xc);
  KVCache<pol::SnapKV> cache(g, Budget::uniform(30), pol::SnapKV({.window = 4, .kernel = 3}));
  pol::ChunkedXkvPrefill<KVCache<pol::SnapKV>> chunked(cache, total, xc);
  const std::size_t kv = std::size_t(g.n_kv_heads * g.head_dim), qn = std::size_t(g.n_heads * g.head_dim);
  for (int l = 0; l < g.n_layers; ++l) {
    const Stream& s = ls[std::size_t(l)];
    const std::span<const float> k(s.k.data(), T * kv), v(s.v.data(), T * kv), q(s.q.data(), T * qn);
    deferred.add_layer(l, 0, T, k, v, q);
    chunked.add_layer(l, 0, T, k, v, q);
  }
  const auto whole = deferred.finish(total);
  REQUIRE(chunked.tokens() == deferred.allocation().tokens);
  REQUIRE(std::set<long long>(chunked.tokens().begin(), chunked.tokens().end()).size() > 1);  // not uniform
  REQUIRE(kvtest::snapshot(cache) == kvtest::snapshot(whole));
  for (int l = 0; l < g.n_layers; ++l)
    for (int h = 0; h < g.n_kv_heads; ++h) REQUIRE(cache.policy().scores(l, h) == whole.policy().scores(l, h));
}

TEST_CASE("ChunkedXkvPrefill: budgets from the chunks seen, bounded memory (brute-force reference)", "[chunked]") {
  const Geometry g{3, 4, 2, 8};
  const std::size_t T = 120;
  const auto ls = layer_streams(g, T, 59);
  const std::size_t chunk = GENERATE(std::size_t{3}, std::size_t{10}, std::size_t{25}, std::size_t{60});
  CAPTURE(chunk);
  const pol::XkvLayerAllocator::Config xc{.window = 4, .kernel = 3};
  const pol::SnapKV::Config sc{.window = 4, .kernel = 3};
  const long long total = 3 * 12;
  KVCache<pol::SnapKV> cache(g, Budget::uniform(16), pol::SnapKV(sc));
  kvtest::Ledger ledger;
  cache.set_eviction_callback(ledger.callback<float>());
  pol::ChunkedXkvPrefill<KVCache<pol::SnapKV>> xkv(cache, total, xc);
  const std::size_t kv = std::size_t(g.n_kv_heads * g.head_dim), qn = std::size_t(g.n_heads * g.head_dim);
  const std::size_t bound = std::size_t(g.n_kv_heads) * std::size_t(total + g.n_layers * 4);
  std::size_t compared = 0, skipped = 0;
  bool moved = false;
  for (std::size_t first = 0; first < T; first += chunk) {
    const std::size_t n = std::min(chunk, T - first);
    // The reference: every layer's pooled scores over its held rows plus the chunk, in
    // double; the allocation from them; then each head keeps the window and its top n_l.
    std::vector<std::vector<Pooled>> ref(std::size_t(g.n_layers));
    pol::XkvLayerAllocator alloc(g, xc);
    for (int l = 0; l < g.n_layers; ++l) {
      std::vector<std::vector<float>> as_float;
      for (int h = 0; h < g.n_kv_heads; ++h) {
        ref[std::size_t(l)].push_back(reference_pooled(g, ls[std::size_t(l)], h, sorted_seqs(cache, l, h), first, n, sc));
        const auto& p = ref[std::size_t(l)].back().pooled;
        as_float.emplace_back(p.begin(), p.end());
      }
      alloc.set_layer_scores(l, as_float);
    }
    const auto expected = alloc.allocate(total);
    const auto before = xkv.tokens();
    for (int l = 0; l < g.n_layers; ++l) {
      const Stream& s = ls[std::size_t(l)];
      for (std::size_t t = first; t < first + n; ++t)
        ledger.record(g, l, std::int64_t(t), t, std::span<const float>(s.k.data() + t * kv, kv),
                      std::span<const float>(s.v.data() + t * kv, kv));
      xkv.add_layer(l, std::int64_t(first), n, std::span<const float>(s.k.data() + first * kv, n * kv),
                    std::span<const float>(s.v.data() + first * kv, n * kv),
                    std::span<const float>(s.q.data() + first * qn, n * qn));
    }
    moved |= xkv.tokens() != before;
    // The library's split reaches the reference's mean retention (equal but for float
    // rounding of near-equal gains), and never more rows than the shared total.
    REQUIRE(alloc.mean_retention(xkv.tokens()) == Approx(expected.mean_retention).epsilon(1e-5));
    long long sum = 0;
    for (long long x : xkv.tokens()) sum += x;
    REQUIRE(sum <= total);
    for (int l = 0; l < g.n_layers; ++l)
      for (int h = 0; h < g.n_kv_heads; ++h) {
        REQUIRE(cache.capacity(l, h) == std::size_t(xkv.tokens()[std::size_t(l)]) + 4);
        REQUIRE(cache.size(l, h) <= cache.capacity(l, h));
        const Reference r = reference_top(ref[std::size_t(l)][std::size_t(h)], 4,
                                          std::size_t(xkv.tokens()[std::size_t(l)]));
        if (r.margin < 1e-5) {
          ++skipped;
          continue;
        }
        INFO("chunk at " << first << " layer " << l << " head " << h);
        REQUIRE(sorted_seqs(cache, l, h) == r.kept);
        ++compared;
      }
    REQUIRE(xkv.peak_capacity() <= bound);
    REQUIRE(xkv.peak_rows() <= bound);
    // Staging: one chunk's K/V of every layer plus each layer's window queries.
    REQUIRE(xkv.staged_peak_bytes() <= (std::size_t(g.n_layers) * (2 * chunk * kv + 4 * qn)) * sizeof(float));
  }
  CHECK(skipped * 10 <= compared);
  REQUIRE(compared > 0);
  if (chunk < T / 2) REQUIRE(moved);  // later chunks moved rows between layers
  kvtest::check_against_ledger(cache, ledger, true);
  // Bad input: a layer out of order, another chunk size on a later layer; nothing changes.
  const auto snap = kvtest::snapshot(cache);
  const Stream& s = ls[0];
  const std::span<const float> k(s.k.data(), 5 * kv), v(s.v.data(), 5 * kv), q(s.q.data(), 5 * qn);
  REQUIRE_THROWS_WITH(xkv.add_layer(1, 200, 5, k, v, q), Catch::Contains("expected 0"));
  REQUIRE_THROWS_AS(xkv.add_layer(0, 100, 5, k, v, q), kvevict::Error);  // overlaps the prompt
  REQUIRE(kvtest::snapshot(cache) == snap);
}

TEST_CASE("ChunkedXkvPrefill: bad values on a later layer are refused before the chunk applies", "[chunked]") {
  const Geometry g{2, 4, 2, 8};
  const std::size_t T = 24, chunk = 12;
  const auto ls = layer_streams(g, T, 61);
  const pol::XkvLayerAllocator::Config xc{.window = 4, .kernel = 3};
  const std::size_t kv = std::size_t(g.n_kv_heads * g.head_dim), qn = std::size_t(g.n_heads * g.head_dim);
  const auto feed = [&](pol::ChunkedXkvPrefill<KVCache<pol::SnapKV>>& x, int l, std::size_t first,
                        const std::vector<float>& values) {
    const Stream& s = ls[std::size_t(l)];
    x.add_layer(l, std::int64_t(first), chunk, std::span<const float>(s.k.data() + first * kv, chunk * kv),
                std::span<const float>(values.data() + first * kv, chunk * kv),
                std::span<const float>(s.q.data() + first * qn, chunk * qn));
  };
  KVCache<pol::SnapKV> a(g, Budget::uniform(16), pol::SnapKV({.window = 4, .kernel = 3}));
  KVCache<pol::SnapKV> b(g, Budget::uniform(16), pol::SnapKV({.window = 4, .kernel = 3}));
  pol::ChunkedXkvPrefill<KVCache<pol::SnapKV>> xa(a, 2 * 8, xc), xb(b, 2 * 8, xc);
  for (int l = 0; l < g.n_layers; ++l) {
    feed(xa, l, 0, ls[std::size_t(l)].v);
    feed(xb, l, 0, ls[std::size_t(l)].v);
  }
  // Second chunk: layer 0 staged, then layer 1 with a NaN value (apply would have run).
  feed(xb, 0, chunk, ls[0].v);
  const auto snap = kvtest::snapshot(b);
  std::vector<float> bad = ls[1].v;
  bad[(chunk + 3) * kv + 5] = std::numeric_limits<float>::quiet_NaN();
  REQUIRE_THROWS_WITH(feed(xb, 1, chunk, bad), Catch::Contains("prefill: values"));
  REQUIRE(kvtest::snapshot(b) == snap);
  // The layer again with good values: the same cache as a run that never saw the NaN.
  feed(xb, 1, chunk, ls[1].v);
  for (int l = 0; l < g.n_layers; ++l) feed(xa, l, chunk, ls[std::size_t(l)].v);
  REQUIRE(kvtest::snapshot(b) == kvtest::snapshot(a));
  REQUIRE(xb.tokens() == xa.tokens());
}
