// PagedCache: the paged per-head layout over the container core. On the same stream it
// must keep exactly KVCache's rows (positions, arrival indices, K/V bit for bit, same row
// order) at every block size, several sequences sharing one pool; blocks in use follow
// the rows (ceil(rows / block_tokens) per head) and go back to the pool at once.
#include <kvevict/paged_cache.hpp>
#include <kvevict/policies/block_granular.hpp>
#include <kvevict/policies/keydiff.hpp>

#include <cmath>
#include <limits>
#include <map>
#include <set>

#include "support/test_support.hpp"

namespace {

using kvevict::BlockPool;
using kvevict::Budget;
using kvevict::Geometry;
using kvevict::KVCache;
using kvevict::PagedCache;
namespace pol = kvevict::policies;

template <class S, class Policy>
void check_same(const KVCache<Policy, S>& c, const PagedCache<Policy, S>& p, int l) {
  const auto& g = c.geometry();
  const std::size_t B = p.pool().block_tokens();
  const auto d = static_cast<std::size_t>(g.head_dim);
  for (int h = 0; h < g.n_kv_heads; ++h) {
    INFO("layer " << l << " head " << h);
    const auto pc = c.positions(l, h), pp = p.positions(l, h);
    REQUIRE(std::vector<std::int64_t>(pc.begin(), pc.end()) == std::vector<std::int64_t>(pp.begin(), pp.end()));
    const auto sc = c.seqs(l, h), sp = p.seqs(l, h);
    REQUIRE(std::equal(sc.begin(), sc.end(), sp.begin(), sp.end()));
    const auto table = p.table(l, h);
    REQUIRE(table.size() == (pc.size() + B - 1) / B);
    // The stored rows, byte for byte (for a quantized S: the encoded rows, scales included).
    const auto& pool = p.pool();
    REQUIRE(pool.key_row_bytes() == c.key_row_bytes());
    REQUIRE(pool.value_row_bytes() == c.value_row_bytes());
    const std::size_t ku = pool.key_row_units(), vu = pool.value_row_units();
    REQUIRE(ku * sizeof(*pool.key_block(0)) == pool.key_row_bytes());
    if constexpr (!KVCache<Policy, S>::quantized) REQUIRE(ku == d);
    const auto K = c.stored_keys(l, h), V = c.stored_values(l, h);
    REQUIRE(K.size() == pc.size() * ku);
    std::size_t diff = 0;
    for (std::size_t r = 0; r < pc.size(); ++r) {
      diff += std::memcmp(pool.key_block(table[r / B]) + (r % B) * ku, K.data() + r * ku, pool.key_row_bytes()) != 0;
      diff += std::memcmp(pool.value_block(table[r / B]) + (r % B) * vu, V.data() + r * vu, pool.value_row_bytes()) != 0;
    }
    REQUIRE(diff == 0);
  }
}

// The rows attention reads: as stored, or dequantised for a quantized cache.
template <class Cache>
auto rows_for_attention(const Cache& c, int l, int h) {
  if constexpr (Cache::quantized) return c.dequantized_keys(l, h);
  else return c.keys(l, h);
}

// Two sequences share one pool; each is compared with its own KVCache.
template <class S, class Policy>
void run_same(Policy policy, Budget budget, std::uint32_t block_tokens, std::uint64_t seed, bool with_prefill) {
  const Geometry g{2, 4, 2, 8};
  const std::size_t kv = std::size_t(g.n_kv_heads * g.head_dim), qn = std::size_t(g.n_heads * g.head_dim);
  BlockPool<S> pool(4096, block_tokens, g.head_dim);
  for (std::uint32_t s = 0; s < 2; ++s) {
    KVCache<Policy, S> cache(g, budget, policy);
    {
      PagedCache<Policy, S> paged(g, budget, pool, s, policy);
      kvtest::Rng rng(seed + s);
      std::int64_t pos = 0;
      if (with_prefill) {
        const std::size_t T = 25;
        for (int l = 0; l < g.n_layers; ++l) {
          auto k = rng.normals(T * kv), v = rng.normals(T * kv), q = rng.normals(T * qn);
          cache.prefill(l, 0, T, k, v, q);
          paged.prefill(l, 0, T, k, v, q);
          check_same(cache, paged, l);
        }
        pos = 25;
      }
      for (int t = 0; t < 70; ++t, ++pos)
        for (int l = 0; l < g.n_layers; ++l) {
          auto k = rng.normals(kv, 1.0f + float(t % 5)), v = rng.normals(kv), q = rng.normals(qn);
          cache.append(l, pos, k, v, q);
          paged.append(l, pos, k, v, q);
          check_same(cache, paged, l);
          if constexpr (has(Policy::signals, kvevict::Signals::attention)) {
            kvevict::attend(cache, l, q);
            // The same probabilities from the paged rows, handed to the paged sequence.
            for (int h = 0; h < g.n_kv_heads; ++h) {
              const auto K = rows_for_attention(cache, l, h);
              std::vector<float> p(std::size_t(g.group()) * std::size_t(K.rows()));
              kvevict::detail::group_probabilities(K.data(), std::size_t(K.rows()), std::size_t(g.head_dim),
                                                   q.data() + std::size_t(h * g.group() * g.head_dim),
                                                   g.group(), p.data());
              paged.observe(l, h, p);
            }
          }
        }
      std::size_t rows = 0;
      for (int l = 0; l < g.n_layers; ++l)
        for (int h = 0; h < g.n_kv_heads; ++h) rows += (cache.size(l, h) + block_tokens - 1) / block_tokens;
      REQUIRE(paged.blocks_in_use() == rows);
      REQUIRE(pool.allocator().in_use() == rows);
    }
    REQUIRE(pool.allocator().in_use() == 0);  // the destructor returned every block
  }
}

}  // namespace

