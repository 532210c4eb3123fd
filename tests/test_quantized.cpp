// Quantized K/V storage (quantized.hpp): Q8<G>, Q4<G>, E4M3 and KV<KF, VF> in KVCache.
//  - encode/decode against an independent scalar transcription of the documented formats,
//    for every group size and head dimension listed below (bytes compared bit for bit);
//  - the round-trip error bound of each format;
//  - a cache keeps the encoded bytes of what was appended, bit for bit, and the eviction
//    callback hands out those bytes (and a dequantising view);
//  - bad parameters / inputs are kvevict::Error naming the value, cache unchanged;
//  - policies that read keys see the dequantised rows (same decisions as a float cache fed
//    the dequantised rows); HashEvict hashes the float key before quantization;
//  - attention over quantized rows (scalar and AVX2 kernels) against the float reference
//    over the dequantised rows.
#include <Eigen/Core>
#include <algorithm>
#include <cstring>
#include <kvevict/serialize.hpp>
#include <limits>

#include "support/test_support.hpp"

namespace {

using kvevict::Budget;
using kvevict::E4M3;
using kvevict::Geometry;
using kvevict::KVCache;
using kvevict::KV;
using kvevict::Q4;
using kvevict::Q8;
namespace pol = kvevict::policies;
namespace kd = kvevict::detail;

// --- the reference: a direct transcription of the formats in quantized.hpp's comment -----
float ref_half(float x) { return static_cast<float>(Eigen::half(x)); }
std::uint16_t ref_half_bits(float x) {
  const Eigen::half h(x);
  std::uint16_t b;
  std::memcpy(&b, &h, 2);
  return b;
}

// Symmetric block format: bits 8 or 4, group G. Returns the row's bytes.
std::vector<std::uint8_t> ref_encode(int bits, int G, const std::vector<float>& x) {
  const int qmax = bits == 8 ? 127 : 7;
  std::vector<std::uint8_t> out;
  for (std::size_t b0 = 0; b0 < x.size(); b0 += std::size_t(G)) {
    double amax = 0;
    for (int j = 0; j < G; ++j) amax = std::max(amax, std::abs(double(x[b0 + std::size_t(j)])));
    const std::uint16_t sb = ref_half_bits(static_cast<float>(amax) / float(qmax));
    out.push_back(std::uint8_t(sb & 0xFF));
    out.push_back(std::uint8_t(sb >> 8));
    const float s = ref_half(static_cast<float>(amax) / float(qmax));
    std::vector<int> q(std::size_t(G), 0);
    for (int j = 0; j < G; ++j) {
      if (s == 0.0f) continue;
      float r = std::nearbyint(x[b0 + std::size_t(j)] / s);
      q[std::size_t(j)] = int(std::min(std::max(r, -float(qmax)), float(qmax)));
    }
    if (bits == 8) {
      for (int j = 0; j < G; ++j) out.push_back(std::uint8_t(std::int8_t(q[std::size_t(j)])));
    } else {
      for (int c0 = 0; c0 < G; c0 += 8) {
        const int c = std::min(8, G - c0), h = c / 2;
        for (int j = 0; j < h; ++j)
          out.push_back(std::uint8_t((q[std::size_t(c0 + j)] + 8) | ((q[std::size_t(c0 + j + h)] + 8) << 4)));
      }
    }
  }
  return out;
}

// E4M3 by exhaustive search: the finite code nearest to x, ties to the even mantissa.
float e4m3_decode_ref(std::uint8_t b) {
  const int e = (b >> 3) & 15, m = b & 7;
  const double a = e == 0 ? m * std::ldexp(1.0, -9) : (1.0 + m / 8.0) * std::ldexp(1.0, e - 7);
  return float((b & 0x80) ? -a : a);
}
std::uint8_t e4m3_encode_ref(float x) {
  int best = -1;
  double bd = 1e30;
  for (int c = 0; c < 0x7F; ++c) {  // 0x7F is NaN
    const double dist = std::abs(std::abs(double(x)) - e4m3_decode_ref(std::uint8_t(c)));
    if (dist < bd || (dist == bd && (c & 1) == 0)) {
      bd = dist;
      best = c;
    }
  }
  return std::uint8_t(best | (std::signbit(x) ? 0x80 : 0));
}

template <class F>
std::vector<std::uint8_t> encode(const std::vector<float>& x) {
  std::vector<std::uint8_t> out(kd::Codec<F>::row_bytes(x.size()));
  kd::Codec<F>::encode(x.data(), x.size(), out.data());
  return out;
}
template <class F>
std::vector<float> decode(const std::vector<std::uint8_t>& b, std::size_t d) {
  std::vector<float> out(d);
  kd::Codec<F>::decode(b.data(), d, out.data());
  return out;
}

// Rows with spread magnitudes: zeros, tiny groups, outliers, exact ties (x / s = k + 0.5).
std::vector<float> test_row(kvtest::Rng& rng, std::size_t d, int kind) {
  std::vector<float> x = rng.normals(d, kind == 1 ? 1e-6f : (kind == 2 ? 300.0f : 1.0f));
  if (kind == 3) std::fill(x.begin(), x.end(), 0.0f);
  if (kind == 4) x[rng.uniform(0, long(d) - 1)] = 1000.0f;
  if (kind == 5)
    for (std::size_t j = 0; j < d; ++j) x[j] = float(int(j % 15) - 7) * 0.5f + 0.25f;
  return x;
}

template <class F>
void check_block_format(int bits) {
  constexpr int G = F::group;
  kvtest::Rng rng(0x51 + G * 7 + bits);
  for (std::size_t d : {std::size_t(8), std::size_t(16), std::size_t(24), std::size_t(32),
                        std::size_t(64), std::size_t(128), std::size_t(256)}) {
    if (d % G != 0) continue;
    for (int kind = 0; kind < 6; ++kind)
      for (int rep = 0; rep < 4; ++rep) {
        const auto x = test_row(rng, d, kind);
        const auto bytes = encode<F>(x);
        INFO("format " << kd::Codec<F>::name() << " d " << d << " kind " << kind);
        REQUIRE(bytes == ref_encode(bits, G, x));
        const auto y = decode<F>(bytes, d);
        // decode: s * q for the stored scale and code
        for (std::size_t b0 = 0; b0 < d; b0 += std::size_t(G)) {
          const float s = kd::fp16_value(bytes.data() + (b0 / G) * kd::Codec<F>::block_bytes);
          float amax = 0;
          for (int j = 0; j < G; ++j) amax = std::max(amax, std::fabs(x[b0 + std::size_t(j)]));
          for (int j = 0; j < G; ++j) {
            const std::size_t e = b0 + std::size_t(j);
            // half a step, plus the fp16 rounding of the scale (codes clamp at +-qmax):
            // relative 2^-11, or absolute 2^-25 for a subnormal fp16 scale (tiny groups)
            const float qmax = bits == 8 ? 127.0f : 7.0f;
            const float bound = 0.5f * s * (1 + 1e-6f) + amax * (1.0f / 1024) + qmax * 0x1p-25f;
            REQUIRE(std::fabs(y[e] - x[e]) <= bound);
            REQUIRE(std::fmod(y[e] / (s == 0 ? 1 : s), 1.0f) == 0.0f);
          }
        }
      }
  }
}

}  // namespace

TEST_CASE("Q8 encodes like the reference for every group size and head dim", "[quantized]") {
  check_block_format<Q8<1>>(8);
  check_block_format<Q8<2>>(8);
  check_block_format<Q8<4>>(8);
  check_block_format<Q8<8>>(8);
  check_block_format<Q8<16>>(8);
  check_block_format<Q8<32>>(8);
  check_block_format<Q8<64>>(8);
  check_block_format<Q8<128>>(8);
}

TEST_CASE("Q4 encodes like the reference for every group size and head dim", "[quantized]") {
  check_block_format<Q4<2>>(4);
  check_block_format<Q4<4>>(4);
  check_block_format<Q4<6>>(4);
  check_block_format<Q4<8>>(4);
  check_block_format<Q4<16>>(4);
  check_block_format<Q4<32>>(4);
  check_block_format<Q4<64>>(4);
  check_block_format<Q4<128>>(4);
}

TEST_CASE("E4M3 rounds to the nearest code and decodes every code exactly", "[quantized]") {
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7F) == 0x7F) continue;  // NaN codes are never produced
    const float v = e4m3_decode_ref(std::uint8_t(c));
    REQUIRE(kd::e4m3_value(std::uint8_t(c)) == v);
    if (c != 0x80) REQUIRE(kd::e4m3_bits(v) == std::uint8_t(c));  // -0 encodes as 0x80 too
  }
  REQUIRE(kd::e4m3_bits(-0.0f) == 0x80);
  kvtest::Rng rng(0xE4);
  for (int i = 0; i < 20000; ++i) {
    float x = rng.normal(i % 3 == 0 ? 0.01f : (i % 3 == 1 ? 1.0f : 100.0f));
    x = std::max(std::min(x, 463.9f), -463.9f);
    REQUIRE(kd::e4m3_bits(x) == e4m3_encode_ref(x));
  }
  // ties: midway between 1 and 1.125 rounds to the even mantissa (1.0), 1.1875 -> 1.25
  REQUIRE(kd::e4m3_bits(1.0625f) == kd::e4m3_bits(1.0f));
  REQUIRE(kd::e4m3_bits(1.1875f) == kd::e4m3_bits(1.25f));
  REQUIRE(kd::e4m3_value(kd::e4m3_bits(463.0f)) == 448.0f);
}

