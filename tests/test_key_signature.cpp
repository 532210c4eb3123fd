// RecallDedup's key signature (policies::detail::key_signature) since stop 41: the values
// kernel (kernels::signature_values) equal at every ISA level to its scalar form bit for
// bit; the word-wise FNV-1a equal to byte-serial FNV-1a; the signature equal to the
// definition written out; and the count of keys whose signature differs from the
// pre-stop-41 definition (std::hypot pair lengths, squares summed in index order).
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include <kvevict/kernels/key_signature.hpp>
#include <kvevict/kernels/masked_victim.hpp>
#include <kvevict/policies/common.hpp>

#include "support/key_signature_before41.hpp"
#include "support/recall_support.hpp"

using namespace kvevict;
using kernels::Isa;
using kernels::KeyPairs;
using policies::RopeLayout;
using policies::detail::key_signature;
using policies::detail::llround_exact;
using kvtest::fnv_bytes;
using kvtest::key_signature_before41;

namespace {

// The signature as defined in key_signature's comment, from the scalar values, with
// byte-serial FNV-1a.
std::uint64_t defined_signature(const float* k, std::size_t d, KeyPairs pairs, float step) {
  std::vector<double> v(1 + d);
  const std::size_t n = kernels::signature_values(Isa::scalar, k, d, pairs, step, v.data());
  if (n == 0) return 0;
  std::uint64_t h = 14695981039346656037ull;
  for (std::size_t i = 0; i < n; ++i) h = fnv_bytes(h, static_cast<std::uint64_t>(std::llround(v[i])));
  return h;
}

// A key of d floats: normal coordinates times a per-key scale 10^e (e in [-30, 30]), with,
// by `kind`, per-coordinate scales too, exact zeros, subnormals or repeated coordinates.
std::vector<float> random_key(std::mt19937_64& rng, std::size_t d, int kind) {
  std::normal_distribution<float> nd;
  std::uniform_int_distribution<int> ex(-30, 30), coin(0, 3);
  const float scale = std::pow(10.0f, static_cast<float>(ex(rng)));
  std::vector<float> k(d);
  for (std::size_t i = 0; i < d; ++i) {
    float x = nd(rng) * scale;
    if (kind == 1) x *= std::pow(10.0f, static_cast<float>(ex(rng) / 3));
    if (kind == 2 && coin(rng) == 0) x = 0.0f;
    if (kind == 3 && coin(rng) == 0) x = std::numeric_limits<float>::denorm_min() * static_cast<float>(1 + coin(rng));
    if (kind == 4 && i > 0 && coin(rng) == 0) x = k[i - 1];
    k[i] = x;
  }
  return k;
}

std::vector<Isa> levels() {
  std::vector<Isa> out{Isa::scalar};
  for (Isa i : {Isa::avx2, Isa::avx512})
    if (kernels::isa_supported(i)) out.push_back(i);
  return out;
}

}  // namespace

TEST_CASE("signature_values: every level equals the scalar form bit for bit", "[recall][kernels]") {
  std::mt19937_64 rng(41);
  std::size_t compared = 0;
  for (std::size_t d : {2, 4, 6, 8, 10, 14, 16, 30, 62, 64, 66, 126, 128, 130, 256}) {
    for (KeyPairs pairs : {KeyPairs::none, KeyPairs::interleaved, KeyPairs::halves}) {
      for (int kind = 0; kind < 5; ++kind) {
        for (int rep = 0; rep < 40; ++rep) {
          const auto k = random_key(rng, d, kind);
          for (float step : {0.1f, 0.037f, 1.0f}) {
            std::vector<double> ref(1 + d, -1.0), got(1 + d, -1.0);
            const std::size_t n = kernels::signature_values(Isa::scalar, k.data(), d, pairs, step, ref.data());
            for (Isa isa : levels()) {
              std::fill(got.begin(), got.end(), -1.0);
              INFO("d " << d << " pairs " << static_cast<int>(pairs) << " kind " << kind << " isa "
                        << kernels::isa_name(isa));
              REQUIRE(kernels::signature_values(isa, k.data(), d, pairs, step, got.data()) == n);
              CHECK(std::memcmp(ref.data(), got.data(), n * sizeof(double)) == 0);
              ++compared;
            }
          }
        }
      }
    }
  }
  CHECK(compared > 10000);
}

TEST_CASE("signature_values: a zero or non-finite key gives no values", "[recall][kernels]") {
  for (Isa isa : levels()) {
    std::vector<double> out(9);
    const std::vector<float> zero(8, 0.0f);
    CHECK(kernels::signature_values(isa, zero.data(), 8, KeyPairs::interleaved, 0.1f, out.data()) == 0);
    std::vector<float> nan(8, 1.0f);
    nan[3] = std::numeric_limits<float>::quiet_NaN();
    CHECK(kernels::signature_values(isa, nan.data(), 8, KeyPairs::halves, 0.1f, out.data()) == 0);
    CHECK_THROWS_AS(kernels::signature_values(isa, zero.data(), 7, KeyPairs::interleaved, 0.1f, out.data()),
                    std::invalid_argument);
  }
  std::vector<double> out(1);
  CHECK(kernels::signature_values(nullptr, 0, KeyPairs::none, 0.1f, out.data()) == 0);
  CHECK_THROWS_AS(kernels::signature_values(nullptr, 4, KeyPairs::none, 0.1f, out.data()),
                  std::invalid_argument);
}