TEMPLATE_TEST_CASE("PagedCache keeps exactly KVCache's rows at every block size", "[paged]", float,
                   Eigen::half, kvevict::Q8<8>, (kvevict::KV<kvevict::E4M3, kvevict::Q4<4>>)) {
  using S = TestType;
  const bool prefill = GENERATE(false, true);
  const std::uint32_t bt = GENERATE(1u, 4u, 16u);
  CAPTURE(prefill, bt);
  SECTION("StreamingLLM") { run_same<S>(pol::StreamingLLM{2}, Budget::uniform(9), bt, 1, prefill); }
  SECTION("H2O") { run_same<S>(pol::H2O(pol::H2O::Config{3, 1}), Budget::uniform(10), bt, 2, prefill); }
  SECTION("KNorm") { run_same<S>(pol::KNorm(pol::KNorm::Config{1, 2}), Budget::uniform(8), bt, 3, prefill); }
  SECTION("DecayedAttention") {
    run_same<S>(pol::DecayedAttention(pol::DecayedAttention::Config{.sinks = 1, .recent = 2}),
                Budget::uniform(12), bt, 4, prefill);
  }
  SECTION("SnapKV") {
    run_same<S>(pol::SnapKV(pol::SnapKV::Config{.window = 4, .kernel = 3}), Budget::per_layer({17, 21}), bt, 5, prefill);
  }
  SECTION("per-head budget") {
    run_same<S>(pol::KNorm(pol::KNorm::Config{0, 1}), Budget::per_head({{4, 9}, {12, 5}}), bt, 6, prefill);
  }
}