namespace {

template <class S>
struct Formats {
  using K = typename kd::StorageOf<S>::key_codec;
  using Vc = typename kd::StorageOf<S>::value_codec;
};

// Every kept row of c is the encoding of what was appended, bit for bit.
template <class Cache>
void check_stored_bytes(const Cache& c, const kvtest::Ledger& ledger) {
  using F = Formats<typename Cache::scalar_type>;
  const auto& g = c.geometry();
  const auto d = std::size_t(g.head_dim);
  for (int l = 0; l < g.n_layers; ++l)
    for (int h = 0; h < g.n_kv_heads; ++h) {
      const auto pos = c.positions(l, h);
      const auto kb = c.stored_keys(l, h), vb = c.stored_values(l, h);
      REQUIRE(kb.size() == pos.size() * F::K::row_bytes(d));
      REQUIRE(vb.size() == pos.size() * F::Vc::row_bytes(d));
      const auto dk = c.dequantized_keys(l, h);
      for (std::size_t r = 0; r < pos.size(); ++r) {
        const auto& row = ledger.appended.at(kvtest::RowId{l, h, pos[r]});
        std::vector<std::uint8_t> ek(F::K::row_bytes(d)), ev(F::Vc::row_bytes(d));
        F::K::encode(row.key.data(), d, ek.data());
        F::Vc::encode(row.value.data(), d, ev.data());
        REQUIRE(std::equal(ek.begin(), ek.end(), kb.begin() + std::ptrdiff_t(r * ek.size())));
        REQUIRE(std::equal(ev.begin(), ev.end(), vb.begin() + std::ptrdiff_t(r * ev.size())));
        std::vector<float> x(d);
        F::K::decode(ek.data(), d, x.data());
        for (std::size_t j = 0; j < d; ++j) REQUIRE(dk(Eigen::Index(r), Eigen::Index(j)) == x[j]);
      }
    }
}

template <class S, class Policy>
void run_stream(Policy policy, int head_dim, std::size_t budget, std::uint64_t seed) {
  Geometry g{2, 4, 2, head_dim};
  KVCache<Policy, S> c(g, Budget::uniform(budget), std::move(policy));
  kvtest::Ledger ledger;
  using F = Formats<S>;
  std::size_t reported = 0;
  c.set_eviction_callback([&](const kvevict::EvictedRow<S>& e) {
    const auto& row = ledger.appended.at(kvtest::RowId{e.layer, e.kv_head, e.position});
    const auto d = std::size_t(head_dim);
    std::vector<std::uint8_t> ek(F::K::row_bytes(d));
    F::K::encode(row.key.data(), d, ek.data());
    REQUIRE(std::equal(ek.begin(), ek.end(), e.key.begin(), e.key.end()));
    std::vector<float> deq(d), want(d);
    e.dequantize_value(deq);
    std::vector<std::uint8_t> ev(F::Vc::row_bytes(d));
    F::Vc::encode(row.value.data(), d, ev.data());
    F::Vc::decode(ev.data(), d, want.data());
    REQUIRE(deq == want);
    ++reported;
  });
  kvtest::Rng rng(seed);
  const auto kv = std::size_t(g.n_kv_heads * head_dim), q = std::size_t(g.n_heads * head_dim);
  for (std::int64_t t = 0; t < 40; ++t)
    for (int l = 0; l < g.n_layers; ++l) {
      auto k = rng.normals(kv), v = rng.normals(kv), qq = rng.normals(q);
      ledger.record(g, l, t, c.tokens_seen(l), k, v);
      c.append(l, t, k, v, qq);
      kvevict::attend(c, l, qq);
    }
  check_stored_bytes(c, ledger);
  REQUIRE(reported == 2 * 2 * (40 - std::min<std::size_t>(40, budget)));
}

}  // namespace

TEMPLATE_TEST_CASE("a quantized cache keeps the encoded rows bit for bit", "[quantized]", Q8<8>,
                   Q4<8>, E4M3, Q8<32>, Q4<32>, (KV<Q8<32>, Q4<16>>), (KV<E4M3, Q4<8>>)) {
  using S = TestType;
  const int head_dim = std::is_same_v<S, Q8<32>> || std::is_same_v<S, Q4<32>> ||
                               std::is_same_v<S, KV<Q8<32>, Q4<16>>>
                           ? 64
                           : 8;
  run_stream<S>(pol::StreamingLLM{}, head_dim, 12, 1);
  run_stream<S>(pol::H2O{}, head_dim, 12, 2);
  run_stream<S>(pol::KNorm{}, head_dim, 12, 3);
  run_stream<S>(pol::KeyDiff{}, head_dim, 12, 4);
  run_stream<S>(pol::HashEvictKey{}, head_dim, 20, 5);
  run_stream<S>(pol::DecayedAttention{}, head_dim, 20, 6);
  run_stream<S>(pol::Random{}, head_dim, 12, 7);
}

TEST_CASE("key_row_bytes / value_row_bytes are the bytes of one stored row in every type",
          "[quantized]") {
  // The frontier (docs/quality.md) counts memory with these: head_dim x element size for
  // float, fp16 and bf16, the encoded row (fp16 scales included) for quantized formats.
  const auto bytes = [](auto tag, int d) {
    using S = typename decltype(tag)::type;
    const KVCache<pol::FullCache, S> c(Geometry{1, 2, 1, d}, Budget::unbounded());
    return std::pair{c.key_row_bytes(), c.value_row_bytes()};
  };
  using P = std::pair<std::size_t, std::size_t>;
  CHECK(bytes(std::type_identity<float>{}, 8) == P{32, 32});
  CHECK(bytes(std::type_identity<Eigen::half>{}, 8) == P{16, 16});
  CHECK(bytes(std::type_identity<Eigen::bfloat16>{}, 64) == P{128, 128});
  CHECK(bytes(std::type_identity<Q8<8>>{}, 8) == P{10, 10});
  CHECK(bytes(std::type_identity<Q4<8>>{}, 8) == P{6, 6});
  CHECK(bytes(std::type_identity<Q4<4>>{}, 8) == P{8, 8});
  CHECK(bytes(std::type_identity<Q8<32>>{}, 128) == P{136, 136});
  CHECK(bytes(std::type_identity<E4M3>{}, 8) == P{8, 8});
  CHECK(bytes(std::type_identity<KV<Q8<8>, Q4<8>>>{}, 8) == P{10, 6});
  // The stored spans hold rows x row bytes (in units of the stored element).
  KVCache<pol::FullCache, Eigen::half> h(Geometry{1, 2, 1, 8}, Budget::unbounded());
  const std::vector<float> k(8, 0.5f), q(16, 0.25f);
  h.append(0, 0, k, k, q);
  h.append(0, 1, k, k, q);
  CHECK(h.stored_keys(0, 0).size_bytes() == 2 * h.key_row_bytes());
}

TEST_CASE("bad parameters and inputs are kvevict::Error naming the value, cache unchanged",
          "[quantized]") {
  const Geometry g8{1, 2, 1, 8};
  try {
    KVCache<pol::FullCache, Q8<32>> c(g8, Budget::unbounded());
    FAIL("Q8<32> at head_dim 8 accepted");
  } catch (const kvevict::Error& e) {
    REQUIRE_THAT(e.what(), Catch::Contains("group size 32") && Catch::Contains("head_dim 8"));
  }
  try {
    KVCache<pol::FullCache, KV<Q8<8>, Q4<16>>> c(g8, Budget::unbounded());
    FAIL("Q4<16> values at head_dim 8 accepted");
  } catch (const kvevict::Error& e) {
    REQUIRE_THAT(e.what(), Catch::Contains("value format Q4<16>"));
  }
  try {
    KVCache<pol::FullCache, Q4<6>> c(g8, Budget::unbounded());
    FAIL("Q4<6> at head_dim 8 accepted");
  } catch (const kvevict::Error& e) {
    REQUIRE_THAT(e.what(), Catch::Contains("group size 6"));
  }

  KVCache<pol::StreamingLLM, KV<Q4<8>, E4M3>> c(g8, Budget::uniform(6));
  kvtest::Rng rng(11);
  for (std::int64_t t = 0; t < 9; ++t) c.append(0, t, rng.normals(8), rng.normals(8));
  const std::vector<std::uint8_t> k0(c.stored_keys(0, 0).begin(), c.stored_keys(0, 0).end());
  const std::vector<std::uint8_t> v0(c.stored_values(0, 0).begin(), c.stored_values(0, 0).end());
  const auto pos0 = std::vector<std::int64_t>(c.positions(0, 0).begin(), c.positions(0, 0).end());
  auto unchanged = [&] {
    REQUIRE(std::equal(k0.begin(), k0.end(), c.stored_keys(0, 0).begin(), c.stored_keys(0, 0).end()));
    REQUIRE(std::equal(v0.begin(), v0.end(), c.stored_values(0, 0).begin(), c.stored_values(0, 0).end()));
    REQUIRE(std::equal(pos0.begin(), pos0.end(), c.positions(0, 0).begin(), c.positions(0, 0).end()));
    REQUIRE(c.tokens_seen(0) == 9);
  };
  auto bad = [&](std::vector<float> k, std::vector<float> v, const char* msg) {
    try {
      c.append(0, 100, k, v);
      FAIL("accepted: " << msg);
    } catch (const kvevict::Error& e) {
      REQUIRE_THAT(e.what(), Catch::Contains(msg));
    }
    unchanged();
  };
  auto k = rng.normals(8), v = rng.normals(8);
  auto kn = k;
  kn[3] = std::numeric_limits<float>::quiet_NaN();
  bad(kn, v, "append: keys[3] = nan");
  auto vi = v;
  vi[5] = -std::numeric_limits<float>::infinity();
  bad(k, vi, "append: values[5] = -inf");
  auto kbig = k;
  kbig[1] = 1e6f;
  bad(kbig, v, "does not fit Q4<8>");
  auto vbig = v;
  vbig[0] = 500.0f;
  bad(k, vbig, "does not fit E4M3");
  // prefill: the same checks before anything changes
  std::vector<float> kb(3 * 8), vb(3 * 8);
  for (auto& x : kb) x = rng.normal();
  for (auto& x : vb) x = rng.normal();
  vb[17] = std::numeric_limits<float>::quiet_NaN();
  REQUIRE_THROWS_WITH(c.prefill(0, 200, 3, kb, vb), Catch::Contains("prefill: values[17] = nan"));
  unchanged();
  // the largest storable magnitudes are accepted
  k[0] = 463.0f;  // keys Q4: far inside its limit
  v[0] = 463.0f;  // E4M3 values: stored as 448
  c.append(0, 300, k, v);
  REQUIRE(c.size(0, 0) == 6);
}

