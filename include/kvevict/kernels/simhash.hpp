// SimHash (random-hyperplane LSH): sign bits of a seeded Gaussian projection, packed into the
// b-bit codes the Hamming kernels consume.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <random>
#include <stdexcept>
#include <string>

#include "dispatch.hpp"
#include "hamming.hpp"

namespace kvevict::kernels {

namespace detail {

/// Portable N(0,1) stream: std::mt19937_64 is specified bit-exactly by the standard, and the
/// Box-Muller transform below replaces std::normal_distribution, whose algorithm differs
/// between standard libraries. Results are identical wherever std::log/sqrt/cos/sin agree
/// (IEEE sqrt is exact; glibc's log/cos/sin are correctly rounded in double in practice).
class PortableGaussian {
 public:
  explicit PortableGaussian(std::uint64_t seed) : rng_(seed) {}
  double operator()() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    constexpr double kTwoPi = 6.283185307179586476925286766559;
    const double u1 = static_cast<double>((rng_() >> 11) + 1) * 0x1.0p-53;  // (0, 1]
    const double u2 = static_cast<double>(rng_() >> 11) * 0x1.0p-53;        // [0, 1)
    const double r = std::sqrt(-2.0 * std::log(u1));
    spare_ = r * std::sin(kTwoPi * u2);
    has_spare_ = true;
    return r * std::cos(kTwoPi * u2);
  }

 private:
  std::mt19937_64 rng_;
  double spare_ = 0.0;
  bool has_spare_ = false;
};

}  // namespace detail

/// A dim x bits Gaussian projection. hash() maps each dim-float row to a bits-bit code: bit j
/// is set when (x . column j) >= 0 (zero counts as 1; NaN projections give 0), stored in byte
/// j/8, bit j%8 -- the layout hamming_* expect. Columns are drawn in order (column 0 first,
/// rows 0..dim-1 within it), so a wider projection with the same seed and dim extends a
/// narrower one: its first b bits are the narrower code.
class SimHashProjection {
 public:
  /// dim > 0; bits in {8, 16, 32, 64, 128, 256}. Throws std::invalid_argument otherwise.
  SimHashProjection(int dim, int bits, std::uint64_t seed) : dim_(dim), bits_(bits) {
    if (dim <= 0)
      throw std::invalid_argument("kvevict::kernels::SimHashProjection: dim = " +
                                  std::to_string(dim) + " (expected dim > 0)");
    detail::check_bits(bits);
    matrix_.resize(dim, bits);
    detail::PortableGaussian g(seed);
    for (int j = 0; j < bits; ++j)
      for (int i = 0; i < dim; ++i) matrix_(i, j) = static_cast<float>(g());
  }

  /// Codes for n row-major rows (rows[i*dim + c]); writes n * bits/8 bytes to codes_out.
  void hash(const float* rows, std::size_t n, std::uint8_t* codes_out) const {
    detail::require_nonnull(rows, n, "rows");
    detail::require_nonnull(codes_out, n, "codes_out");
    using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
    constexpr std::size_t kChunk = 256;  // bounds the temporary to kChunk x bits floats
    RowMat proj;
    const std::size_t bytes = static_cast<std::size_t>(bits_) / 8;
    for (std::size_t base = 0; base < n; base += kChunk) {
      const auto m = static_cast<Eigen::Index>(std::min(kChunk, n - base));
      Eigen::Map<const RowMat> x(rows + base * static_cast<std::size_t>(dim_), m, dim_);
      proj.noalias() = x * matrix_;
      for (Eigen::Index i = 0; i < m; ++i)
        pack_signs(proj.data() + i * bits_, codes_out + (base + static_cast<std::size_t>(i)) * bytes);
    }
  }

  /// Code of one dim-float vector; writes bits/8 bytes.
  void hash_one(const float* x, std::uint8_t* code_out) const {
    if (x == nullptr || code_out == nullptr)
      throw std::invalid_argument("kvevict::kernels::SimHashProjection::hash_one: null pointer");
    Eigen::Map<const Eigen::RowVectorXf> v(x, dim_);
    // bits <= 256: the projection fits a stack buffer, so hashing allocates nothing.
    Eigen::Matrix<float, 1, Eigen::Dynamic, Eigen::RowMajor, 1, kMaxBits> p;
    p.noalias() = v * matrix_;
    pack_signs(p.data(), code_out);
  }

  int bits() const noexcept { return bits_; }
  int dim() const noexcept { return dim_; }
  /// The dim x bits projection (column j = hyperplane normal of bit j).
  const Eigen::MatrixXf& matrix() const noexcept { return matrix_; }

 private:
  static constexpr int kMaxBits = 256;  // the widest code check_bits accepts
  void pack_signs(const float* p, std::uint8_t* code) const noexcept {
    for (int b = 0; b < bits_ / 8; ++b) {
      unsigned byte = 0;
      for (int t = 0; t < 8; ++t) byte |= static_cast<unsigned>(p[8 * b + t] >= 0.0f) << t;
      code[b] = static_cast<std::uint8_t>(byte);
    }
  }

  int dim_;
  int bits_;
  Eigen::MatrixXf matrix_;
};

}  // namespace kvevict::kernels