TEST_CASE("PagedCache: an exhausted pool is a kvevict::Error and nothing changes", "[paged]") {
  const Geometry g{1, 2, 2, 4};
  BlockPool<float> pool(3, 2, 4);
  PagedCache<pol::StreamingLLM> a(g, Budget::uniform(8), pool, 0, pol::StreamingLLM{1});
  kvtest::Rng rng(5);
  for (int t = 0; t < 2; ++t) a.append(0, t, rng.normals(8), rng.normals(8));  // one block per head
  REQUIRE(pool.allocator().in_use() == 2);
  // The third token needs a second block for each KV head; one is free.
  REQUIRE_THROWS_WITH(a.append(0, 2, rng.normals(8), rng.normals(8)),
                      Catch::Contains("pool exhausted") && Catch::Contains("needs 2 new blocks, 1 of 3 free"));
  REQUIRE(pool.allocator().in_use() == 2);
  REQUIRE(a.size(0, 0) == 2);
  REQUIRE(a.tokens_seen(0) == 2);
  {
    PagedCache<pol::StreamingLLM> b(g, Budget::uniform(8), pool, 1, pol::StreamingLLM{1});
    REQUIRE_THROWS_WITH(b.append(0, 0, rng.normals(8), rng.normals(8)), Catch::Contains("sequence 1"));
    REQUIRE(pool.allocator().in_use() == 2);
  }
  a.release();
  REQUIRE(pool.allocator().in_use() == 0);
  REQUIRE(a.size(0, 1) == 0);
  REQUIRE_THROWS_WITH(a.append(0, 9, rng.normals(8), rng.normals(8)), Catch::Contains("sequence 0 was released"));
  REQUIRE(pool.allocator().in_use() == 0);
  REQUIRE_THROWS_WITH(BlockPool<float>(4, 6, 4), Catch::Contains("block_tokens = 6"));
  REQUIRE_THROWS_WITH(PagedCache<pol::StreamingLLM>(Geometry{1, 2, 2, 8}, Budget::uniform(8), pool, 0),
                      Catch::Contains("pool head_dim = 4"));
}

TEST_CASE("PagedCache: a prefill block that would exhaust the pool half way changes nothing", "[paged]") {
  // Found by fuzz_paged_pool: a block going token by token (a policy without a prompt
  // selection) used to apply its first tokens and then throw "pool exhausted" at the token
  // needing a block. The whole block is now checked before its first step.
  const Geometry g{1, 2, 2, 4};
  BlockPool<float> pool(4, 2, 4);  // 4 blocks of 2 rows, 2 KV heads
  PagedCache<pol::H2O> a(g, Budget::uniform(8), pool, 0, pol::H2O(pol::H2O::Config{2, 0}));
  kvtest::Rng rng(11);
  a.prefill(0, 0, 1, rng.normals(8), rng.normals(8), rng.normals(8));
  REQUIRE(pool.allocator().in_use() == 2);
  const auto pos = std::vector<std::int64_t>(a.positions(0, 1).begin(), a.positions(0, 1).end());
  // 4 more tokens: 5 rows per head = 3 blocks each, 4 new blocks, 2 free (the third token
  // of the block is where it used to fail, with two tokens already in).
  REQUIRE_THROWS_WITH(a.prefill(0, 1, 4, rng.normals(32), rng.normals(32), rng.normals(32)),
                      Catch::Contains("pool exhausted") && Catch::Contains("needs 4 new blocks, 2 of 4 free"));
  REQUIRE(pool.allocator().in_use() == 2);
  REQUIRE(a.tokens_seen(0) == 1);
  for (int h = 0; h < 2; ++h) REQUIRE(a.size(0, h) == 1);
  REQUIRE(std::vector<std::int64_t>(a.positions(0, 1).begin(), a.positions(0, 1).end()) == pos);
  // 3 tokens fit exactly (4 rows per head, 2 blocks each).
  a.prefill(0, 1, 3, rng.normals(24), rng.normals(24), rng.normals(24));
  REQUIRE(pool.allocator().in_use() == 4);
  REQUIRE(a.size(0, 0) == 4);
}

TEST_CASE("PagedCache over a quantized pool: bad formats and values are a kvevict::Error, nothing changes",
          "[paged]") {
  using Q = kvevict::Q8<8>;
  // The group size must divide head_dim, named in the message.
  REQUIRE_THROWS_WITH(BlockPool<kvevict::Q8<32>>(4, 2, 8),
                      Catch::Contains("group size 32") && Catch::Contains("head_dim 8"));
  const Geometry g{1, 2, 1, 8};
  BlockPool<Q> pool(8, 2, 8);
  REQUIRE(pool.key_row_bytes() == 8 + 2);  // 8 codes and one fp16 scale per group of 8
  PagedCache<pol::StreamingLLM, Q> c(g, Budget::uniform(6), pool, 0, pol::StreamingLLM{1});
  kvtest::Rng rng(3);
  for (int t = 0; t < 3; ++t) c.append(0, t, rng.normals(8), rng.normals(8));
  const auto in_use = pool.allocator().in_use();
  std::vector<std::uint8_t> before(pool.key_block(c.table(0, 0)[0]),
                                   pool.key_block(c.table(0, 0)[0]) + 2 * pool.key_row_bytes());
  auto k = rng.normals(8);
  k[5] = std::numeric_limits<float>::infinity();
  REQUIRE_THROWS_WITH(c.append(0, 3, k, rng.normals(8)), Catch::Contains("keys[5]"));
  auto v = rng.normals(8);
  v[2] = std::nanf("");
  REQUIRE_THROWS_WITH(c.append(0, 3, rng.normals(8), v), Catch::Contains("values[2]"));
  REQUIRE(pool.allocator().in_use() == in_use);
  REQUIRE(c.size(0, 0) == 3);
  REQUIRE(c.tokens_seen(0) == 3);
  REQUIRE(std::equal(before.begin(), before.end(), pool.key_block(c.table(0, 0)[0])));
}

