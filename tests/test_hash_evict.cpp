// HashEvictSimHash against a plain brute-force model of the same rule, step by step, plus the
// guarantees the rule must keep: protected rows stay, fixed seeds reproduce, ISA levels agree.
#include <algorithm>
#include <bit>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <kvevict/cache.hpp>
#include <kvevict/kernels/simhash.hpp>
#include <kvevict/policies/hash_evict.hpp>
#include <optional>
#include <random>
#include <vector>

namespace {

using kvevict::Budget;
using kvevict::Geometry;
using kvevict::KVCache;
using kvevict::kernels::Isa;
using kvevict::policies::HashEvictSimHash;
using kvevict::policies::HashMode;
using kvevict::policies::PrefillRule;
using kvevict::policies::QueryCombine;

template <HashMode M>
using Config = typename HashEvictSimHash<M>::Config;

// The rule written the slow, obvious way: rows in a vector with swap-remove (as the container
// stores them), distances by std::popcount byte by byte, protection from seqs directly.
template <HashMode M>
class Brute {
 public:
  struct Row {
    std::int64_t pos;
    std::uint64_t seq;
    std::vector<std::uint8_t> code;
  };

  Brute(const Geometry& g, std::size_t cap, const Config<M>& c) : g_(g), cap_(cap), c_(c) {
    width_ = 8;
    while (width_ < c.bits * c.ensemble) width_ *= 2;
    for (int l = 0; l < g.n_layers; ++l)
      proj_.emplace_back(g.head_dim, width_, HashEvictSimHash<M>::layer_seed(c.seed, l));
    heads_.resize(static_cast<std::size_t>(g.n_layers * g.n_kv_heads));
    next_seq_.assign(static_cast<std::size_t>(g.n_layers), 0);
  }