namespace {
template <class S>
std::vector<float> roundtrip(bool key, const std::vector<float>& x, std::size_t d) {
  using C = typename kd::StorageOf<S>::key_codec;
  using Cv = typename kd::StorageOf<S>::value_codec;
  std::vector<float> out(x.size());
  for (std::size_t r = 0; r < x.size() / d; ++r) {
    if (key) {
      std::vector<std::uint8_t> b(C::row_bytes(d));
      C::encode(x.data() + r * d, d, b.data());
      C::decode(b.data(), d, out.data() + r * d);
    } else {
      std::vector<std::uint8_t> b(Cv::row_bytes(d));
      Cv::encode(x.data() + r * d, d, b.data());
      Cv::decode(b.data(), d, out.data() + r * d);
    }
  }
  return out;
}

// Runs the same stream through a quantized cache and a float cache. With `feed_dequantised`
// both are fed the dequantised rows x^ = dequant(quant(x)) (quantizing x^ again gives the
// same bytes, checked here), so a policy sees the same incoming float key in both and the
// quantized cache's stored rows dequantise to exactly the float cache's rows; otherwise
// both are fed x. Returns whether both keep the same positions after every step.
template <class S, class Policy>
bool same_decisions(Policy policy, bool feed_dequantised, int head_dim, std::uint64_t seed,
                    std::size_t budget = 10) {
  const Geometry g{2, 4, 2, head_dim};
  KVCache<Policy, S> qc(g, Budget::uniform(budget), policy);
  KVCache<Policy, float> fc(g, Budget::uniform(budget), policy);
  kvtest::Rng rng(seed);
  const auto d = std::size_t(head_dim), kv = std::size_t(g.n_kv_heads) * d;
  bool same = true;
  for (std::int64_t t = 0; t < 60; ++t)
    for (int l = 0; l < g.n_layers; ++l) {
      auto k = rng.normals(kv), v = rng.normals(kv), q = rng.normals(std::size_t(g.n_heads) * d);
      if (feed_dequantised) {
        const auto kq = roundtrip<S>(true, k, d), vq = roundtrip<S>(false, v, d);
        REQUIRE(roundtrip<S>(true, kq, d) == kq);  // re-quantizing x^ is exact
        REQUIRE(roundtrip<S>(false, vq, d) == vq);
        k = kq;
        v = vq;
      }
      qc.append(l, t, k, v, q);
      fc.append(l, t, k, v, q);
      for (int h = 0; h < g.n_kv_heads; ++h) {
        auto a = qc.positions(l, h), b = fc.positions(l, h);
        same = same && std::equal(a.begin(), a.end(), b.begin(), b.end());
      }
    }
  return same;
}
}  // namespace

TEMPLATE_TEST_CASE("policies that read keys see the dequantised rows", "[quantized]", Q8<8>,
                   Q4<8>, E4M3, (KV<Q4<8>, Q8<8>>)) {
  REQUIRE(same_decisions<TestType>(pol::KNorm{}, true, 8, 21));
  REQUIRE(same_decisions<TestType>(pol::KeyDiff{}, true, 8, 22));
  REQUIRE(same_decisions<TestType>(pol::ExpectedAttention{}, true, 8, 23));
}

TEST_CASE("HashEvict hashes the float key before it is quantized", "[quantized]") {
  // The same decisions as a float cache fed the unquantized keys...
  REQUIRE(same_decisions<Q4<8>>(pol::HashEvictKey{}, false, 8, 31, 20));
  REQUIRE(same_decisions<Q8<32>>(pol::HashEvictKey{}, false, 64, 32, 20));
  // ...while a policy that reads the stored (dequantised) keys, KNorm, decides differently
  // from a float cache fed the same floats somewhere in such a stream (Q4 at group 8
  // moves keys enough): the comparison above is not vacuous.
  REQUIRE_FALSE(same_decisions<Q4<8>>(pol::KNorm{}, false, 8, 21, 20));
}

namespace {
// Attention in double over the dequantised rows.
void reference_attention(const std::vector<float>& q, std::size_t G, const std::vector<float>& K,
                         const std::vector<float>& Vv, std::size_t n, std::size_t d, float scale,
                         std::vector<double>& p, std::vector<double>& out) {
  p.assign(G * n, 0.0);
  out.assign(G * d, 0.0);
  for (std::size_t g = 0; g < G; ++g) {
    double m = -1e300;
    for (std::size_t i = 0; i < n; ++i) {
      double s = 0;
      for (std::size_t j = 0; j < d; ++j) s += double(q[g * d + j]) * K[i * d + j];
      p[g * n + i] = s * scale;
      m = std::max(m, p[g * n + i]);
    }
    double z = 0;
    for (std::size_t i = 0; i < n; ++i) z += (p[g * n + i] = std::exp(p[g * n + i] - m));
    for (std::size_t i = 0; i < n; ++i) p[g * n + i] /= z;
    for (std::size_t i = 0; i < n; ++i)
      for (std::size_t j = 0; j < d; ++j) out[g * d + j] += p[g * n + i] * Vv[i * d + j];
  }
}

template <kvevict::kernels::Isa I, class S>
void check_kernel(std::size_t d, std::size_t G, std::size_t n, std::uint64_t seed) {
  using KC = typename kd::StorageOf<S>::key_codec;
  using VC = typename kd::StorageOf<S>::value_codec;
  kvtest::Rng rng(seed);
  const auto x = rng.normals(n * d, 2.0f), y = rng.normals(n * d), q = rng.normals(G * d);
  std::vector<std::uint8_t> kb(n * KC::row_bytes(d)), vb(n * VC::row_bytes(d));
  for (std::size_t i = 0; i < n; ++i) {
    KC::encode(x.data() + i * d, d, kb.data() + i * KC::row_bytes(d));
    VC::encode(y.data() + i * d, d, vb.data() + i * VC::row_bytes(d));
  }
  const auto K = roundtrip<S>(true, x, d), Vv = roundtrip<S>(false, y, d);
  const float scale = 1.0f / std::sqrt(float(d));
  std::vector<double> pr, outr;
  reference_attention(q, G, K, Vv, n, d, scale, pr, outr);
  std::vector<float> p(G * n), out(G * d + 3, -7.0f);  // out stride d + 1: padding untouched
  namespace kk = kvevict::kernels;
  REQUIRE(kk::quant_attention_probs_at<I, typename KC::desc>(q.data(), d, G, kb.data(),
                                                             KC::row_bytes(d), n, d, scale, p.data()));
  for (std::size_t i = 0; i < G * n; ++i) REQUIRE(std::abs(p[i] - pr[i]) <= 1e-5 * (1 + pr[i]));
  std::vector<float> o2(G * (d + 1), -7.0f);
  kk::quant_attention_output_at<I, typename VC::desc>(p.data(), G, vb.data(), VC::row_bytes(d), n,
                                                      d, o2.data(), d + 1);
  double mx = 0;
  for (double v : outr) mx = std::max(mx, std::abs(v));
  for (std::size_t g = 0; g < G; ++g) {
    for (std::size_t j = 0; j < d; ++j) REQUIRE(std::abs(o2[g * (d + 1) + j] - outr[g * d + j]) <= 1e-5 * (1 + mx));
    REQUIRE(o2[g * (d + 1) + d] == -7.0f);
  }
}

template <class S>
void check_kernel_all(std::size_t d) {
  namespace kk = kvevict::kernels;
  for (std::size_t G : {std::size_t(1), std::size_t(3), std::size_t(4), std::size_t(5)})
    for (std::size_t n : {std::size_t(1), std::size_t(2), std::size_t(7), std::size_t(300)}) {
      INFO("d " << d << " G " << G << " n " << n);
      check_kernel<kk::Isa::scalar, S>(d, G, n, 100 + d + G * 7 + n);
      if (kk::attention_isa() != kk::Isa::scalar) check_kernel<kk::Isa::avx2, S>(d, G, n, 200 + d + G + n);
      if (kk::attention_isa() == kk::Isa::avx512) check_kernel<kk::Isa::avx512, S>(d, G, n, 300 + d + G + n);
    }
}

// The AVX-512 level (Q8/Q4, G a multiple of 16) and the levels below it on the same inputs,
// each against the double reference (1e-5 relative, as the other levels).
template <class S>
void check_kernel_512(std::size_t d) {
  namespace kk = kvevict::kernels;
  for (std::size_t G : {std::size_t(1), std::size_t(4), std::size_t(5)})
    for (std::size_t n : {std::size_t(1), std::size_t(2), std::size_t(7), std::size_t(130)}) {
      INFO("d " << d << " G " << G << " n " << n);
      const std::uint64_t seed = 400 + d + G * 11 + n;
      check_kernel<kk::Isa::scalar, S>(d, G, n, seed);
      if (kk::attention_isa() != kk::Isa::scalar) check_kernel<kk::Isa::avx2, S>(d, G, n, seed);
      if (kk::attention_isa() == kk::Isa::avx512) check_kernel<kk::Isa::avx512, S>(d, G, n, seed);
    }
}
}  // namespace

TEST_CASE("attention over quantized rows matches the reference over the dequantised rows",
          "[quantized]") {
  INFO("attention ISA " << kvevict::kernels::isa_name(kvevict::kernels::attention_isa()));
  for (std::size_t d : {std::size_t(8), std::size_t(16), std::size_t(64), std::size_t(128)}) {
    check_kernel_all<Q8<8>>(d);
    check_kernel_all<Q4<8>>(d);
    check_kernel_all<E4M3>(d);
    if (d % 16 == 0) check_kernel_all<KV<Q8<16>, Q4<16>>>(d);
    if (d % 64 == 0) check_kernel_all<KV<Q4<64>, Q8<64>>>(d);
  }
  for (std::size_t d : {std::size_t(32), std::size_t(64), std::size_t(128)}) {
    check_kernel_all<Q8<32>>(d);
    check_kernel_all<Q4<32>>(d);
  }
  check_kernel_all<Q8<2>>(8);  // shapes the AVX2 level hands to the scalar level
  check_kernel_all<Q4<4>>(8);
  check_kernel_all<Q8<24>>(48);
  check_kernel_all<Q4<24>>(48);
}