TEST_CASE("PagedCache: a prompt prefilled in chunks never needs more blocks than its budget", "[paged]") {
  // The pool holds exactly the blocks the budget needs (layers x KV heads x ceil(cap / B)):
  // any transient overshoot while a chunk is selected would throw "pool exhausted".
  const Geometry g{2, 4, 2, 8};
  const std::size_t kv = std::size_t(g.n_kv_heads * g.head_dim), qn = std::size_t(g.n_heads * g.head_dim);
  const std::uint32_t bt = GENERATE(1u, 4u, 16u);
  const std::size_t chunk = GENERATE(std::size_t{7}, std::size_t{32});
  CAPTURE(bt, chunk);
  const long long cap = 48;
  const auto blocks = std::uint32_t(g.n_layers * g.n_kv_heads) * std::uint32_t((cap + bt - 1) / bt);
  auto run = [&](auto policy) {
    using P = decltype(policy);
    BlockPool<float> pool(blocks, bt, g.head_dim);
    PagedCache<P> paged(g, Budget::uniform(cap), pool, 0, policy);
    KVCache<P> cache(g, Budget::uniform(cap), policy);
    kvtest::Rng rng(11);
    for (std::size_t first = 0; first < 200; first += chunk) {
      const std::size_t T = std::min(chunk, 200 - first);
      for (int l = 0; l < g.n_layers; ++l) {
        auto k = rng.normals(T * kv), v = rng.normals(T * kv), q = rng.normals(T * qn);
        paged.prefill(l, std::int64_t(first), T, k, v, q);
        cache.prefill(l, std::int64_t(first), T, k, v, q);
        for (int h = 0; h < g.n_kv_heads; ++h) {
          REQUIRE(paged.size(l, h) <= std::size_t(cap));
          const auto pp = paged.positions(l, h), pc = cache.positions(l, h);
          REQUIRE(std::equal(pp.begin(), pp.end(), pc.begin(), pc.end()));
        }
      }
      REQUIRE(pool.allocator().in_use() <= blocks);
    }
    REQUIRE(paged.size(0, 0) == std::size_t(cap));
  };
  run(pol::H2O(pol::H2O::Config{4, 1}));
  run(pol::DecayedAttention::recommended());
  run(pol::SnapKV(pol::SnapKV::Config{.window = 4, .kernel = 3}));
}

// --- BlockGranular<P>: block-granular (and shared-cell) decisions through the one core -----
namespace {
using BG = pol::BlockGranularConfig;

// Every held arrival block but the newest is whole, the sink blocks are held, and once the
// head has filled up it holds between cap - B + 1 and cap rows (a table of cap / B blocks).
template <class Cache>
void check_blocks(const Cache& c, int l, std::uint32_t B, std::uint32_t sinks, std::uint64_t seen) {
  const std::size_t cap = c.capacity(l, 0);
  for (int h = 0; h < c.geometry().n_kv_heads; ++h) {
    std::map<std::uint64_t, std::size_t> per;
    for (auto s : c.seqs(l, h)) ++per[s / B];
    const std::uint64_t newest = per.empty() ? 0 : per.rbegin()->first;
    for (auto [b, n] : per) {
      INFO("head " << h << " block " << b);
      if (b != newest) REQUIRE(n == B);
    }
    for (std::uint64_t b = 0; b < sinks && b * B < seen; ++b) REQUIRE(per.count(b) == 1);
    if (seen >= cap) REQUIRE(c.size(l, h) + B > cap);
    REQUIRE(c.size(l, h) <= cap);
  }
}
}  // namespace

