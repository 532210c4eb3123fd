// AVX-512 selection kernels: compress (VPCOMPRESSD to a register, then a masked store) for the
// counting-select emit pass and the float top-k partition pass; 16-wide masked min/max.
#pragma once

#include <algorithm>
#include <cstddef>
#include <bit>
#include <cstdint>
#include <limits>

#include "dispatch.hpp"

#if KVEVICT_X86
#include <immintrin.h>
#endif
#include "select_scalar.hpp"

#if KVEVICT_X86
KVEVICT_SUPPRESS_INTRIN_WARNINGS_BEGIN
namespace kvevict::kernels::detail::avx512 {

template <bool Filter, class K>
KVEVICT_TARGET_AVX512 inline void hist256(const K* keys, std::size_t n, int shift,
                                          unsigned prefix, std::uint32_t* hist) noexcept {
  scalar::hist256_body<Filter, K>(keys, n, shift, prefix, hist);
}

// Register compress + masked store: VPCOMPRESSD straight to memory is microcoded and slow on
// AMD Zen 4.
KVEVICT_TARGET_AVX512 KVEVICT_ALWAYS_INLINE std::size_t compress_store(std::uint32_t* dst,
                                                                      __mmask16 m,
                                                                      __m512i idx) noexcept {
  const unsigned c = static_cast<unsigned>(_mm_popcnt_u32(m));
  _mm512_mask_storeu_epi32(dst, static_cast<__mmask16>((1u << c) - 1),
                           _mm512_maskz_compress_epi32(m, idx));
  return c;
}

/// Mask of lanes among 16 keys beyond t, and of lanes equal to t.
template <bool Top, class K>
KVEVICT_TARGET_AVX512 KVEVICT_ALWAYS_INLINE void compare16(const K* p, __mmask16 valid, K t,
                                                          __mmask16* beyond,
                                                          __mmask16* eq) noexcept {
  if constexpr (sizeof(K) == 1) {
    const __m128i v = _mm_maskz_loadu_epi8(valid, p);
    const __m128i tv = _mm_set1_epi8(static_cast<char>(t));
    *beyond = Top ? _mm_mask_cmpgt_epu8_mask(valid, v, tv) : _mm_mask_cmplt_epu8_mask(valid, v, tv);
    *eq = _mm_mask_cmpeq_epi8_mask(valid, v, tv);
  } else {
    const __m256i v = _mm256_maskz_loadu_epi16(valid, p);
    const __m256i tv = _mm256_set1_epi16(static_cast<short>(t));
    *beyond = Top ? _mm256_mask_cmpgt_epu16_mask(valid, v, tv)
                  : _mm256_mask_cmplt_epu16_mask(valid, v, tv);
    *eq = _mm256_mask_cmpeq_epi16_mask(valid, v, tv);
  }
}

template <bool Top, class K>
KVEVICT_TARGET_AVX512 inline std::size_t emit(const K* keys, std::size_t n, K t,
                                              std::size_t take_eq, std::size_t k,
                                              std::uint32_t* out) noexcept {
  std::size_t pos = 0;
  __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  for (std::size_t i = 0; i < n && pos < k; i += 16) {
    const std::size_t r = n - i < 16 ? n - i : 16;
    const auto valid = static_cast<__mmask16>((1u << r) - 1);
    __mmask16 beyond, eq;
    compare16<Top, K>(keys + i, valid, t, &beyond, &eq);
    if (take_eq != 0 && eq != 0) {
      const unsigned c = static_cast<unsigned>(_mm_popcnt_u32(eq));
      if (c > take_eq)  // keep the lowest take_eq tie lanes
        eq = static_cast<__mmask16>(_pdep_u32((1u << take_eq) - 1, eq));
      take_eq -= c > take_eq ? take_eq : c;
    } else {
      eq = 0;
    }
    pos += compress_store(out + pos, static_cast<__mmask16>(beyond | eq), idx);
    idx = _mm512_add_epi32(idx, step);
  }
  return pos;
}

KVEVICT_TARGET_AVX512 inline std::size_t topk_pass(const float* s, std::size_t n, float thi,
                                                   float tlo, std::uint32_t* above,
                                                   std::uint32_t* mid,
                                                   std::size_t* n_mid) noexcept {
  std::size_t na = 0, nm = 0;
  const __m512 vhi = _mm512_set1_ps(thi), vlo = _mm512_set1_ps(tlo);
  __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(s + i);
    const __mmask16 a = _mm512_cmp_ps_mask(v, vhi, _CMP_GT_OQ);
    const __mmask16 m = _mm512_mask_cmp_ps_mask(static_cast<__mmask16>(~a), v, vlo, _CMP_GE_OQ);
    na += compress_store(above + na, a, idx);
    nm += compress_store(mid + nm, m, idx);
    idx = _mm512_add_epi32(idx, step);
  }
  if (i < n) {
    const auto valid = static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 v = _mm512_maskz_loadu_ps(valid, s + i);
    const __mmask16 a = _mm512_mask_cmp_ps_mask(valid, v, vhi, _CMP_GT_OQ);
    const __mmask16 m =
        _mm512_mask_cmp_ps_mask(static_cast<__mmask16>(valid & ~a), v, vlo, _CMP_GE_OQ);
    na += compress_store(above + na, a, idx);
    nm += compress_store(mid + nm, m, idx);
  }
  *n_mid = nm;
  return na;
}

