// AVX-512 Hamming kernels: VPOPCNT{B,W} (BITALG) for 8/16-bit codes, VPOPCNT{D,Q} (VPOPCNTDQ)
// for wider ones, masked loads/stores for the tails so no row is handled by scalar code.
#pragma once

#include <cstddef>
#include <cstdint>

#include "dispatch.hpp"
#include "hamming_scalar.hpp"

#if KVEVICT_X86
KVEVICT_SUPPRESS_INTRIN_WARNINGS_BEGIN
namespace kvevict::kernels::detail::avx512 {

/// Sums adjacent qword pairs of (a, b): result lane j = a[2j]+a[2j+1] for j<4, b[..] for j>=4.
KVEVICT_TARGET_AVX512 KVEVICT_ALWAYS_INLINE __m512i pair_sum_epi64(__m512i a, __m512i b) noexcept {
  const __m512i even = _mm512_setr_epi64(0, 2, 4, 6, 8, 10, 12, 14);
  const __m512i odd = _mm512_setr_epi64(1, 3, 5, 7, 9, 11, 13, 15);
  return _mm512_add_epi64(_mm512_permutex2var_epi64(a, even, b),
                          _mm512_permutex2var_epi64(a, odd, b));
}

KVEVICT_TARGET_AVX512 KVEVICT_ALWAYS_INLINE __m512i popxor64(const std::uint8_t* p,
                                                            __m512i qv) noexcept {
  return _mm512_popcnt_epi64(_mm512_xor_si512(_mm512_loadu_si512(p), qv));
}

template <int W>
KVEVICT_TARGET_AVX512 inline void distances(const std::uint8_t* q, const std::uint8_t* codes,
                                            std::size_t n, std::uint16_t* out) noexcept {
  std::size_t i = 0;
  if constexpr (W == 1) {
    const __m512i qv = _mm512_set1_epi8(static_cast<char>(q[0]));
    for (; i + 64 <= n; i += 64) {
      const __m512i c = _mm512_popcnt_epi8(_mm512_xor_si512(_mm512_loadu_si512(codes + i), qv));
      _mm512_storeu_si512(out + i, _mm512_cvtepu8_epi16(_mm512_castsi512_si256(c)));
      _mm512_storeu_si512(out + i + 32, _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(c, 1)));
    }
    for (; i < n; i += 32) {
      const std::size_t r = n - i < 32 ? n - i : 32;
      const __mmask32 m = static_cast<__mmask32>((std::uint64_t{1} << r) - 1);
      const __m256i x = _mm256_maskz_loadu_epi8(m, codes + i);
      const __m256i c = _mm256_popcnt_epi8(_mm256_xor_si256(x, _mm512_castsi512_si256(qv)));
      _mm512_mask_storeu_epi16(out + i, m, _mm512_cvtepu8_epi16(c));
    }
  } else if constexpr (W == 2) {
    const __m512i qv = _mm512_set1_epi16(static_cast<short>(scalar::load<std::uint16_t>(q)));
    for (; i + 64 <= n; i += 64) {
      const __m512i a = _mm512_loadu_si512(codes + 2 * i);
      const __m512i b = _mm512_loadu_si512(codes + 2 * i + 64);
      _mm512_storeu_si512(out + i, _mm512_popcnt_epi16(_mm512_xor_si512(a, qv)));
      _mm512_storeu_si512(out + i + 32, _mm512_popcnt_epi16(_mm512_xor_si512(b, qv)));
    }
    for (; i < n; i += 32) {
      const std::size_t r = n - i < 32 ? n - i : 32;
      const __mmask32 m = static_cast<__mmask32>((std::uint64_t{1} << r) - 1);
      const __m512i x = _mm512_maskz_loadu_epi16(m, codes + 2 * i);
      _mm512_mask_storeu_epi16(out + i, m, _mm512_popcnt_epi16(_mm512_xor_si512(x, qv)));
    }
  } else if constexpr (W == 4) {
    const __m512i qv = _mm512_set1_epi32(static_cast<int>(scalar::load<std::uint32_t>(q)));
    for (; i + 32 <= n; i += 32) {
      const __m512i a = _mm512_popcnt_epi32(_mm512_xor_si512(_mm512_loadu_si512(codes + 4 * i), qv));
      const __m512i b =
          _mm512_popcnt_epi32(_mm512_xor_si512(_mm512_loadu_si512(codes + 4 * i + 64), qv));
      // Counts fit in 16 bits: pack a and b dword->word, then undo the 128-bit lane interleave.
      const __m512i p = _mm512_packus_epi32(a, b);
      const __m512i fix = _mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7);
      _mm512_storeu_si512(out + i, _mm512_permutexvar_epi64(fix, p));
    }
    for (; i < n; i += 16) {
      const std::size_t r = n - i < 16 ? n - i : 16;
      const __mmask16 m = static_cast<__mmask16>((1u << r) - 1);
      const __m512i x = _mm512_maskz_loadu_epi32(m, codes + 4 * i);
      const __m512i c = _mm512_popcnt_epi32(_mm512_xor_si512(x, qv));
      _mm256_mask_storeu_epi16(out + i, m, _mm512_cvtepi32_epi16(c));
    }
  } else if constexpr (W == 8) {
    const __m512i qv = _mm512_set1_epi64(static_cast<long long>(scalar::load<std::uint64_t>(q)));
    for (; i + 32 <= n; i += 32) {
      const __m512i a = popxor64(codes + 8 * i, qv);
      const __m512i b = popxor64(codes + 8 * i + 64, qv);
      const __m512i c = popxor64(codes + 8 * i + 128, qv);
      const __m512i d = popxor64(codes + 8 * i + 192, qv);
      // Counts are <= 64: pack qwords to dwords (a,b) and (c,d), then dwords to words.
      const __m512i ab = _mm512_or_si512(a, _mm512_slli_epi64(b, 32));
      const __m512i cd = _mm512_or_si512(c, _mm512_slli_epi64(d, 32));
      // ab lane j = (a_j, b_j); cd lane j = (c_j, d_j); word k of (ab|cd<<16) is interleaved.
      const __m512i w = _mm512_or_si512(ab, _mm512_slli_epi32(cd, 16));
      // w word 4j+0 = a_j, 4j+1 = c_j, 4j+2 = b_j, 4j+3 = d_j; gather into row order.
      alignas(64) static constexpr std::uint16_t kIdx[32] = {
          0, 4, 8,  12, 16, 20, 24, 28, 2, 6, 10, 14, 18, 22, 26, 30,
          1, 5, 9,  13, 17, 21, 25, 29, 3, 7, 11, 15, 19, 23, 27, 31};
      _mm512_storeu_si512(out + i, _mm512_permutexvar_epi16(_mm512_load_si512(kIdx), w));
    }
    for (; i < n; i += 8) {
      const std::size_t r = n - i < 8 ? n - i : 8;
      const __mmask8 m = static_cast<__mmask8>((1u << r) - 1);
      const __m512i x = _mm512_maskz_loadu_epi64(m, codes + 8 * i);
      const __m512i c = _mm512_popcnt_epi64(_mm512_xor_si512(x, qv));
      _mm_mask_storeu_epi16(out + i, m, _mm512_cvtepi64_epi16(c));
    }
  } else if constexpr (W == 16) {
    const __m512i qv = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    for (; i + 8 <= n; i += 8) {
      const __m512i s = pair_sum_epi64(popxor64(codes + 16 * i, qv), popxor64(codes + 16 * i + 64, qv));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm512_cvtepi64_epi16(s));
    }
    for (; i < n; ++i) {
      const __m128i x = _mm_xor_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16 * i)),
                                      _mm512_castsi512_si128(qv));
      out[i] = static_cast<std::uint16_t>(_mm_popcnt_u64(static_cast<std::uint64_t>(_mm_cvtsi128_si64(x))) +
                                          _mm_popcnt_u64(static_cast<std::uint64_t>(_mm_extract_epi64(x, 1))));
    }
  } else {
    static_assert(W == 32, "code width must be 1, 2, 4, 8, 16 or 32 bytes");
    const __m512i qv = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
    for (; i + 8 <= n; i += 8) {
      const std::uint8_t* p = codes + 32 * i;
      const __m512i s0 = pair_sum_epi64(popxor64(p, qv), popxor64(p + 64, qv));
      const __m512i s1 = pair_sum_epi64(popxor64(p + 128, qv), popxor64(p + 192, qv));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm512_cvtepi64_epi16(pair_sum_epi64(s0, s1)));
    }
    for (; i < n; ++i) {
      const __m256i x = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 32 * i)),
                                         _mm512_castsi512_si256(qv));
      const __m256i c = _mm256_popcnt_epi64(x);
      const __m128i h = _mm_add_epi64(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
      out[i] = static_cast<std::uint16_t>(_mm_cvtsi128_si64(h) + _mm_extract_epi64(h, 1));
    }
  }
}