  std::vector<std::uint8_t> code(int layer, const float* x) const {
    std::vector<std::uint8_t> out(static_cast<std::size_t>(width_ / 8));
    proj_[static_cast<std::size_t>(layer)].hash_one(x, out.data());
    for (int bit = c_.bits * c_.ensemble; bit < width_; ++bit)
      out[static_cast<std::size_t>(bit / 8)] &= static_cast<std::uint8_t>(~(1u << (bit % 8)));
    return out;
  }
  static unsigned dist(const std::vector<std::uint8_t>& a, const std::vector<std::uint8_t>& b) {
    unsigned d = 0;
    for (std::size_t i = 0; i < a.size(); ++i)
      d += static_cast<unsigned>(std::popcount(static_cast<unsigned>(a[i] ^ b[i])));
    return d;
  }
  bool is_protected(std::uint64_t seq, std::uint64_t incoming) const {
    return seq < c_.sinks || seq + c_.recent >= incoming;
  }
  std::vector<std::vector<std::uint8_t>> query_codes(int layer, int kh, const float* keys,
                                                     const float* queries) const {
    const auto d = static_cast<std::size_t>(g_.head_dim);
    const int G = g_.group();
    if (M == HashMode::key) return {code(layer, keys + static_cast<std::size_t>(kh) * d)};
    const float* q = queries + static_cast<std::size_t>(kh * G) * d;
    std::vector<std::vector<std::uint8_t>> out;
    if (c_.combine == QueryCombine::sum || G == 1) {
      for (int gi = 0; gi < G; ++gi)
        out.push_back(code(layer, q + static_cast<std::size_t>(gi) * d));
    } else {
      std::vector<float> mean(d, 0.0f);
      for (int gi = 0; gi < G; ++gi)
        for (std::size_t j = 0; j < d; ++j) mean[j] += q[static_cast<std::size_t>(gi) * d + j];
      out.push_back(code(layer, mean.data()));
    }
    return out;
  }
  // Rows chosen for eviction: the `need` farthest unprotected, ties to the lowest row.
  std::vector<std::size_t> victims(const std::vector<Row>& rows, std::size_t need,
                                   const std::vector<std::vector<std::uint8_t>>& qs,
                                   std::uint64_t incoming) const {
    std::vector<std::pair<long, std::size_t>> cand;
    for (std::size_t r = 0; r < rows.size(); ++r) {
      if (is_protected(rows[r].seq, incoming)) continue;
      long s = 0;
      for (const auto& q : qs) s += dist(q, rows[r].code);
      cand.push_back({-s, r});
    }
    REQUIRE(cand.size() >= need);
    std::sort(cand.begin(), cand.end());
    std::vector<std::size_t> v;
    for (std::size_t i = 0; i < need; ++i) v.push_back(cand[i].second);
    std::sort(v.rbegin(), v.rend());  // the container removes the highest row first
    return v;
  }
  static void remove(std::vector<Row>& rows, const std::vector<std::size_t>& desc) {
    for (std::size_t r : desc) {
      rows[r] = rows.back();
      rows.pop_back();
    }
  }
  // One decode step on a layer (also what the container does for a non-empty layer's prefill).
  void step(std::vector<Row>& rows, int layer, int kh, std::int64_t pos, std::uint64_t seq,
            const float* keys, const float* queries) const {
    if (rows.size() >= cap_)
      remove(rows, victims(rows, 1, query_codes(layer, kh, keys, queries), seq));
    rows.push_back({pos, seq, code(layer, keys + static_cast<std::size_t>(kh * g_.head_dim))});
  }
  void append(int layer, std::int64_t pos, const float* keys, const float* queries) {
    const std::uint64_t seq = next_seq_[static_cast<std::size_t>(layer)]++;
    for (int kh = 0; kh < g_.n_kv_heads; ++kh)
      step(at(layer, kh), layer, kh, pos, seq, keys, queries);
  }
  void prefill(int layer, std::int64_t first, std::size_t T, const float* keys,
               const float* queries) {
    const auto d = static_cast<std::size_t>(g_.head_dim);
    const std::size_t kstride = static_cast<std::size_t>(g_.n_kv_heads) * d;
    const std::size_t qstride = static_cast<std::size_t>(g_.n_heads) * d;
    const std::uint64_t seq0 = next_seq_[static_cast<std::size_t>(layer)];
    next_seq_[static_cast<std::size_t>(layer)] += T;
    for (int kh = 0; kh < g_.n_kv_heads; ++kh) {
      auto& rows = at(layer, kh);
      const bool empty_layer = seq0 == 0;
      std::vector<Row> sim;
      for (std::size_t t = 0; t < T; ++t) {
        const float* qt = queries ? queries + t * qstride : nullptr;
        if (!empty_layer) {
          step(rows, layer, kh, first + static_cast<std::int64_t>(t), seq0 + t, keys + t * kstride,
               qt);
        } else if (T <= cap_ || c_.prefill == PrefillRule::decode) {
          step(sim, layer, kh, first + static_cast<std::int64_t>(t), seq0 + t, keys + t * kstride,
               qt);
        } else if (t < c_.sinks || t >= T - (cap_ - c_.sinks)) {
          sim.push_back({first + static_cast<std::int64_t>(t), seq0 + t,
                         code(layer, keys + t * kstride + static_cast<std::size_t>(kh) * d)});
        }
      }
      if (empty_layer) {
        // The container stores a prefill selection in token order.
        std::sort(sim.begin(), sim.end(), [](const Row& a, const Row& b) { return a.seq < b.seq; });
        rows = sim;
      }
    }
  }
  void shrink(std::size_t cap) {
    for (int l = 0; l < g_.n_layers; ++l)
      for (int kh = 0; kh < g_.n_kv_heads; ++kh) {
        auto& rows = at(l, kh);
        if (rows.size() <= cap) continue;
        std::size_t newest = 0;
        for (std::size_t r = 0; r < rows.size(); ++r)
          if (rows[r].seq > rows[newest].seq) newest = r;
        remove(rows, victims(rows, rows.size() - cap, {rows[newest].code},
                             next_seq_[static_cast<std::size_t>(l)]));
      }
    cap_ = cap;
  }
  std::vector<Row>& at(int l, int kh) {
    return heads_[static_cast<std::size_t>(l * g_.n_kv_heads + kh)];
  }