/// Best eligible value (max for Top, min otherwise) over m floats, NaN and protected lanes
/// excluded; *any = whether some lane was eligible.
template <bool Top>
KVEVICT_TARGET_AVX512 inline float block_best(const float* s, std::size_t m,
                                              const std::uint64_t* elig, bool* any) noexcept {
  const float init = Top ? -std::numeric_limits<float>::infinity()
                         : std::numeric_limits<float>::infinity();
  __m512 acc0 = _mm512_set1_ps(init), acc1 = acc0;
  __mmask16 seen = 0;
  std::size_t i = 0;
  for (; i + 32 <= m; i += 32) {
    const auto w = static_cast<std::uint32_t>(elig[i >> 6] >> (i & 63));
    const __m512 v0 = _mm512_loadu_ps(s + i), v1 = _mm512_loadu_ps(s + i + 16);
    const __mmask16 e0 = _mm512_mask_cmp_ps_mask(static_cast<__mmask16>(w), v0, v0, _CMP_ORD_Q);
    const __mmask16 e1 =
        _mm512_mask_cmp_ps_mask(static_cast<__mmask16>(w >> 16), v1, v1, _CMP_ORD_Q);
    acc0 = Top ? _mm512_mask_max_ps(acc0, e0, acc0, v0) : _mm512_mask_min_ps(acc0, e0, acc0, v0);
    acc1 = Top ? _mm512_mask_max_ps(acc1, e1, acc1, v1) : _mm512_mask_min_ps(acc1, e1, acc1, v1);
    seen = static_cast<__mmask16>(seen | e0 | e1);
  }
  for (; i < m; i += 16) {
    const std::size_t r = m - i < 16 ? m - i : 16;
    const auto w = static_cast<__mmask16>((elig[i >> 6] >> (i & 63)) & ((1u << r) - 1));
    const __m512 v = _mm512_maskz_loadu_ps(w, s + i);
    const __mmask16 e = _mm512_mask_cmp_ps_mask(w, v, v, _CMP_ORD_Q);
    acc0 = Top ? _mm512_mask_max_ps(acc0, e, acc0, v) : _mm512_mask_min_ps(acc0, e, acc0, v);
    seen = static_cast<__mmask16>(seen | e);
  }
  const __m512 acc = Top ? _mm512_max_ps(acc0, acc1) : _mm512_min_ps(acc0, acc1);
  *any = seen != 0;
  return Top ? _mm512_reduce_max_ps(acc) : _mm512_reduce_min_ps(acc);
}

/// First i < m with elig bit set and s[i] == v (v not NaN), or m.
KVEVICT_TARGET_AVX512 inline std::size_t find_first_eq(const float* s, std::size_t m,
                                                       const std::uint64_t* elig, float v) noexcept {
  const __m512 t = _mm512_set1_ps(v);
  for (std::size_t i = 0; i < m; i += 16) {
    const std::size_t r = m - i < 16 ? m - i : 16;
    const auto e = static_cast<__mmask16>((elig[i >> 6] >> (i & 63)) & ((1u << r) - 1));
    const __mmask16 hit = _mm512_mask_cmp_ps_mask(e, _mm512_maskz_loadu_ps(e, s + i), t, _CMP_EQ_OQ);
    if (hit) return i + static_cast<std::size_t>(std::countr_zero(static_cast<unsigned>(hit)));
  }
  return m;
}

