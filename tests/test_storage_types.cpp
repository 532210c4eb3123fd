// K/V storage in Eigen::half and Eigen::bfloat16: rows are the float -> storage
// conversion of what was appended, bit for bit; attention and policy signals are
// computed in float from the widened rows.
//
// Documented tolerance (docs/reliability.md): attention over a half/bfloat16 cache equals
// attention over a float cache fed the same rounded rows to float accumulation error
// (relative 1e-5), and is within 8 * unit roundoff of the storage type (half 2^-11,
// bfloat16 2^-8), relative to the largest output magnitude, of attention over the
// unrounded float rows, for the unit-scale data used here (|q . k| / sqrt(d) ~ 1).
#include <Eigen/Core>
#include <cstring>

#include "support/test_support.hpp"

namespace {

using kvevict::Budget;
using kvevict::Geometry;
using kvevict::KVCache;
namespace pol = kvevict::policies;

template <class S>
std::uint16_t bits(S x) {
  static_assert(sizeof(S) == 2);
  std::uint16_t b;
  std::memcpy(&b, &x, 2);
  return b;
}

template <class S>
constexpr double unit_roundoff() {
  if constexpr (std::is_same_v<S, Eigen::half>) return 1.0 / 2048.0;  // 11-bit significand
  else return 1.0 / 256.0;                                            // bfloat16: 8 bits
}

template <class S>
std::vector<float> rounded(std::span<const float> x) {
  std::vector<float> r(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) r[i] = static_cast<float>(static_cast<S>(x[i]));
  return r;
}

// Every kept row of `c` equals static_cast<S>(appended float) bit for bit.
template <class Cache>
void check_bits(const Cache& c, const kvtest::Ledger& ledger) {
  using S = typename Cache::scalar_type;
  const auto& g = c.geometry();
  for (int l = 0; l < g.n_layers; ++l)
    for (int h = 0; h < g.n_kv_heads; ++h) {
      const auto pos = c.positions(l, h);
      const auto k = c.keys(l, h);
      const auto v = c.values(l, h);
      for (std::size_t r = 0; r < pos.size(); ++r) {
        const auto& row = ledger.appended.at(kvtest::RowId{l, h, pos[r]});
        std::size_t mismatches = 0;
        for (int j = 0; j < g.head_dim; ++j) {
          const auto ri = static_cast<Eigen::Index>(r);
          mismatches += bits(k(ri, j)) != bits(static_cast<S>(row.key[std::size_t(j)]));
          mismatches += bits(v(ri, j)) != bits(static_cast<S>(row.value[std::size_t(j)]));
        }
        INFO("layer " << l << " head " << h << " position " << pos[r]);
        REQUIRE(mismatches == 0);
      }
    }
}

// Streams `steps` decode tokens (scale chosen so values exercise subnormal/large halves
// too) through a cache of storage S and checks every kept row after every step.
template <class S, class Policy>
void run_bit_exact(Policy policy, std::uint64_t seed) {
  const Geometry g{2, 4, 2, 8};
  KVCache<Policy, S> c(g, Budget::uniform(12), policy);
  kvtest::Ledger ledger;
  c.set_eviction_callback(ledger.template callback<S>());
  kvtest::Rng rng(seed);
  const std::size_t kv = std::size_t(g.n_kv_heads * g.head_dim);
  const std::size_t qn = std::size_t(g.n_heads * g.head_dim);
  for (int t = 0; t < 60; ++t)
    for (int l = 0; l < g.n_layers; ++l) {
      // Mix magnitudes: 1e-6 (half subnormals), 1, 1e3 (near half's range).
      const float scale = t % 3 == 0 ? 1e-6f : (t % 3 == 1 ? 1.0f : 1e3f);
      auto k = rng.normals(kv, scale);
      auto v = rng.normals(kv, scale);
      auto q = rng.normals(qn);
      ledger.record(g, l, t, std::uint64_t(t), k, v);
      c.append(l, t, k, v, q);
      if constexpr (has(Policy::signals, kvevict::Signals::attention))
        kvevict::attend(c, l, q);
    }
  kvtest::check_against_ledger(c, ledger, true);
  check_bits(c, ledger);
}

}  // namespace

TEMPLATE_TEST_CASE("half/bfloat16 storage keeps the converted rows bit for bit", "[storage]",
                   Eigen::half, Eigen::bfloat16) {
  using S = TestType;
  SECTION("StreamingLLM") { run_bit_exact<S>(pol::StreamingLLM{2}, 11); }
  SECTION("H2O") { run_bit_exact<S>(pol::H2O(pol::H2O::Config{3, 1}), 12); }
  SECTION("KNorm") { run_bit_exact<S>(pol::KNorm(pol::KNorm::Config{1, 2}), 13); }
  SECTION("Random") { run_bit_exact<S>(pol::Random(pol::Random::Config{7, 1, 1}), 14); }
}

TEMPLATE_TEST_CASE("half/bfloat16 storage halves K/V memory", "[storage]", Eigen::half,
                   Eigen::bfloat16) {
  const Geometry g{1, 2, 2, 16};
  KVCache<pol::StreamingLLM, float> f(g, Budget::uniform(32), pol::StreamingLLM{1});
  KVCache<pol::StreamingLLM, TestType> h(g, Budget::uniform(32), pol::StreamingLLM{1});
  kvtest::Rng rng(3);
  for (int t = 0; t < 40; ++t) {
    auto k = rng.normals(32), v = rng.normals(32);
    f.append(0, t, k, v);
    h.append(0, t, k, v);
  }
  std::size_t rows = 0;
  for (int kh = 0; kh < 2; ++kh) {
    REQUIRE(f.allocated_rows(0, kh) == h.allocated_rows(0, kh));
    rows += f.allocated_rows(0, kh);
  }
  // K and V: 2 matrices x rows x d x (4 - 2) bytes saved; positions/seqs unchanged.
  REQUIRE(f.allocated_bytes() - h.allocated_bytes() == 2 * rows * 16 * 2);
}