TEST_CASE("fnv1a_word is byte-serial FNV-1a", "[recall]") {
  using policies::detail::fnv1a_word;
  std::mt19937_64 rng(7);
  std::vector<std::uint64_t> words{0, 1, 0xff, 0x100, 0xffff, 0x10000, ~0ull, 1ull << 63,
                                   static_cast<std::uint64_t>(-1ll), static_cast<std::uint64_t>(-2ll),
                                   static_cast<std::uint64_t>(-256ll), 0x00ff00ff00ff00ffull};
  for (int i = 0; i < 64; ++i) words.push_back(1ull << i);
  for (int i = 0; i < 20000; ++i) {
    const std::uint64_t u = rng();
    words.push_back(u);
    words.push_back(u >> (u % 64));
    words.push_back(static_cast<std::uint64_t>(static_cast<std::int64_t>(u % 41) - 20));
  }
  std::uint64_t h = 14695981039346656037ull, g = h;
  for (std::uint64_t u : words) {
    INFO("u = " << u);
    REQUIRE(fnv1a_word(h, u) == fnv_bytes(h, u));
    h = fnv1a_word(h, u);
    g = fnv_bytes(g, u);
  }
  CHECK(h == g);
}

TEST_CASE("key_signature is the defined signature", "[recall]") {
  std::mt19937_64 rng(5);
  for (std::size_t d : {2, 8, 64, 128, 300, 600}) {
    for (RopeLayout rope : {RopeLayout::none, RopeLayout::interleaved, RopeLayout::halves}) {
      const KeyPairs pairs = policies::detail::key_pairs(rope);
      for (int kind = 0; kind < 5; ++kind) {
        for (int rep = 0; rep < 20; ++rep) {
          const auto k = random_key(rng, d, kind);
          INFO("d " << d << " rope " << static_cast<int>(rope) << " kind " << kind);
          CHECK(key_signature(k.data(), d, rope, 0.1f) == defined_signature(k.data(), d, pairs, 0.1f));
        }
      }
    }
  }
}

// The change of definition at stop 41: how many signatures differ from the old ones over
// random keys of many magnitudes (the count is reported in docs/policies/decayed_attention.md;
// the real model's keys are counted by bench/signature_change_count).
TEST_CASE("key_signature: random keys keep their pre-stop-41 signatures", "[recall]") {
  std::mt19937_64 rng(2026);
  std::size_t keys = 0, differ = 0;
  for (std::size_t d : {8, 64, 128}) {
    for (RopeLayout rope : {RopeLayout::none, RopeLayout::interleaved, RopeLayout::halves}) {
      for (int kind = 0; kind < 5; ++kind) {
        for (int rep = 0; rep < 2000; ++rep) {
          const auto k = random_key(rng, d, kind);
          for (float step : {0.1f, 0.05f, 0.3f}) {
            ++keys;
            differ += key_signature(k.data(), d, rope, step) != key_signature_before41(k.data(), d, rope, step);
          }
        }
      }
    }
  }
  WARN("keys " << keys << ", signatures changed " << differ);
  CHECK(keys == 270000);
  CHECK(differ == 0);
}

TEST_CASE("find_u32: every level finds what the scalar loop finds", "[recall][kernels]") {
  std::mt19937_64 rng(9);
  for (std::size_t n : {0, 1, 7, 15, 16, 17, 31, 64, 100, 1000}) {
    std::vector<std::uint32_t> a(n);
    for (auto& x : a) x = static_cast<std::uint32_t>(rng() % 6);
    for (std::uint32_t value : {0u, 3u, 5u, 9u, 0xFFFFFFFFu}) {
      for (std::size_t from : {std::size_t{0}, std::size_t{1}, n / 2, n}) {
        const std::size_t want = kernels::find_u32(Isa::scalar, a.data(), n, value, from);
        if (want != kernels::npos) CHECK((a[want] == value && want >= from));
        for (Isa isa : levels()) {
          INFO("n " << n << " value " << value << " from " << from << " isa " << kernels::isa_name(isa));
          CHECK(kernels::find_u32(isa, a.data(), n, value, from) == want);
        }
      }
    }
  }
}

