// AVX2 Hamming kernels. Narrow codes (8/16/32 bits) use the nibble-lookup popcount (vpshufb)
// and widen or pair-sum the byte counts; codes of 64 bits and more use the POPCNT instruction
// per 64-bit word, which is at least as fast as the lookup on the CPUs that have AVX2.
#pragma once

#include <cstddef>
#include <bit>
#include <cstdint>

#include "dispatch.hpp"

#if KVEVICT_X86
#include <immintrin.h>
#endif
#include "hamming_scalar.hpp"

#if KVEVICT_X86
KVEVICT_SUPPRESS_INTRIN_WARNINGS_BEGIN
namespace kvevict::kernels::detail::avx2 {

KVEVICT_TARGET_AVX2 KVEVICT_ALWAYS_INLINE __m256i popcount_bytes(__m256i v) noexcept {
  const __m256i lut = _mm256_setr_epi8(0, 1, 1, 2, 1, 2, 2, 3, 1, 2, 2, 3, 2, 3, 3, 4, 0, 1, 1, 2,
                                       1, 2, 2, 3, 1, 2, 2, 3, 2, 3, 3, 4);
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  const __m256i lo = _mm256_shuffle_epi8(lut, _mm256_and_si256(v, low4));
  const __m256i hi = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(v, 4), low4));
  return _mm256_add_epi8(lo, hi);
}

KVEVICT_TARGET_AVX2 KVEVICT_ALWAYS_INLINE unsigned popcnt64(const std::uint8_t* p,
                                                           const std::uint8_t* q) noexcept {
  return static_cast<unsigned>(
      _mm_popcnt_u64(scalar::load<std::uint64_t>(p) ^ scalar::load<std::uint64_t>(q)));
}

template <int W>
KVEVICT_TARGET_AVX2 inline void distances(const std::uint8_t* q, const std::uint8_t* codes,
                                          std::size_t n, std::uint16_t* out) noexcept {
  std::size_t i = 0;
  if constexpr (W == 1) {
    const __m256i qv = _mm256_set1_epi8(static_cast<char>(q[0]));
    for (; i + 32 <= n; i += 32) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + i));
      const __m256i c = popcount_bytes(_mm256_xor_si256(x, qv));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                          _mm256_cvtepu8_epi16(_mm256_castsi256_si128(c)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i + 16),
                          _mm256_cvtepu8_epi16(_mm256_extracti128_si256(c, 1)));
    }
  } else if constexpr (W == 2) {
    const __m256i qv = _mm256_set1_epi16(static_cast<short>(scalar::load<std::uint16_t>(q)));
    const __m256i ones = _mm256_set1_epi8(1);
    for (; i + 16 <= n; i += 16) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 2 * i));
      const __m256i c = popcount_bytes(_mm256_xor_si256(x, qv));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm256_maddubs_epi16(c, ones));
    }
  } else if constexpr (W == 4) {
    const __m256i qv = _mm256_set1_epi32(static_cast<int>(scalar::load<std::uint32_t>(q)));
    const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
    for (; i + 16 <= n; i += 16) {
      const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 4 * i));
      const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 4 * i + 32));
      const __m256i c0 = _mm256_madd_epi16(
          _mm256_maddubs_epi16(popcount_bytes(_mm256_xor_si256(x0, qv)), ones8), ones16);
      const __m256i c1 = _mm256_madd_epi16(
          _mm256_maddubs_epi16(popcount_bytes(_mm256_xor_si256(x1, qv)), ones8), ones16);
      // packus interleaves 128-bit lanes; the permute restores row order.
      const __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(c0, c1), 0xD8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), p);
    }
  } else if constexpr (W == 8) {
    // Nibble-LUT byte counts, VPSADBW sums each 64-bit lane, then 4 vectors (16 codes) are
    // packed to words: word 4j+{0,1,2,3} = {a,c,b,d}_j, regrouped by a byte shuffle and a
    // dword permute into row order.
    const __m256i qv = _mm256_set1_epi64x(static_cast<long long>(scalar::load<std::uint64_t>(q)));
    const __m256i zero = _mm256_setzero_si256();
    const __m256i shuf = _mm256_setr_epi8(0, 1, 8, 9, 4, 5, 12, 13, 2, 3, 10, 11, 6, 7, 14, 15,
                                          0, 1, 8, 9, 4, 5, 12, 13, 2, 3, 10, 11, 6, 7, 14, 15);
    const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    auto count = [&](const std::uint8_t* p) KVEVICT_TARGET_AVX2 {
      const __m256i x = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), qv);
      return _mm256_sad_epu8(popcount_bytes(x), zero);
    };
    for (; i + 16 <= n; i += 16) {
      const std::uint8_t* p = codes + 8 * i;
      const __m256i a = count(p), b = count(p + 32), c = count(p + 64), d = count(p + 96);
      const __m256i ab = _mm256_or_si256(a, _mm256_slli_epi64(b, 32));
      const __m256i cd = _mm256_or_si256(c, _mm256_slli_epi64(d, 32));
      const __m256i w = _mm256_or_si256(ab, _mm256_slli_epi32(cd, 16));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                          _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(w, shuf), perm));
    }
  } else {
    for (; i + 4 <= n; i += 4) {
      unsigned d[4] = {0, 0, 0, 0};
      for (int r = 0; r < 4; ++r)
        for (int w = 0; w < W; w += 8) d[r] += popcnt64(codes + (i + r) * W + w, q + w);
      for (int r = 0; r < 4; ++r) out[i + r] = static_cast<std::uint16_t>(d[r]);
    }
  }
  for (; i < n; ++i) {
    unsigned d = 0;
    if constexpr (W >= 8) {
      for (int w = 0; w < W; w += 8) d += popcnt64(codes + i * W + w, q + w);
    } else {
      d = scalar::distance<W>(q, codes + i * W);
    }
    out[i] = static_cast<std::uint16_t>(d);
  }
}

