// IndexCache: a policy run over row indices of engine-owned memory. The decisions,
// applied to an engine-side cell array (and, separately, to a dense row-ordered mirror),
// must give exactly the rows KVCache keeps with the same policy and stream, in the same
// row order, bit for bit.
#include <kvevict/index_cache.hpp>

#include "support/test_support.hpp"

namespace {

using kvevict::Budget;
using kvevict::CellRows;
using kvevict::Decision;
using kvevict::Geometry;
using kvevict::IndexCache;
using kvevict::KVCache;
namespace pol = kvevict::policies;

// An engine's own KV memory: per layer, head-major [Hkv][cells][d] K and V arrays, the
// position held by each cell (-1: free), and a dense row-ordered mirror kept by applying
// the move records.
template <class S>
struct EngineMemory {
  Geometry g;
  std::size_t cells = 0;
  std::vector<std::vector<S>> k, v;
  std::vector<std::vector<std::int64_t>> cell_pos;  // [layer][head * cells + cell]
  std::vector<std::vector<std::int64_t>> dense;     // [layer * Hkv + head]: positions by row

  EngineMemory(const Geometry& geo, std::size_t n_cells) : g(geo), cells(n_cells) {
    const std::size_t per = std::size_t(g.n_kv_heads) * cells * std::size_t(g.head_dim);
    k.assign(std::size_t(g.n_layers), std::vector<S>(per));
    v.assign(std::size_t(g.n_layers), std::vector<S>(per));
    cell_pos.assign(std::size_t(g.n_layers), std::vector<std::int64_t>(std::size_t(g.n_kv_heads) * cells, -1));
    dense.assign(std::size_t(g.n_layers * g.n_kv_heads), {});
  }
  CellRows<S> keys(int l) const { return {k[std::size_t(l)].data(), std::size_t(g.head_dim), cells * std::size_t(g.head_dim)}; }
  CellRows<S> values(int l) const { return {v[std::size_t(l)].data(), std::size_t(g.head_dim), cells * std::size_t(g.head_dim)}; }
  S* row(std::vector<S>& m, int h, std::uint32_t c) {
    return m.data() + (std::size_t(h) * cells + c) * std::size_t(g.head_dim);
  }