// lowest_masked_seq4 (DecayedAttention's one-victim path under RecallDedup): the rows
// lowest_masked_seq gives one after another, at every level; ties, -0.0, NaN, protection.
TEST_CASE("lowest_masked_seq4: the first 4 rows of repeated lowest_masked_seq, every level", "[recall][kernels]") {
  std::mt19937_64 rng(12);
  for (std::size_t n : {0, 1, 3, 4, 5, 8, 9, 31, 64, 65, 200, 1000}) {
    for (int kind = 0; kind < 5; ++kind) {
      for (int rep = 0; rep < 8; ++rep) {
        std::vector<float> s(n);
        std::vector<std::uint64_t> seqs(n);
        std::vector<std::uint64_t> bits((n + 63) / 64 + 1, 0);
        for (std::size_t i = 0; i < n; ++i) {
          s[i] = kind == 1 ? static_cast<float>(rng() % 3)           // many ties
                 : kind == 2 ? (rng() % 2 ? 0.0f : -0.0f)           // signed zeros
                             : static_cast<float>(rng() % 100000) / 7.0f;
          if (kind == 3 && rng() % 4 == 0) s[i] = std::numeric_limits<float>::quiet_NaN();
          seqs[i] = kind == 4 ? rng() % 3 : rng() % 1000000;  // kind 4: equal seqs too
          if (rng() % 3 == 0) bits[i >> 6] |= std::uint64_t{1} << (i & 63);
        }
        // The reference: lowest_masked_seq, then protect the row found, 4 times.
        std::vector<std::size_t> want;
        auto prot = bits;
        for (int i = 0; i < 4; ++i) {
          const std::size_t r = kernels::lowest_masked_seq(Isa::scalar, s.data(), seqs.data(), n, prot.data());
          if (r == kernels::npos) break;
          want.push_back(r);
          prot[r >> 6] |= std::uint64_t{1} << (r & 63);
        }
        for (Isa isa : levels()) {
          std::size_t got[4] = {9, 9, 9, 9};
          INFO("n " << n << " kind " << kind << " isa " << kernels::isa_name(isa));
          const std::size_t c = kernels::lowest_masked_seq4(isa, s.data(), seqs.data(), n, bits.data(), got);
          REQUIRE(c == want.size());
          for (std::size_t i = 0; i < c; ++i) CHECK(got[i] == want[i]);
        }
      }
    }
  }
}

TEST_CASE("masked_costs: the rate or the protected value of every row, every level", "[pool][kernels]") {
  std::mt19937_64 rng(43);
  constexpr float inf = std::numeric_limits<float>::infinity();
  constexpr float top = std::numeric_limits<float>::max();
  int protected_rows = 0, open_rows = 0;
  for (std::size_t n : {0, 1, 7, 8, 9, 15, 16, 17, 63, 64, 65, 100, 128, 200, 1000, 1025}) {
    for (int kind = 0; kind < 4; ++kind) {
      for (int rep = 0; rep < 6; ++rep) {
        std::vector<float> s(n);
        // Bits past n set (as protect leaves them) and garbage words beyond the last.
        std::vector<std::uint64_t> bits((n + 63) / 64 + 1, ~std::uint64_t{0}), outside(bits.size(), ~std::uint64_t{0});
        for (std::size_t i = 0; i < n; ++i) {
          s[i] = static_cast<float>(rng() % 100000) / 7.0f;
          if (kind == 1 && rng() % 5 == 0) s[i] = std::numeric_limits<float>::quiet_NaN();
          if (kind == 2 && rng() % 5 == 0) s[i] = rng() % 2 ? inf : top;
          const bool b = kind == 3 ? rng() % 64 == 0 : rng() % 2 == 0;
          const bool o = rng() % 2 == 0;
          if (!b) bits[i >> 6] &= ~(std::uint64_t{1} << (i & 63));
          if (!o) outside[i >> 6] &= ~(std::uint64_t{1} << (i & 63));
        }
        const float scale = rng() % 2 ? 0.0029296875f : static_cast<float>(rng() % 1000) / 977.0f;
        // The rule written out: +inf in both masks, FLT_MAX in bits alone, else scale * s.
        std::vector<float> want(n);
        for (std::size_t i = 0; i < n; ++i) {
          const bool b = (bits[i >> 6] >> (i & 63)) & 1, o = (outside[i >> 6] >> (i & 63)) & 1;
          want[i] = b ? (o ? inf : top) : scale * s[i];
          (b ? protected_rows : open_rows) += 1;
        }
        for (Isa isa : levels()) {
          INFO("n " << n << " kind " << kind << " isa " << kernels::isa_name(isa));
          std::vector<float> got(n + 1, -5.0f);  // the row past n must stay untouched
          kernels::masked_costs(isa, s.data(), n, scale, bits.data(), outside.data(), got.data());
          REQUIRE(got[n] == -5.0f);
          for (std::size_t i = 0; i < n; ++i)
            REQUIRE(std::memcmp(&got[i], &want[i], sizeof(float)) == 0);  // bit for bit (NaN too)
        }
      }
    }
  }
  REQUIRE(protected_rows > 1000);
  REQUIRE(open_rows > 1000);
}
