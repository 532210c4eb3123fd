// Many sequences on many threads: each thread owns a batch of independent caches (one per
// policy, KVCache and IndexCache, save/restore in the middle); the only shared state is
// read-only (the token stream, the geometry, the kernels' CPU-feature detection, which the
// threads race to initialise first). Every cache must end exactly as the same work run
// alone on one thread. Built with -fsanitize=thread by scripts/tsan.sh, this is the data
// race check; without it, the determinism check still holds.
#include <kvevict/index_cache.hpp>
#include <kvevict/policies/buzz.hpp>
#include <kvevict/policies/hash_evict.hpp>
#include <kvevict/policies/snapkv.hpp>
#include <kvevict/serialize.hpp>

#include <atomic>
#include <bit>
#include <thread>

#include "support/test_support.hpp"

namespace {

using kvevict::Budget;
using kvevict::Geometry;
using kvevict::KVCache;
namespace pol = kvevict::policies;

const Geometry kGeo{2, 4, 2, 16};
constexpr std::size_t kPrompt = 40;
constexpr int kSteps = 120;

// The shared, read-only token stream (built before any thread starts).
struct Stream {
  std::vector<float> pk, pv, pq;               // prompt: T x Hkv x d (q: T x H x d)
  std::vector<std::vector<float>> k, v, q;     // decode step x layer -> one token
  explicit Stream(std::uint64_t seed) {
    kvtest::Rng rng(seed);
    const std::size_t kv = std::size_t(kGeo.n_kv_heads * kGeo.head_dim);
    const std::size_t qn = std::size_t(kGeo.n_heads * kGeo.head_dim);
    pk = rng.normals(kPrompt * kv);
    pv = rng.normals(kPrompt * kv);
    pq = rng.normals(kPrompt * qn);
    for (int t = 0; t < kSteps * kGeo.n_layers; ++t) {
      k.push_back(rng.normals(kv, 1.0f + float(t % 4)));
      v.push_back(rng.normals(kv));
      q.push_back(rng.normals(qn));
    }
  }
};

std::uint64_t mix(std::uint64_t h, std::uint64_t x) { return (h ^ x) * 0x100000001b3ull; }

template <class Cache>
std::uint64_t fingerprint(const Cache& c) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (std::uint8_t b : kvevict::save_bytes(c)) h = mix(h, b);
  return h;
}

// One sequence through one policy: prefill, decode with attention, a save/restore round
// trip half way. Returns the final state's fingerprint.
template <class Policy>
std::uint64_t run_kv(const Stream& s, Policy policy, Budget budget) {
  KVCache<Policy> c(kGeo, budget, policy);
  for (int l = 0; l < kGeo.n_layers; ++l) c.prefill(l, 0, kPrompt, s.pk, s.pv, s.pq);
  for (int t = 0; t < kSteps; ++t) {
    for (int l = 0; l < kGeo.n_layers; ++l) {
      const std::size_t i = std::size_t(t * kGeo.n_layers + l);
      c.append(l, std::int64_t(kPrompt) + t, s.k[i], s.v[i], s.q[i]);
      kvevict::attend(c, l, s.q[i]);
    }
    if (t == kSteps / 2) {
      KVCache<Policy> restored(kGeo, budget, policy);
      kvevict::load_bytes(restored, kvevict::save_bytes(c));
      c = std::move(restored);
    }
  }
  return fingerprint(c);
}

// The same decode stream through an IndexCache over a thread-local engine array.
std::uint64_t run_index(const Stream& s) {
  const pol::KNorm policy(pol::KNorm::Config{2, 4});
  kvevict::IndexCache<pol::KNorm> idx(kGeo, Budget::uniform(24), policy);
  const std::size_t d = std::size_t(kGeo.head_dim), cells = idx.cells_per_head();
  std::vector<std::vector<float>> mem(std::size_t(kGeo.n_layers),
                                      std::vector<float>(std::size_t(kGeo.n_kv_heads) * cells * d));
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (int t = 0; t < kSteps; ++t)
    for (int l = 0; l < kGeo.n_layers; ++l) {
      const std::size_t i = std::size_t(t * kGeo.n_layers + l);
      auto& m = mem[std::size_t(l)];
      auto ds = idx.append(l, t, s.k[i], kvevict::CellRows<float>{m.data(), d, cells * d}, s.q[i]);
      for (const auto& e : ds) {
        h = mix(mix(mix(h, std::uint64_t(e.kind)), e.cell), std::uint64_t(e.position));
        if (e.kind == kvevict::Decision::Kind::place)
          std::copy_n(s.k[i].data() + std::size_t(e.kv_head) * d, d,
                      m.data() + (std::size_t(e.kv_head) * cells + e.cell) * d);
      }
    }
  return h;
}

