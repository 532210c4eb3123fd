// AVX-512 decode-attention kernel: 16-wide float lanes, F16C-style widening of fp16
// (VCVTPH2PS), bfloat16 widened by a 16-bit shift, tails by masked loads and stores, exp by
// range reduction + polynomial + VSCALEFPS. The algorithm itself is attention_simd_body.hpp.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "attention_scalar.hpp"
#include "dispatch.hpp"

#if KVEVICT_X86
#include <immintrin.h>
#endif

#if KVEVICT_X86
#define KVEVICT_ATTN_TARGET_AVX512                                                          \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512vpopcntdq,avx512bitalg,avx2,fma," \
                        "f16c,popcnt,bmi,bmi2")))

KVEVICT_SUPPRESS_INTRIN_WARNINGS_BEGIN
namespace kvevict::kernels::detail::attn_avx512 {

#define KVEVICT_ATTN_TARGET KVEVICT_ATTN_TARGET_AVX512
#define KVEVICT_ATTN_INLINE KVEVICT_ATTN_TARGET KVEVICT_ALWAYS_INLINE

using V = __m512;
inline constexpr std::size_t W = 16;
inline constexpr int kRows = 4;   // rows per q.K block (4 x 4 heads = 16 accumulators)
inline constexpr int kHeads = 4;  // query heads per block
inline constexpr int kVecs = 4;   // vectors per p.V column block (4 heads x 4 = 16 accumulators)

KVEVICT_ATTN_INLINE __mmask16 tail_mask(std::size_t cnt) noexcept {
  return static_cast<__mmask16>((1u << cnt) - 1u);
}
KVEVICT_ATTN_INLINE V vzero() noexcept { return _mm512_setzero_ps(); }
KVEVICT_ATTN_INLINE V vset1(float x) noexcept { return _mm512_set1_ps(x); }
KVEVICT_ATTN_INLINE V vload(const float* p) noexcept { return _mm512_loadu_ps(p); }
KVEVICT_ATTN_INLINE V vload_tail(const float* p, std::size_t cnt) noexcept {
  return _mm512_maskz_loadu_ps(tail_mask(cnt), p);
}
KVEVICT_ATTN_INLINE void vstore(float* p, V x) noexcept { _mm512_storeu_ps(p, x); }
KVEVICT_ATTN_INLINE void vstore_tail(float* p, V x, std::size_t cnt) noexcept {
  _mm512_mask_storeu_ps(p, tail_mask(cnt), x);
}
KVEVICT_ATTN_INLINE V vfma(V a, V b, V c) noexcept { return _mm512_fmadd_ps(a, b, c); }
KVEVICT_ATTN_INLINE V vadd(V a, V b) noexcept { return _mm512_add_ps(a, b); }
KVEVICT_ATTN_INLINE V vsub(V a, V b) noexcept { return _mm512_sub_ps(a, b); }
KVEVICT_ATTN_INLINE V vmul(V a, V b) noexcept { return _mm512_mul_ps(a, b); }
KVEVICT_ATTN_INLINE V vmax(V a, V b) noexcept { return _mm512_max_ps(a, b); }
KVEVICT_ATTN_INLINE float vhsum(V x) noexcept { return _mm512_reduce_add_ps(x); }
KVEVICT_ATTN_INLINE float vhmax(V x) noexcept { return _mm512_reduce_max_ps(x); }

template <KvFormat F>
KVEVICT_ATTN_INLINE V vwiden(const void* rows, std::size_t idx) noexcept {
  if constexpr (F == KvFormat::f32) {
    return _mm512_loadu_ps(static_cast<const float*>(rows) + idx);
  } else {
    const __m256i h =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const std::uint16_t*>(rows) + idx));
    if constexpr (F == KvFormat::f16) return _mm512_cvtph_ps(h);
    else return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

template <KvFormat F>
KVEVICT_ATTN_INLINE V vwiden_tail(const void* rows, std::size_t idx, std::size_t cnt) noexcept {
  if constexpr (F == KvFormat::f32) {
    return _mm512_maskz_loadu_ps(tail_mask(cnt), static_cast<const float*>(rows) + idx);
  } else {
    const __m256i h =
        _mm256_maskz_loadu_epi16(tail_mask(cnt), static_cast<const std::uint16_t*>(rows) + idx);
    if constexpr (F == KvFormat::f16) return _mm512_cvtph_ps(h);
    else return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

/// The upper and lower 256-bit halves added.
KVEVICT_ATTN_INLINE __m256 fold256(V a) noexcept {
  return _mm256_add_ps(_mm512_castps512_ps256(a),
                       _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}

/// dst[r] = scale * (sum of the lanes of acc[r]) for r < R (R = 1, 2 or 4), each row summed
/// in the same order whatever R.
template <int R>
KVEVICT_ATTN_INLINE void vreduce_store(float* dst, const V* acc, float scale) noexcept {
  if constexpr (R == 4) {
    const __m256 t01 = _mm256_hadd_ps(fold256(acc[0]), fold256(acc[1]));
    const __m256 t23 = _mm256_hadd_ps(fold256(acc[2]), fold256(acc[3]));
    const __m256 u = _mm256_hadd_ps(t01, t23);
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
    _mm_storeu_ps(dst, _mm_mul_ps(s, _mm_set1_ps(scale)));
  } else {
    // The same tree on zero-padded rows: a row's score must not depend on how many rows
    // share its reduction (a block table's runs group rows differently from a dense array).
    V a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int r = 0; r < R; ++r) a[r] = acc[r];
    float t[4];
    vreduce_store<4>(t, a, scale);
    for (int r = 0; r < R; ++r) dst[r] = t[r];
  }
}

/// Accumulates, per lane, a sign bit when x is infinite or NaN.
KVEVICT_ATTN_INLINE V vnonfinite_or(V acc, V x) noexcept {
  const __m512i b = _mm512_add_epi32(_mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7fffffff)),
                                     _mm512_set1_epi32(0x00800000));
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(acc), b));
}
KVEVICT_ATTN_INLINE bool vany_sign(V acc) noexcept {
  return _mm512_test_epi32_mask(_mm512_castps_si512(acc),
                                _mm512_set1_epi32(static_cast<int>(0x80000000u))) != 0;
}

/// e^x for x <= 88.37 (the softmax only passes x <= 0): n = round(x log2 e),
/// r = x - n ln 2 (two-part ln 2), Cephes' degree-6 polynomial, times 2^n by VSCALEFPS
/// (which underflows to 0 for very negative x). Max error about 2 ulp.
KVEVICT_ATTN_INLINE V vexp(V x) noexcept {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)), _mm512_set1_ps(-104.0f));
  const V n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  V r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  V y = _mm512_set1_ps(1.9875691500E-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507E-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073E-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894E-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459E-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201E-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(y, n);
}

#include "attention_simd_body.hpp"

#undef KVEVICT_ATTN_INLINE
#undef KVEVICT_ATTN_TARGET

}  // namespace kvevict::kernels::detail::attn_avx512
KVEVICT_SUPPRESS_INTRIN_WARNINGS_END
#endif
