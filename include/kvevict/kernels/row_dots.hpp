// Row kernels of KeyDiff's bounded candidate search (policies/keydiff.hpp): the dot product
// of every stored key with one anchor (its rebase, n x d multiply-adds), and the gather of
// the open rows at or below a threshold (its candidates). One body per level (scalar, AVX2,
// AVX-512); the untemplated entry points dispatch on active_isa() once per call. Also
// ExpectedAttention's arrival (arrival_dots: one row's squared norm and G dot products in
// double, scalar and AVX2 bodies with the same values).
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>

#include "dispatch.hpp"

namespace kvevict::kernels {
KVEVICT_KERNEL_FN void scaled_row_dots(const float* rows, std::size_t n, std::size_t d,
                                       const float* a, const double* scale, float c, float* out);
KVEVICT_KERNEL_FN void scaled_row_dots_at(const float* rows, std::size_t d,
                                          const std::uint32_t* idx, std::size_t m,
                                          const float* a, const double* scale, float c,
                                          float* out);
KVEVICT_KERNEL_FN std::size_t gather_open_at_most(const float* s, const std::uint64_t* seqs,
                                                  std::size_t n, std::uint64_t lo,
                                                  std::uint64_t hi, float t, std::uint32_t* idx);
KVEVICT_KERNEL_FN std::size_t gather_at_most(const float* s, std::size_t n, float t,
                                             std::uint32_t* idx, std::size_t* finite);
KVEVICT_KERNEL_FN double arrival_dots(const float* key, const float* val, const double* means,
                                      std::size_t group, std::size_t d, double* lin);
}  // namespace kvevict::kernels

#if !KVEVICT_KERNELS_DECLARE_ONLY
#if KVEVICT_X86
#include <immintrin.h>
#endif

namespace kvevict::kernels::detail {
namespace scalar {
KVEVICT_ALWAYS_INLINE float row_dot(const float* k, const float* a, std::size_t d) noexcept {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  std::size_t j = 0;
  for (; j + 8 <= d; j += 8)
    for (std::size_t t = 0; t < 8; ++t) acc[t] += k[j + t] * a[j + t];
  float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; j < d; ++j) s += k[j] * a[j];
  return s;
}
// Rows 0..n-1, or (idx not null) rows idx[0..n).
inline void scaled_row_dots(const float* rows, std::size_t n, std::size_t d, const float* a,
                            const double* scale, float c, float* out,
                            const std::uint32_t* idx) noexcept {
  for (std::size_t i = 0; i < n; ++i) {
    const std::size_t r = idx != nullptr ? idx[i] : i;
    out[r] = row_dot(rows + r * d, a, d) * static_cast<float>(scale[r]) * c;
  }
}
KVEVICT_ALWAYS_INLINE std::size_t gather_open_at_most_body(const float* s,
                                                           const std::uint64_t* seqs,
                                                           std::size_t n, std::uint64_t lo,
                                                           std::uint64_t span, float t,
                                                           std::uint32_t* idx, std::size_t r,
                                                           std::size_t count) noexcept {
  for (; r < n; ++r) {
    idx[count] = static_cast<std::uint32_t>(r);
    count += static_cast<std::size_t>((s[r] <= t) & (seqs[r] - lo < span));
  }
  return count;
}
/// gather_at_most from row r on (count rows gathered and fin finite so far).
KVEVICT_ALWAYS_INLINE std::size_t gather_at_most_body(const float* s, std::size_t n, float t,
                                                      std::uint32_t* idx, std::size_t* finite,
                                                      std::size_t r, std::size_t count,
                                                      std::size_t fin) noexcept {
  constexpr float top = 3.40282347e+38f;  // FLT_MAX
  for (; r < n; ++r) {
    idx[count] = static_cast<std::uint32_t>(r);
    count += static_cast<std::size_t>(s[r] <= t);
    fin += static_cast<std::size_t>(s[r] <= top);
  }
  *finite = fin;
  return count;
}
/// arrival_dots' lanes: coordinate i goes into lane i % 8 (in coordinate order, each
/// product rounded before its add), and the 8 lanes are added as a tree.
constexpr std::size_t kArrivalDotLanes = 8;
KVEVICT_ALWAYS_INLINE double lane_tree(const double* l) noexcept {
  return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}
/// Lanes of sum_i a[i] * b[i] from coordinate i = from on (a scalar tail or the whole sum).
template <class A>
KVEVICT_ALWAYS_INLINE void lane_dots(const A* a, const float* b, std::size_t from, std::size_t d,
                                     double* l) noexcept {
  for (std::size_t i = from; i < d; ++i)
    l[i % kArrivalDotLanes] += static_cast<double>(a[i]) * static_cast<double>(b[i]);
}
inline double arrival_dots(const float* key, const float* val, const double* means,
                           std::size_t group, std::size_t d, double* lin) noexcept {
  for (std::size_t g = 0; g < group; ++g) {
    double l[kArrivalDotLanes] = {};
    lane_dots(means + g * d, key, 0, d, l);
    lin[g] = lane_tree(l);
  }
  double l[kArrivalDotLanes] = {};
  lane_dots(val, val, 0, d, l);
  return lane_tree(l);
}
}  // namespace scalar