// Everything one sequence of the batch runs; seq selects the policy mix.
std::vector<std::uint64_t> run_sequence(const Stream& s, int seq) {
  std::vector<std::uint64_t> out;
  out.push_back(run_kv(s, pol::StreamingLLM{4}, Budget::uniform(20 + seq % 3)));
  out.push_back(run_kv(s, pol::H2O(pol::H2O::Config{6, 2}), Budget::uniform(24)));
  out.push_back(run_kv(s, pol::KNorm(pol::KNorm::Config{2, 4}), Budget::uniform(24)));
  out.push_back(run_kv(s, pol::Random(pol::Random::Config{std::uint64_t(seq), 2, 4}), Budget::uniform(24)));
  pol::HashEvictSimHash<>::Config hc;
  hc.bits = 32;
  out.push_back(run_kv(s, pol::HashEvictSimHash<>(hc), Budget::uniform(28)));
  out.push_back(run_kv(s, pol::HashEvictSimHash<pol::HashMode::query>(), Budget::uniform(28)));
  pol::BuzzBeehive::Config bc;
  bc.budget_mode = true;
  out.push_back(run_kv(s, pol::BuzzBeehive(bc), Budget::uniform(40)));
  pol::SnapKV::Config sc;
  sc.window = 8;
  sc.decode_reserve = 16;
  out.push_back(run_kv(s, pol::SnapKV(sc), Budget::uniform(36)));
  out.push_back(run_index(s));
  return out;
}

}  // namespace

TEST_CASE("independent caches on many threads match the single-threaded run", "[threads]") {
  const Stream stream(2024);  // shared, read-only from here on
  const int threads = GENERATE(2, 8);
  const int per_thread = 3;
  std::vector<std::vector<std::vector<std::uint64_t>>> got(static_cast<std::size_t>(threads));
  std::vector<std::string> errors(static_cast<std::size_t>(threads));
  std::atomic<int> ready{0};
  {
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t)
      pool.emplace_back([&, t] {
        // Start together so first uses (CPU-feature detection, statics) really race.
        ready.fetch_add(1);
        while (ready.load() < threads) std::this_thread::yield();
        try {
          for (int i = 0; i < per_thread; ++i)
            got[std::size_t(t)].push_back(run_sequence(stream, t * per_thread + i));
        } catch (const std::exception& e) {
          errors[std::size_t(t)] = e.what();
        }
      });
    for (auto& th : pool) th.join();
  }
  for (int t = 0; t < threads; ++t) {
    INFO("thread " << t);
    REQUIRE(errors[std::size_t(t)].empty());
    for (int i = 0; i < per_thread; ++i) {
      INFO("sequence " << t * per_thread + i);
      REQUIRE(got[std::size_t(t)][std::size_t(i)] == run_sequence(stream, t * per_thread + i));
    }
  }
}

// The thread-safety contract (docs/reliability.md) allows any number of threads to read
// one cache at once while nobody changes it: views, sizes, counters and save_bytes.
TEST_CASE("readers share one cache while nobody changes it", "[threads]") {
  const Stream stream(7);
  KVCache<pol::H2O> cache(kGeo, Budget::uniform(24), pol::H2O({4, 1}));
  const std::size_t kv = std::size_t(kGeo.n_kv_heads * kGeo.head_dim);
  for (int t = 0; t < 40; ++t)
    for (int l = 0; l < kGeo.n_layers; ++l) {
      const std::size_t i = std::size_t(t * kGeo.n_layers + l);
      cache.append(l, t, stream.k[i], stream.v[i]);
      kvevict::attend(cache, l, stream.q[i]);
    }
  auto read_all = [&cache, kv] {
    std::uint64_t h = fingerprint(cache);
    for (int l = 0; l < kGeo.n_layers; ++l) {
      h = mix(h, cache.tokens_seen(l));
      for (int kh = 0; kh < kGeo.n_kv_heads; ++kh) {
        const auto k = cache.keys(l, kh), v = cache.values(l, kh);
        for (Eigen::Index j = 0; j < k.size(); ++j)
          h = mix(h, std::uint64_t(std::bit_cast<std::uint32_t>(k.data()[j] + v.data()[j])));
        for (auto p : cache.positions(l, kh)) h = mix(h, std::uint64_t(p));
        for (auto s : cache.seqs(l, kh)) h = mix(h, s);
        h = mix(h, cache.size(l, kh) + cache.capacity(l, kh) + cache.allocated_rows(l, kh));
      }
    }
    return mix(h, cache.allocated_bytes() + kv);
  };
  const std::uint64_t want = read_all();
  std::vector<std::uint64_t> got(4);
  std::atomic<int> ready{0};
  {
    std::vector<std::thread> pool;
    for (std::size_t t = 0; t < got.size(); ++t)
      pool.emplace_back([&, t] {
        ready.fetch_add(1);
        while (ready.load() < int(got.size())) std::this_thread::yield();
        for (int rep = 0; rep < 20; ++rep) got[t] = read_all();
      });
    for (auto& th : pool) th.join();
  }
  for (auto g : got) REQUIRE(g == want);
}
