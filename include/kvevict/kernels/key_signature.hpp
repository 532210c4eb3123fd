// The values DecayedAttention's RecallDedup rounds and hashes into a key's signature
// (policies::detail::key_signature), from one key of d floats:
//
//   sq      = the sum of the squares, in double, in this order: lane j in [0, 8) sums
//             double(k[i]) * double(k[i]) over i = j mod 8 in increasing i, then
//             sq = ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))   (IEEE double adds);
//   norm    = sqrt(sq) (IEEE, correctly rounded);
//   out[0]  = std::log(norm) / double(step);
//   pairs:  out[1 + j] = (sqrt(double(a)^2 + double(b)^2) / norm) / double(step) for the
//           j-th RoPE pair (a, b) = (k[2j], k[2j+1]) (interleaved) or (k[j], k[j + d/2])
//           (halves), j < d/2: each square exact in double, one rounding for the sum, one
//           for the root, two IEEE divisions;
//   none:   out[1 + i] = (double(k[i]) / norm) / double(step), i < d.
//
// Every operation but the one std::log is an IEEE 754 basic operation on doubles, so the
// values are the same at every level and on every platform with IEEE doubles (the log is
// libm's, as before). Returns how many values were written: 1 + d/2 (pairs), 1 + d (none),
// or 0 when sq is not > 0 (a zero key, or NaN/inf coordinates) and nothing is written.
//
// (Until stop 41 the pair lengths were std::hypot's, whose last bit differs between libms
// and from the IEEE root of the sum in a few percent of pairs, and the squares were summed
// in index order; docs/policies/decayed_attention.md, "recall() step at 1K rows, stop 41",
// counts the signatures that changed: none on the keys tried.)
//
// Each level has the scalar form's results bit for bit (tests/test_key_signature.cpp).
#pragma once

#include <cstddef>
#include <cstdint>

#include "dispatch.hpp"

namespace kvevict::kernels {

/// How a key's coordinates pair up under RoPE (policies::RopeLayout's values).
enum class KeyPairs { none, interleaved, halves };

/// The signature values of key k (d floats; d even unless pairs is none) into out (1 + d/2
/// or 1 + d doubles); see the file comment.
KVEVICT_KERNEL_FN std::size_t signature_values(Isa isa, const float* k, std::size_t d,
                                               KeyPairs pairs, float step, double* out);
KVEVICT_KERNEL_FN std::size_t signature_values(const float* k, std::size_t d, KeyPairs pairs,
                                               float step, double* out);

/// The first index i in [from, n) with a[i] == value, npos when there is none (RecallDedup:
/// the next row with a given signature number).
KVEVICT_KERNEL_FN std::size_t find_u32(Isa isa, const std::uint32_t* a, std::size_t n,
                                       std::uint32_t value, std::size_t from);
KVEVICT_KERNEL_FN std::size_t find_u32(const std::uint32_t* a, std::size_t n,
                                       std::uint32_t value, std::size_t from);

}  // namespace kvevict::kernels

#if !KVEVICT_KERNELS_DECLARE_ONLY
#include <cmath>
#include <stdexcept>
#include <string>
#if KVEVICT_X86
#include <immintrin.h>
#endif