TEST_CASE("BlockGranular: whole blocks of every policy, PagedCache = KVCache, pool accounting", "[paged]") {
  const std::uint32_t bt = GENERATE(1u, 4u);
  CAPTURE(bt);
  const BG cfg{.block_tokens = 4, .sink_blocks = 1, .recent_blocks = 1};
  const Budget b = Budget::uniform(24);
  SECTION("StreamingLLM (votes)") { run_same<float>(pol::BlockGranular(pol::StreamingLLM{1}, cfg), b, bt, 21, false); }
  SECTION("H2O (costs)") { run_same<float>(pol::BlockGranular(pol::H2O({.recent = 2}), cfg), b, bt, 22, true); }
  SECTION("DecayedAttention (costs, mean)") {
    BG c = cfg;
    c.score = kvevict::BlockScore::mean;
    run_same<float>(pol::BlockGranular(pol::DecayedAttention::recommended(), c), b, bt, 23, false);
  }
  SECTION("KeyDiff (votes, max)") {
    BG c = cfg;
    c.score = kvevict::BlockScore::max;
    run_same<float>(pol::BlockGranular(pol::KeyDiff({.sinks = 1, .recent = 2}), c), b, bt, 24, false);
  }
  SECTION("KNorm, shared decisions") {
    BG c = cfg;
    c.shared = true;
    run_same<Eigen::half>(pol::BlockGranular(pol::KNorm(pol::KNorm::Config{1, 2}), c), b, bt, 25, true);
  }
}

