// SimHashProjection: determinism, Gaussian entries, sign packing, agreement with Hamming.
// Eigen's allocation guard, made to throw even in Release, proves hash_one allocates nothing.
#include <stdexcept>
#define EIGEN_RUNTIME_NO_MALLOC
#define eigen_assert(x)                                    \
  do {                                                     \
    if (!(x)) throw std::logic_error("eigen_assert: " #x); \
  } while (false)
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <random>
#include <stdexcept>
#include <vector>

#include "kvevict/kernels/kernels.hpp"

namespace kk = kvevict::kernels;

TEST_CASE("SimHash matrix is deterministic, Gaussian and prefix-stable", "[kernels][simhash]") {
  const kk::SimHashProjection a(96, 256, 1234), b(96, 256, 1234), c(96, 256, 1235);
  REQUIRE(a.dim() == 96);
  REQUIRE(a.bits() == 256);
  REQUIRE(a.matrix().rows() == 96);
  REQUIRE(a.matrix().cols() == 256);
  REQUIRE(a.matrix() == b.matrix());
  REQUIRE(a.matrix() != c.matrix());
  const double mean = a.matrix().cast<double>().mean();
  const double var = (a.matrix().cast<double>().array() - mean).square().mean();
  REQUIRE(std::abs(mean) < 0.05);
  REQUIRE(std::abs(var - 1.0) < 0.05);
  // A narrower projection with the same seed is the leading columns of a wider one.
  const kk::SimHashProjection narrow(96, 64, 1234);
  REQUIRE(narrow.matrix() == a.matrix().leftCols(64));
  // First entry from the documented recipe: mt19937_64 + Box-Muller (cos branch).
  std::mt19937_64 rng(1234);
  const double u1 = static_cast<double>((rng() >> 11) + 1) * 0x1.0p-53;
  const double u2 = static_cast<double>(rng() >> 11) * 0x1.0p-53;
  const double z = std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  REQUIRE(a.matrix()(0, 0) == static_cast<float>(z));
}

TEST_CASE("SimHash codes pack the projection signs", "[kernels][simhash]") {
  std::mt19937_64 rng(3);
  std::normal_distribution<float> g;
  for (int bits : {8, 16, 32, 64, 128, 256}) {
    const int dim = 37;
    const std::size_t n = 300;  // crosses the internal chunk boundary
    const kk::SimHashProjection p(dim, bits, 99);
    std::vector<float> x(n * dim);
    for (auto& v : x) v = g(rng);
    std::vector<std::uint8_t> codes(n * bits / 8), one(bits / 8);
    p.hash(x.data(), n, codes.data());
    for (std::size_t i = 0; i < n; ++i) {
      p.hash_one(x.data() + i * dim, one.data());
      for (int j = 0; j < bits; ++j) {
        double proj = 0;
        for (int c = 0; c < dim; ++c) proj += double(x[i * dim + c]) * p.matrix()(c, j);
        const int bit = (codes[i * bits / 8 + j / 8] >> (j % 8)) & 1;
        if (std::abs(proj) > 1e-3) REQUIRE(bit == (proj >= 0 ? 1 : 0));
        REQUIRE(bit == ((one[j / 8] >> (j % 8)) & 1));
      }
    }
  }
}

TEST_CASE("SimHash edge cases and errors", "[kernels][simhash]") {
  const kk::SimHashProjection p(8, 16, 1);
  std::vector<float> zero(8, 0.0f);
  std::uint8_t code[2] = {0, 0};
  p.hash_one(zero.data(), code);  // projection 0 counts as set
  REQUIRE(code[0] == 0xFF);
  REQUIRE(code[1] == 0xFF);
  std::vector<float> x(8, 1.0f), neg(8, -1.0f);
  std::uint8_t cx[2], cn[2];
  p.hash_one(x.data(), cx);
  p.hash_one(neg.data(), cn);
  REQUIRE(kk::hamming_distance(cx, cn, 16) == 16);  // antipodal vectors: every bit flips
  REQUIRE_NOTHROW(p.hash(nullptr, 0, nullptr));
  REQUIRE_THROWS_WITH(kk::SimHashProjection(0, 64, 1), Catch::Contains("dim = 0"));
  REQUIRE_THROWS_WITH(kk::SimHashProjection(8, 24, 1), Catch::Contains("bits = 24"));
  REQUIRE_THROWS_AS(p.hash(nullptr, 2, code), std::invalid_argument);
}

TEST_CASE("SimHash hash_one allocates nothing", "[kernels][simhash]") {
  std::mt19937_64 rng(5);
  std::normal_distribution<float> g;
  for (int bits : {8, 64, 256}) {
    const kk::SimHashProjection p(128, bits, 7);
    std::vector<float> x(128);
    for (auto& v : x) v = g(rng);
    std::vector<std::uint8_t> code(bits / 8);
    Eigen::internal::set_is_malloc_allowed(false);
    bool threw = false;
    try {
      p.hash_one(x.data(), code.data());
    } catch (const std::logic_error&) {
      threw = true;
    }
    Eigen::internal::set_is_malloc_allowed(true);
    REQUIRE_FALSE(threw);
    // The guard is live: a heap-allocated projection does trip it.
    Eigen::internal::set_is_malloc_allowed(false);
    bool guarded = false;
    try {
      const Eigen::RowVectorXf heap =
          Eigen::Map<const Eigen::RowVectorXf>(x.data(), 128) * p.matrix();
      (void)heap;
    } catch (const std::logic_error&) {
      guarded = true;
    }
    Eigen::internal::set_is_malloc_allowed(true);
    REQUIRE(guarded);
  }
}

namespace {
// Removes x's component along column j: that projection is then ~0 (rounding noise).
void zero_projection(const kk::SimHashProjection& p, std::vector<float>& x, int j) {
  double dot = 0, nn = 0;
  for (int i = 0; i < p.dim(); ++i) {
    dot += double(x[static_cast<std::size_t>(i)]) * p.matrix()(i, j);
    nn += double(p.matrix()(i, j)) * p.matrix()(i, j);
  }
  for (int i = 0; i < p.dim(); ++i)
    x[static_cast<std::size_t>(i)] -= static_cast<float>(dot / nn * p.matrix()(i, j));
}
}  // namespace

// hash_one's dispatched FMA projection must give the reference product's code bit for bit,
// including vectors whose projections sit at the rounding limit (those take the fallback).
TEST_CASE("SimHash FMA path agrees with the reference product", "[kernels][simhash]") {
  std::mt19937_64 rng(17);
  std::normal_distribution<float> g;
  // At AVX-512, 16 bits run the zmm blocked kernel at every dim (masked tail block at 8, 12,
  // 37, 136) and bits 32/64 the zmm row-major one; otherwise (or at AVX2: KVEVICT_ISA=avx2) dim % 8 == 0 with bits <= 32
  // runs the column-major kernel (8 columns per pass, hadd tree), the rest the row-major one.
  for (int dim : {8, 12, 37, 64, 128, 136}) {
    for (int bits : {8, 16, 32, 64, 128, 256}) {
      const kk::SimHashProjection p(dim, bits, 5 + static_cast<std::uint64_t>(dim));
      const std::size_t w = static_cast<std::size_t>(bits) / 8;
      std::vector<float> x(static_cast<std::size_t>(dim));
      std::vector<std::uint8_t> fast(w), ref(w), batch(4 * w), batch_ref(4 * w);
      for (int trial = 0; trial < 300; ++trial) {
        for (auto& v : x) v = g(rng);
        if (trial % 3 == 1) {
          zero_projection(p, x, trial % bits);
        } else if (trial % 3 == 2) {
          for (auto& v : x) v *= 1e-25f;  // tiny: below the FMA path's range
        }
        p.hash_one(x.data(), fast.data());
        p.reference_one(x.data(), ref.data());
        REQUIRE(fast == ref);
      }
      // A small batch (the FMA path per row) equals hash_one row by row.
      std::vector<float> rows(4 * static_cast<std::size_t>(dim));
      for (auto& v : rows) v = g(rng);
      p.hash(rows.data(), 4, batch.data());
      for (std::size_t r = 0; r < 4; ++r) {
        p.reference_one(rows.data() + r * static_cast<std::size_t>(dim), batch_ref.data() + r * w);
      }
      REQUIRE(batch == batch_ref);
    }
  }
}

// hash_two (at AVX-512 with 32 or 64 bits: one weight pass for two vectors, simhash_fma512
// with NV = 2) gives hash_one's code for each vector, bit for bit: dims with and without a
// 16-dim tail, the partial-sum tail (dims not a multiple of the kernel's P), either vector
// near a zero projection or tiny (the whole pair then takes the fallback), and the two
// vectors in either order.
TEST_CASE("SimHash hash_two equals hash_one and the reference for each vector",
          "[kernels][simhash]") {
  std::mt19937_64 rng(29);
  std::normal_distribution<float> g;
  for (int dim : {1, 3, 7, 8, 12, 16, 17, 37, 64, 128, 131, 136}) {
    for (int bits : {8, 16, 32, 64, 128, 256}) {
      const kk::SimHashProjection p(dim, bits, 41 + static_cast<std::uint64_t>(dim));
      const std::size_t w = static_cast<std::size_t>(bits) / 8;
      const auto d = static_cast<std::size_t>(dim);
      std::vector<float> x0(d), x1(d);
      std::vector<std::uint8_t> c0(w), c1(w), r0(w), r1(w), one(w);
      for (int trial = 0; trial < 200; ++trial) {
        for (auto& v : x0) v = g(rng);
        for (auto& v : x1) v = g(rng);
        auto& edge = trial % 2 ? x1 : x0;  // which vector gets the edge case
        if (trial % 5 == 1 && dim > 1) {
          zero_projection(p, edge, trial % bits);
        } else if (trial % 5 == 2) {
          for (auto& v : edge) v *= 1e-25f;  // tiny: below the FMA path's range
        }
        p.hash_two(x0.data(), x1.data(), c0.data(), c1.data());
        p.reference_one(x0.data(), r0.data());
        p.reference_one(x1.data(), r1.data());
        INFO("dim " << dim << " bits " << bits << " trial " << trial);
        REQUIRE(c0 == r0);
        REQUIRE(c1 == r1);
        p.hash_one(x1.data(), one.data());
        REQUIRE(one == c1);
        p.hash_two(x1.data(), x0.data(), c1.data(), c0.data());  // swapped
        REQUIRE(c0 == r0);
        REQUIRE(c1 == r1);
      }
    }
  }
  const kk::SimHashProjection p(8, 64, 3);
  std::vector<float> x(8, 1.0f);
  std::vector<std::uint8_t> c(8);
  REQUIRE_THROWS_AS(p.hash_two(x.data(), nullptr, c.data(), c.data()), std::invalid_argument);
  REQUIRE_THROWS_AS(p.hash_two(x.data(), x.data(), c.data(), nullptr), std::invalid_argument);
}
