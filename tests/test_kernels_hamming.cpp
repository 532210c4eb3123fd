// Hamming kernels at every ISA level this CPU supports vs a bit-by-bit reference.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <stdexcept>
#include <vector>

#include "kvevict/kernels/kernels.hpp"

namespace kk = kvevict::kernels;
using kk::Isa;

namespace {

std::vector<Isa> supported_levels() {
  std::vector<Isa> v{Isa::scalar};
  if (kk::isa_supported(Isa::avx2)) v.push_back(Isa::avx2);
  if (kk::isa_supported(Isa::avx512)) v.push_back(Isa::avx512);
  return v;
}

unsigned ref_distance(const std::uint8_t* a, const std::uint8_t* b, int bits) {
  unsigned d = 0;
  for (int j = 0; j < bits; ++j) d += ((a[j / 8] >> (j % 8)) & 1) != ((b[j / 8] >> (j % 8)) & 1);
  return d;
}

std::size_t ref_argmax(const std::uint8_t* q, const std::uint8_t* codes, std::size_t n, int bits,
                       const std::uint64_t* prot) {
  std::size_t best = kk::npos;
  unsigned bd = 0;
  for (std::size_t i = 0; i < n; ++i) {
    if (prot && ((prot[i / 64] >> (i % 64)) & 1)) continue;
    const unsigned d = ref_distance(q, codes + i * (bits / 8), bits);
    if (best == kk::npos || d > bd) best = i, bd = d;
  }
  return best;
}

void distances_at(Isa isa, const std::uint8_t* q, const std::uint8_t* c, std::size_t n, int bits,
                  std::uint16_t* out) {
  switch (isa) {
    case Isa::avx512: return kk::hamming_distances<Isa::avx512>(q, c, n, bits, out);
    case Isa::avx2: return kk::hamming_distances<Isa::avx2>(q, c, n, bits, out);
    default: return kk::hamming_distances<Isa::scalar>(q, c, n, bits, out);
  }
}
std::size_t argmax_at(Isa isa, const std::uint8_t* q, const std::uint8_t* c, std::size_t n,
                      int bits, const std::uint64_t* p) {
  switch (isa) {
    case Isa::avx512: return kk::hamming_argmax<Isa::avx512>(q, c, n, bits, p);
    case Isa::avx2: return kk::hamming_argmax<Isa::avx2>(q, c, n, bits, p);
    default: return kk::hamming_argmax<Isa::scalar>(q, c, n, bits, p);
  }
}
void histogram_at(Isa isa, const std::uint8_t* q, const std::uint8_t* c, std::size_t n, int bits,
                  std::uint16_t* out, std::uint32_t* h) {
  switch (isa) {
    case Isa::avx512: return kk::hamming_histogram<Isa::avx512>(q, c, n, bits, out, h);
    case Isa::avx2: return kk::hamming_histogram<Isa::avx2>(q, c, n, bits, out, h);
    default: return kk::hamming_histogram<Isa::scalar>(q, c, n, bits, out, h);
  }
}

const int kWidths[] = {8, 16, 32, 64, 128, 256};
const std::size_t kSizes[] = {0,  1,  2,  3,   7,   8,   15,  16,   17,   31,   32,  33,
                              63, 64, 65, 127, 128, 129, 511, 1023, 1024, 1025, 2047, 3001};

enum class Fill { random, equal_to_query, complement_of_query, all_same, sparse_bits };

void fill_codes(std::mt19937_64& rng, Fill f, const std::vector<std::uint8_t>& q,
                std::vector<std::uint8_t>& c, std::size_t n, int bytes) {
  std::vector<std::uint8_t> same(bytes);
  for (auto& x : same) x = static_cast<std::uint8_t>(rng());
  for (std::size_t i = 0; i < n; ++i)
    for (int b = 0; b < bytes; ++b) {
      std::uint8_t& v = c[i * bytes + b];
      switch (f) {
        case Fill::random: v = static_cast<std::uint8_t>(rng()); break;
        case Fill::equal_to_query: v = q[b]; break;
        case Fill::complement_of_query: v = static_cast<std::uint8_t>(~q[b]); break;
        case Fill::all_same: v = same[b]; break;
        case Fill::sparse_bits: v = static_cast<std::uint8_t>(q[b] ^ ((rng() % 97 == 0) << (rng() % 8))); break;
      }
    }
}

}  // namespace

TEST_CASE("hamming_distances matches the bit reference at every level", "[kernels][hamming]") {
  std::mt19937_64 rng(12345);
  for (Isa isa : supported_levels())
    for (int bits : kWidths)
      for (std::size_t n : kSizes)
        for (Fill f : {Fill::random, Fill::equal_to_query, Fill::complement_of_query,
                       Fill::all_same, Fill::sparse_bits}) {
          const int bytes = bits / 8;
          std::vector<std::uint8_t> q(bytes), c(n * bytes + 1);
          for (auto& x : q) x = static_cast<std::uint8_t>(rng());
          fill_codes(rng, f, q, c, n, bytes);
          // One sentinel slot past the end catches stores beyond n.
          std::vector<std::uint16_t> out(n + 1, 0xBEEF);
          distances_at(isa, q.data(), c.data(), n, bits, out.data());
          INFO("isa " << kk::isa_name(isa) << " bits " << bits << " n " << n);
          for (std::size_t i = 0; i < n; ++i)
            REQUIRE(out[i] == ref_distance(q.data(), c.data() + i * bytes, bits));
          REQUIRE(out[n] == 0xBEEF);
        }
}