 private:
  Geometry g_;
  std::size_t cap_;
  Config<M> c_;
  int width_;
  std::vector<kvevict::kernels::SimHashProjection> proj_;
  std::vector<std::vector<Row>> heads_;
  std::vector<std::uint64_t> next_seq_;
};

// Keys with a shared offset (as real keys have) so codes are correlated and ties common.
struct Stream {
  explicit Stream(std::uint64_t seed, const Geometry& g) : rng(seed), g(g) {
    bias.resize(static_cast<std::size_t>(g.head_dim));
    for (auto& b : bias) b = normal();
  }
  float normal() { return std::normal_distribution<float>(0.0f, 1.0f)(rng); }
  std::vector<float> keys(std::size_t T) {
    std::vector<float> k(T * static_cast<std::size_t>(g.n_kv_heads * g.head_dim));
    for (std::size_t i = 0; i < k.size(); ++i) k[i] = 0.7f * bias[i % bias.size()] + normal();
    return k;
  }
  std::vector<float> values(std::size_t T) {
    std::vector<float> v(T * static_cast<std::size_t>(g.n_kv_heads * g.head_dim));
    for (auto& x : v) x = normal();
    return v;
  }
  std::vector<float> queries(std::size_t T) {
    std::vector<float> q(T * static_cast<std::size_t>(g.n_heads * g.head_dim));
    for (std::size_t i = 0; i < q.size(); ++i) q[i] = 0.5f * bias[i % bias.size()] + normal();
    return q;
  }
  std::mt19937_64 rng;
  Geometry g;
  std::vector<float> bias;
};

template <HashMode M>
void check_same(const KVCache<HashEvictSimHash<M>>& cache, Brute<M>& brute, std::size_t step) {
  const auto& g = cache.geometry();
  for (int l = 0; l < g.n_layers; ++l)
    for (int kh = 0; kh < g.n_kv_heads; ++kh) {
      const auto pos = cache.positions(l, kh);
      const auto& rows = brute.at(l, kh);
      std::vector<std::int64_t> got(pos.begin(), pos.end()), want;
      std::vector<std::uint8_t> want_codes;
      for (const auto& r : rows) {
        want.push_back(r.pos);
        want_codes.insert(want_codes.end(), r.code.begin(), r.code.end());
      }
      INFO("step " << step << " layer " << l << " kv head " << kh);
      REQUIRE(got == want);  // same rows in the same order
      REQUIRE(cache.policy().codes(l, kh) == want_codes);
    }
}

// Prefill of `prompt` tokens, a long decode stream, a second prefill block on the now
// non-empty layers, and a budget shrink; compared with the brute force after every step.
template <HashMode M>
void run_agreement(const Config<M>& c, int n_heads, int n_kv, std::size_t cap, std::size_t prompt,
                   std::size_t steps, std::uint64_t seed) {
  const Geometry g{2, n_heads, n_kv, 32};
  KVCache<HashEvictSimHash<M>> cache(g, Budget::uniform(static_cast<long long>(cap)),
                                     HashEvictSimHash<M>(c));
  Brute<M> brute(g, cap, c);
  Stream s(seed, g);
  std::int64_t pos = 0;
  for (int l = 0; l < g.n_layers; ++l) {
    auto k = s.keys(prompt), v = s.values(prompt), q = s.queries(prompt);
    cache.prefill(l, 0, prompt, k, v, q);
    brute.prefill(l, 0, prompt, k.data(), q.data());
  }
  check_same(cache, brute, 0);
  pos = static_cast<std::int64_t>(prompt);
  for (std::size_t t = 0; t < steps; ++t, ++pos) {
    for (int l = 0; l < g.n_layers; ++l) {
      auto k = s.keys(1), v = s.values(1), q = s.queries(1);
      cache.append(l, pos, k, v, q);
      brute.append(l, pos, k.data(), q.data());
    }
    check_same(cache, brute, t + 1);
  }
  for (int l = 0; l < g.n_layers; ++l) {
    auto k = s.keys(17), v = s.values(17), q = s.queries(17);
    cache.prefill(l, pos, 17, k, v, q);
    brute.prefill(l, pos, 17, k.data(), q.data());
  }
  check_same(cache, brute, steps + 1);
  const std::size_t smaller = c.sinks + c.recent + 5;
  cache.set_budget(Budget::uniform(static_cast<long long>(smaller)));
  brute.shrink(smaller);
  check_same(cache, brute, steps + 2);
}

}  // namespace

TEST_CASE("key mode agrees with the brute-force rule after every step") {
  for (int bits : {8, 16, 64})
    for (int ensemble : {1, 3})
      for (int group : {1, 4})
        for (PrefillRule pr : {PrefillRule::keep_ends, PrefillRule::decode}) {
          if (bits * ensemble > 256) continue;
          Config<HashMode::key> c;
          c.bits = bits;
          c.ensemble = ensemble;
          c.prefill = pr;
          c.seed = 1000u + static_cast<unsigned>(bits * 7 + ensemble);
          DYNAMIC_SECTION("bits " << bits << " m " << ensemble << " G " << group << " prefill "
                                  << static_cast<int>(pr)) {
            run_agreement<HashMode::key>(c, 2 * group, 2, 48, 90, 500, 11u + bits + group);
          }
        }
}

TEST_CASE("query mode agrees with the brute-force rule after every step") {
  for (QueryCombine comb : {QueryCombine::sum, QueryCombine::mean})
    for (int bits : {8, 16, 64})
      for (int group : {1, 2, 4}) {
        Config<HashMode::query> c;
        c.bits = bits;
        c.combine = comb;
        c.ensemble = bits == 16 ? 2 : 1;
        c.prefill = group == 2 ? PrefillRule::decode : PrefillRule::keep_ends;
        c.seed = 77u + static_cast<unsigned>(bits);
        DYNAMIC_SECTION("combine " << static_cast<int>(comb) << " bits " << bits << " G "
                                   << group) {
          run_agreement<HashMode::query>(c, 2 * group, 2, 40, 70, 500, 5u + bits * group);
        }
      }
}