TEST_CASE("the AVX-512 quantized level matches the reference at d 32/96/128/256", "[quantized]") {
  INFO("attention ISA " << kvevict::kernels::isa_name(kvevict::kernels::attention_isa()));
  for (std::size_t d : {std::size_t(32), std::size_t(96), std::size_t(128), std::size_t(256)}) {
    check_kernel_512<Q8<16>>(d);
    check_kernel_512<Q4<16>>(d);
    check_kernel_512<KV<Q8<32>, Q4<32>>>(d);
    if (d % 64 == 0) check_kernel_512<KV<Q4<64>, Q8<64>>>(d);
  }
  check_kernel_512<KV<Q8<48>, Q4<48>>>(96);
}

TEST_CASE("the AVX-512 p.V across tile boundaries (Q4 span order put back per call)",
          "[quantized]") {
  // 600 rows: several tiles for every format (Q8<32> at d 128: 119 rows per tile, Q4<32>
  // 224), a partial last tile; G 5 leaves a head group of one.
  namespace kk = kvevict::kernels;
  for (std::size_t G : {std::size_t(4), std::size_t(5)}) {
    INFO("G " << G);
    check_kernel<kk::Isa::scalar, KV<Q8<32>, Q4<32>>>(128, G, 600, 900 + G);
    if (kk::attention_isa() != kk::Isa::avx512) continue;
    check_kernel<kk::Isa::avx512, KV<Q4<32>, Q8<32>>>(128, G, 600, 901 + G);
    check_kernel<kk::Isa::avx512, KV<Q8<32>, Q4<32>>>(128, G, 600, 902 + G);
    check_kernel<kk::Isa::avx512, KV<Q8<16>, Q4<16>>>(32, G, 600, 903 + G);
    check_kernel<kk::Isa::avx512, KV<Q4<16>, Q8<16>>>(32, G, 600, 904 + G);
    check_kernel<kk::Isa::avx512, KV<Q8<48>, Q8<48>>>(96, G, 600, 905 + G);
  }
}

// p.V's per-column sums are in row order at every level whatever the lane a column takes
// (AVX-512 Q4 with G a multiple of 32 accumulates in the widened bytes' order and puts the
// output back): each output is exactly the fused multiply-add chain of the decoded values,
// bit for bit, across tiles (600 rows) and head groups.
template <class D>
void check_pv_fma_chain(kvevict::kernels::Isa isa, std::size_t d, std::size_t G, std::uint64_t seed) {
  namespace kk = kvevict::kernels;
  const std::size_t n = 600, rb = D::row_bytes(d);
  kvtest::Rng rng(seed);
  std::vector<std::uint8_t> rows(n * rb);
  for (auto& b : rows) b = static_cast<std::uint8_t>(rng.uniform(0, 255));
  for (std::size_t i = 0; i < n; ++i)  // finite scales 2^-8..2^-6
    for (std::size_t b = 0; b < d / D::group; ++b) {
      const auto h = static_cast<std::uint16_t>(((7 + rng.uniform(0, 2)) << 10) | rng.uniform(0, 1023));
      std::memcpy(rows.data() + i * rb + b * D::block_bytes, &h, 2);
    }
  std::vector<float> probs(G * n), out(G * d, -1.0f), want(G * d, 0.0f), blk(D::group);
  for (auto& p : probs) p = static_cast<float>(rng.uniform(1, 1 << 20)) * 0x1p-20f;
  for (std::size_t i = 0; i < n; ++i)
    for (std::size_t b = 0; b < d / D::group; ++b) {
      kk::detail::qdecode_block<D>(rows.data() + i * rb + b * D::block_bytes, blk.data());
      for (std::size_t g = 0; g < G; ++g)
        for (std::size_t j = 0; j < D::group; ++j) {
          float& w = want[g * d + b * D::group + j];
          w = std::fma(probs[g * n + i], blk[j], w);
        }
    }
  if (isa == kk::Isa::avx512) kk::quant_attention_output_at<kk::Isa::avx512, D>(probs.data(), G, rows.data(), rb, n, d, out.data(), d);
  else kk::quant_attention_output_at<kk::Isa::avx2, D>(probs.data(), G, rows.data(), rb, n, d, out.data(), d);
  REQUIRE(std::memcmp(out.data(), want.data(), out.size() * sizeof(float)) == 0);
}

TEST_CASE("quantized p.V is the fused multiply-add chain over rows, bit for bit", "[quantized]") {
  namespace kk = kvevict::kernels;
  using kk::QDesc;
  using kk::QKind;
  for (const auto isa : {kk::Isa::avx2, kk::Isa::avx512}) {
    if (!kk::isa_supported(isa) || static_cast<int>(isa) > static_cast<int>(kk::attention_isa())) continue;
    for (std::size_t G : {std::size_t(4), std::size_t(5)}) {
      INFO("isa " << kk::isa_name(isa) << " G " << G);
      check_pv_fma_chain<QDesc<QKind::q4, 32>>(isa, 128, G, 960 + G);
      check_pv_fma_chain<QDesc<QKind::q4, 32>>(isa, 96, G, 961 + G);
      check_pv_fma_chain<QDesc<QKind::q4, 64>>(isa, 192, G, 962 + G);
      check_pv_fma_chain<QDesc<QKind::q4, 128>>(isa, 256, G, 963 + G);
      check_pv_fma_chain<QDesc<QKind::q4, 16>>(isa, 32, G, 964 + G);
      check_pv_fma_chain<QDesc<QKind::q8, 32>>(isa, 128, G, 965 + G);
    }
  }
}

TEST_CASE("the quantized q.K over row blocks and head groups; p.V sharing a block's scale",
          "[quantized]") {
  // q.K runs blocks of kRows rows (4 at AVX-512, 2 at AVX2), then single rows, and per block
  // every group of 4 query heads (the 4 x 4 block reduced by one tree at AVX-512): row counts
  // around the block size, 1..9 heads (two and three head groups), group sizes 8/16/32/48/64
  // (head dim 8 included), every level against the double reference.
  namespace kk = kvevict::kernels;
  for (std::size_t G : {std::size_t(1), std::size_t(2), std::size_t(4), std::size_t(5), std::size_t(8), std::size_t(9)})
    for (std::size_t n : {std::size_t(3), std::size_t(4), std::size_t(5), std::size_t(9), std::size_t(17)}) {
      INFO("G " << G << " n " << n);
      const std::uint64_t seed = 700 + G * 31 + n;
      check_kernel<kk::Isa::scalar, KV<Q8<8>, Q4<8>>>(8, G, n, seed);
      check_kernel<kk::Isa::scalar, KV<Q4<48>, Q8<48>>>(96, G, n, seed);
      if (kk::attention_isa() != kk::Isa::scalar) {
        check_kernel<kk::Isa::avx2, KV<Q8<8>, Q4<8>>>(8, G, n, seed);
        check_kernel<kk::Isa::avx2, KV<Q4<8>, Q8<8>>>(8, G, n, seed + 1);
        check_kernel<kk::Isa::avx2, KV<Q4<48>, Q8<48>>>(96, G, n, seed + 2);
        check_kernel<kk::Isa::avx2, E4M3>(16, G, n, seed + 3);
      }
      if (kk::attention_isa() == kk::Isa::avx512) {
        check_kernel<kk::Isa::avx512, KV<Q8<16>, Q4<16>>>(32, G, n, seed);
        check_kernel<kk::Isa::avx512, KV<Q4<32>, Q8<32>>>(64, G, n, seed + 1);
        check_kernel<kk::Isa::avx512, KV<Q8<48>, Q4<48>>>(96, G, n, seed + 2);
        check_kernel<kk::Isa::avx512, KV<Q4<64>, Q8<64>>>(128, G, n, seed + 3);
      }
    }
  // p.V at AVX-512 computes a block's scale once for the 2 (G 32) or 4 (G 64, 128) vectors
  // of a column block it covers: values at those group sizes across tile boundaries.
  for (std::size_t G : {std::size_t(1), std::size_t(4), std::size_t(5)}) {
    INFO("G " << G);
    check_kernel<kk::Isa::scalar, KV<Q8<64>, Q4<64>>>(192, G, 600, 950 + G);
    if (kk::attention_isa() != kk::Isa::avx512) continue;
    check_kernel<kk::Isa::avx512, KV<Q8<64>, Q4<64>>>(192, G, 600, 951 + G);
    check_kernel<kk::Isa::avx512, KV<Q4<64>, Q8<64>>>(128, G, 600, 952 + G);
    check_kernel<kk::Isa::avx512, KV<Q8<128>, Q4<128>>>(256, G, 600, 953 + G);
    check_kernel<kk::Isa::avx512, KV<Q4<128>, Q8<128>>>(256, G, 600, 954 + G);
  }
  // d = 0 (no block: the block loop runs at least once, so the kernel returns early): every
  // score 0, the softmax uniform, at every level.
  std::vector<float> p(3 * 5, -1.0f);
  const std::vector<std::uint8_t> none(1);
  const float qz = 0.0f;
  REQUIRE(kk::quant_attention_probs_at<kk::Isa::scalar, kk::QDesc<kk::QKind::q4, 32>>(&qz, 0, 3, none.data(), 0, 5, 0, 0.5f, p.data()));
  for (float x : p) REQUIRE(std::abs(x - 0.2f) <= 1e-6f);
  if (kk::attention_isa() != kk::Isa::scalar) {
    std::fill(p.begin(), p.end(), -1.0f);
    REQUIRE(kk::quant_attention_probs_at<kk::Isa::avx2, kk::QDesc<kk::QKind::q4, 32>>(&qz, 0, 3, none.data(), 0, 5, 0, 0.5f, p.data()));
    for (float x : p) REQUIRE(std::abs(x - 0.2f) <= 1e-6f);
  }
  if (kk::attention_isa() == kk::Isa::avx512) {
    std::fill(p.begin(), p.end(), -1.0f);
    REQUIRE(kk::quant_attention_probs_at<kk::Isa::avx512, kk::QDesc<kk::QKind::q4, 32>>(&qz, 0, 3, none.data(), 0, 5, 0, 0.5f, p.data()));
    for (float x : p) REQUIRE(std::abs(x - 0.2f) <= 1e-6f);
  }
}

