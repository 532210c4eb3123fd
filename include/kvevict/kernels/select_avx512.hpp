// AVX-512 selection kernels: compress (VPCOMPRESSD to a register, then a masked store) for the
// counting-select emit pass and the float top-k partition pass; 16-wide masked min/max.
#pragma once

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

}  // namespace kvevict::kernels::detail::avx512
KVEVICT_SUPPRESS_INTRIN_WARNINGS_END
#endif