TEMPLATE_TEST_CASE("attention over half/bfloat16 accumulates in float", "[storage]", Eigen::half,
                   Eigen::bfloat16) {
  using S = TestType;
  const Geometry g{1, 8, 2, 32};
  const std::size_t kv = std::size_t(g.n_kv_heads * g.head_dim);
  const std::size_t qn = std::size_t(g.n_heads * g.head_dim);
  KVCache<pol::FullCache, S> low(g, Budget::unbounded());
  KVCache<pol::FullCache, float> exact(g, Budget::unbounded());
  KVCache<pol::FullCache, float> pre_rounded(g, Budget::unbounded());
  kvtest::Rng rng(21);
  double worst_vs_rounded = 0.0, worst_vs_exact = 0.0;
  for (int t = 0; t < 300; ++t) {
    auto k = rng.normals(kv), v = rng.normals(kv), q = rng.normals(qn);
    low.append(0, t, k, v);
    exact.append(0, t, k, v);
    pre_rounded.append(0, t, rounded<S>(k), rounded<S>(v));
    if (t % 25 != 24) continue;
    const auto a = kvevict::attend(low, 0, q);
    const auto b = kvevict::attend(exact, 0, q);
    const auto c = kvevict::attend(pre_rounded, 0, q);
    const double mag = b.out.cwiseAbs().maxCoeff();
    REQUIRE(mag > 0.0);
    worst_vs_rounded = std::max(worst_vs_rounded, double((a.out - c.out).cwiseAbs().maxCoeff()) / mag);
    worst_vs_exact = std::max(worst_vs_exact, double((a.out - b.out).cwiseAbs().maxCoeff()) / mag);
    // Probabilities are float and sum to one per query head.
    for (const auto& p : a.probs)
      for (Eigen::Index r = 0; r < p.rows(); ++r) REQUIRE(std::abs(p.row(r).sum() - 1.0f) < 1e-5f);
  }
  INFO("relative error vs pre-rounded float " << worst_vs_rounded << ", vs exact float "
                                              << worst_vs_exact);
  CHECK(worst_vs_rounded <= 1e-5);
  CHECK(worst_vs_exact <= 8.0 * unit_roundoff<S>());
  // The rounding is visible at all (the low-precision path is really low precision).
  CHECK(worst_vs_exact > 1e-3 * unit_roundoff<S>());
}

TEMPLATE_TEST_CASE("policies read half/bfloat16 keys widened to float", "[storage]", Eigen::half,
                   Eigen::bfloat16) {
  using S = TestType;
  // A half cache must decide exactly as a float cache fed the rounded rows: KNorm ranks by
  // the widened stored key, H2O by float probabilities from widened keys.
  const Geometry g{2, 4, 2, 16};
  const std::size_t kv = std::size_t(g.n_kv_heads * g.head_dim);
  const std::size_t qn = std::size_t(g.n_heads * g.head_dim);
  auto run = [&](auto policy) {
    using P = decltype(policy);
    KVCache<P, S> low(g, Budget::uniform(10), policy);
    KVCache<P, float> ref(g, Budget::uniform(10), policy);
    kvtest::Rng rng(99);
    for (int t = 0; t < 80; ++t)
      for (int l = 0; l < g.n_layers; ++l) {
        auto k = rng.normals(kv, 1.0f + float(t % 7)), v = rng.normals(kv), q = rng.normals(qn);
        low.append(l, t, k, v, q);
        ref.append(l, t, rounded<S>(k), rounded<S>(v), q);
        if constexpr (has(P::signals, kvevict::Signals::attention)) {
          kvevict::attend(low, l, q);
          kvevict::attend(ref, l, q);
        }
        for (int h = 0; h < g.n_kv_heads; ++h)
          REQUIRE(kvtest::sorted_positions(low, l, h) == kvtest::sorted_positions(ref, l, h));
      }
  };
  SECTION("KNorm") { run(pol::KNorm(pol::KNorm::Config{1, 1})); }
  SECTION("H2O") { run(pol::H2O(pol::H2O::Config{2, 1})); }
}

TEMPLATE_TEST_CASE("half/bfloat16 prefill stores converted rows", "[storage]", Eigen::half,
                   Eigen::bfloat16) {
  using S = TestType;
  const Geometry g{1, 4, 2, 8};
  const std::size_t kv = std::size_t(g.n_kv_heads * g.head_dim);
  const std::size_t T = 30;
  KVCache<pol::H2O, S> c(g, Budget::uniform(12), pol::H2O(pol::H2O::Config{4, 1}));
  kvtest::Ledger ledger;
  c.set_eviction_callback(ledger.template callback<S>());
  kvtest::Rng rng(5);
  auto k = rng.normals(T * kv), v = rng.normals(T * kv), q = rng.normals(T * 4 * 8);
  for (std::size_t t = 0; t < T; ++t)
    ledger.record(g, 0, std::int64_t(t), t, std::span<const float>(k).subspan(t * kv, kv),
                  std::span<const float>(v).subspan(t * kv, kv));
  c.prefill(0, 0, T, k, v, q);
  kvtest::check_against_ledger(c, ledger, true);
  check_bits(c, ledger);
}