  // Applies one call's decisions; `tok_k/tok_v` are the call's float K/V block
  // (tokens x Hkv x d), `evicted` collects (layer, head, position) of every eviction.
  void apply(std::span<const Decision> ds, const std::vector<float>& tok_k,
             const std::vector<float>& tok_v, std::vector<kvtest::RowId>& evicted) {
    const auto d = std::size_t(g.head_dim);
    for (const Decision& e : ds) {
      auto& cp = cell_pos[std::size_t(e.layer)];
      auto& dn = dense[std::size_t(e.layer * g.n_kv_heads + e.kv_head)];
      const std::size_t slot = std::size_t(e.kv_head) * cells + e.cell;
      switch (e.kind) {
        case Decision::Kind::evict:
          evicted.emplace_back(e.layer, e.kv_head, e.position);
          if (e.row == Decision::kNoRow) break;  // a prompt token never kept
          REQUIRE(e.cell < cells);
          REQUIRE(cp[slot] == e.position);
          REQUIRE(dn.at(e.row) == e.position);
          cp[slot] = -1;
          // The row leaves; if it was not the last, a move record follows and fills it.
          if (e.row + 1 == dn.size()) dn.pop_back();
          break;
        case Decision::Kind::move:
          REQUIRE(e.from + 1 == dn.size());
          REQUIRE(dn[e.from] == e.position);
          dn[e.row] = dn[e.from];
          dn.pop_back();
          break;
        case Decision::Kind::place: {
          REQUIRE(e.cell < cells);
          REQUIRE(cp[slot] == -1);
          REQUIRE(e.row == dn.size());
          dn.push_back(e.position);
          cp[slot] = e.position;
          const std::size_t off = (std::size_t(e.from) * std::size_t(g.n_kv_heads) + std::size_t(e.kv_head)) * d;
          S* kr = row(k[std::size_t(e.layer)], e.kv_head, e.cell);
          S* vr = row(v[std::size_t(e.layer)], e.kv_head, e.cell);
          for (std::size_t j = 0; j < d; ++j) {
            kr[j] = static_cast<S>(tok_k[off + j]);
            vr[j] = static_cast<S>(tok_v[off + j]);
          }
          break;
        }
      }
    }
  }
};

template <class S>
std::uint16_t or_bits(S x) {
  if constexpr (sizeof(S) == 4) {
    std::uint32_t b;
    std::memcpy(&b, &x, 4);
    return static_cast<std::uint16_t>(b ^ (b >> 16));
  } else {
    std::uint16_t b;
    std::memcpy(&b, &x, 2);
    return b;
  }
}

// Everything KVCache exposes equals what the engine holds under IndexCache's bookkeeping.
template <class Cache, class Index, class Mem>
void check_same(const Cache& c, const Index& idx, Mem& mem, int l) {
  const auto d = mem.g.head_dim;
  for (int h = 0; h < mem.g.n_kv_heads; ++h) {
    INFO("layer " << l << " head " << h);
    const auto pc = c.positions(l, h);
    const auto pi = idx.positions(l, h);
    REQUIRE(std::vector<std::int64_t>(pc.begin(), pc.end()) ==
            std::vector<std::int64_t>(pi.begin(), pi.end()));
    const auto sc = c.seqs(l, h), si = idx.seqs(l, h);
    REQUIRE(std::equal(sc.begin(), sc.end(), si.begin(), si.end()));
    REQUIRE(mem.dense[std::size_t(l * mem.g.n_kv_heads + h)] ==
            std::vector<std::int64_t>(pc.begin(), pc.end()));
    const auto cells = idx.cells(l, h);
    const auto K = c.keys(l, h), V = c.values(l, h);
    std::size_t diff = 0;
    for (std::size_t r = 0; r < cells.size(); ++r) {
      REQUIRE(cells[r] < mem.cells);
      REQUIRE(mem.cell_pos[std::size_t(l)][std::size_t(h) * mem.cells + cells[r]] == pc[r]);
      const auto* kr = mem.row(mem.k[std::size_t(l)], h, cells[r]);
      const auto* vr = mem.row(mem.v[std::size_t(l)], h, cells[r]);
      for (int j = 0; j < d; ++j) {
        diff += or_bits(kr[j]) != or_bits(K(Eigen::Index(r), j));
        diff += or_bits(vr[j]) != or_bits(V(Eigen::Index(r), j));
      }
    }
    REQUIRE(diff == 0);
  }
}

// Streams a prompt then decode tokens through KVCache and IndexCache + EngineMemory, with
// attention computed for IndexCache from the engine's own cells.
// chunk > 0: the prompt arrives in chunks of that many tokens (chunked prefill).
template <class S, class Policy>
void run_same(Policy policy, Budget budget, std::uint64_t seed, bool with_prefill, std::size_t chunk = 0) {
  const Geometry g{2, 4, 2, 8};
  const std::size_t kv = std::size_t(g.n_kv_heads * g.head_dim);
  const std::size_t qn = std::size_t(g.n_heads * g.head_dim);
  KVCache<Policy, S> cache(g, budget, policy);
  IndexCache<Policy, S> idx(g, budget, policy);
  const std::size_t cells = idx.cells_per_head();
  EngineMemory<S> mem(g, cells);
  std::vector<kvtest::RowId> ev_cache, ev_idx;
  cache.set_eviction_callback([&](const kvevict::EvictedRow<S>& e) {
    ev_cache.emplace_back(e.layer, e.kv_head, e.position);
  });
  kvtest::Rng rng(seed);
  std::int64_t pos = 0;
  if (with_prefill) {
    const std::size_t T = 25, step = chunk == 0 ? T : chunk;
    for (std::size_t first = 0; first < T; first += step) {
      const std::size_t n = std::min(step, T - first);
      for (int l = 0; l < g.n_layers; ++l) {
        auto k = rng.normals(n * kv), v = rng.normals(n * kv), q = rng.normals(n * qn);
        cache.prefill(l, std::int64_t(first), n, k, v, q);
        auto ds = idx.prefill(l, std::int64_t(first), n, k, q, mem.keys(l));
        mem.apply(ds, k, v, ev_idx);
        check_same(cache, idx, mem, l);
      }
    }
    pos = 25;
  }
  for (int t = 0; t < 70; ++t, ++pos)
    for (int l = 0; l < g.n_layers; ++l) {
      auto k = rng.normals(kv, 1.0f + float(t % 5)), v = rng.normals(kv), q = rng.normals(qn);
      cache.append(l, pos, k, v, q);
      auto ds = idx.append(l, pos, k, mem.keys(l), q, {}, v, mem.values(l));
      mem.apply(ds, k, v, ev_idx);
      check_same(cache, idx, mem, l);
      if constexpr (has(Policy::signals, kvevict::Signals::attention)) {
        kvevict::attend(cache, l, q);
        for (int h = 0; h < g.n_kv_heads; ++h) {
          // The engine's attention over its own cells, in IndexCache's row order.
          const auto cl = idx.cells(l, h);
          std::vector<S> rows;
          for (auto c : cl) {
            const S* r = mem.row(mem.k[std::size_t(l)], h, c);
            rows.insert(rows.end(), r, r + g.head_dim);
          }
          std::vector<float> p(std::size_t(g.group()) * cl.size());
          kvevict::detail::group_probabilities(rows.data(), cl.size(), std::size_t(g.head_dim),
                                               q.data() + std::size_t(h * g.group() * g.head_dim),
                                               g.group(), p.data());
          idx.observe(l, h, p);
        }
      }
    }
  REQUIRE(ev_cache == ev_idx);
  REQUIRE(!ev_cache.empty());
}

}  // namespace