/// Largest n topk_threshold takes (its buffers live on the stack: about 14 n bytes).
inline constexpr std::size_t kThresholdMaxN = 512;

/// Signed order keys of 16 floats (avx2::topk_skey8's, 16 lanes): ascending = best first,
/// -0 == +0, every NaN INT32_MAX (below every number).
KVEVICT_TARGET_AVX512 KVEVICT_ALWAYS_INLINE __m512i topk_skey16(__m512 f) noexcept {
  const __m512i sign = _mm512_set1_epi32(static_cast<int>(0x80000000u));
  const __m512i low = _mm512_set1_epi32(0x7FFFFFFF);
  __m512i u = _mm512_castps_si512(f);
  u = _mm512_maskz_mov_epi32(_mm512_cmpneq_epi32_mask(u, sign), u);  // -0 -> +0
  const __m512i neg = _mm512_srai_epi32(u, 31);
  const __m512i key = _mm512_xor_si512(_mm512_xor_si512(u, _mm512_andnot_si512(neg, low)), sign);
  const __mmask16 nan =
      _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, low), _mm512_set1_epi32(0x7F800000));
  return _mm512_mask_mov_epi32(key, nan, low);
}

/// Lanes <= c among two registers of signed 16-bit lanes (their masks joined, one popcount).
KVEVICT_TARGET_AVX512 KVEVICT_ALWAYS_INLINE std::size_t count_le2(__m512i x, __m512i y,
                                                                 __m512i c) noexcept {
  return static_cast<std::size_t>(_mm_popcnt_u64(_cvtmask64_u64(
      _mm512_kunpackd(_mm512_cmple_epi16_mask(x, c), _mm512_cmple_epi16_mask(y, c)))));
}