#if KVEVICT_X86
KVEVICT_SUPPRESS_INTRIN_WARNINGS_BEGIN
namespace avx2 {
// A multiply, then an add (the AVX2 level does not require FMA).
KVEVICT_TARGET_AVX2 inline void scaled_row_dots(
    const float* rows, std::size_t n, std::size_t d, const float* a, const double* scale, float c,
    float* out, const std::uint32_t* idx) noexcept {
  for (std::size_t i = 0; i < n; ++i) {
    const std::size_t r = idx != nullptr ? idx[i] : i;
    if (idx != nullptr && i + 4 < n) _mm_prefetch(reinterpret_cast<const char*>(rows + idx[i + 4] * d), _MM_HINT_T0);
    const float* k = rows + r * d;
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    std::size_t j = 0;
    for (; j + 16 <= d; j += 16) {
      s0 = _mm256_add_ps(s0, _mm256_mul_ps(_mm256_loadu_ps(k + j), _mm256_loadu_ps(a + j)));
      s1 = _mm256_add_ps(s1, _mm256_mul_ps(_mm256_loadu_ps(k + j + 8), _mm256_loadu_ps(a + j + 8)));
    }
    for (; j + 8 <= d; j += 8)
      s0 = _mm256_add_ps(s0, _mm256_mul_ps(_mm256_loadu_ps(k + j), _mm256_loadu_ps(a + j)));
    s0 = _mm256_add_ps(s0, s1);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(s0), _mm256_extractf128_ps(s0, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_shuffle_ps(h, h, 1));
    float dot = _mm_cvtss_f32(h);
    for (; j < d; ++j) dot += k[j] * a[j];
    out[r] = dot * static_cast<float>(scale[r]) * c;
  }
}
KVEVICT_TARGET_AVX2 inline std::size_t gather_open_at_most(const float* s,
                                                           const std::uint64_t* seqs,
                                                           std::size_t n, std::uint64_t lo,
                                                           std::uint64_t span, float t,
                                                           std::uint32_t* idx) noexcept {
  const __m256 vt = _mm256_set1_ps(t);
  const __m256i flip = _mm256_set1_epi64x(static_cast<long long>(0x8000000000000000ull));
  const __m256i vlo = _mm256_set1_epi64x(static_cast<long long>(lo));
  const __m256i vspan = _mm256_xor_si256(_mm256_set1_epi64x(static_cast<long long>(span)), flip);
  std::size_t r = 0, count = 0;
  for (; r + 8 <= n; r += 8) {
    unsigned m = static_cast<unsigned>(
        _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(s + r), vt, _CMP_LE_OQ)));
    if (m == 0) continue;
    const __m256i d0 = _mm256_xor_si256(
        _mm256_sub_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(seqs + r)), vlo), flip);
    const __m256i d1 = _mm256_xor_si256(
        _mm256_sub_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(seqs + r + 4)), vlo),
        flip);
    m &= static_cast<unsigned>(_mm256_movemask_pd(_mm256_castsi256_pd(_mm256_cmpgt_epi64(vspan, d0)))) |
         (static_cast<unsigned>(_mm256_movemask_pd(_mm256_castsi256_pd(_mm256_cmpgt_epi64(vspan, d1))))
          << 4);
    while (m != 0) {
      idx[count++] = static_cast<std::uint32_t>(r + static_cast<std::size_t>(std::countr_zero(m)));
      m &= m - 1;
    }
  }
  return scalar::gather_open_at_most_body(s, seqs, n, lo, span, t, idx, r, count);
}
KVEVICT_TARGET_AVX2 inline std::size_t gather_at_most(const float* s, std::size_t n, float t,
                                                      std::uint32_t* idx,
                                                      std::size_t* finite) noexcept {
  const __m256 vt = _mm256_set1_ps(t);
  const __m256 vtop = _mm256_set1_ps(3.40282347e+38f);
  std::size_t r = 0, count = 0, fin = 0;
  for (; r + 8 <= n; r += 8) {
    const __m256 x = _mm256_loadu_ps(s + r);
    fin += static_cast<std::size_t>(
        std::popcount(static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(x, vtop, _CMP_LE_OQ)))));
    unsigned m = static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(x, vt, _CMP_LE_OQ)));
    while (m != 0) {
      idx[count++] = static_cast<std::uint32_t>(r + static_cast<std::size_t>(std::countr_zero(m)));
      m &= m - 1;
    }
  }
  return scalar::gather_at_most_body(s, n, t, idx, finite, r, count, fin);
}
// arrival_dots 8 coordinates at a time: lanes 0-3 and 4-7 in two registers, a multiply then
// an add (no FMA at this level), the tail coordinates through the scalar lanes. A is double
// (the means) or float (the value row, widened as the scalar body widens it).
KVEVICT_TARGET_AVX2 inline __m256d lane_load(const double* a) noexcept { return _mm256_loadu_pd(a); }
KVEVICT_TARGET_AVX2 inline __m256d lane_load(const float* a) noexcept {
  return _mm256_cvtps_pd(_mm_loadu_ps(a));
}
template <class A>
KVEVICT_TARGET_AVX2 inline double lane_dot(const A* a, const float* b, std::size_t d) noexcept {
  __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
  std::size_t i = 0;
  for (; i + 8 <= d; i += 8) {
    lo = _mm256_add_pd(lo, _mm256_mul_pd(lane_load(a + i), _mm256_cvtps_pd(_mm_loadu_ps(b + i))));
    hi = _mm256_add_pd(hi, _mm256_mul_pd(lane_load(a + i + 4), _mm256_cvtps_pd(_mm_loadu_ps(b + i + 4))));
  }
  alignas(32) double l[scalar::kArrivalDotLanes];
  _mm256_store_pd(l, lo);
  _mm256_store_pd(l + 4, hi);
  scalar::lane_dots(a, b, i, d, l);
  return scalar::lane_tree(l);
}
KVEVICT_TARGET_AVX2 inline double arrival_dots(const float* key, const float* val,
                                               const double* means, std::size_t group,
                                               std::size_t d, double* lin) noexcept {
  for (std::size_t g = 0; g < group; ++g) lin[g] = lane_dot(means + g * d, key, d);
  return lane_dot(val, val, d);
}
}  // namespace avx2