TEST_CASE("other sinks/recent settings agree too, including none") {
  Config<HashMode::key> c;
  c.sinks = 0;
  c.recent = 0;
  run_agreement<HashMode::key>(c, 4, 2, 16, 30, 300, 3);
  c.sinks = 9;
  c.recent = 1;
  c.bits = 32;
  run_agreement<HashMode::key>(c, 4, 2, 24, 50, 300, 4);
}

TEST_CASE("protected rows are never evicted, even when they are the farthest") {
  // Every 5th token, the sinks and the recent window point away from all others: the rule
  // must take the unprotected far tokens and never the protected ones.
  const Geometry g{1, 4, 1, 16};
  Config<HashMode::key> c;
  c.bits = 32;
  const std::size_t cap = 30;
  KVCache<HashEvictSimHash<HashMode::key>> cache(g, Budget::uniform(cap), HashEvictSimHash<>(c));
  std::vector<std::uint64_t> evicted;
  cache.set_eviction_callback([&](const auto& row) { evicted.push_back(row.seq); });
  std::mt19937_64 rng(9);
  std::normal_distribution<float> n01;
  std::vector<float> u(16);
  for (auto& x : u) x = n01(rng);
  auto far = [](std::uint64_t t) { return t < 4 || t % 5 == 0; };
  std::size_t far_evictions = 0, evictions_with_far_candidate = 0;
  for (std::uint64_t t = 0; t < 2000; ++t) {
    std::vector<float> k(16), v(16, 0.0f);
    for (int j = 0; j < 16; ++j)
      k[static_cast<std::size_t>(j)] = (far(t) ? -u[j] : u[j]) + 0.05f * n01(rng);
    bool far_candidate = false;
    for (auto s : cache.seqs(0, 0)) far_candidate |= far(s) && s >= c.sinks && s + c.recent < t;
    const std::size_t before = evicted.size();
    cache.append(0, static_cast<std::int64_t>(t), k, v);
    for (std::size_t i = before; i < evicted.size(); ++i) {
      REQUIRE(evicted[i] >= c.sinks);
      REQUIRE(evicted[i] + c.recent < t);
      if (far_candidate && !far(t)) {
        ++evictions_with_far_candidate;
        far_evictions += far(evicted[i]) ? 1 : 0;
      }
    }
  }
  REQUIRE(evicted.size() == 2000 - cap);
  // A near incoming key: the far unprotected tokens are the ones that go.
  REQUIRE(evictions_with_far_candidate > 100);
  REQUIRE(far_evictions == evictions_with_far_candidate);
  for (std::uint64_t s = 0; s < 4; ++s)
    REQUIRE(std::find(cache.seqs(0, 0).begin(), cache.seqs(0, 0).end(), s) !=
            cache.seqs(0, 0).end());
}

namespace {
template <HashMode M>
std::vector<std::uint64_t> eviction_log(Config<M> c, std::uint64_t data_seed) {
  const Geometry g{2, 8, 2, 64};
  KVCache<HashEvictSimHash<M>> cache(g, Budget::uniform(64), HashEvictSimHash<M>(c));
  std::vector<std::uint64_t> log;
  cache.set_eviction_callback([&](const auto& row) {
    log.push_back(row.seq * 4 + static_cast<std::uint64_t>(row.layer * 2 + row.kv_head));
  });
  Stream s(data_seed, g);
  for (std::int64_t t = 0; t < 600; ++t)
    for (int l = 0; l < 2; ++l) {
      auto k = s.keys(1), v = s.values(1), q = s.queries(1);
      cache.append(l, t, k, v, q);
    }
  cache.set_budget(Budget::uniform(30));
  return log;
}
}  // namespace