/// Small-n float top-k (0 < k < n <= kThresholdMaxN) by a threshold search, no sampling and
/// no sort. The signed order keys' high 16 bits are packed 32 to a register (hi[j] = key[j]
/// >> 16); the k-th smallest high half is found two bits at a time (8 steps, three compares
/// and popcounts per 32 rows each: the smallest t with at least k halves <= t), which also
/// gives the count of halves below it. The keys sharing that high half (usually one to
/// three) are picked out of the equality masks and the wanted rank among their low halves
/// taken (scalar::threshold_key): that is the k-th key T. One pass left-packs (VPCOMPRESSD)
/// the ids of the keys below T and the lowest-index keys equal to T. Same set as topk_exact
/// (ties to the lower index, NaN last, -0 == +0); ids in index order.
KVEVICT_TARGET_AVX512 inline void topk_threshold(const float* s, std::size_t n, std::size_t k,
                                                 std::uint32_t* out) noexcept {
  alignas(64) std::int32_t key[kThresholdMaxN];
  alignas(64) std::int16_t hi[kThresholdMaxN];
  alignas(64) std::int32_t cand[kThresholdMaxN];
  const std::size_t nv = (n + 15) / 16, nh = (n + 31) / 32;
  const __m512i kmax = _mm512_set1_epi32(std::numeric_limits<std::int32_t>::max());
  for (std::size_t v = 0; v < nv; ++v) {
    const std::size_t r = n - 16 * v < 16 ? n - 16 * v : 16;
    const auto valid = static_cast<__mmask16>((1u << r) - 1);
    _mm512_store_si512(key + 16 * v,
                       _mm512_mask_mov_epi32(kmax, valid,
                                             topk_skey16(_mm512_maskz_loadu_ps(valid, s + 16 * v))));
  }
  if (nv & 1) _mm512_store_si512(key + 16 * nv, kmax);  // pad to whole 32-row registers
  const __m512i odd16 = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37,
                                         35, 33, 31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7,
                                         5, 3, 1);  // the high 16-bit word of each key
  for (std::size_t h = 0; h < nh; ++h)
    _mm512_store_si512(hi + 32 * h, _mm512_permutex2var_epi16(_mm512_load_si512(key + 32 * h),
                                                              odd16,
                                                              _mm512_load_si512(key + 32 * h + 16)));
  // Unsigned patterns (sign flipped) of the high halves. Padding rows hold the largest half,
  // counted only when the candidate is the largest, where the real count is n >= k anyway.
  unsigned tu = 0;
  std::size_t c_lt = 0;  // halves below tu: the count of the last candidate that fell short
  for (int b = 14; b >= 0; b -= 2) {
    const unsigned ones = (1u << b) - 1;
    // The three candidates tu | d << b | ones, d = 0, 1, 2, as signed halves.
    const auto c0 = static_cast<short>((tu | ones) ^ 0x8000u);
    const __m512i c1 = _mm512_set1_epi16(c0),
                  c2 = _mm512_set1_epi16(static_cast<short>(c0 + (1 << b))),
                  c3 = _mm512_set1_epi16(static_cast<short>(c0 + (2 << b)));
    std::size_t n1 = 0, n2 = 0, n3 = 0;
    std::size_t h = 0;
    for (; h + 2 <= nh; h += 2) {
      const __m512i x = _mm512_load_si512(hi + 32 * h), y = _mm512_load_si512(hi + 32 * h + 32);
      n1 += count_le2(x, y, c1);
      n2 += count_le2(x, y, c2);
      n3 += count_le2(x, y, c3);
    }
    if (h < nh) {  // an odd last register (the padding row of hi is never read)
      const __m512i x = _mm512_load_si512(hi + 32 * h);
      n1 += static_cast<std::size_t>(_mm_popcnt_u32(_mm512_cmple_epi16_mask(x, c1)));
      n2 += static_cast<std::size_t>(_mm_popcnt_u32(_mm512_cmple_epi16_mask(x, c2)));
      n3 += static_cast<std::size_t>(_mm_popcnt_u32(_mm512_cmple_epi16_mask(x, c3)));
    }
    c_lt = n3 < k ? n3 : n2 < k ? n2 : n1 < k ? n1 : c_lt;
    tu |= (static_cast<unsigned>(n1 < k) + (n2 < k) + (n3 < k)) << b;
  }
  const auto t16 = static_cast<std::int16_t>(tu ^ 0x8000u);
  const __m512i vt16 = _mm512_set1_epi16(t16);
  std::size_t m = 0;
  for (std::size_t h = 0; h < nh; ++h)
    for (std::uint32_t eq = _mm512_cmpeq_epi16_mask(_mm512_load_si512(hi + 32 * h), vt16); eq;
         eq &= eq - 1) {
      const std::size_t j = 32 * h + static_cast<std::size_t>(std::countr_zero(eq));
      cand[m] = key[j] & 0xFFFF;  // keys with one high half order by the low one
      m += j < n;
    }
  std::size_t take_eq = 0;
  const std::int32_t t = scalar::threshold_key(cand, m, k, c_lt, t16, &take_eq);
  const __m512i vt = _mm512_set1_epi32(t);
  __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  std::size_t pos = 0;
  for (std::size_t v = 0; v < nv; ++v) {
    const __m512i x = _mm512_load_si512(key + 16 * v);
    __mmask16 eq = _mm512_cmpeq_epi32_mask(x, vt);  // padding only when T is NaN's key: it
    if (eq != 0) {                                   // comes last, after take_eq real ties
      const auto c = static_cast<std::size_t>(_mm_popcnt_u32(eq));
      if (c > take_eq)  // keep the lowest take_eq tie lanes
        eq = static_cast<__mmask16>(_pdep_u32((1u << take_eq) - 1, eq));
      take_eq -= c > take_eq ? take_eq : c;
    }
    const auto sel = static_cast<__mmask16>(_mm512_cmplt_epi32_mask(x, vt) | eq);
    const __m512i packed = _mm512_maskz_compress_epi32(sel, idx);
    const auto c = static_cast<std::size_t>(_mm_popcnt_u32(sel));
    if (pos + 16 <= k)  // a whole register (the lanes past c are overwritten later)
      _mm512_storeu_si512(out + pos, packed);
    else  // near the end of out: its first c lanes only
      _mm512_mask_storeu_epi32(out + pos, static_cast<__mmask16>((1u << c) - 1), packed);
    pos += c;
    idx = _mm512_add_epi32(idx, step);
  }
}

}  // namespace kvevict::kernels::detail::avx512
KVEVICT_SUPPRESS_INTRIN_WARNINGS_END
#endif
