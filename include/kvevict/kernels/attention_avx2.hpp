// AVX2 + FMA + F16C decode-attention kernel: 8-wide float lanes, VCVTPH2PS for fp16,
// bfloat16 widened by a 16-bit shift, tails through a small zero-padded stack buffer, exp by
// range reduction + polynomial + exponent-field arithmetic. The algorithm itself is
// attention_simd_body.hpp.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "attention_scalar.hpp"
#include "dispatch.hpp"

#if KVEVICT_X86
#include <immintrin.h>
#endif

#if KVEVICT_X86
#define KVEVICT_ATTN_TARGET_AVX2 __attribute__((target("avx2,fma,f16c,popcnt,bmi,bmi2")))

KVEVICT_SUPPRESS_INTRIN_WARNINGS_BEGIN
namespace kvevict::kernels::detail::attn_avx2 {

#define KVEVICT_ATTN_TARGET KVEVICT_ATTN_TARGET_AVX2
#define KVEVICT_ATTN_INLINE KVEVICT_ATTN_TARGET KVEVICT_ALWAYS_INLINE

using V = __m256;
inline constexpr std::size_t W = 8;
inline constexpr int kRows = 2;   // rows per q.K block (2 x 4 heads = 8 of the 16 registers)
inline constexpr int kHeads = 4;  // query heads per block
inline constexpr int kVecs = 2;   // vectors per p.V column block (4 heads x 2 = 8 accumulators)

KVEVICT_ATTN_INLINE V vzero() noexcept { return _mm256_setzero_ps(); }
KVEVICT_ATTN_INLINE V vset1(float x) noexcept { return _mm256_set1_ps(x); }
KVEVICT_ATTN_INLINE V vload(const float* p) noexcept { return _mm256_loadu_ps(p); }
KVEVICT_ATTN_INLINE V vload_tail(const float* p, std::size_t cnt) noexcept {
  alignas(32) float buf[8] = {};
  std::memcpy(buf, p, cnt * sizeof(float));
  return _mm256_load_ps(buf);
}
KVEVICT_ATTN_INLINE void vstore(float* p, V x) noexcept { _mm256_storeu_ps(p, x); }
KVEVICT_ATTN_INLINE void vstore_tail(float* p, V x, std::size_t cnt) noexcept {
  alignas(32) float buf[8];
  _mm256_store_ps(buf, x);
  std::memcpy(p, buf, cnt * sizeof(float));
}
KVEVICT_ATTN_INLINE V vfma(V a, V b, V c) noexcept { return _mm256_fmadd_ps(a, b, c); }
KVEVICT_ATTN_INLINE V vadd(V a, V b) noexcept { return _mm256_add_ps(a, b); }
KVEVICT_ATTN_INLINE V vsub(V a, V b) noexcept { return _mm256_sub_ps(a, b); }
KVEVICT_ATTN_INLINE V vmul(V a, V b) noexcept { return _mm256_mul_ps(a, b); }
KVEVICT_ATTN_INLINE V vmax(V a, V b) noexcept { return _mm256_max_ps(a, b); }
KVEVICT_ATTN_INLINE float vhsum(V x) noexcept {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
KVEVICT_ATTN_INLINE float vhmax(V x) noexcept {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <KvFormat F>
KVEVICT_ATTN_INLINE V widen_loaded(const void* p) noexcept {
  if constexpr (F == KvFormat::f32) {
    return _mm256_loadu_ps(static_cast<const float*>(p));
  } else {
    const __m128i h = _mm_loadu_si128(static_cast<const __m128i*>(p));
    if constexpr (F == KvFormat::f16) return _mm256_cvtph_ps(h);
    else return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

template <KvFormat F>
KVEVICT_ATTN_INLINE V vwiden(const void* rows, std::size_t idx) noexcept {
  return widen_loaded<F>(static_cast<const char*>(rows) + idx * kv_format_bytes(F));
}

template <KvFormat F>
KVEVICT_ATTN_INLINE V vwiden_tail(const void* rows, std::size_t idx, std::size_t cnt) noexcept {
  alignas(32) unsigned char buf[32] = {};
  std::memcpy(buf, static_cast<const char*>(rows) + idx * kv_format_bytes(F),
              cnt * kv_format_bytes(F));
  return widen_loaded<F>(buf);
}

/// dst[r] = scale * (sum of the lanes of acc[r]) for r < R (R = 1 or 2), each row summed in
/// the same order whatever R.
template <int R>
KVEVICT_ATTN_INLINE void vreduce_store(float* dst, const V* acc, float scale) noexcept {
  if constexpr (R == 2) {
    const __m256 t = _mm256_hadd_ps(acc[0], acc[1]);  // [a01 a23 b01 b23 | a45 a67 b45 b67]
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    s = _mm_hadd_ps(s, s);  // [a b a b]
    _mm_storel_pi(reinterpret_cast<__m64*>(dst), _mm_mul_ps(s, _mm_set1_ps(scale)));
  } else {
    // The same tree with a zero second row: a row's score must not depend on how many rows
    // share its reduction (a block table's runs group rows differently from a dense array).
    static_assert(R == 1, "AVX2 reduces 1 or 2 rows");
    const V a[2] = {acc[0], _mm256_setzero_ps()};
    float t[2];
    vreduce_store<2>(t, a, scale);
    dst[0] = t[0];
  }
}

/// Accumulates, per lane, a sign bit when x is infinite or NaN.
KVEVICT_ATTN_INLINE V vnonfinite_or(V acc, V x) noexcept {
  const __m256i b = _mm256_add_epi32(
      _mm256_and_si256(_mm256_castps_si256(x), _mm256_set1_epi32(0x7fffffff)),
      _mm256_set1_epi32(0x00800000));
  return _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(acc), b));
}
KVEVICT_ATTN_INLINE bool vany_sign(V acc) noexcept { return _mm256_movemask_ps(acc) != 0; }

/// e^x for x <= 88.37 (the softmax only passes x <= 0): n = round(x log2 e),
/// r = x - n ln 2 (two-part ln 2), Cephes' degree-6 polynomial, times 2^n built in the
/// exponent field; x below -87.33 (result below FLT_MIN) gives 0. Max error about 2 ulp.
KVEVICT_ATTN_INLINE V vexp(V x) noexcept {
  const V lo = _mm256_set1_ps(-87.3365447505531f);
  const V tiny = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), lo);
  const V n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  V r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  V y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  // n in [-126, 128]: 2^n as (n + 127) << 23, split in two factors so n = 128 cannot overflow
  // the exponent field.
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i half1 = _mm256_srai_epi32(ni, 1);
  const __m256i half2 = _mm256_sub_epi32(ni, half1);
  const V p1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half1, _mm256_set1_epi32(127)), 23));
  const V p2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half2, _mm256_set1_epi32(127)), 23));
  return _mm256_andnot_ps(tiny, _mm256_mul_ps(_mm256_mul_ps(y, p1), p2));
}

#include "attention_simd_body.hpp"

#undef KVEVICT_ATTN_INLINE
#undef KVEVICT_ATTN_TARGET

}  // namespace kvevict::kernels::detail::attn_avx2
KVEVICT_SUPPRESS_INTRIN_WARNINGS_END
#endif