/// Largest value of eligible lanes plus one (0 when none) over a block of uint16 distances
/// whose first element is row `base` (a multiple of 64). `elig` holds the block's
/// eligibility words (bit set = may be chosen), one per 64 rows.
KVEVICT_TARGET_AVX2 inline unsigned block_max_plus1(const std::uint16_t* d, std::size_t m,
                                                    const std::uint64_t* elig) noexcept {
  // Expand 16 mask bits to 16 lanes: broadcast, AND with a lane bit, compare.
  const __m256i bits = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096,
                                         8192, 16384, static_cast<short>(0x8000));
  const __m256i one = _mm256_set1_epi16(1);
  __m256i acc = _mm256_setzero_si256();
  std::size_t i = 0;
  for (; i + 16 <= m; i += 16) {
    const auto word = static_cast<short>((elig[i >> 6] >> (i & 63)) & 0xFFFF);
    const __m256i sel =
        _mm256_cmpeq_epi16(_mm256_and_si256(_mm256_set1_epi16(word), bits), bits);
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + i));
    acc = _mm256_max_epu16(acc, _mm256_and_si256(_mm256_add_epi16(v, one), sel));
  }
  __m128i m128 = _mm_max_epu16(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
  // max = ~minpos(~x)
  const __m128i inv = _mm_xor_si128(m128, _mm_set1_epi32(-1));
  unsigned best = 0xFFFFu - static_cast<unsigned>(_mm_extract_epi16(_mm_minpos_epu16(inv), 0));
  for (; i < m; ++i)
    if ((elig[i >> 6] >> (i & 63)) & 1u) best = best > d[i] + 1u ? best : d[i] + 1u;
  return best;
}

/// First i < m with elig bit set and d[i] + 1 == target, or m.
KVEVICT_TARGET_AVX2 inline std::size_t block_find_first(const std::uint16_t* d, std::size_t m,
                                                        const std::uint64_t* elig,
                                                        unsigned target) noexcept {
  const __m256i t = _mm256_set1_epi16(static_cast<short>(target - 1));
  std::size_t i = 0;
  for (; i + 16 <= m; i += 16) {
    const __m256i eq = _mm256_cmpeq_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + i)), t);
    // movemask gives two bits per 16-bit lane; pext keeps one per lane.
    const auto lanes = static_cast<std::uint32_t>(_pext_u32(static_cast<std::uint32_t>(_mm256_movemask_epi8(eq)), 0x55555555u));
    const auto hit = lanes & static_cast<std::uint32_t>((elig[i >> 6] >> (i & 63)) & 0xFFFF);
    if (hit) return i + static_cast<std::size_t>(std::countr_zero(hit));
  }
  for (; i < m; ++i)
    if (((elig[i >> 6] >> (i & 63)) & 1u) && d[i] + 1u == target) return i;
  return m;
}

}  // namespace kvevict::kernels::detail::avx2
KVEVICT_SUPPRESS_INTRIN_WARNINGS_END
#endif