TEST_CASE("BlockGranular: the block with the lowest summed accumulated attention leaves (brute force)", "[paged]") {
  // H2O's score of a token = the attention its G query heads drew, summed over steps; a
  // block's = the sum over its tokens. Reference: per (layer, head) token scores kept here.
  const Geometry g{1, 4, 2, 8};
  const std::uint32_t B = 4;
  const pol::HeadCombine comb = GENERATE(pol::HeadCombine::sum, pol::HeadCombine::max, pol::HeadCombine::rank_sum,
                                         pol::HeadCombine::rank_max, pol::HeadCombine::mass_sum, pol::HeadCombine::quota);
  const bool shared = GENERATE(false, true);
  CAPTURE(shared, pol::to_string(comb));
  const BG cfg{.block_tokens = B, .sink_blocks = 1, .recent_blocks = 1, .shared = shared, .combine = comb};
  KVCache<pol::BlockGranular<pol::H2O>> c(g, Budget::uniform(20), pol::BlockGranular(pol::H2O({.recent = 1}), cfg));
  std::vector<std::map<std::uint64_t, double>> score(2);  // per KV head: seq -> accumulated
  kvtest::Rng rng(7);
  const std::size_t kv = 16, qn = 32;
  std::size_t evictions = 0;
  for (std::int64_t t = 0; t < 90; ++t) {
    auto k = rng.normals(kv, 2.0f), v = rng.normals(kv), q = rng.normals(qn, 2.0f);
    std::vector<std::set<std::uint64_t>> before(2);
    for (int h = 0; h < 2; ++h) before[h] = {c.seqs(0, h).begin(), c.seqs(0, h).end()};
    c.append(0, t, k, v, q);
    for (int h = 0; h < 2; ++h) {
      std::set<std::uint64_t> gone;
      for (auto s : before[h])
        if (std::find(c.seqs(0, h).begin(), c.seqs(0, h).end(), s) == c.seqs(0, h).end()) gone.insert(s);
      if (gone.empty()) continue;
      if (h == 0) ++evictions;
      // Expected: among blocks 1..newest-1 (held), the lowest aggregate (sum over tokens;
      // shared: per token, sum or max over the heads); ties to the oldest.
      std::map<std::uint64_t, double> agg;
      std::uint64_t newest = 0;
      for (auto s : before[h]) newest = std::max<std::uint64_t>(newest, s / B);
      // Normalised modes: per head, each open row's rank among the open rows (H2O protects the
      // newest row: +inf), equal scores sharing the lower rank, over open - 1; or its share
      // of the head's open total; quota: the top ceil(open / 2) ranks of a head.
      std::vector<std::map<std::uint64_t, double>> norm(2);
      std::vector<double> cut(2, 2.0);
      for (int hh = 0; hh < 2; ++hh) {
        std::vector<std::uint64_t> open;
        double total = 0.0;
        for (auto s : before[hh])
          if (s + 1 != std::uint64_t(t)) open.push_back(s), total += score[hh][s];
        for (auto s : open) {
          std::size_t below = 0;
          for (auto o : open) below += float(score[hh][o]) < float(score[hh][s]);
          norm[hh][s] = comb == pol::HeadCombine::mass_sum ? score[hh][s] / total : double(below) / double(open.size() - 1);
        }
        std::vector<double> ranks;
        for (auto s : open) ranks.push_back(norm[hh][s]);
        std::sort(ranks.begin(), ranks.end());
        cut[hh] = ranks[ranks.size() - (ranks.size() + 1) / 2];
      }
      for (auto s : before[h]) {
        const std::uint64_t blk = s / B;
        if (blk < 1 || blk + 1 > newest) continue;
        double x = score[h][s];
        if (shared) {
          const bool normalised = comb != pol::HeadCombine::sum && comb != pol::HeadCombine::max;
          const double a = normalised ? norm[0][s] : score[0][s], b = normalised ? norm[1][s] : score[1][s];
          x = comb == pol::HeadCombine::max || comb == pol::HeadCombine::rank_max ? std::max(a, b) : a + b;
          if (comb == pol::HeadCombine::quota && (a >= cut[0] || b >= cut[1])) x += 2.0;
        }
        agg[blk] += x;
      }
      REQUIRE(!agg.empty());
      auto best = agg.begin();
      for (auto it = agg.begin(); it != agg.end(); ++it)
        if (it->second < best->second - 1e-5) best = it;
      std::set<std::uint64_t> want;
      for (std::uint64_t s = best->first * B; s < best->first * B + B; ++s) want.insert(s);
      INFO("head " << h << " t " << t);
      REQUIRE(gone == want);
    }
    if (shared) REQUIRE(std::vector<std::uint64_t>(c.seqs(0, 0).begin(), c.seqs(0, 0).end()) ==
                        std::vector<std::uint64_t>(c.seqs(0, 1).begin(), c.seqs(0, 1).end()));
    check_blocks(c, 0, B, 1, static_cast<std::uint64_t>(t + 1));
    const auto res = kvevict::attend(c, 0, q);
    for (int h = 0; h < 2; ++h) {
      const auto seqs = c.seqs(0, h);
      const std::size_t n = seqs.size();
      for (int gq = 0; gq < 2; ++gq)
        for (std::size_t r = 0; r < n; ++r) score[h][seqs[r]] += res.probs[std::size_t(h)](gq, static_cast<Eigen::Index>(r));
    }
  }
  REQUIRE(evictions > 10);
  REQUIRE(c.policy().fallbacks() == 0);
}

TEST_CASE("BlockGranular, shared decisions: a budget shrink keeps every head on the same tokens", "[paged]") {
  // Per-head H2O costs differ between the heads (random keys), so a shrink decided per head
  // would leave the heads on different tokens; shared decisions shrink with one victim set,
  // of whole blocks, and later steps stay shared.
  const Geometry g{2, 4, 2, 8};
  const std::uint32_t B = 4;
  const BG cfg{.block_tokens = B, .sink_blocks = 1, .recent_blocks = 1, .shared = true};
  KVCache<pol::BlockGranular<pol::H2O>> c(g, Budget::uniform(32), pol::BlockGranular(pol::H2O({.recent = 1}), cfg));
  kvtest::Rng rng(11);
  const auto same = [&](int l) {
    return std::vector<std::uint64_t>(c.seqs(l, 0).begin(), c.seqs(l, 0).end()) ==
           std::vector<std::uint64_t>(c.seqs(l, 1).begin(), c.seqs(l, 1).end());
  };
  const auto step = [&](std::int64_t t) {
    for (int l = 0; l < 2; ++l) {
      auto k = rng.normals(16, 2.0f), v = rng.normals(16), q = rng.normals(32, 2.0f);
      c.append(l, t, k, v, q);
      kvevict::attend(c, l, q);
    }
  };
  std::int64_t t = 0;
  for (; t < 40; ++t) step(t);
  REQUIRE((same(0) && same(1)));
  c.set_budget(Budget::uniform(17));
  for (int l = 0; l < 2; ++l) {
    INFO("layer " << l);
    CHECK(same(l));
    CHECK(c.size(l, 0) <= 17);
    check_blocks(c, l, B, 1, static_cast<std::uint64_t>(t));
  }
  for (; t < 60; ++t) step(t);
  for (int l = 0; l < 2; ++l) CHECK(same(l));
  CHECK(c.policy().fallbacks() == 0);
}