TEST_CASE("uint8 hamming_distances matches the uint16 form at every level", "[kernels][hamming]") {
  std::mt19937_64 rng(321);
  for (Isa isa : supported_levels())
    for (int bits : {8, 16, 32, 64, 128})
      for (std::size_t n : kSizes)
        for (Fill f : {Fill::random, Fill::complement_of_query}) {
          const int bytes = bits / 8;
          std::vector<std::uint8_t> q(bytes), c(n * bytes + 1);
          for (auto& x : q) x = static_cast<std::uint8_t>(rng());
          fill_codes(rng, f, q, c, n, bytes);
          std::vector<std::uint8_t> out(n + 1, 0xAB);
          switch (isa) {
            case Isa::avx512: kk::hamming_distances<Isa::avx512>(q.data(), c.data(), n, bits, out.data()); break;
            case Isa::avx2: kk::hamming_distances<Isa::avx2>(q.data(), c.data(), n, bits, out.data()); break;
            default: kk::hamming_distances<Isa::scalar>(q.data(), c.data(), n, bits, out.data()); break;
          }
          INFO("isa " << kk::isa_name(isa) << " bits " << bits << " n " << n);
          for (std::size_t i = 0; i < n; ++i)
            REQUIRE(out[i] == ref_distance(q.data(), c.data() + i * bytes, bits));
          REQUIRE(out[n] == 0xAB);
        }
  std::uint8_t q[32] = {}, c[32] = {}, o[1];
  REQUIRE_THROWS_WITH(kk::hamming_distances(q, c, 1, 256, o), Catch::Contains("bits = 256"));
}

TEST_CASE("hamming_distances works on unaligned codes and outputs", "[kernels][hamming]") {
  std::mt19937_64 rng(7);
  for (Isa isa : supported_levels())
    for (int bits : kWidths) {
      const int bytes = bits / 8;
      const std::size_t n = 301;
      std::vector<std::uint8_t> q(bytes + 1), c(n * bytes + 3);
      for (auto& x : q) x = static_cast<std::uint8_t>(rng());
      for (auto& x : c) x = static_cast<std::uint8_t>(rng());
      std::vector<std::uint16_t> out(n + 2);
      distances_at(isa, q.data() + 1, c.data() + 3, n, bits, out.data() + 1);
      for (std::size_t i = 0; i < n; ++i)
        REQUIRE(out[i + 1] == ref_distance(q.data() + 1, c.data() + 3 + i * bytes, bits));
    }
}

TEST_CASE("hamming_argmax: farthest unprotected row, lowest index on ties", "[kernels][hamming]") {
  std::mt19937_64 rng(99);
  for (Isa isa : supported_levels())
    for (int bits : kWidths)
      for (std::size_t n : kSizes)
        for (int mode = 0; mode < 6; ++mode) {
          const int bytes = bits / 8;
          std::vector<std::uint8_t> q(bytes), c(n * bytes + 1);
          for (auto& x : q) x = static_cast<std::uint8_t>(rng());
          fill_codes(rng, mode == 3 ? Fill::all_same : Fill::random, q, c, n, bytes);
          std::vector<std::uint64_t> prot((n + 63) / 64 + 1, 0);
          const std::uint64_t* p = prot.data();
          switch (mode) {
            case 0: p = nullptr; break;
            case 1: for (auto& w : prot) w = rng() & rng(); break;    // ~25% protected
            case 2: for (auto& w : prot) w = rng() | rng(); break;    // ~75% protected
            case 3: break;                                            // all equal distances
            case 4: for (auto& w : prot) w = ~std::uint64_t{0}; break;  // all protected
            case 5:  // all but the last row protected
              for (auto& w : prot) w = ~std::uint64_t{0};
              if (n) prot[(n - 1) / 64] &= ~(std::uint64_t{1} << ((n - 1) % 64));
              break;
          }
          INFO("isa " << kk::isa_name(isa) << " bits " << bits << " n " << n << " mode " << mode);
          const std::size_t got = argmax_at(isa, q.data(), c.data(), n, bits, p);
          REQUIRE(got == ref_argmax(q.data(), c.data(), n, bits, p));
          if (mode == 4 || n == 0) REQUIRE(got == kk::npos);
          if (mode == 3 && n > 0) REQUIRE(got == 0);
          if (mode == 5 && n > 0) REQUIRE(got == n - 1);
        }
}