TEST_CASE("attend over a quantized cache equals attend over the dequantised rows", "[quantized]") {
  const Geometry g{1, 8, 2, 64};
  KVCache<pol::FullCache, KV<Q8<32>, Q4<32>>> qc(g, Budget::unbounded());
  KVCache<pol::FullCache, float> fc(g, Budget::unbounded());
  kvtest::Rng rng(41);
  using S = KV<Q8<32>, Q4<32>>;
  for (std::int64_t t = 0; t < 100; ++t) {
    auto k = rng.normals(128), v = rng.normals(128);
    qc.append(0, t, k, v);
    fc.append(0, t, roundtrip<S>(true, k, 64), roundtrip<S>(false, v, 64));
  }
  const auto q = rng.normals(8 * 64);
  const auto a = kvevict::attend(qc, 0, q), b = kvevict::attend(fc, 0, q);
  REQUIRE((a.out - b.out).cwiseAbs().maxCoeff() <= 1e-5f * (1 + b.out.cwiseAbs().maxCoeff()));
  for (int h = 0; h < 2; ++h) REQUIRE((a.probs[std::size_t(h)] - b.probs[std::size_t(h)]).cwiseAbs().maxCoeff() <= 1e-5f);
}

namespace {
// One step of both layers (geometry {2, 4, 2, 8}): append, then attend (H2O observes).
template <class C>
void h2o_step(C& c, std::int64_t t, kvtest::Rng& r) {
  for (int l = 0; l < 2; ++l) {
    auto k = r.normals(16), v = r.normals(16), q = r.normals(32);
    c.append(l, t, k, v);
    kvevict::attend(c, l, q);
  }
}
}  // namespace

TEMPLATE_TEST_CASE("save/restore of a quantized cache is bit-exact", "[quantized]", Q8<8>, Q4<8>,
                   E4M3, (KV<Q8<8>, Q4<8>>)) {
  const Geometry g{2, 4, 2, 8};
  using C = KVCache<pol::H2O, TestType>;
  C a(g, Budget::uniform(12));
  kvtest::Rng rng(51);
  const auto step = [](C& c, std::int64_t t, kvtest::Rng& r) { h2o_step(c, t, r); };
  for (std::int64_t t = 0; t < 30; ++t) step(a, t, rng);
  const auto bytes = kvevict::save_bytes(a);
  C b(g, Budget::uniform(12));
  kvevict::load_bytes(b, bytes);
  REQUIRE(kvevict::save_bytes(b) == bytes);
  kvtest::Rng r1(52), r2(52);
  for (std::int64_t t = 30; t < 50; ++t) {
    step(a, t, r1);
    step(b, t, r2);
  }
  REQUIRE(kvevict::save_bytes(a) == kvevict::save_bytes(b));
  // another format is refused, naming both
  KVCache<pol::H2O, Q8<4>> other(g, Budget::uniform(12));
  REQUIRE_THROWS_WITH(kvevict::load_bytes(other, bytes), Catch::Contains("expected Q8<4> / Q8<4>"));
  KVCache<pol::H2O, float> plain(g, Budget::uniform(12));
  REQUIRE_THROWS_WITH(kvevict::load_bytes(plain, bytes), Catch::Contains("scalar type quantized"));
}

// --- the opt-in integer q.K (quant_attention_probs_qint, issue 15) --------------------------
namespace {
namespace kk = kvevict::kernels;

template <class S>
std::vector<std::uint8_t> encode_rows(const std::vector<float>& x, std::size_t n, std::size_t d) {
  using C = kd::Codec<S>;
  using D = typename C::desc;
  std::vector<std::uint8_t> b(n * D::row_bytes(d));
  for (std::size_t i = 0; i < n; ++i) C::encode(x.data() + i * d, d, b.data() + i * D::row_bytes(d));
  return b;
}

// Rows whose codes are exact multiples of a power-of-two scale (every block holds +-qmax):
// with integer queries holding +-127 the query rounding is the identity and every float step
// of both paths is exact, so the integer path must equal the exact kernel bit for bit.
template <class S>
void check_qint_exact(std::size_t d, std::size_t G, std::size_t n, std::uint64_t seed) {
  using D = typename kd::Codec<S>::desc;
  const int qmax = D::kind == kk::QKind::q8 ? 127 : 7;
  const float s = D::kind == kk::QKind::q8 ? 0x1p-7f : 0x1p-4f;
  kvtest::Rng rng(seed);
  std::vector<float> x(n * d), q(G * d);
  for (std::size_t i = 0; i < n * d; ++i) {
    const int c = (i % D::group == i / D::group % D::group) ? ((i & 1) ? qmax : -qmax)
                                                             : int(rng.uniform(-qmax, qmax));
    x[i] = float(c) * s;
  }
  for (std::size_t i = 0; i < G * d; ++i) q[i] = i % d == 3 ? -127.0f : float(rng.uniform(-127, 127));
  const auto kb = encode_rows<S>(x, n, d);
  std::vector<float> pe(G * n), pi(G * n);
  const float scale = 1.0f / 1024.0f;
  REQUIRE(kk::quant_attention_probs_at<kk::Isa::scalar, D>(q.data(), d, G, kb.data(), D::row_bytes(d), n, d, scale, pe.data()));
  REQUIRE(kk::quant_attention_probs_qint_at<kk::Isa::scalar, D>(q.data(), d, G, kb.data(), D::row_bytes(d), n, d, scale, pi.data()));
  REQUIRE(pe == pi);
  if (kk::attention_isa() != kk::Isa::scalar) {
    REQUIRE(kk::quant_attention_probs_at<kk::Isa::avx2, D>(q.data(), d, G, kb.data(), D::row_bytes(d), n, d, scale, pe.data()));
    REQUIRE(kk::quant_attention_probs_qint_at<kk::Isa::avx2, D>(q.data(), d, G, kb.data(), D::row_bytes(d), n, d, scale, pi.data()));
    REQUIRE(pe == pi);
  }
  if (kk::attention_isa() == kk::Isa::avx512) {
    REQUIRE(kk::quant_attention_probs_at<kk::Isa::avx512, D>(q.data(), d, G, kb.data(), D::row_bytes(d), n, d, scale, pe.data()));
    REQUIRE(kk::quant_attention_probs_qint_at<kk::Isa::avx512, D>(q.data(), d, G, kb.data(), D::row_bytes(d), n, d, scale, pi.data()));
    REQUIRE(pe == pi);
  }
}

// The test's own transcription: codes round-half-even(q / s_q), s_q = max|q| / 127; scores
// scale * s_q * sum_b s_k(b) * (integer dot of block b), in double; softmax in double.
template <class S>
void check_qint_reference(std::size_t d, std::size_t G, std::size_t n, std::uint64_t seed) {
  using D = typename kd::Codec<S>::desc;
  kvtest::Rng rng(seed);
  const auto x = rng.normals(n * d, 2.0f), q = rng.normals(G * d);
  const auto kb = encode_rows<S>(x, n, d);
  const std::size_t rb = D::row_bytes(d);
  const float scale = 1.0f / std::sqrt(float(d));
  std::vector<double> pr(G * n);
  for (std::size_t g = 0; g < G; ++g) {
    float amax = 0;
    for (std::size_t j = 0; j < d; ++j) amax = std::max(amax, std::abs(q[g * d + j]));
    const float sq = amax / 127.0f;
    std::vector<int> cq(d);
    for (std::size_t j = 0; j < d; ++j) cq[j] = int(std::clamp(std::nearbyint(q[g * d + j] / sq), -127.0f, 127.0f));
    double m = -1e300;
    for (std::size_t i = 0; i < n; ++i) {
      const std::uint8_t* row = kb.data() + i * rb;
      double acc = 0;
      for (std::size_t b = 0; b < d / D::group; ++b) {
        const std::uint8_t* blk = row + b * D::block_bytes;
        std::uint16_t h;
        std::memcpy(&h, blk, 2);
        const Eigen::half eh = Eigen::half_impl::raw_uint16_to_half(h);
        long dot = 0;
        for (std::size_t j = 0; j < D::group; ++j) {
          int c;
          if constexpr (D::kind == kk::QKind::q8) {
            c = std::int8_t(blk[2 + j]);
          } else {  // chunks of 8: byte c0/2 + j holds element c0 + j (low) and c0 + j + 4 (high)
            const std::size_t c0 = j / 8 * 8, r = j % 8;
            const std::uint8_t v = blk[2 + c0 / 2 + r % 4];
            c = int(r < 4 ? (v & 0xF) : (v >> 4)) - 8;
          }
          dot += long(c) * cq[b * D::group + j];
        }
        acc += double(float(eh)) * double(dot);
      }
      pr[g * n + i] = acc * double(sq) * scale;
      m = std::max(m, pr[g * n + i]);
    }
    double z = 0;
    for (std::size_t i = 0; i < n; ++i) z += (pr[g * n + i] = std::exp(pr[g * n + i] - m));
    for (std::size_t i = 0; i < n; ++i) pr[g * n + i] /= z;
  }
  std::vector<float> p(G * n);
  REQUIRE(kk::quant_attention_probs_qint_at<kk::Isa::scalar, D>(q.data(), d, G, kb.data(), rb, n, d, scale, p.data()));
  for (std::size_t i = 0; i < G * n; ++i) REQUIRE(std::abs(p[i] - pr[i]) <= 1e-5 * (1 + pr[i]));
  if (kk::attention_isa() != kk::Isa::scalar) {
    REQUIRE(kk::quant_attention_probs_qint_at<kk::Isa::avx2, D>(q.data(), d, G, kb.data(), rb, n, d, scale, p.data()));
    for (std::size_t i = 0; i < G * n; ++i) REQUIRE(std::abs(p[i] - pr[i]) <= 1e-5 * (1 + pr[i]));
  }
  if (kk::attention_isa() == kk::Isa::avx512) {  // VNNI when the CPU has it
    REQUIRE(kk::quant_attention_probs_qint_at<kk::Isa::avx512, D>(q.data(), d, G, kb.data(), rb, n, d, scale, p.data()));
    for (std::size_t i = 0; i < G * n; ++i) REQUIRE(std::abs(p[i] - pr[i]) <= 1e-5 * (1 + pr[i]));
  }
}

// Shapes outside the integer path run the exact kernel: the same probabilities bit for bit.
template <class S>
void check_qint_fallback(std::size_t d, std::size_t G, std::size_t n) {
  using D = typename kd::Codec<S>::desc;
  kvtest::Rng rng(d * 31 + G + n);
  const auto x = rng.normals(n * d), q = rng.normals(G * d);
  const auto kb = encode_rows<S>(x, n, d);
  std::vector<float> pe(G * n), pi(G * n);
  REQUIRE(kk::quant_attention_probs<D>(q.data(), d, G, kb.data(), D::row_bytes(d), n, d, 0.3f, pe.data()));
  REQUIRE(kk::quant_attention_probs_qint<D>(q.data(), d, G, kb.data(), D::row_bytes(d), n, d, 0.3f, pi.data()));
  REQUIRE(pe == pi);
}
}  // namespace