namespace avx512 {
KVEVICT_TARGET_AVX512 inline void scaled_row_dots(
    const float* rows, std::size_t n, std::size_t d, const float* a, const double* scale, float c,
    float* out, const std::uint32_t* idx) noexcept {
  const std::size_t full = d / 16 * 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (d - full)) - 1u);
  for (std::size_t i = 0; i < n; ++i) {
    const std::size_t r = idx != nullptr ? idx[i] : i;
    if (idx != nullptr && i + 4 < n) _mm_prefetch(reinterpret_cast<const char*>(rows + idx[i + 4] * d), _MM_HINT_T0);
    const float* k = rows + r * d;
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
    std::size_t j = 0;
    for (; j + 32 <= full; j += 32) {
      s0 = _mm512_fmadd_ps(_mm512_loadu_ps(k + j), _mm512_loadu_ps(a + j), s0);
      s1 = _mm512_fmadd_ps(_mm512_loadu_ps(k + j + 16), _mm512_loadu_ps(a + j + 16), s1);
    }
    if (j < full) s0 = _mm512_fmadd_ps(_mm512_loadu_ps(k + j), _mm512_loadu_ps(a + j), s0);
    if (tail != 0)
      s1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, k + full), _mm512_maskz_loadu_ps(tail, a + full), s1);
    out[r] = _mm512_reduce_add_ps(_mm512_add_ps(s0, s1)) * static_cast<float>(scale[r]) * c;
  }
}
KVEVICT_TARGET_AVX512 inline std::size_t gather_open_at_most(const float* s,
                                                             const std::uint64_t* seqs,
                                                             std::size_t n, std::uint64_t lo,
                                                             std::uint64_t span, float t,
                                                             std::uint32_t* idx) noexcept {
  const __m512 vt = _mm512_set1_ps(t);
  const __m512i vlo = _mm512_set1_epi64(static_cast<long long>(lo));
  const __m512i vspan = _mm512_set1_epi64(static_cast<long long>(span));
  __m512i ids = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  std::size_t r = 0, count = 0;
  for (; r + 16 <= n; r += 16, ids = _mm512_add_epi32(ids, step)) {
    __mmask16 m = _mm512_cmp_ps_mask(_mm512_loadu_ps(s + r), vt, _CMP_LE_OQ);
    if (m == 0) continue;
    const __mmask8 o0 = _mm512_cmplt_epu64_mask(
        _mm512_sub_epi64(_mm512_loadu_si512(seqs + r), vlo), vspan);
    const __mmask8 o1 = _mm512_cmplt_epu64_mask(
        _mm512_sub_epi64(_mm512_loadu_si512(seqs + r + 8), vlo), vspan);
    m &= static_cast<__mmask16>(static_cast<unsigned>(o0) | (static_cast<unsigned>(o1) << 8));
    _mm512_mask_compressstoreu_epi32(idx + count, m, ids);
    count += static_cast<std::size_t>(std::popcount(static_cast<unsigned>(m)));
  }
  return scalar::gather_open_at_most_body(s, seqs, n, lo, span, t, idx, r, count);
}
KVEVICT_TARGET_AVX512 inline std::size_t gather_at_most(const float* s, std::size_t n, float t,
                                                        std::uint32_t* idx,
                                                        std::size_t* finite) noexcept {
  const __m512 vt = _mm512_set1_ps(t);
  const __m512 vtop = _mm512_set1_ps(3.40282347e+38f);
  __m512i ids = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  std::size_t r = 0, count = 0, fin = 0;
  for (; r + 16 <= n; r += 16, ids = _mm512_add_epi32(ids, step)) {
    const __m512 x = _mm512_loadu_ps(s + r);
    fin += static_cast<std::size_t>(
        std::popcount(static_cast<unsigned>(_mm512_cmp_ps_mask(x, vtop, _CMP_LE_OQ))));
    const __mmask16 m = _mm512_cmp_ps_mask(x, vt, _CMP_LE_OQ);
    if (m == 0) continue;
    _mm512_mask_compressstoreu_epi32(idx + count, m, ids);
    count += static_cast<std::size_t>(std::popcount(static_cast<unsigned>(m)));
  }
  return scalar::gather_at_most_body(s, n, t, idx, finite, r, count, fin);
}
// arrival_dots with the G + 1 sums side by side: per 8 coordinates one register of 8
// double lanes per sum (lane i % 8, as the AVX2 form's two 4-lane registers hold them),
// a multiply then an add (the product kept in a register through an empty asm so the
// compiler cannot contract it into an FMA: the AVX2 form's values, bit for bit), the key
// and value rows widened once for all G + 1 sums; the d % 8 tail coordinates as one masked
// block (only their lanes added), each sum's 8 lanes added as scalar::lane_tree. Gc: the
// group size (1, 2, 4 or 8: arrival_dots_fused_group).
template <std::size_t Gc>
KVEVICT_TARGET_AVX512 inline double arrival_dots_fused(const float* key, const float* val,
                                                       const double* means, std::size_t d,
                                                       double* lin) noexcept {
  __m512d acc[Gc], sq = _mm512_setzero_pd();
  for (std::size_t g = 0; g < Gc; ++g) acc[g] = _mm512_setzero_pd();
  std::size_t i = 0;
  for (; i + 8 <= d; i += 8) {
    const __m512d k = _mm512_cvtps_pd(_mm256_loadu_ps(key + i));
    const __m512d v = _mm512_cvtps_pd(_mm256_loadu_ps(val + i));
    __m512d vv = _mm512_mul_pd(v, v);
    __asm__("" : "+v"(vv));
    sq = _mm512_add_pd(sq, vv);
    for (std::size_t g = 0; g < Gc; ++g) {
      __m512d p = _mm512_mul_pd(_mm512_loadu_pd(means + g * d + i), k);
      __asm__("" : "+v"(p));
      acc[g] = _mm512_add_pd(acc[g], p);
    }
  }
  if (i < d) {  // the last d % 8 coordinates into lanes 0.., masked (a scalar tail here
                // would be contracted into FMAs: this target has them)
    const auto m = static_cast<__mmask8>((1u << (d - i)) - 1u);
    const __m512d k = _mm512_cvtps_pd(_mm256_maskz_loadu_ps(m, key + i));
    const __m512d v = _mm512_cvtps_pd(_mm256_maskz_loadu_ps(m, val + i));
    __m512d vv = _mm512_mul_pd(v, v);
    __asm__("" : "+v"(vv));
    sq = _mm512_mask_add_pd(sq, m, sq, vv);
    for (std::size_t g = 0; g < Gc; ++g) {
      __m512d p = _mm512_mul_pd(_mm512_maskz_loadu_pd(m, means + g * d + i), k);
      __asm__("" : "+v"(p));
      acc[g] = _mm512_mask_add_pd(acc[g], m, acc[g], p);
    }
  }
  alignas(64) double l[scalar::kArrivalDotLanes];
  for (std::size_t g = 0; g < Gc; ++g) {
    _mm512_store_pd(l, acc[g]);
    lin[g] = scalar::lane_tree(l);
  }
  _mm512_store_pd(l, sq);
  return scalar::lane_tree(l);
}
/// Whether the AVX-512 body takes this group size (others run the AVX2 body).
constexpr bool arrival_dots_fused_group(std::size_t group) noexcept {
  return group == 1 || group == 2 || group == 4 || group == 8;
}
KVEVICT_TARGET_AVX512 inline double arrival_dots(const float* key, const float* val,
                                                 const double* means, std::size_t group,
                                                 std::size_t d, double* lin) noexcept {
  switch (group) {
    case 1: return arrival_dots_fused<1>(key, val, means, d, lin);
    case 2: return arrival_dots_fused<2>(key, val, means, d, lin);
    case 4: return arrival_dots_fused<4>(key, val, means, d, lin);
    default: return arrival_dots_fused<8>(key, val, means, d, lin);  // group 8 (fused_group)
  }
}
}  // namespace avx512
KVEVICT_SUPPRESS_INTRIN_WARNINGS_END
#endif
inline void scaled_row_dots_at_level(const float* rows, std::size_t n, std::size_t d,
                                     const float* a, const double* scale, float c, float* out,
                                     const std::uint32_t* idx) {
#if KVEVICT_X86
  const Isa isa = active_isa();
  if (isa == Isa::avx512) return avx512::scaled_row_dots(rows, n, d, a, scale, c, out, idx);
  if (isa == Isa::avx2) return avx2::scaled_row_dots(rows, n, d, a, scale, c, out, idx);
#endif
  scalar::scaled_row_dots(rows, n, d, a, scale, c, out, idx);
}
}  // namespace kvevict::kernels::detail