namespace kvevict::kernels::detail {

/// The lane sums' combination (the file comment's order).
inline double combine_lanes8(const double* l) noexcept {
  return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

namespace scalar {

/// Squares of k[from, d) added to lane i mod 8.
inline void square_lanes(const float* k, std::size_t from, std::size_t d, double* lane) noexcept {
  for (std::size_t i = from; i < d; ++i) {
    const double x = static_cast<double>(k[i]);
    lane[i % 8] += x * x;
  }
}
/// The pair values out[1 + j] for j in [from, pairs).
inline void pair_values(const float* k, std::size_t d, KeyPairs pairs, std::size_t from,
                        double norm, double step, double* out) noexcept {
  const std::size_t p = d / 2;
  for (std::size_t j = from; j < p; ++j) {
    const std::size_t a = pairs == KeyPairs::halves ? j : 2 * j;
    const std::size_t b = pairs == KeyPairs::halves ? j + p : 2 * j + 1;
    const double x = static_cast<double>(k[a]), y = static_cast<double>(k[b]);
    out[1 + j] = (std::sqrt(x * x + y * y) / norm) / step;
  }
}
inline void coordinate_values(const float* k, std::size_t from, std::size_t d, double norm,
                              double step, double* out) noexcept {
  for (std::size_t i = from; i < d; ++i) out[1 + i] = (static_cast<double>(k[i]) / norm) / step;
}
inline std::size_t signature_values(const float* k, std::size_t d, KeyPairs pairs, float step,
                                    double* out) noexcept {
  double lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  square_lanes(k, 0, d, lane);
  const double sq = combine_lanes8(lane);
  if (!(sq > 0.0)) return 0;
  const double norm = std::sqrt(sq), s = static_cast<double>(step);
  out[0] = std::log(norm) / s;
  if (pairs == KeyPairs::none) {
    coordinate_values(k, 0, d, norm, s, out);
    return 1 + d;
  }
  pair_values(k, d, pairs, 0, norm, s, out);
  return 1 + d / 2;
}

inline std::size_t find_u32(const std::uint32_t* a, std::size_t n, std::uint32_t value,
                            std::size_t from) noexcept {
  for (std::size_t i = from; i < n; ++i)
    if (a[i] == value) return i;
  return npos;
}

}  // namespace scalar

#if KVEVICT_X86
KVEVICT_SUPPRESS_INTRIN_WARNINGS_BEGIN
namespace avx2 {

/// The scalar form, 4 doubles per operation: the same IEEE operations on the same operands
/// (a product of two floats is exact in double, so no rounding differs), tails by the scalar
/// code; the lanes of the sum of squares are the scalar form's lanes.
KVEVICT_TARGET_AVX2 inline std::size_t signature_values(const float* k, std::size_t d,
                                                        KeyPairs pairs, float step,
                                                        double* out) noexcept {
  __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();  // lanes 0-3, 4-7
  const std::size_t full = d - d % 8;
  for (std::size_t i = 0; i < full; i += 8) {
    const __m256 x = _mm256_loadu_ps(k + i);
    const __m256d a = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
    const __m256d b = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
    lo = _mm256_add_pd(lo, _mm256_mul_pd(a, a));
    hi = _mm256_add_pd(hi, _mm256_mul_pd(b, b));
  }
  alignas(32) double lane[8];
  _mm256_store_pd(lane, lo);
  _mm256_store_pd(lane + 4, hi);
  scalar::square_lanes(k, full, d, lane);
  const double sq = combine_lanes8(lane);
  if (!(sq > 0.0)) return 0;
  const double norm = std::sqrt(sq), s = static_cast<double>(step);
  out[0] = std::log(norm) / s;
  const __m256d vn = _mm256_set1_pd(norm), vs = _mm256_set1_pd(s);
  if (pairs == KeyPairs::none) {
    std::size_t i = 0;
    for (; i + 4 <= d; i += 4) {
      const __m256d x = _mm256_cvtps_pd(_mm_loadu_ps(k + i));
      _mm256_storeu_pd(out + 1 + i, _mm256_div_pd(_mm256_div_pd(x, vn), vs));
    }
    scalar::coordinate_values(k, i, d, norm, s, out);
    return 1 + d;
  }
  const std::size_t p = d / 2;
  std::size_t j = 0;
  if (pairs == KeyPairs::halves) {
    for (; j + 4 <= p; j += 4) {
      const __m256d a = _mm256_cvtps_pd(_mm_loadu_ps(k + j));
      const __m256d b = _mm256_cvtps_pd(_mm_loadu_ps(k + p + j));
      const __m256d len = _mm256_sqrt_pd(_mm256_add_pd(_mm256_mul_pd(a, a), _mm256_mul_pd(b, b)));
      _mm256_storeu_pd(out + 1 + j, _mm256_div_pd(_mm256_div_pd(len, vn), vs));
    }
  } else {
    for (; j + 4 <= p; j += 4) {
      const __m256 x = _mm256_loadu_ps(k + 2 * j);  // a0 b0 a1 b1 a2 b2 a3 b3
      const __m256d u = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
      const __m256d w = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
      // hadd: (a0²+b0², a2²+b2², a1²+b1², a3²+b3²); each sum is x*x + y*y of one pair
      const __m256d h = _mm256_hadd_pd(_mm256_mul_pd(u, u), _mm256_mul_pd(w, w));
      const __m256d len = _mm256_sqrt_pd(_mm256_permute4x64_pd(h, 0xD8));  // pairs 0 1 2 3
      _mm256_storeu_pd(out + 1 + j, _mm256_div_pd(_mm256_div_pd(len, vn), vs));
    }
  }
  scalar::pair_values(k, d, pairs, j, norm, s, out);
  return 1 + p;
}

/// find_u32 16 entries a step (two 8-lane compares), the rest by the scalar loop.
KVEVICT_TARGET_AVX2 inline std::size_t find_u32(const std::uint32_t* a, std::size_t n,
                                                std::uint32_t value, std::size_t from) noexcept {
  const __m256i v = _mm256_set1_epi32(static_cast<int>(value));
  std::size_t i = from;
  for (; i + 16 <= n; i += 16) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + i));
    const __m256i y = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + i + 8));
    const auto m = static_cast<std::uint32_t>(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(x, v)))) |
                   (static_cast<std::uint32_t>(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(y, v)))) << 8);
    if (m != 0) return i + static_cast<std::size_t>(__builtin_ctz(m));
  }
  return scalar::find_u32(a, n, value, i);
}

}  // namespace avx2
KVEVICT_SUPPRESS_INTRIN_WARNINGS_END
#endif  // KVEVICT_X86