TEST_CASE("integer q.K: exact inputs give the exact kernel's probabilities bit for bit", "[quantized]") {
  INFO("attention ISA " << kk::isa_name(kk::attention_isa()));
  for (std::size_t G : {std::size_t(1), std::size_t(4), std::size_t(5)})
    for (std::size_t n : {std::size_t(1), std::size_t(2), std::size_t(7), std::size_t(130)}) {
      INFO("G " << G << " n " << n);
      for (std::size_t d : {std::size_t(32), std::size_t(96), std::size_t(128)}) {
        INFO("d " << d);
        check_qint_exact<Q8<32>>(d, G, n, 1 + d + G + n);
        check_qint_exact<Q4<32>>(d, G, n, 2 + d + G + n);
      }
      check_qint_exact<Q8<64>>(128, G, n, 3 + G + n);
      check_qint_exact<Q4<64>>(64, G, n, 4 + G + n);
      check_qint_exact<Q8<128>>(128, G, n, 5 + G + n);
      check_qint_exact<Q4<128>>(256, G, n, 6 + G + n);
    }
}

TEST_CASE("the query's codes round half to even like std::nearbyint, ties included", "[quantized]") {
  // max |q| = 127: s_q = 1, so q / s_q is q itself and the halves are exact ties.
  const std::size_t d = 64, G = 2;
  std::vector<float> q(G * d);
  kvtest::Rng rng(77);
  const auto r = rng.normals(q.size(), 40.0f);
  for (std::size_t i = 0; i < q.size(); ++i)
    q[i] = i % 5 == 0 ? float(int(i % 41) - 20) + 0.5f : std::clamp(r[i], -126.9f, 126.9f);
  q[3] = 127.0f;
  q[d + 7] = -127.0f;
  q[9] = -0.5f;
  q[11] = 1e-7f;
  auto check = [&](auto desc) {
    using D = decltype(desc);
    kk::detail::QuantQuery qq;
    REQUIRE(kk::detail::quantize_query<D>(q.data(), d, G, d, qq));
    for (std::size_t g = 0; g < G; ++g) {
      REQUIRE(qq.scale[g] == 1.0f);
      for (std::size_t j = 0; j < d; ++j) {
        const std::size_t src = D::kind == kk::QKind::q4 ? (j / 32) * 32 + kk::detail::q4_span_element(j % 32) : j;
        REQUIRE(int(qq.codes[g * d + j]) == int(std::nearbyint(q[g * d + src])));
      }
    }
    std::vector<float> bad = q;
    bad[d + 5] = std::numeric_limits<float>::infinity();
    REQUIRE_FALSE(kk::detail::quantize_query<D>(bad.data(), d, G, d, qq));
    bad[d + 5] = std::numeric_limits<float>::quiet_NaN();
    REQUIRE_FALSE(kk::detail::quantize_query<D>(bad.data(), d, G, d, qq));
  };
  check(kk::QDesc<kk::QKind::q8, 32>{});
  check(kk::QDesc<kk::QKind::q4, 32>{});
}

TEST_CASE("integer q.K matches a double transcription of its arithmetic", "[quantized]") {
  INFO("attention ISA " << kk::isa_name(kk::attention_isa()) << ", VNNI " << kk::has_avx512_vnni());
  for (std::size_t G : {std::size_t(1), std::size_t(3), std::size_t(4), std::size_t(9)})
    for (std::size_t n : {std::size_t(1), std::size_t(9), std::size_t(200)}) {
      INFO("G " << G << " n " << n);
      check_qint_reference<Q8<32>>(128, G, n, 11 + G + n);
      check_qint_reference<Q4<32>>(96, G, n, 12 + G + n);
      check_qint_reference<Q8<64>>(64, G, n, 13 + G + n);
      check_qint_reference<Q4<64>>(128, G, n, 14 + G + n);
      check_qint_reference<Q8<96>>(192, G, n, 15 + G + n);
    }
}

TEST_CASE("integer q.K: other formats and shapes run the exact kernel; bad queries are refused",
          "[quantized]") {
  for (std::size_t G : {std::size_t(1), std::size_t(4)}) {
    check_qint_fallback<Q8<8>>(8, G, 33);   // stories260K's head dim and group
    check_qint_fallback<Q4<8>>(8, G, 33);
    check_qint_fallback<Q8<16>>(48, G, 33);  // G not a multiple of 32
    check_qint_fallback<Q4<24>>(48, G, 33);
    check_qint_fallback<E4M3>(64, G, 33);
  }
  kvtest::Rng rng(5);
  using D = kd::Codec<Q8<32>>::desc;
  const auto kb = encode_rows<Q8<32>>(rng.normals(4 * 64), 4, 64);
  for (float bad : {NAN, INFINITY}) {
    auto q = rng.normals(64);
    q[17] = bad;
    std::vector<float> p(4);
    REQUIRE_FALSE(kk::quant_attention_probs_qint<D>(q.data(), 64, 1, kb.data(), D::row_bytes(64), 4, 64, 0.1f, p.data()));
  }
}
TEST_CASE("integer q.K with d = 0: every score 0, the softmax uniform, at every level", "[quantized]") {
  // The VNNI kernel's block loop runs at least once (its accumulators stay in registers), so
  // d = 0 must not reach it: quant_attention_probs_qint_at runs the exact kernel's d = 0 case.
  const std::vector<std::uint8_t> none(1);
  const float qz = 0.0f;
  auto check = [&](auto desc) {
    using D = decltype(desc);
    std::vector<float> p(3 * 5, -1.0f);
    REQUIRE(kk::quant_attention_probs_qint_at<kk::Isa::scalar, D>(&qz, 0, 3, none.data(), 0, 5, 0, 0.5f, p.data()));
    for (float x : p) REQUIRE(std::abs(x - 0.2f) <= 1e-6f);
    if (kk::attention_isa() != kk::Isa::scalar) {
      std::fill(p.begin(), p.end(), -1.0f);
      REQUIRE(kk::quant_attention_probs_qint_at<kk::Isa::avx2, D>(&qz, 0, 3, none.data(), 0, 5, 0, 0.5f, p.data()));
      for (float x : p) REQUIRE(std::abs(x - 0.2f) <= 1e-6f);
    }
    if (kk::attention_isa() == kk::Isa::avx512) {
      std::fill(p.begin(), p.end(), -1.0f);
      REQUIRE(kk::quant_attention_probs_qint_at<kk::Isa::avx512, D>(&qz, 0, 3, none.data(), 0, 5, 0, 0.5f, p.data()));
      for (float x : p) REQUIRE(std::abs(x - 0.2f) <= 1e-6f);
    }
  };
  check(kk::QDesc<kk::QKind::q8, 32>{});
  check(kk::QDesc<kk::QKind::q4, 32>{});
}

namespace {
// attend's integer q.K (AttendOptions::quant_qk) on a K/V-quantized cache: the kernel's
// probabilities and p.V bit for bit, and the output within a stated distance of the exact path.
template <class S>
void check_attend_qint(float tol) {
  const Geometry g{1, 8, 2, 128};
  KVCache<pol::FullCache, S> c(g, Budget::unbounded());
  kvtest::Rng rng(77);
  for (std::int64_t t = 0; t < 300; ++t) c.append(0, t, rng.normals(256, 1.5f), rng.normals(256));
  const auto q = rng.normals(8 * 128);
  kvevict::AttendOptions qint{false};
  qint.quant_qk = kvevict::QuantQK::integer_query;
  const auto a = kvevict::attend(c, 0, q, qint), e = kvevict::attend(c, 0, q, kvevict::AttendOptions{false});
  using St = kd::StorageOf<S>;
  using DK = typename St::key_codec::desc;
  using DV = typename St::value_codec::desc;
  for (int h = 0; h < 2; ++h) {
    std::vector<float> p(4 * 300), o(4 * 128);
    REQUIRE(kk::quant_attention_probs_qint<DK>(q.data() + h * 512, 128, 4, c.stored_keys(0, h).data(),
                                               c.key_row_bytes(), 300, 128, 1.0f / std::sqrt(128.0f), p.data()));
    kk::quant_attention_output<DV>(p.data(), 4, c.stored_values(0, h).data(), c.value_row_bytes(), 300, 128, o.data(), 128);
    REQUIRE(std::memcmp(p.data(), a.probs[std::size_t(h)].data(), p.size() * 4) == 0);
    REQUIRE(std::memcmp(o.data(), a.out.data() + h * 512, o.size() * 4) == 0);
  }
  const float rel = (a.out - e.out).norm() / e.out.norm();
  INFO("relative L2 distance to the exact path " << rel);
  REQUIRE(rel <= tol);
  REQUIRE(rel > 0.0f);  // the query's rounding shows
}
}  // namespace