TEST_CASE("a fixed seed gives identical evictions across runs and ISA levels") {
  for (Isa isa : {Isa::scalar, Isa::avx2, Isa::avx512}) {
    if (!kvevict::kernels::isa_supported(isa)) continue;
    Config<HashMode::key> ck;
    ck.ensemble = 3;  // 48 bits padded to 64
    Config<HashMode::query> cq;
    cq.combine = QueryCombine::sum;
    cq.bits = 8;
    const auto key_ref = eviction_log<HashMode::key>(ck, 5);
    const auto query_ref = eviction_log<HashMode::query>(cq, 6);
    REQUIRE(key_ref == eviction_log<HashMode::key>(ck, 5));
    ck.isa = isa;
    cq.isa = isa;
    INFO("isa " << kvevict::kernels::isa_name(isa));
    REQUIRE(eviction_log<HashMode::key>(ck, 5) == key_ref);
    REQUIRE(eviction_log<HashMode::query>(cq, 6) == query_ref);
  }
  // The seed matters: another projection evicts other rows.
  Config<HashMode::key> a, b;
  b.seed = a.seed + 1;
  REQUIRE(eviction_log<HashMode::key>(a, 5) != eviction_log<HashMode::key>(b, 5));
}

TEST_CASE("codes are the sign bits of the layer's projection, padding cleared") {
  const Geometry g{3, 2, 2, 24};
  Config<HashMode::key> c;
  c.bits = 8;
  c.ensemble = 5;  // 40 bits in a 64-bit word
  HashEvictSimHash<> policy(c);
  REQUIRE(policy.code_bytes() == 8);
  KVCache<HashEvictSimHash<>> cache(g, Budget::uniform(100), policy);
  Stream s(21, g);
  std::vector<std::vector<float>> keys;
  for (int t = 0; t < 20; ++t) {
    keys.push_back(s.keys(1));
    for (int l = 0; l < 3; ++l) cache.append(l, t, keys.back(), s.values(1));
  }
  std::size_t checked = 0;
  for (int l = 0; l < 3; ++l) {
    kvevict::kernels::SimHashProjection proj(24, 64, HashEvictSimHash<>::layer_seed(c.seed, l));
    const auto& R = proj.matrix();
    for (int kh = 0; kh < 2; ++kh) {
      const auto& codes = cache.policy().codes(l, kh);
      REQUIRE(codes.size() == 20 * 8);
      for (std::size_t t = 0; t < 20; ++t)
        for (int j = 0; j < 64; ++j) {
          const bool bit = (codes[t * 8 + static_cast<std::size_t>(j / 8)] >> (j % 8)) & 1u;
          if (j >= 40) {
            REQUIRE(!bit);
            continue;
          }
          double dot = 0.0;
          for (int i = 0; i < 24; ++i)
            dot += static_cast<double>(keys[t][static_cast<std::size_t>(kh * 24 + i)]) * R(i, j);
          if (std::abs(dot) < 1e-3) continue;  // float rounding may flip a sign this close
          REQUIRE(bit == (dot >= 0.0));
          ++checked;
        }
    }
  }
  REQUIRE(checked > 4000);
}

TEST_CASE("an ensemble of m b-bit projections is one (m*b)-bit projection") {
  // Summed Hamming distances of concatenated codes: m = 4 x 16 bits decides exactly as 64 bits.
  Config<HashMode::key> a, b;
  a.bits = 16;
  a.ensemble = 4;
  b.bits = 64;
  REQUIRE(eviction_log<HashMode::key>(a, 8) == eviction_log<HashMode::key>(b, 8));
  Config<HashMode::key> one;
  one.bits = 16;
  REQUIRE(eviction_log<HashMode::key>(a, 8) != eviction_log<HashMode::key>(one, 8));
}

TEST_CASE("configuration errors name the value and what was expected") {
  using P = HashEvictSimHash<>;
  Config<HashMode::key> c;
  c.bits = 12;
  REQUIRE_THROWS_AS(P(c), kvevict::Error);
  REQUIRE_THROWS_WITH(P(c), Catch::Contains("bits = 12"));
  c.bits = 64;
  c.ensemble = 8;
  REQUIRE_THROWS_WITH(P(c), Catch::Contains("512"));
  c.ensemble = 0;
  REQUIRE_THROWS_AS(P(c), kvevict::Error);
  const Geometry g{1, 4, 2, 8};
  REQUIRE_THROWS_AS(KVCache<P>(g, Budget::uniform(14)), kvevict::Error);  // 4 + 10 protected
  KVCache<P> ok(g, Budget::uniform(15));
  REQUIRE(ok.capacity(0, 0) == 15);
  // Query mode declares Signals::query, so the container insists on queries.
  KVCache<HashEvictSimHash<HashMode::query>> qc(g, Budget::uniform(15));
  std::vector<float> kv(16, 1.0f);
  REQUIRE_THROWS_AS(qc.append(0, 0, kv, kv), kvevict::Error);
  static_assert(HashEvictSimHash<HashMode::key>::signals == kvevict::Signals::none);
  static_assert(HashEvictSimHash<HashMode::query>::signals == kvevict::Signals::query);
}