namespace kvevict::kernels {

/// out[r] = (rows[r] . a) * float(scale[r]) * c for n rows of d floats (row-major), the dot
/// product summed in float in a level-dependent order (a sum of d products: within the
/// usual d-term bound of the exact value at every level, not bit-identical across levels).
KVEVICT_KERNEL_FN void scaled_row_dots(const float* rows, std::size_t n, std::size_t d,
                                       const float* a, const double* scale, float c, float* out) {
  detail::require_nonnull(rows, n * d, "rows");
  detail::require_nonnull(scale, n, "scale");
  detail::require_nonnull(out, n, "out");
  detail::scaled_row_dots_at_level(rows, n, d, a, scale, c, out, nullptr);
}

/// scaled_row_dots for the rows idx[0..m) only (out[idx[i]] written; rows read in that
/// order, prefetched a few ahead).
KVEVICT_KERNEL_FN void scaled_row_dots_at(const float* rows, std::size_t d,
                                          const std::uint32_t* idx, std::size_t m,
                                          const float* a, const double* scale, float c,
                                          float* out) {
  detail::require_nonnull(rows, m * d, "rows");
  detail::require_nonnull(idx, m, "idx");
  detail::require_nonnull(scale, m, "scale");
  detail::require_nonnull(out, m, "out");
  detail::scaled_row_dots_at_level(rows, m, d, a, scale, c, out, idx);
}

/// The rows r with s[r] <= t (NaN never) and lo <= seqs[r] < hi, in index order, into idx
/// (at least n entries; entries past the returned count may be overwritten); returns how
/// many. The same set at every level.
KVEVICT_KERNEL_FN std::size_t gather_open_at_most(const float* s, const std::uint64_t* seqs,
                                                  std::size_t n, std::uint64_t lo,
                                                  std::uint64_t hi, float t, std::uint32_t* idx) {
  detail::require_nonnull(s, n, "scores");
  detail::require_nonnull(seqs, n, "seqs");
  detail::require_nonnull(idx, n, "idx");
  const std::uint64_t span = hi > lo ? hi - lo : 0;
#if KVEVICT_X86
  const Isa isa = active_isa();
  if (isa == Isa::avx512)
    return detail::avx512::gather_open_at_most(s, seqs, n, lo, span, t, idx);
  if (isa == Isa::avx2) return detail::avx2::gather_open_at_most(s, seqs, n, lo, span, t, idx);
#endif
  return detail::scalar::gather_open_at_most_body(s, seqs, n, lo, span, t, idx, 0, 0);
}

/// The rows r with s[r] <= t (NaN never), in index order, into idx (at least n entries;
/// entries past the returned count may be overwritten); returns how many, and sets *finite
/// to the number of rows with s[r] <= FLT_MAX (neither +infinity nor NaN). One pass over s;
/// the same set and count at every level.
KVEVICT_KERNEL_FN std::size_t gather_at_most(const float* s, std::size_t n, float t,
                                             std::uint32_t* idx, std::size_t* finite) {
  detail::require_nonnull(s, n, "scores");
  detail::require_nonnull(idx, n, "idx");
  detail::require_nonnull(finite, 1, "finite");
#if KVEVICT_X86
  const Isa isa = active_isa();
  if (isa == Isa::avx512) return detail::avx512::gather_at_most(s, n, t, idx, finite);
  if (isa == Isa::avx2) return detail::avx2::gather_at_most(s, n, t, idx, finite);
#endif
  return detail::scalar::gather_at_most_body(s, n, t, idx, finite, 0, 0, 0);
}

/// ExpectedAttention's arrival (policies/expected_attention.hpp): returns sum_i val[i]^2 and
/// sets lin[g] = sum_i means[g * d + i] * key[i] for g < group, in double, each sum in 8
/// lanes (coordinate i into lane i % 8, in coordinate order, every product rounded before its
/// add) added ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)): independent chains of d / 8
/// adds where one ordered sum is a chain of d. The same values at every level (the AVX-512
/// body computes the G + 1 sums side by side, for G 1, 2, 4, 8; other G run the AVX2 body),
/// as long as the compiler does not fuse the scalar body's multiply-adds (no FMA in the
/// target flags).
KVEVICT_KERNEL_FN double arrival_dots(const float* key, const float* val, const double* means,
                                      std::size_t group, std::size_t d, double* lin) {
  detail::require_nonnull(key, d, "key");
  detail::require_nonnull(val, d, "val");
  detail::require_nonnull(means, group * d, "means");
  detail::require_nonnull(lin, group, "lin");
#if KVEVICT_X86
  const Isa isa = active_isa();
  if (isa == Isa::avx512 && detail::avx512::arrival_dots_fused_group(group))
    return detail::avx512::arrival_dots(key, val, means, group, d, lin);
  if (isa != Isa::scalar) return detail::avx2::arrival_dots(key, val, means, group, d, lin);
#endif
  return detail::scalar::arrival_dots(key, val, means, group, d, lin);
}

}  // namespace kvevict::kernels

#endif  // !KVEVICT_KERNELS_DECLARE_ONLY