TEST_CASE("BlockGranular at block size 1, per head, keeps the wrapped policy's rows", "[paged]") {
  const Geometry g{2, 4, 2, 8};
  const BG one{.block_tokens = 1, .sink_blocks = 0, .recent_blocks = 0};
  const auto same = [&](auto policy, Budget b, std::uint64_t seed) {
    using P = decltype(policy);
    KVCache<P> ref(g, b, policy);
    KVCache<pol::BlockGranular<P>> c(g, b, pol::BlockGranular<P>(policy, one));
    kvtest::Rng rng(seed);
    for (std::int64_t t = 0; t < 60; ++t)
      for (int l = 0; l < 2; ++l) {
        auto k = rng.normals(16, 1.0f + float(t % 3)), v = rng.normals(16), q = rng.normals(32);
        ref.append(l, t, k, v, q);
        c.append(l, t, k, v, q);
        for (int h = 0; h < 2; ++h)
          REQUIRE(std::vector<std::uint64_t>(ref.seqs(l, h).begin(), ref.seqs(l, h).end()) ==
                  std::vector<std::uint64_t>(c.seqs(l, h).begin(), c.seqs(l, h).end()));
        if constexpr (has(P::signals, kvevict::Signals::attention)) {
          kvevict::attend(ref, l, q);
          kvevict::attend(c, l, q);
        }
      }
  };
  SECTION("StreamingLLM") { same(pol::StreamingLLM{2}, Budget::uniform(10), 31); }
  SECTION("KNorm") { same(pol::KNorm(pol::KNorm::Config{1, 2}), Budget::uniform(9), 32); }
  SECTION("H2O") { same(pol::H2O({.recent = 2}), Budget::uniform(12), 33); }
  SECTION("DecayedAttention::recommended()") { same(pol::DecayedAttention::recommended(), Budget::uniform(16), 34); }
  SECTION("KeyDiff") { same(pol::KeyDiff({.sinks = 1, .recent = 2}), Budget::uniform(11), 35); }
}

TEST_CASE("BlockGranular: bad settings are a kvevict::Error and the pool is unchanged", "[paged]") {
  const Geometry g{1, 2, 2, 4};
  BlockPool<float> pool(8, 2, 4);
  PagedCache<pol::StreamingLLM> a(g, Budget::uniform(8), pool, 0, pol::StreamingLLM{1});
  kvtest::Rng rng(3);
  a.append(0, 0, rng.normals(8), rng.normals(8));
  REQUIRE(pool.allocator().in_use() == 2);
  using SB = pol::BlockGranular<pol::StreamingLLM>;
  REQUIRE_THROWS_WITH((PagedCache<SB>(g, Budget::uniform(32), pool, 1, SB(pol::StreamingLLM{1}, BG{.block_tokens = 6}))),
                      Catch::Contains("block_tokens = 6") && Catch::Contains("power of two"));
  REQUIRE_THROWS_WITH((PagedCache<SB>(g, Budget::uniform(32), pool, 1,
                                      SB(pol::StreamingLLM{1}, BG{.block_tokens = 4, .source = pol::BlockSource::costs}))),
                      Catch::Contains("source = costs"));
  // Budget below the protected blocks + one evictable block (3 x 4 tokens).
  REQUIRE_THROWS_AS((PagedCache<SB>(g, Budget::uniform(11), pool, 1, SB(pol::StreamingLLM{1}, BG{.block_tokens = 4}))),
                    kvevict::Error);
  REQUIRE(pool.allocator().in_use() == 2);
  REQUIRE(a.size(0, 0) == 1);
}