TEST_CASE("attend with QuantQK::integer_query: the integer kernel, close to exact; bad options refused",
          "[quantized]") {
  // Stated bound: relative L2 distance of the output to the exact path <= 1e-2 (this data,
  // keys 1.5x the query's spread, d 128: 6.7e-3 for each format; the query's int8 rounding).
  check_attend_qint<Q8<32>>(1e-2f);
  check_attend_qint<KV<Q4<32>, Q8<32>>>(1e-2f);
  check_attend_qint<KV<Q8<64>, Q4<32>>>(1e-2f);

  kvevict::AttendOptions bad{false};
  bad.quant_qk = kvevict::QuantQK::integer_query;
  const Geometry g{1, 4, 2, 64};
  kvtest::Rng rng(3);
  const auto q = rng.normals(4 * 64);
  auto refuse = [&](auto& c, const char* what) {
    for (std::int64_t t = 0; t < 20; ++t) c.append(0, t, rng.normals(128), rng.normals(128));
    const auto before = kvevict::save_bytes(c);
    REQUIRE_THROWS_AS(kvevict::attend(c, 0, q, bad), kvevict::Error);
    REQUIRE_THROWS_WITH(kvevict::attend(c, 0, q, bad), Catch::Contains(what) && Catch::Contains("integer_query"));
    REQUIRE(kvevict::save_bytes(c) == before);  // H2O observed nothing
  };
  KVCache<pol::H2O, float> f(g, Budget::uniform(16));
  refuse(f, "keys are float");
  KVCache<pol::H2O, Q8<16>> q16(g, Budget::uniform(16));
  refuse(q16, "keys are Q8<16>");
  KVCache<pol::H2O, E4M3> e4(g, Budget::uniform(16));
  refuse(e4, "keys are E4M3");
  KVCache<pol::H2O, kvevict::Mixed<Eigen::half, Q8<32>>> mx(g, Budget::uniform(16));
  mx.set_hot_rows(4);
  refuse(mx, "Mixed");
  KVCache<pol::H2O, Q8<32>> ok(g, Budget::uniform(16));
  for (std::int64_t t = 0; t < 20; ++t) ok.append(0, t, rng.normals(128), rng.normals(128));
  kvevict::AttendOptions odd{true};
  odd.quant_qk = static_cast<kvevict::QuantQK>(7);
  const auto before = kvevict::save_bytes(ok);
  REQUIRE_THROWS_WITH(kvevict::attend(ok, 0, q, odd), Catch::Contains("quant_qk = 7"));
  REQUIRE(kvevict::save_bytes(ok) == before);
  bad.observe = true;
  REQUIRE_NOTHROW(kvevict::attend(ok, 0, q, bad));
}

// --- Mixed<Hot, Cold> (mixed.hpp): a recent band in Hot, older rows in Cold -------------
namespace {

template <class F>
struct BandRef {  // the band's codecs, through the test's own Formats / fp16 transcription
  static std::vector<std::uint8_t> enc(bool is_key, const std::vector<float>& x) {
    using C = typename kd::BandCodecs<F>::key;
    using V = typename kd::BandCodecs<F>::value;
    std::vector<std::uint8_t> out(is_key ? C::row_bytes(x.size()) : V::row_bytes(x.size()));
    if constexpr (std::is_same_v<F, Eigen::half>) {
      for (std::size_t j = 0; j < x.size(); ++j) {
        const std::uint16_t b = ref_half_bits(x[j]);
        std::memcpy(out.data() + 2 * j, &b, 2);
      }
    } else if (is_key) {
      C::encode(x.data(), x.size(), out.data());
    } else {
      V::encode(x.data(), x.size(), out.data());
    }
    return out;
  }
  static std::vector<float> dec(bool is_key, const std::vector<std::uint8_t>& b, std::size_t d) {
    std::vector<float> out(d);
    if constexpr (std::is_same_v<F, Eigen::half>) {
      for (std::size_t j = 0; j < d; ++j) {
        std::uint16_t h;
        std::memcpy(&h, b.data() + 2 * j, 2);
        out[j] = static_cast<float>(Eigen::numext::bit_cast<Eigen::half>(h));
      }
    } else if (is_key) {
      kd::BandCodecs<F>::key::decode(b.data(), d, out.data());
    } else {
      kd::BandCodecs<F>::value::decode(b.data(), d, out.data());
    }
    return out;
  }
};

// A scalar model of the band rule: per head, the hot set (arrival indices); a row arrives
// hot, and when R rows are hot the lowest arrival index goes cold, its bytes re-encoded
// from the decoded hot bytes. Every kept row's band and bytes are checked after each step,
// and every evicted row's bytes as the callback sees them.
template <class Hot, class Cold, class Policy>
void run_mixed_stream(Policy policy, std::size_t budget, std::size_t R, std::uint64_t seed) {
  using S = kvevict::Mixed<Hot, Cold>;
  const Geometry g{2, 4, 2, 8};
  const auto d = std::size_t(g.head_dim);
  KVCache<Policy, S> c(g, Budget::uniform(budget), std::move(policy));
  c.set_hot_rows(R);
  struct Row {
    bool hot = true;
    std::uint64_t seq = 0;
    std::vector<std::uint8_t> k, v;
  };
  std::map<kvtest::RowId, Row> model;  // every row appended and not yet seen evicted
  std::map<std::pair<int, int>, std::set<std::uint64_t>> hot;
  std::size_t evicted = 0;
  c.set_eviction_callback([&](const kvevict::EvictedRow<S>& e) {
    const auto it = model.find(kvtest::RowId{e.layer, e.kv_head, e.position});
    REQUIRE(it != model.end());
    REQUIRE(e.hot == it->second.hot);
    REQUIRE(std::equal(e.key.begin(), e.key.end(), it->second.k.begin(), it->second.k.end()));
    REQUIRE(std::equal(e.value.begin(), e.value.end(), it->second.v.begin(), it->second.v.end()));
    std::vector<float> x(d);
    e.dequantize_key(x);
    REQUIRE(x == (e.hot ? BandRef<Hot>::dec(true, it->second.k, d) : BandRef<Cold>::dec(true, it->second.k, d)));
    hot[{e.layer, e.kv_head}].erase(it->second.seq);
    model.erase(it);
    ++evicted;
  });
  const auto arrive = [&](int l, int h, std::int64_t pos, std::uint64_t seq, const float* k, const float* v) {
    auto& hs = hot[{l, h}];
    if (R > 0 && hs.size() == R) {  // the oldest hot row goes cold
      const std::uint64_t old = *hs.begin();
      hs.erase(hs.begin());
      for (auto& [id, row] : model)
        if (std::get<0>(id) == l && std::get<1>(id) == h && row.seq == old) {
          row.k = BandRef<Cold>::enc(true, BandRef<Hot>::dec(true, row.k, d));
          row.v = BandRef<Cold>::enc(false, BandRef<Hot>::dec(false, row.v, d));
          row.hot = false;
        }
    }
    const std::vector<float> kk(k, k + d), vv(v, v + d);
    Row row{R > 0, seq, R > 0 ? BandRef<Hot>::enc(true, kk) : BandRef<Cold>::enc(true, kk),
            R > 0 ? BandRef<Hot>::enc(false, vv) : BandRef<Cold>::enc(false, vv)};
    if (R > 0) hs.insert(seq);
    model[kvtest::RowId{l, h, pos}] = std::move(row);
  };
  const auto check = [&] {
    for (int l = 0; l < g.n_layers; ++l)
      for (int h = 0; h < g.n_kv_heads; ++h) {
        const auto pos = c.positions(l, h);
        std::size_t n_hot = 0;
        const auto dk = c.dequantized_keys(l, h);
        for (std::size_t r = 0; r < pos.size(); ++r) {
          const auto& want = model.at(kvtest::RowId{l, h, pos[r]});
          const auto got = c.stored_row(l, h, r);
          REQUIRE(got.hot == want.hot);
          n_hot += got.hot;
          REQUIRE(std::equal(got.key.begin(), got.key.end(), want.k.begin(), want.k.end()));
          REQUIRE(std::equal(got.value.begin(), got.value.end(), want.v.begin(), want.v.end()));
          const auto x = want.hot ? BandRef<Hot>::dec(true, want.k, d) : BandRef<Cold>::dec(true, want.k, d);
          for (std::size_t j = 0; j < d; ++j) REQUIRE(dk(Eigen::Index(r), Eigen::Index(j)) == x[j]);
        }
        REQUIRE(n_hot == c.hot_count(l, h));
        REQUIRE(n_hot <= R);
        REQUIRE(c.allocated_rows(l, h) <= budget);
      }
  };
  kvtest::Rng rng(seed);
  const std::size_t kv = 2 * d, q = 4 * d;
  std::int64_t t = 0;
  for (; t < 40; ++t)
    for (int l = 0; l < g.n_layers; ++l) {
      auto k = rng.normals(kv), v = rng.normals(kv), qq = rng.normals(q);
      const std::uint64_t seq = c.tokens_seen(l);
      // the victims leave (callback, model erased) before the new row arrives
      c.append(l, t, k, v, qq);
      for (int h = 0; h < g.n_kv_heads; ++h)
        arrive(l, h, t, seq, k.data() + std::size_t(h) * d, v.data() + std::size_t(h) * d);
      kvevict::attend(c, l, qq);
      check();
    }
  REQUIRE(evicted > 0);
}

}  // namespace