/// Largest eligible distance plus one (0 when no lane is eligible) over m uint16 distances;
/// `elig` holds one eligibility word per 64 rows (bit set = may be chosen).
KVEVICT_TARGET_AVX512 inline unsigned block_max_plus1(const std::uint16_t* d, std::size_t m,
                                                      const std::uint64_t* elig) noexcept {
  const __m512i one = _mm512_set1_epi16(1);
  __m512i acc = _mm512_setzero_si512();
  std::size_t i = 0;
  for (; i < m; i += 32) {
    const std::size_t r = m - i < 32 ? m - i : 32;
    const __mmask32 tail = static_cast<__mmask32>((std::uint64_t{1} << r) - 1);
    const auto e = static_cast<__mmask32>((elig[i >> 6] >> (i & 63)) & tail);
    const __m512i v = _mm512_maskz_loadu_epi16(tail, d + i);
    acc = _mm512_mask_max_epu16(acc, e, acc, _mm512_add_epi16(v, one));
  }
  __m256i h = _mm256_max_epu16(_mm512_castsi512_si256(acc), _mm512_extracti64x4_epi64(acc, 1));
  __m128i x = _mm_max_epu16(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
  x = _mm_xor_si128(x, _mm_set1_epi32(-1));
  return 0xFFFFu - static_cast<unsigned>(_mm_extract_epi16(_mm_minpos_epu16(x), 0));
}

}  // namespace kvevict::kernels::detail::avx512
KVEVICT_SUPPRESS_INTRIN_WARNINGS_END
#endif
