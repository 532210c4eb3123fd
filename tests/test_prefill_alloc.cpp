// A chunked prefill whose allocation fails leaves the cache unchanged (the rule: everything
// that can throw runs before the first change). This binary replaces the global operator
// new with one that can be told to fail at its N-th call; a prefill chunk that reselects
// (SnapKV) runs with N = 0, 1, 2, ... until it succeeds, and every failed attempt must
// leave rows, positions, arrival indices, tokens seen, the policy's scores, the pool's
// blocks and the engine decisions exactly as they were. Covered: KVCache (float, and Q8
// with an eviction callback, whose dropped prompt rows are encoded for it), IndexCache and
// PagedCache (float and Q8), with held rows dropped by the selection on two KV heads (the
// first head's changes would be visible if the second head's allocation failed).
#include <kvevict/index_cache.hpp>
#include <kvevict/paged_cache.hpp>

#include <cstdlib>
#include <new>

#include "support/test_support.hpp"

// GCC warns that free() releases what (its model of) operator new returned: here both are
// replaced together, so the pairing is right.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif

namespace {
// -1: never fail; otherwise the number of allocations still allowed.
long g_allow = -1;
}  // namespace

void* operator new(std::size_t n) {
  if (g_allow == 0) throw std::bad_alloc();
  if (g_allow > 0) --g_allow;
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
  try {
    return ::operator new(n);
  } catch (...) {
    return nullptr;
  }
}
void* operator new[](std::size_t n) { return ::operator new(n); }
void* operator new[](std::size_t n, const std::nothrow_t& t) noexcept { return ::operator new(n, t); }
// Every form of delete frees what one of the forms above took from malloc (ASan checks
// the pairing: a form left to the runtime would pair its new with this free).
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { std::free(p); }

namespace {

using kvevict::Budget;
using kvevict::Geometry;
namespace pol = kvevict::policies;

struct Stream {
  std::vector<float> k, v, q;
};

Stream make_stream(const Geometry& g, std::size_t T) {
  kvtest::Rng rng(17);
  return {rng.normals(T * std::size_t(g.n_kv_heads * g.head_dim)), rng.normals(T * std::size_t(g.n_kv_heads * g.head_dim)),
          rng.normals(T * std::size_t(g.n_heads * g.head_dim), 1.5f)};
}

template <class Cache>
std::vector<double> state(const Cache& c) {
  std::vector<double> s;
  const auto& g = c.geometry();
  for (int l = 0; l < g.n_layers; ++l) {
    s.push_back(double(c.tokens_seen(l)));
    for (int h = 0; h < g.n_kv_heads; ++h) {
      s.push_back(double(c.size(l, h)));
      for (auto x : c.positions(l, h)) s.push_back(double(x));
      for (auto x : c.seqs(l, h)) s.push_back(double(x));
      for (float x : c.policy().scores(l, h)) s.push_back(double(x));
      if constexpr (requires { c.dequantized_keys(l, h); }) {
        const auto k = c.dequantized_keys(l, h);
        for (Eigen::Index i = 0; i < k.size(); ++i) s.push_back(double(k.data()[i]));
      }
    }
  }
  return s;
}

const Geometry kGeom{1, 4, 2, 8};
const pol::SnapKV::Config kSnap{.window = 2, .kernel = 3};

/// `make()` builds a cache and feeds its first chunk (8 rows: the budget); `chunk(c)` runs
/// the second (5 tokens: the selection drops held rows on both heads). `extra()` is any
/// outside state (pool blocks, decisions) that must not change either.
template <class Make, class Chunk, class Extra>
void fails_cleanly(Make make, Chunk chunk, Extra extra) {
  int failures = 0;
  for (long n = 0;; ++n) {
    auto c = make();
    const auto before = state(*c);
    const auto outside = extra(*c);
    g_allow = n;
    try {
      chunk(*c);
      g_allow = -1;
      break;  // succeeded: every allocation up to here was tried failing
    } catch (const std::bad_alloc&) {
      g_allow = -1;
      ++failures;
      CAPTURE(n);
      REQUIRE(state(*c) == before);
      REQUIRE(extra(*c) == outside);
    }
    REQUIRE(n < 10000);
  }
  REQUIRE(failures > 0);  // the chunk does allocate (phase 1): the test reached it
}

template <class Cache>
void first_chunk(Cache& c, const Stream& s) {
  const std::size_t qn = 4 * 8;
  c.prefill(0, 0, 8, std::span<const float>(s.k.data(), 8 * 16), std::span<const float>(s.v.data(), 8 * 16),
            std::span<const float>(s.q.data(), 8 * qn));
}
template <class Cache>
auto second_chunk(Cache& c, const Stream& s) {
  const std::size_t kv = 16, qn = 32;
  return c.prefill(0, 8, 5, std::span<const float>(s.k.data() + 8 * kv, 5 * kv),
                   std::span<const float>(s.v.data() + 8 * kv, 5 * kv), std::span<const float>(s.q.data() + 8 * qn, 5 * qn));
}

template <class S>
void kv_cache(bool callback) {
  const Stream s = make_stream(kGeom, 13);
  std::vector<std::uint64_t> evicted;
  evicted.reserve(64);  // the callback must not throw: it never allocates here
  fails_cleanly(
      [&] {
        auto c = std::make_unique<kvevict::KVCache<pol::SnapKV, S>>(kGeom, Budget::uniform(8), pol::SnapKV(kSnap));
        if (callback) c->set_eviction_callback([&](const auto& e) { evicted.push_back(e.seq); });
        first_chunk(*c, s);
        evicted.clear();
        return c;
      },
      [&](auto& c) { second_chunk(c, s); }, [&](const auto&) { return evicted; });
  REQUIRE((!callback || !evicted.empty()));
}

template <class S>
void paged_cache() {
  const Stream s = make_stream(kGeom, 13);
  kvevict::BlockPool<S> pool(8, 4, kGeom.head_dim);
  fails_cleanly(
      [&] {
        auto c = std::make_unique<kvevict::PagedCache<pol::SnapKV, S>>(kGeom, Budget::uniform(8), pool, 0,
                                                                       pol::SnapKV(kSnap));
        first_chunk(*c, s);
        return c;
      },
      [&](auto& c) { second_chunk(c, s); },
      [&](const auto& c) {
        std::vector<std::uint32_t> t{pool.allocator().in_use()};
        for (int h = 0; h < 2; ++h) t.insert(t.end(), c.table(0, h).begin(), c.table(0, h).end());
        return t;
      });
}

}  // namespace