TEST_CASE("a mixed cache keeps hot rows in Hot, demoted rows re-encoded in Cold, bit for bit",
          "[quantized][mixed]") {
  using K8V4 = KV<Q8<8>, Q4<8>>;
  for (std::size_t R : {std::size_t(0), std::size_t(1), std::size_t(4), std::size_t(12)}) {
    INFO("R " << R);
    run_mixed_stream<Eigen::half, K8V4>(pol::StreamingLLM{}, 12, R, 11 + R);
    run_mixed_stream<Eigen::half, K8V4>(pol::H2O{}, 12, R, 12 + R);
    run_mixed_stream<Q8<8>, Q4<8>>(pol::KNorm{}, 12, R, 13 + R);
    run_mixed_stream<Q8<4>, E4M3>(pol::DecayedAttention{}, 20, R, 14 + R);
    run_mixed_stream<Eigen::half, Q8<8>>(pol::Random{}, 12, R, 15 + R);
  }
}

TEST_CASE("attend over a mixed cache equals attention over its dequantised rows", "[quantized][mixed]") {
  // Both bands through their own kernels, one softmax: within 1e-5 of a double-precision
  // softmax over the rows as stored (dequantised), probabilities in the cache's row order.
  const auto run = [](auto tag, int d, std::size_t R, std::size_t budget, std::uint64_t seed) {
    using S = typename decltype(tag)::type;
    const Geometry g{1, 8, 2, d};
    KVCache<pol::H2O, S> c(g, Budget::uniform(budget));
    c.set_hot_rows(R);
    kvtest::Rng rng(seed);
    const auto kv = std::size_t(2 * d), qn = std::size_t(8 * d);
    for (std::int64_t t = 0; t < 60; ++t) {
      auto k = rng.normals(kv, 2.0f), v = rng.normals(kv), q = rng.normals(qn);
      c.append(0, t, k, v);
      const auto a = kvevict::attend(c, 0, q);
      if (t % 11 != 5) continue;
      for (int h = 0; h < 2; ++h) {
        const auto K = c.dequantized_keys(0, h), V = c.dequantized_values(0, h);
        const auto n = std::size_t(K.rows());
        REQUIRE(c.hot_count(0, h) == std::min(n, R));
        for (int gq = 0; gq < 4; ++gq) {
          const float* qg = q.data() + std::size_t(h * 4 + gq) * std::size_t(d);
          std::vector<double> s(n);
          double m = -1e300, z = 0;
          for (std::size_t r = 0; r < n; ++r) {
            double dot = 0;
            for (int j = 0; j < d; ++j) dot += double(qg[j]) * K(Eigen::Index(r), j);
            s[r] = dot / std::sqrt(double(d));
            m = std::max(m, s[r]);
          }
          for (std::size_t r = 0; r < n; ++r) z += std::exp(s[r] - m);
          for (int j = 0; j < d; ++j) {
            double o = 0;
            for (std::size_t r = 0; r < n; ++r) o += std::exp(s[r] - m) / z * V(Eigen::Index(r), j);
            REQUIRE(std::abs(a.out(h * 4 + gq, j) - o) <= 1e-5 * (1 + std::abs(o)));
          }
          for (std::size_t r = 0; r < n; ++r)
            REQUIRE(std::abs(a.probs[std::size_t(h)](gq, Eigen::Index(r)) - std::exp(s[r] - m) / z) <= 1e-5);
        }
      }
    }
  };
  using K8V4 = KV<Q8<8>, Q4<8>>;
  for (std::size_t R : {std::size_t(0), std::size_t(1), std::size_t(5), std::size_t(24)}) {
    INFO("R " << R);
    run(std::type_identity<kvevict::Mixed<Eigen::half, K8V4>>{}, 8, R, 24, 61 + R);
    run(std::type_identity<kvevict::Mixed<Q8<32>, Q4<32>>>{}, 64, R, 40, 62 + R);
    run(std::type_identity<kvevict::Mixed<Eigen::half, E4M3>>{}, 128, R, 32, 63 + R);
  }
}

TEST_CASE("mixed caches: bad parameters are kvevict::Error naming the value, cache unchanged",
          "[quantized][mixed]") {
  using S = kvevict::Mixed<Eigen::half, KV<Q8<8>, Q4<8>>>;
  const Geometry g{2, 4, 2, 8};
  KVCache<pol::StreamingLLM, S> c(g, Budget::uniform(12));
  // a band larger than a head's capacity
  REQUIRE_THROWS_WITH(c.set_hot_rows(13), Catch::Contains("R = 13 exceeds the capacity 12"));
  REQUIRE(c.hot_rows() == 0);
  KVCache<pol::StreamingLLM, S> per_head(g, Budget::per_head({{12, 6}, {12, 12}}));
  REQUIRE_THROWS_WITH(per_head.set_hot_rows(7), Catch::Contains("capacity 6 of (layer 0, KV head 1)"));
  c.set_hot_rows(4);  // fine; a pooled budget is then refused
  REQUIRE(c.hot_rows() == 4);
  REQUIRE_THROWS_WITH(c.set_budget(Budget::uniform(12).pooled()), Catch::Contains("pooled budget"));
  // a group size that does not divide head_dim, named with its band
  using Bad = kvevict::Mixed<Q8<8>, Q4<16>>;
  REQUIRE_THROWS_WITH((KVCache<pol::StreamingLLM, Bad>(g, Budget::uniform(12))),
                      Catch::Contains("cold key format Q4<16>: group size 16 does not divide head_dim 8"));
  kvtest::Rng rng(71);
  for (std::int64_t t = 0; t < 20; ++t)
    for (int l = 0; l < 2; ++l) c.append(l, t, rng.normals(16), rng.normals(16));
  const auto snapshot = [&] {
    std::vector<std::vector<float>> s;
    for (int l = 0; l < 2; ++l)
      for (int h = 0; h < 2; ++h) {
        const auto k = c.dequantized_keys(l, h), v = c.dequantized_values(l, h);
        s.emplace_back(k.data(), k.data() + k.size());
        s.emplace_back(v.data(), v.data() + v.size());
        s.emplace_back(c.positions(l, h).begin(), c.positions(l, h).end());
        s.push_back({float(c.hot_count(l, h)), float(c.tokens_seen(l))});
      }
    return s;
  };
  const auto before = snapshot();
  // the band is set on an empty cache only
  REQUIRE_THROWS_WITH(c.set_hot_rows(2), Catch::Contains("R = 2 on a cache holding"));
  // a budget below the band
  REQUIRE_THROWS_WITH(c.set_budget(Budget::uniform(3)), Catch::Contains("below the hot band's 4 rows"));
  // values neither band can store (fp16 overflows at 65520; Q8's scale later)
  auto k = rng.normals(16), v = rng.normals(16);
  k[3] = 70000.0f;
  REQUIRE_THROWS_WITH(c.append(0, 20, k, v), Catch::Contains("70000"));
  k[3] = std::nanf("");
  REQUIRE_THROWS_WITH(c.append(0, 20, k, v), Catch::Contains("nan"));
  REQUIRE(snapshot() == before);
  REQUIRE(c.hot_rows() == 4);
  // a budget at the band is fine: the cache shrinks through the policy
  // a budget at or above the band is fine: the cache shrinks through the policy. StreamingLLM
  // keeps its 4 sinks (cold: the oldest rows) and the newest row (hot)
  c.set_budget(Budget::uniform(5));
  for (int h = 0; h < 2; ++h) {
    REQUIRE(c.hot_count(0, h) == 1);
  }
  for (std::int64_t t = 20; t < 24; ++t) c.append(0, t, rng.normals(16), rng.normals(16));
  for (int h = 0; h < 2; ++h) {
    REQUIRE(c.size(0, h) == 5);
    std::size_t hot = 0;
    for (std::size_t r = 0; r < 5; ++r) hot += c.stored_row(0, h, r).hot;
    REQUIRE(hot == c.hot_count(0, h));
    REQUIRE(hot == 1);
  }
}

TEST_CASE("save/restore of a mixed cache is bit-exact; another band or format is refused",
          "[quantized][mixed]") {
  using S = kvevict::Mixed<Eigen::half, KV<Q8<8>, Q4<8>>>;
  const Geometry g{2, 4, 2, 8};
  using C = KVCache<pol::H2O, S>;
  C a(g, Budget::uniform(12));
  a.set_hot_rows(5);
  kvtest::Rng rng(81);
  const auto step = [](C& c, std::int64_t t, kvtest::Rng& r) { h2o_step(c, t, r); };
  for (std::int64_t t = 0; t < 30; ++t) step(a, t, rng);
  const auto bytes = kvevict::save_bytes(a);
  C b(g, Budget::uniform(12));
  b.set_hot_rows(5);
  kvevict::load_bytes(b, bytes);
  REQUIRE(kvevict::save_bytes(b) == bytes);
  for (int l = 0; l < 2; ++l)
    for (int h = 0; h < 2; ++h) {
      REQUIRE(b.hot_count(l, h) == 5);
      REQUIRE(a.dequantized_keys(l, h) == b.dequantized_keys(l, h));
    }
  kvtest::Rng r1(82), r2(82);
  for (std::int64_t t = 30; t < 50; ++t) {
    step(a, t, r1);
    step(b, t, r2);
  }
  REQUIRE(kvevict::save_bytes(a) == kvevict::save_bytes(b));
  // another hot band, another format, a plain quantized cache: refused, target unchanged
  C other_r(g, Budget::uniform(12));
  other_r.set_hot_rows(4);
  REQUIRE_THROWS_WITH(kvevict::load_bytes(other_r, bytes), Catch::Contains("hot_rows 5, expected 4"));
  REQUIRE(other_r.size(0, 0) == 0);
  KVCache<pol::H2O, kvevict::Mixed<Q8<8>, KV<Q8<8>, Q4<8>>>> other_f(g, Budget::uniform(12));
  other_f.set_hot_rows(5);
  REQUIRE_THROWS_WITH(kvevict::load_bytes(other_f, bytes),
                      Catch::Contains("mixed formats fp16 / fp16 hot, Q8<8> / Q4<8> cold"));
  KVCache<pol::H2O, KV<Q8<8>, Q4<8>>> plain(g, Budget::uniform(12));
  REQUIRE_THROWS_WITH(kvevict::load_bytes(plain, bytes), Catch::Contains("scalar type mixed"));
}