TEMPLATE_TEST_CASE("IndexCache decisions reproduce KVCache exactly", "[index_cache]", float,
                   Eigen::half) {
  using S = TestType;
  const bool prefill = GENERATE(false, true);
  SECTION("StreamingLLM") { run_same<S>(pol::StreamingLLM{2}, Budget::uniform(9), 1, prefill); }
  SECTION("H2O") { run_same<S>(pol::H2O(pol::H2O::Config{3, 1}), Budget::uniform(10), 2, prefill); }
  SECTION("KNorm") { run_same<S>(pol::KNorm(pol::KNorm::Config{1, 2}), Budget::uniform(8), 3, prefill); }
  SECTION("Random") {
    run_same<S>(pol::Random(pol::Random::Config{42, 1, 1}), Budget::per_layer({6, 11}), 4, prefill);
  }
  SECTION("per-head budget") {
    run_same<S>(pol::KNorm(pol::KNorm::Config{0, 1}), Budget::per_head({{4, 9}, {12, 5}}), 5, prefill);
  }
  // Pooled budgets (layer scope): the cross-head split is the core's, so the rows match too.
  SECTION("H2O, pooled") { run_same<S>(pol::H2O(pol::H2O::Config{3, 1}), Budget::uniform(10).pooled(), 6, prefill); }
  SECTION("recommended(), pooled, share capacity") {
    run_same<S>(pol::DecayedAttention::recommended(),
                Budget::uniform(16).pooled({.capacity = kvevict::PoolOptions::Capacity::share}), 7, prefill);
  }
}

TEMPLATE_TEST_CASE("IndexCache decisions reproduce KVCache under chunked prefill", "[index_cache]", float,
                   Eigen::half) {
  // SnapKV selects again after every chunk from its held rows (read from the engine's
  // cells) plus the chunk: evictions of held rows, moves and placements, then decoding.
  using S = TestType;
  const std::size_t chunk = GENERATE(std::size_t{3}, std::size_t{7}, std::size_t{25});
  CAPTURE(chunk);
  run_same<S>(pol::SnapKV(pol::SnapKV::Config{.window = 4, .kernel = 3}), Budget::uniform(12), 9, true, chunk);
  run_same<S>(pol::SnapKV(pol::SnapKV::Config{.window = 4, .kernel = 3, .pooling = pol::Pooling::max,
                                              .decode_reserve = 2}),
              Budget::per_head({{9, 14}, {11, 7}}), 10, true, chunk);
  run_same<S>(pol::H2O(pol::H2O::Config{3, 1}), Budget::uniform(10), 11, true, chunk);
}