TEST_CASE("a chunk whose allocation fails leaves KVCache unchanged", "[chunked][alloc]") {
  kv_cache<float>(false);
  kv_cache<float>(true);
  kv_cache<kvevict::Q8<4>>(true);
}

TEST_CASE("a chunk whose allocation fails leaves IndexCache unchanged", "[chunked][alloc]") {
  const Stream s = make_stream(kGeom, 13);
  std::size_t decisions = 0;
  // Engine memory the held rows' keys are gathered from (zeros: the decisions are not
  // applied here; the selection only has to be the same on every attempt).
  std::vector<float> mem(2 * 9 * 8, 0.0f);  // 9 cells per head (one spare)
  const kvevict::CellRows<float> rows{mem.data(), 8, 9 * 8};
  const std::size_t kv = 16, qn = 32;
  fails_cleanly(
      [&] {
        auto c = std::make_unique<kvevict::IndexCache<pol::SnapKV>>(kGeom, Budget::uniform(8), pol::SnapKV(kSnap));
        REQUIRE(c->cells_per_head() == 9);
        c->prefill(0, 0, 8, std::span<const float>(s.k.data(), 8 * kv), std::span<const float>(s.q.data(), 8 * qn), rows);
        return c;
      },
      [&](auto& c) {
        decisions = c.prefill(0, 8, 5, std::span<const float>(s.k.data() + 8 * kv, 5 * kv),
                              std::span<const float>(s.q.data() + 8 * qn, 5 * qn), rows)
                        .size();
      },
      [&](const auto& c) {
        std::vector<std::uint32_t> cells;
        for (int h = 0; h < 2; ++h) cells.insert(cells.end(), c.cells(0, h).begin(), c.cells(0, h).end());
        return cells;
      });
  REQUIRE(decisions > 0);
}

TEST_CASE("a chunk whose allocation fails leaves PagedCache and its pool unchanged", "[chunked][alloc]") {
  paged_cache<float>();
  paged_cache<kvevict::Q8<4>>();
}
