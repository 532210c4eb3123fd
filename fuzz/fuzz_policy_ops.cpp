// Random operation sequences on every policy: append, attend, prefill, set_budget,
// save/restore, and malformed calls, on a small random geometry and budget. After every
// operation the cache invariants must hold; malformed calls must throw kvevict::Error and
// change nothing. The malformed classes include sizes that wrap (prefill token counts near
// 2^64 with empty spans), a block passing INT64_MAX, values at the storage type's overflow
// edge, probabilities outside [0, 1], and calls on a moved-from cache; some inputs build
// configurations whose protected rows overflow, or raw geometries, which must be refused
// with kvevict::Error (never bad_alloc or a crash). Shapes are small and decode steps come
// in batches so a run covers many operations per second. While no budget change has happened, an IndexCache runs the same stream
// and must keep exactly the same rows (differential check). Any other exception, or a
// policy returning bad victims (std::logic_error), is a bug and aborts.
// After every operation each kept row's stored bytes must equal the encoding of what was
// appended for its arrival index (bit-exact rows, every storage type). Chunked prefill: a
// prompt of 1-24 tokens in chunks of random sizes (SnapKV reselects after each chunk, or
// keeps the first-chunk rule; XKV/PyramidKV-style per-layer budgets come from the budget
// draw), no head above its capacity after any chunk, malformed chunks between the chunks
// (missing queries, a NaN key, a short query block) refused with nothing changed, and, on
// a cache that held nothing, the same rows as the whole prompt in one prefill wherever the
// docs promise it (one chunk; policies without a prompt selection; SnapKV when the prompt
// fits in capacity - decode_reserve).
#include <kvevict/index_cache.hpp>
#include <kvevict/kvevict.hpp>
#include <kvevict/policies/buzz.hpp>
#include <kvevict/policies/decayed_attention.hpp>
#include <kvevict/policies/hash_evict.hpp>
#include <kvevict/policies/snapkv.hpp>
#include <kvevict/serialize.hpp>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <limits>
#include <optional>

#include "fuzz_input.hpp"