/// signature_values at `isa` (AVX-512 runs the AVX2 form: a 128-dim key is 16 vectors of
/// 8 doubles, too short for the wider form to pay).
inline std::size_t signature_values_at(Isa isa, const float* k, std::size_t d, KeyPairs pairs,
                                       float step, double* out) {
  if (d > 0) require_nonnull(k, d, "key");
  if (pairs != KeyPairs::none && d % 2 != 0)
    throw std::invalid_argument("kvevict::kernels::signature_values: d = " + std::to_string(d) +
                                " with RoPE pairs (expected an even d)");
#if KVEVICT_X86
  if (isa == Isa::avx2 || isa == Isa::avx512) return avx2::signature_values(k, d, pairs, step, out);
#endif
  (void)isa;
  return scalar::signature_values(k, d, pairs, step, out);
}

inline std::size_t find_u32_at(Isa isa, const std::uint32_t* a, std::size_t n,
                               std::uint32_t value, std::size_t from) {
  if (from < n) require_nonnull(a, n, "a");
#if KVEVICT_X86
  if (isa == Isa::avx2 || isa == Isa::avx512) return avx2::find_u32(a, n, value, from);
#endif
  (void)isa;
  return scalar::find_u32(a, n, value, from);
}

}  // namespace kvevict::kernels::detail

namespace kvevict::kernels {

KVEVICT_KERNEL_FN std::size_t find_u32(Isa isa, const std::uint32_t* a, std::size_t n,
                                       std::uint32_t value, std::size_t from) {
  detail::require_isa(isa);
  return detail::find_u32_at(isa, a, n, value, from);
}
KVEVICT_KERNEL_FN std::size_t find_u32(const std::uint32_t* a, std::size_t n,
                                       std::uint32_t value, std::size_t from) {
  return detail::find_u32_at(active_isa(), a, n, value, from);
}

KVEVICT_KERNEL_FN std::size_t signature_values(Isa isa, const float* k, std::size_t d,
                                               KeyPairs pairs, float step, double* out) {
  detail::require_isa(isa);
  return detail::signature_values_at(isa, k, d, pairs, step, out);
}
KVEVICT_KERNEL_FN std::size_t signature_values(const float* k, std::size_t d, KeyPairs pairs,
                                               float step, double* out) {
  return detail::signature_values_at(active_isa(), k, d, pairs, step, out);
}

}  // namespace kvevict::kernels

#endif  // !KVEVICT_KERNELS_DECLARE_ONLY