TEST_CASE("hamming_argmax ties across blocks resolve to the lowest index", "[kernels][hamming]") {
  // Two rows at the maximal distance far apart (different internal blocks).
  for (Isa isa : supported_levels()) {
    const std::size_t n = 5000;
    std::vector<std::uint8_t> q(8, 0), c(n * 8, 0);
    for (std::size_t i : {std::size_t{4500}, std::size_t{1500}, std::size_t{3000}})
      std::fill(c.begin() + static_cast<std::ptrdiff_t>(i * 8),
                c.begin() + static_cast<std::ptrdiff_t>(i * 8 + 8), 0xFF);
    REQUIRE(argmax_at(isa, q.data(), c.data(), n, 64, nullptr) == 1500);
    std::vector<std::uint64_t> prot((n + 63) / 64, 0);
    prot[1500 / 64] |= std::uint64_t{1} << (1500 % 64);
    REQUIRE(argmax_at(isa, q.data(), c.data(), n, 64, prot.data()) == 3000);
  }
}

TEST_CASE("hamming_histogram counts every distance and writes distances", "[kernels][hamming]") {
  std::mt19937_64 rng(2024);
  for (Isa isa : supported_levels())
    for (int bits : kWidths)
      for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{33}, std::size_t{1025},
                            std::size_t{4099}}) {
        const int bytes = bits / 8;
        std::vector<std::uint8_t> q(bytes), c(n * bytes + 1);
        for (auto& x : q) x = static_cast<std::uint8_t>(rng());
        for (auto& x : c) x = static_cast<std::uint8_t>(rng());
        std::vector<std::uint16_t> out(n + 1);
        std::vector<std::uint32_t> h(bits + 1, 777), h2(bits + 1, 777), ref(bits + 1, 0);
        histogram_at(isa, q.data(), c.data(), n, bits, out.data(), h.data());
        histogram_at(isa, q.data(), c.data(), n, bits, nullptr, h2.data());
        for (std::size_t i = 0; i < n; ++i) {
          const unsigned d = ref_distance(q.data(), c.data() + i * bytes, bits);
          REQUIRE(out[i] == d);
          ++ref[d];
        }
        REQUIRE(h == ref);
        REQUIRE(h2 == ref);
      }
}

TEST_CASE("untemplated Hamming entry points agree with the pinned scalar level",
          "[kernels][hamming]") {
  std::mt19937_64 rng(5);
  const std::size_t n = 777;
  for (int bits : kWidths) {
    const int bytes = bits / 8;
    std::vector<std::uint8_t> q(bytes), c(n * bytes);
    for (auto& x : q) x = static_cast<std::uint8_t>(rng());
    for (auto& x : c) x = static_cast<std::uint8_t>(rng());
    std::vector<std::uint16_t> a(n), b(n);
    kk::hamming_distances(q.data(), c.data(), n, bits, a.data());
    kk::hamming_distances<Isa::scalar>(q.data(), c.data(), n, bits, b.data());
    REQUIRE(a == b);
    REQUIRE(kk::hamming_argmax(q.data(), c.data(), n, bits, nullptr) ==
            kk::hamming_argmax<Isa::scalar>(q.data(), c.data(), n, bits, nullptr));
    REQUIRE(kk::hamming_distance(q.data(), c.data(), bits) == a[0]);
  }
}

TEST_CASE("Hamming API rejects bad arguments with precise messages", "[kernels][hamming]") {
  std::uint8_t q[32] = {}, c[64] = {};
  std::uint16_t out[4];
  std::uint32_t h[257];
  REQUIRE_THROWS_WITH(kk::hamming_distances(q, c, 1, 12, out), Catch::Contains("bits = 12"));
  REQUIRE_THROWS_AS(kk::hamming_distances(q, c, 1, 0, out), std::invalid_argument);
  REQUIRE_THROWS_AS(kk::hamming_distances(q, c, 1, 512, out), std::invalid_argument);
  REQUIRE_THROWS_WITH(kk::hamming_distances(q, nullptr, 3, 8, out),
                      Catch::Contains("codes") && Catch::Contains("n = 3"));
  REQUIRE_THROWS_WITH(kk::hamming_distances(q, c, 2, 8, static_cast<std::uint16_t*>(nullptr)), Catch::Contains("out"));
  REQUIRE_THROWS_AS(kk::hamming_distances(nullptr, c, 2, 8, out), std::invalid_argument);
  REQUIRE_THROWS_AS(kk::hamming_argmax(q, nullptr, 2, 64, nullptr), std::invalid_argument);
  REQUIRE_THROWS_WITH(kk::hamming_histogram(q, c, 1, 8, out, nullptr),
                      Catch::Contains("histogram"));
  // n == 0 with null arrays is fine.
  REQUIRE_NOTHROW(kk::hamming_distances(q, nullptr, 0, 64, static_cast<std::uint16_t*>(nullptr)));
  REQUIRE(kk::hamming_argmax(q, nullptr, 0, 64, nullptr) == kk::npos);
  REQUIRE_NOTHROW(kk::hamming_histogram(q, nullptr, 0, 8, nullptr, h));
  REQUIRE(h[0] == 0);
}