namespace {

namespace pol = kvevict::policies;
using kvevict::Budget;
using kvevict::Geometry;

#define KVFUZZ_ASSERT(x) \
  do {                   \
    if (!(x)) std::abort(); \
  } while (0)

// What KVCache accepted, IndexCache must accept too.
template <class F>
void must(F&& f) {
  try {
    f();
  } catch (...) {
    std::abort();
  }
}

template <class Cache>
void check_invariants(const Cache& c) {
  const auto& g = c.geometry();
  for (int l = 0; l < g.n_layers; ++l)
    for (int h = 0; h < g.n_kv_heads; ++h) {
      const std::size_t n = c.size(l, h);
      // kept rows are finite (quantized caches: dequantised from the stored bytes)
      const auto keys = c.dequantized_keys(l, h), values = c.dequantized_values(l, h);
      for (Eigen::Index i = 0; i < keys.size(); ++i)
        KVFUZZ_ASSERT(std::isfinite(keys.data()[i]) && std::isfinite(values.data()[i]));
      KVFUZZ_ASSERT(n <= c.capacity(l, h));
      KVFUZZ_ASSERT(c.allocated_rows(l, h) >= n && c.allocated_rows(l, h) <= c.capacity(l, h));
      // Positions and arrival indices distinct: sorted copies in reused scratch (a
      // std::set per head and op cost more than the cache operations under ASan).
      const auto pos = c.positions(l, h);
      const auto seq = c.seqs(l, h);
      KVFUZZ_ASSERT(pos.size() == n && seq.size() == n);
      static std::vector<std::int64_t> ps;
      static std::vector<std::uint64_t> ss;
      ps.assign(pos.begin(), pos.end());
      ss.assign(seq.begin(), seq.end());
      std::sort(ps.begin(), ps.end());
      std::sort(ss.begin(), ss.end());
      KVFUZZ_ASSERT(std::adjacent_find(ps.begin(), ps.end()) == ps.end());
      KVFUZZ_ASSERT(std::adjacent_find(ss.begin(), ss.end()) == ss.end());
      KVFUZZ_ASSERT(n == 0 || ss.back() < c.tokens_seen(l));
    }
}

template <class Cache, class Index>
void check_same(const Cache& c, const Index& idx) {
  const auto& g = c.geometry();
  for (int l = 0; l < g.n_layers; ++l)
    for (int h = 0; h < g.n_kv_heads; ++h) {
      const auto a = c.positions(l, h), b = idx.positions(l, h);
      KVFUZZ_ASSERT(std::equal(a.begin(), a.end(), b.begin(), b.end()));
    }
}

constexpr std::size_t kMaxOps = 64;    // operations per input
constexpr std::size_t kMaxBlock = 12;  // rows one operation appends at most (a prefill block)

/// The largest magnitude the storage type rejects at its overflow edge (inf for float).
template <class Scalar>
float overflow_edge(bool key) {
  if constexpr (kvevict::detail::QuantizedStorage<Scalar>) {
    using St = kvevict::detail::StorageOf<Scalar>;
    return key ? St::key_codec::limit() : St::value_codec::limit();
  } else {
    (void)key;
    return kvevict::detail::storage_limit<Scalar>();
  }
}

/// Every kept row's stored key/value bytes equal the encoding of the float row appended
/// for its arrival index (hk/hv: per layer, n_kv_heads x d floats per arrival).
template <class Cache>
void check_rows(const Cache& c, const std::vector<std::vector<float>>& hk,
                const std::vector<std::vector<float>>& hv) {
  using Codec = kvevict::detail::RowCodec<typename Cache::scalar_type>;
  using Unit = typename Codec::unit;
  const auto& g = c.geometry();
  const std::size_t d = std::size_t(g.head_dim), kv = std::size_t(g.n_kv_heads) * d;
  const std::size_t ku = Codec::key_units(d), vu = Codec::value_units(d);
  static std::vector<Unit> ek, ev;
  ek.resize(ku), ev.resize(vu);
  for (int l = 0; l < g.n_layers; ++l)
    for (int h = 0; h < g.n_kv_heads; ++h) {
      const auto seqs = c.seqs(l, h);
      const auto sk = c.stored_keys(l, h), sv = c.stored_values(l, h);
      KVFUZZ_ASSERT(sk.size() >= seqs.size() * ku && sv.size() >= seqs.size() * vu);
      for (std::size_t r = 0; r < seqs.size(); ++r) {
        const std::size_t at = std::size_t(seqs[r]) * kv + std::size_t(h) * d;
        KVFUZZ_ASSERT(at + d <= hk[std::size_t(l)].size());
        Codec::encode(hk[std::size_t(l)].data() + at, hv[std::size_t(l)].data() + at, d, ek.data(), ev.data());
        KVFUZZ_ASSERT(std::memcmp(ek.data(), sk.data() + r * ku, ku * sizeof(Unit)) == 0);
        KVFUZZ_ASSERT(std::memcmp(ev.data(), sv.data() + r * vu, vu * sizeof(Unit)) == 0);
      }
    }
}

template <class Policy>
constexpr bool kIsSnapKV = std::is_same_v<Policy, pol::SnapKV>;

template <class Policy, class Scalar>
void run(kvfuzz::Input& in, const Geometry& g, const Budget& budget, const Policy& policy) {
  // IndexCache (engine-owned cells) has no quantized form: quantized runs skip the
  // differential check and run KVCache alone.
  constexpr bool quantized = kvevict::detail::QuantizedStorage<Scalar>;
  using CellScalar = std::conditional_t<quantized, float, Scalar>;
  std::optional<kvevict::KVCache<Policy, Scalar>> made;
  std::optional<kvevict::IndexCache<Policy, CellScalar>> idx;
  try {
    made.emplace(g, budget, policy);
    // Unbounded budgets: enough cells for every row an input can append (ops x largest block).
    if (!quantized) idx.emplace(g, budget, policy, budget.is_unbounded() ? kMaxOps * kMaxBlock : 0u);
  } catch (const kvevict::Error&) {
    return;  // budget or configuration the policy rejects: a clean refusal
  }
  auto& c = *made;
  const std::size_t d = std::size_t(g.head_dim);
  const std::size_t kv = std::size_t(g.n_kv_heads) * d, qn = std::size_t(g.n_heads) * d;
  const std::size_t cells = idx ? idx->cells_per_head() : 0;
  std::vector<std::vector<CellScalar>> mem(std::size_t(g.n_layers),
                                           std::vector<CellScalar>(std::size_t(g.n_kv_heads) * cells * d));
  auto rows_of = [&](int l) {
    return kvevict::CellRows<CellScalar>{mem[std::size_t(l)].data(), d, cells * d};
  };
  auto apply = [&](std::span<const kvevict::Decision> ds, const std::vector<float>& block) {
    for (const auto& e : ds)
      if (e.kind == kvevict::Decision::Kind::place) {
        KVFUZZ_ASSERT(e.cell < cells);
        const float* src = block.data() + (std::size_t(e.from) * std::size_t(g.n_kv_heads) + std::size_t(e.kv_head)) * d;
        CellScalar* dst = mem[std::size_t(e.layer)].data() + (std::size_t(e.kv_head) * cells + e.cell) * d;
        for (std::size_t j = 0; j < d; ++j) dst[j] = static_cast<CellScalar>(src[j]);
      }
  };
  std::vector<std::int64_t> next_pos(std::size_t(g.n_layers), 0), last_pos(next_pos);
  std::vector<float> k, v, q;  // one token's rows, reused by every decode step
  kvevict::AttendWorkspace ws;
  std::vector<float> out(qn);
  Budget now = budget;  // the budget in force (set_budget)
  bool budget_set = false;  // set_budget succeeded at least once
  // What each layer was fed, by arrival index (check_rows).
  std::vector<std::vector<float>> hk(std::size_t(g.n_layers)), hv(hk);
  auto record = [&](int l, const std::vector<float>& kk, const std::vector<float>& vv, std::size_t n) {
    hk[std::size_t(l)].insert(hk[std::size_t(l)].end(), kk.begin(), kk.begin() + std::ptrdiff_t(n));
    hv[std::size_t(l)].insert(hv[std::size_t(l)].end(), vv.begin(), vv.begin() + std::ptrdiff_t(n));
  };
  for (std::size_t op = 0; op < kMaxOps && !in.done(); ++op) {
    const int l = in.range(0, g.n_layers - 1);
    switch (in.range(0, 8)) {
      case 0:
      case 1: {  // a batch of 1-4 decode steps, each followed by attention or not
        const int steps = in.range(1, 4);
        for (int s = 0; s < steps; ++s) {
          in.fill(k, kv), in.fill(v, kv), in.fill(q, qn);
          const std::int64_t p = next_pos[std::size_t(l)];
          next_pos[std::size_t(l)] += in.range(1, 3);
          c.append(l, p, k, v, q);
          record(l, k, v, kv);
          last_pos[std::size_t(l)] = p;
          if (idx) must([&] { apply(idx->append(l, p, k, rows_of(l), q), k); });
          const std::uint8_t how = in.byte();
          if (how & 1) {
            // bit 1: the allocating attend or the workspace overload (both observe)
            if (how & 2) {
              kvevict::attend(c, l, q, out, ws);
              if (idx)
                for (int h = 0; h < g.n_kv_heads; ++h) idx->observe(l, h, ws.probs(h));
            } else {
              const auto r = kvevict::attend(c, l, q);
              if (idx)
                for (int h = 0; h < g.n_kv_heads; ++h)
                  idx->observe(l, h, std::span<const float>(r.probs[std::size_t(h)].data(),
                                                            std::size_t(r.probs[std::size_t(h)].size())));
            }
          }
        }
        break;
      }
      case 2: {  // prefill block
        const std::size_t T = std::size_t(in.range(1, int(kMaxBlock)));
        in.fill(k, T * kv), in.fill(v, T * kv), in.fill(q, T * qn);
        const std::int64_t p = next_pos[std::size_t(l)];
        next_pos[std::size_t(l)] += std::int64_t(T);
        c.prefill(l, p, T, k, v, q);
        record(l, k, v, T * kv);
        last_pos[std::size_t(l)] = p + std::int64_t(T) - 1;
        if (idx) must([&] { apply(idx->prefill(l, p, T, k, q, rows_of(l)), k); });
        break;
      }
      case 8: {  // a prompt of T tokens in chunks of random sizes (chunked prefill)
        const std::size_t T = std::size_t(in.range(1, 24));
        std::vector<float> pk, pv, pq;
        in.fill(pk, T * kv), in.fill(pv, T * kv), in.fill(pq, T * qn);
        bool empty = true;  // the whole cache held nothing: compare with the whole prompt
        for (int ll = 0; ll < g.n_layers; ++ll) empty = empty && c.tokens_seen(ll) == 0;
        const std::int64_t p0 = next_pos[std::size_t(l)];
        std::size_t chunks = 0;
        for (std::size_t at = 0; at < T;) {
          const std::size_t n = std::min(T - at, std::size_t(in.range(1, 12)));
          const std::int64_t p = p0 + std::int64_t(at);
          const std::span<const float> ck(pk.data() + at * kv, n * kv), cv(pv.data() + at * kv, n * kv),
              cq(pq.data() + at * qn, n * qn);
          const std::uint8_t bad = in.byte();
          if (bad >= 224) {  // a malformed chunk first: refused, nothing changed
            const auto before = kvevict::save_bytes(c);
            bool threw = false;
            try {
              if (bad % 4 == 0) {  // NaN in one key element
                std::vector<float> kb(ck.begin(), ck.end());
                kb[std::size_t(in.range(0, int(kb.size()) - 1))] = NAN;
                c.prefill(l, p, n, kb, cv, cq);
              } else if (bad % 4 == 1) {  // one query row short
                // (of a one-token chunk that leaves no queries: valid for a policy without
                // them; a long run's first finding was this harness case, on Oracle)
                if (n < 2) throw kvevict::Error("a one-token chunk one query row short has none");
                c.prefill(l, p, n, ck, cv, cq.first(cq.size() - qn));
              } else if (bad % 4 == 2) {  // overlaps the last position fed
                if (c.tokens_seen(l) == 0) throw kvevict::Error("nothing to overlap");
                c.prefill(l, last_pos[std::size_t(l)], n, ck, cv, cq);
              } else {  // no queries (SnapKV needs them; others accept: then not malformed)
                if constexpr (kIsSnapKV<Policy>) {
                  if (!policy.reselects_prefill() && c.tokens_seen(l) != 0)
                    throw kvevict::Error("the decode rule takes no queries");
                } else {
                  throw kvevict::Error("not malformed for this policy");
                }
                c.prefill(l, p, n, ck, cv, {});
              }
            } catch (const kvevict::Error&) {
              threw = true;
            }
            KVFUZZ_ASSERT(threw);
            KVFUZZ_ASSERT(kvevict::save_bytes(c) == before);
          }
          c.prefill(l, p, n, ck, cv, cq);
          if (idx) must([&] { apply(idx->prefill(l, p, n, ck, cq, rows_of(l)), std::vector<float>(ck.begin(), ck.end())); });
          hk[std::size_t(l)].insert(hk[std::size_t(l)].end(), ck.begin(), ck.end());
          hv[std::size_t(l)].insert(hv[std::size_t(l)].end(), cv.begin(), cv.end());
          last_pos[std::size_t(l)] = p + std::int64_t(n) - 1;
          for (int h = 0; h < g.n_kv_heads; ++h) KVFUZZ_ASSERT(c.size(l, h) <= c.capacity(l, h));
          check_rows(c, hk, hv);
          at += n, ++chunks;
        }
        next_pos[std::size_t(l)] = p0 + std::int64_t(T);
        // The whole prompt in one prefill, where the docs promise the same rows.
        bool fits = true;
        if constexpr (kIsSnapKV<Policy>)
          for (int h = 0; h < g.n_kv_heads; ++h)
            fits = fits && T <= c.capacity(l, h) - policy.config().decode_reserve;
        if (empty && (chunks == 1 || !kvevict::detail::HasPrefillKeep<Policy> || (kIsSnapKV<Policy> && fits))) {
          // Built as c was: with the first budget, then the budget in force set (a policy
          // may keep state from its first budget until an eviction: DecayedAttention's
          // decay with a horizon).
          kvevict::KVCache<Policy, Scalar> w(g, budget, policy);
          if (budget_set) w.set_budget(now);
          w.prefill(l, p0, T, pk, pv, pq);
          for (int h = 0; h < g.n_kv_heads; ++h) {
            const auto a = c.seqs(l, h), b = w.seqs(l, h);
            KVFUZZ_ASSERT(std::equal(a.begin(), a.end(), b.begin(), b.end()));
          }
        }
        break;
      }
      case 3: {  // budget change (IndexCache has none: stop the differential check)
        try {
          const Budget b = Budget::uniform(in.range(1, 24));
          c.set_budget(b);
          now = b;
          budget_set = true;
        } catch (const kvevict::Error&) {
        }
        idx.reset();
        break;
      }
      case 4: {  // save and restore into a fresh cache: identical bytes and rows
        const auto bytes = kvevict::save_bytes(c);
        kvevict::KVCache<Policy, Scalar> d2(g, budget, policy);
        try {
          d2.set_budget(Budget::uniform(1));
        } catch (const kvevict::Error&) {
        }
        if (c.shape().capacity != d2.shape().capacity) break;  // budget differs: skip
        kvevict::load_bytes(d2, bytes);
        KVFUZZ_ASSERT(kvevict::save_bytes(d2) == bytes);
        break;
      }
      case 5: {  // malformed calls: rejected, nothing changed
        const auto before = kvevict::save_bytes(c);
        const int which = in.range(0, 9);
        bool threw = false;
        try {
          auto k = in.values(kv), v = in.values(kv), q = in.values(qn);
          if (which == 0) k.pop_back();
          if (which == 1) v[0] = NAN;
          if (which == 2) q.push_back(1.0f);
          // which == 3 repeats the last position appended to the layer.
          const std::int64_t p = which == 3 ? last_pos[std::size_t(l)] : next_pos[std::size_t(l)];
          if (which == 7) {  // a finite float at the storage type's overflow edge (inf for float)
            const bool key = in.byte() & 1;
            const float lim = overflow_edge<Scalar>(key);
            (key ? k : v)[std::size_t(in.range(0, int(kv) - 1))] = in.byte() & 1 ? lim : -lim;
          }
          if (which == 4) {
            std::vector<float> bad(c.size(l, 0) * std::size_t(g.group()) + 1, 0.1f);
            c.observe(l, 0, bad);
          } else if (which == 3 && c.tokens_seen(l) == 0) {
            threw = true;  // no earlier position to repeat
          } else if (which == 5) {  // a token count whose size product wraps, empty spans
            constexpr std::size_t kCounts[] = {std::size_t{1} << 63, ~std::size_t{0},
                                               (std::size_t{1} << 61) + 1, (std::size_t{1} << 62) + 3};
            c.prefill(l, p, kCounts[in.range(0, 3)], {}, {}, {});
          } else if (which == 6) {  // a block passing INT64_MAX
            const std::size_t T = std::size_t(in.range(3, 5));
            c.prefill(l, std::numeric_limits<std::int64_t>::max() - in.range(0, 1), T, in.values(T * kv),
                      in.values(T * kv), in.values(T * qn));
          } else if (which == 8) {  // one probability out of [0, 1]
            const std::size_t n = c.size(l, 0) * std::size_t(g.group());
            if (n == 0) {
              threw = true;
            } else {
              constexpr float kBad[] = {-1e-3f, 1.0f + 2.0f / 64, 3e38f, NAN, -INFINITY, 2.0f};
              std::vector<float> probs(n, 0.0f);
              probs[std::size_t(in.range(0, int(n) - 1))] = kBad[in.range(0, 5)];
              c.observe(l, 0, probs);
            }
          } else if (which == 9) {  // a moved-from cache refuses, the moved-to one works
            auto moved = std::move(c);
            try {
              c.append(l, p, k, v, q);  // NOLINT(bugprone-use-after-move)
            } catch (const kvevict::Error&) {
              threw = true;
            }
            try {  // attend too (it divided by the moved-from geometry's 0 KV heads)
              if (in.byte() & 1)
                (void)kvevict::attend(c, l, q);
              else
                kvevict::attend(c, l, q, out, ws);
              KVFUZZ_ASSERT(false);
            } catch (const kvevict::Error&) {
            }
            KVFUZZ_ASSERT(c.geometry().n_layers == 0 && c.allocated_bytes() == 0);
            c = std::move(moved);
          } else {
            c.append(l, p, k, v, q);
          }
        } catch (const kvevict::Error&) {
          threw = true;
        }
        KVFUZZ_ASSERT(threw);
        KVFUZZ_ASSERT(kvevict::save_bytes(c) == before);
        break;
      }
      default: {  // attention without observing, then an explicit observe of its output
        in.fill(q, qn);
        const auto r = kvevict::attend(c, l, q, kvevict::AttendOptions{false});
        for (int h = 0; h < g.n_kv_heads; ++h) {
          const auto& p = r.probs[std::size_t(h)];
          for (Eigen::Index i = 0; i < p.size(); ++i) KVFUZZ_ASSERT(std::isfinite(p.data()[i]));
          const std::span<const float> ps(p.data(), std::size_t(p.size()));
          c.observe(l, h, ps);
          if (idx) idx->observe(l, h, ps);
        }
      }
    }
    check_invariants(c);
    check_rows(c, hk, hv);
    if (idx) check_same(c, *idx);
  }
}

// A raw geometry (any int32 fields) must construct or be refused with kvevict::Error:
// never std::bad_alloc or a crash (Geometry::validate has upper bounds).
void raw_geometry(kvfuzz::Input& in) {
  auto i32 = [&] {
    std::uint32_t x = 0;
    for (int b = 0; b < 4; ++b) x = (x << 8) | in.byte();
    return static_cast<std::int32_t>(x);
  };
  Geometry g{i32(), i32(), i32(), i32()};
  try {
    kvevict::KVCache<pol::StreamingLLM> c(g, Budget::uniform(8), pol::StreamingLLM{1});
    KVFUZZ_ASSERT(c.geometry() == g);
  } catch (const kvevict::Error&) {
  }
}

template <class Scalar>
void dispatch(kvfuzz::Input& in) {
  Geometry g;
  g.n_layers = in.range(1, 2);
  g.n_kv_heads = in.range(1, 2);
  g.n_heads = g.n_kv_heads * in.range(1, 2);
  g.head_dim = in.range(1, 4);
  auto sinks = std::size_t(in.range(0, 3)), recent = std::size_t(in.range(0, 3));
  // Now and then protected counts near SIZE_MAX: sinks + recent + 1 must be refused, never wrap.
  const std::uint8_t edge = in.byte();
  if (edge >= 248) (edge & 1 ? sinks : recent) = ~std::size_t{0} - std::size_t(edge & 3);
  const int kind = in.range(0, 2);
  const int cap = in.range(1, 24);
  const Budget bounded = kind == 0   ? Budget::uniform(cap)
                         : kind == 1 ? Budget::per_layer([&] {  // a different budget per layer (XKV, PyramidKV)
                             std::vector<long long> b(std::size_t(g.n_layers));
                             for (auto& x : b) x = cap + in.range(0, 8);
                             return b;
                           }())
                                     : Budget::per_head(std::vector<std::vector<long long>>(
                                           std::size_t(g.n_layers),
                                           std::vector<long long>(std::size_t(g.n_kv_heads), cap + in.range(0, 2))));
  const std::uint64_t seed = in.byte();
  switch (in.range(0, 12)) {
    case 0: return run<pol::FullCache, Scalar>(in, g, Budget::unbounded(), pol::FullCache{});
    case 1: return run<pol::Oracle, Scalar>(in, g, Budget::unbounded(), pol::Oracle{std::size_t(cap)});
    case 2: return run<pol::StreamingLLM, Scalar>(in, g, bounded, pol::StreamingLLM{sinks});
    case 3: return run<pol::H2O, Scalar>(in, g, bounded, pol::H2O(pol::H2O::Config{recent, sinks}));
    case 4: return run<pol::KNorm, Scalar>(in, g, bounded, pol::KNorm(pol::KNorm::Config{sinks, recent}));
    case 5: return run<pol::Random, Scalar>(in, g, bounded, pol::Random(pol::Random::Config{seed, sinks, recent}));
    case 6: {
      pol::HashEvictSimHash<>::Config hc;
      hc.bits = 8 << in.range(0, 3);
      hc.sinks = sinks;
      hc.recent = recent;
      const int flags = in.byte();  // bit 0: prefill rule, bit 1: reference slot order
      hc.prefill = flags & 1 ? pol::PrefillRule::decode : pol::PrefillRule::keep_ends;
      hc.reference_slots = (flags & 2) != 0;
      return run<pol::HashEvictSimHash<>, Scalar>(in, g, bounded, pol::HashEvictSimHash<>(hc));
    }
    case 7: {
      pol::HashEvictSimHash<pol::HashMode::query>::Config hc;
      hc.bits = 16;
      hc.sinks = sinks;
      hc.recent = recent;
      const int flags = in.byte();  // bit 0: group combination, bit 1: reference slot order
      hc.combine = flags & 1 ? pol::QueryCombine::sum : pol::QueryCombine::mean;
      hc.reference_slots = (flags & 2) != 0;
      return run<pol::HashEvictSimHash<pol::HashMode::query>, Scalar>(
          in, g, bounded, pol::HashEvictSimHash<pol::HashMode::query>(hc));
    }
    case 8:
    case 9: {
      pol::BuzzBeehive::Config bc;
      bc.sinks = sinks;
      bc.window = std::size_t(in.range(1, 6));
      bc.threshold = std::size_t(in.range(1, 8));
      bc.stride = std::size_t(in.range(1, 5));
      const int mode = in.range(0, 2);
      bc.budget_mode = mode == 1;
      bc.log_n = mode == 2;
      // bit 0: bounded budget (always in budget mode), bit 1: reference timing (plain form)
      const int flags = mode == 1 ? 1 : in.byte();
      bc.reference_timing = mode == 0 && (flags & 2) != 0;
      return run<pol::BuzzBeehive, Scalar>(in, g, (flags & 1) ? bounded : Budget::unbounded(),
                                           pol::BuzzBeehive(bc));
    }
    case 10: {
      pol::SnapKV::Config sc;
      sc.window = std::size_t(in.range(1, 4));
      sc.kernel = std::size_t(2 * in.range(0, 3) + 1);
      sc.decode_reserve = std::size_t(in.range(0, 3));
      const std::uint8_t flags = in.byte();  // bit 0: first-chunk rule, bit 1: max pooling
      if (flags & 1) sc.chunked = pol::ChunkedPrefill::first_chunk;
      if (flags & 2) sc.pooling = pol::Pooling::max;
      return run<pol::SnapKV, Scalar>(in, g, bounded, pol::SnapKV(sc));
    }
    default: {
      pol::DecayedAttention::Config dc;
      dc.decay = float(in.byte()) / 255.0f;
      dc.sinks = sinks;
      dc.recent = recent;
      const std::uint8_t recall = in.byte();
      dc.recall_fraction = float(recall % 128) / 128.0f;  // [0, 1): the recall reserve
      if (recall >= 128)  // the high bit: the distinct-key reserve (RecallDedup)
        dc.recall_dedup = pol::DecayedAttention::RecallDedup::protected_rows;
      // The rest of the settings from the byte `seed` (read for every case, used by Random
      // only), so inputs of the corpus keep their meaning up to here: bits 0-1 the reserve's
      // rank (spike, excess, total; 3: spike), bit 2 the dedup mode `reserve` instead of
      // protected_rows, bit 3 recall_successor (without dedup; with it the settings are
      // refused), bits 4-5 the RoPE layout (3: interleaved), bit 6 a horizon and a recent
      // fraction in place of the decay.
      using DA = pol::DecayedAttention;
      const int rank = int(seed & 3);
      dc.recall_rank = rank == 1 ? DA::RecallRank::excess : rank == 2 ? DA::RecallRank::total
                                                                      : DA::RecallRank::spike;
      if ((seed & 4) && dc.recall_dedup != DA::RecallDedup::none)
        dc.recall_dedup = DA::RecallDedup::reserve;
      dc.recall_successor = (seed & 8) != 0 && dc.recall_dedup == DA::RecallDedup::none;
      const int rope = int((seed >> 4) & 3);
      dc.rope = rope == 0 ? pol::RopeLayout::none : rope == 2 ? pol::RopeLayout::halves
                                                              : pol::RopeLayout::interleaved;
      if (seed & 64) {
        dc.horizon = 0.5f + float(dc.decay * 4.0f);
        dc.recent_fraction = float(recall % 16) / 32.0f;
      }
      return run<pol::DecayedAttention, Scalar>(in, g, bounded, pol::DecayedAttention(dc));
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  kvfuzz::Input in(data, size);
  try {
    const std::uint8_t mode = in.byte();
    if ((mode & 0x1e) == 0x1e)
      raw_geometry(in);
    else if ((mode & 0x1e) == 0x02)  // quantized storage (head_dim 1-4: group sizes 1)
      (mode & 0x20) ? dispatch<kvevict::E4M3>(in) : dispatch<kvevict::KV<kvevict::Q8<1>, kvevict::E4M3>>(in);
    else if ((mode & 0x1e) == 0x04)
      dispatch<kvevict::Q8<1>>(in);
    else if (mode & 1)
      dispatch<Eigen::half>(in);
    else
      dispatch<float>(in);
  } catch (const kvevict::Error&) {
    // Only configuration refusals reach here (policy constructors): fine.
  }
  return 0;
}