TEST_CASE("IndexCache allocates cells within the budget", "[index_cache]") {
  const Geometry g{1, 2, 1, 4};
  IndexCache<pol::StreamingLLM> idx(g, Budget::uniform(5), pol::StreamingLLM{1});
  REQUIRE(idx.cells_per_head() == 6);
  EngineMemory<float> mem(g, 6);
  std::vector<kvtest::RowId> ev;
  kvtest::Rng rng(8);
  for (int t = 0; t < 40; ++t) {
    auto k = rng.normals(4), v = rng.normals(4);
    auto ds = idx.append(0, t, k, mem.keys(0), {}, {}, v, mem.values(0));
    mem.apply(ds, k, v, ev);
    // Auto-allocated cells reuse the victim's cell: never beyond the capacity.
    for (auto c : idx.cells(0, 0)) REQUIRE(c < 5);
  }
  REQUIRE(idx.size(0, 0) == 5);
  REQUIRE(ev.size() == 35);
}

TEST_CASE("IndexCache accepts engine-chosen cells and rejects bad ones unchanged", "[index_cache]") {
  const Geometry g{1, 2, 2, 4};
  IndexCache<pol::StreamingLLM> idx(g, Budget::uniform(3), pol::StreamingLLM{1});
  EngineMemory<float> mem(g, idx.cells_per_head());
  std::vector<kvtest::RowId> ev;
  kvtest::Rng rng(9);
  // An engine with its own free list (capacity + 1 cells: one spare) writes the new token
  // into a free cell first, then frees the cells of the victims.
  std::vector<std::vector<std::uint32_t>> free_cells{{0, 1, 2, 3}, {3, 2, 1, 0}};
  for (int t = 0; t < 12; ++t) {
    auto k = rng.normals(8), v = rng.normals(8);
    std::vector<std::uint32_t> chosen;
    for (auto& f : free_cells) {
      chosen.push_back(f.back());
      f.pop_back();
    }
    auto ds = idx.append(0, t, k, mem.keys(0), {}, chosen, v, mem.values(0));
    mem.apply(ds, k, v, ev);
    for (const auto& d : ds) {
      if (d.kind == Decision::Kind::evict) free_cells[std::size_t(d.kv_head)].push_back(d.cell);
      if (d.kind == Decision::Kind::place) REQUIRE(d.cell == chosen[std::size_t(d.kv_head)]);
    }
  }
  REQUIRE(ev.size() == 2 * (12 - 3));
  REQUIRE(idx.size(0, 0) == 3);
  const auto before = std::vector<std::uint32_t>(idx.cells(0, 1).begin(), idx.cells(0, 1).end());
  auto k = rng.normals(8);
  const std::uint32_t busy = idx.cells(0, 0)[0];
  CHECK_THROWS_AS(idx.append(0, 100, k, mem.keys(0), {}, std::vector<std::uint32_t>{busy, 0}),
                  kvevict::Error);
  CHECK_THROWS_AS(idx.append(0, 100, k, mem.keys(0), {}, std::vector<std::uint32_t>{4, 4}),
                  kvevict::Error);
  CHECK_THROWS_AS(idx.append(0, 100, k, CellRows<float>{}), kvevict::Error);
  CHECK_THROWS_AS(idx.append(0, 5, k, mem.keys(0)), kvevict::Error);  // position not increasing
  REQUIRE(idx.tokens_seen(0) == 12);
  REQUIRE(std::vector<std::uint32_t>(idx.cells(0, 1).begin(), idx.cells(0, 1).end()) == before);
}
