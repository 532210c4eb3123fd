// AVX-512 Hamming kernels: VPOPCNT{B,W} (BITALG) for 8/16-bit codes, VPOPCNT{D,Q} (VPOPCNTDQ)
// for wider ones, masked loads/stores for the tails so no row is handled by scalar code.
#pragma once

#include <cstddef>
#include <algorithm>
#include <bit>
#include <cstdint>

#include "dispatch.hpp"

#if KVEVICT_X86
#include <immintrin.h>
#endif
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

/// Distances narrowed to bytes (bits <= 128, so every distance fits): a quarter (64-bit codes)
/// of the uint16 form's write traffic, which matters once the codes stream from L2 or DRAM.
/// Only the widths with a dedicated byte path are here; the others go through uint16 blocks.
template <int W>
KVEVICT_TARGET_AVX512 inline void distances_u8(const std::uint8_t* q, const std::uint8_t* codes,
                                               std::size_t n, std::uint8_t* out) noexcept {
  static_assert(W == 1 || W == 2 || W == 8, "dedicated byte-output widths");
  std::size_t i = 0;
  if constexpr (W == 1) {
    const __m512i qv = _mm512_set1_epi8(static_cast<char>(q[0]));
    for (; i + 64 <= n; i += 64)
      _mm512_storeu_si512(out + i, _mm512_popcnt_epi8(_mm512_xor_si512(_mm512_loadu_si512(codes + i), qv)));
    if (i < n) {
      const __mmask64 m = (std::uint64_t{1} << (n - i)) - 1;
      const __m512i c = _mm512_popcnt_epi8(_mm512_xor_si512(_mm512_maskz_loadu_epi8(m, codes + i), qv));
      _mm512_mask_storeu_epi8(out + i, m, c);
    }
  } else if constexpr (W == 2) {
    const __m512i qv = _mm512_set1_epi16(static_cast<short>(scalar::load<std::uint16_t>(q)));
    for (; i + 32 <= n; i += 32) {
      const __m512i c = _mm512_popcnt_epi16(_mm512_xor_si512(_mm512_loadu_si512(codes + 2 * i), qv));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm512_cvtepi16_epi8(c));
    }
    if (i < n) {
      const auto m = static_cast<__mmask32>((std::uint64_t{1} << (n - i)) - 1);
      const __m512i c = _mm512_popcnt_epi16(_mm512_xor_si512(_mm512_maskz_loadu_epi16(m, codes + 2 * i), qv));
      _mm512_mask_cvtepi16_storeu_epi8(out + i, m, c);
    }
  } else {
    const __m512i qv = _mm512_set1_epi64(static_cast<long long>(scalar::load<std::uint64_t>(q)));
    // After the dword->word narrowing, byte 4j+{0,1,2,3} = rows {j, 16+j, 8+j, 24+j} of each
    // 128-bit half; the byte shuffle groups rows by four, the dword permute restores order.
    const __m256i shuf = _mm256_setr_epi8(0, 4, 8, 12, 2, 6, 10, 14, 1, 5, 9, 13, 3, 7, 11, 15,
                                          0, 4, 8, 12, 2, 6, 10, 14, 1, 5, 9, 13, 3, 7, 11, 15);
    const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (; i + 32 <= n; i += 32) {
      const __m512i a = popxor64(codes + 8 * i, qv);
      const __m512i b = popxor64(codes + 8 * i + 64, qv);
      const __m512i c = popxor64(codes + 8 * i + 128, qv);
      const __m512i d = popxor64(codes + 8 * i + 192, qv);
      const __m512i ab = _mm512_or_si512(a, _mm512_slli_epi64(b, 32));
      const __m512i cd = _mm512_or_si512(c, _mm512_slli_epi64(d, 32));
      const __m256i w = _mm512_cvtepi32_epi16(_mm512_or_si512(ab, _mm512_slli_epi32(cd, 8)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                          _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(w, shuf), perm));
    }
    for (; i < n; i += 8) {
      const std::size_t r = n - i < 8 ? n - i : 8;
      const auto m = static_cast<__mmask8>((1u << r) - 1);
      const __m512i c = _mm512_popcnt_epi64(_mm512_xor_si512(_mm512_maskz_loadu_epi64(m, codes + 8 * i), qv));
      _mm512_mask_cvtepi64_storeu_epi8(out + i, m, c);
    }
  }
}

/// Lane view of 64 bytes of W-byte codes, W <= 8: one code per lane, so distances, masked max
/// and equality need no cross-lane work. L lanes per vector; M is the matching mask type.
template <int W>
struct Lanes;

template <>
struct Lanes<1> {
  static constexpr int L = 64;
  using M = __mmask64;
  KVEVICT_TARGET_AVX512 static __m512i query(const std::uint8_t* q) { return _mm512_set1_epi8(static_cast<char>(q[0])); }
  KVEVICT_TARGET_AVX512 static __m512i load(M m, const std::uint8_t* p) { return _mm512_maskz_loadu_epi8(m, p); }
  KVEVICT_TARGET_AVX512 static __m512i pop(__m512i x) { return _mm512_popcnt_epi8(x); }
  KVEVICT_TARGET_AVX512 static __m512i max(__m512i a, M m, __m512i d) { return _mm512_mask_max_epu8(a, m, a, d); }
  KVEVICT_TARGET_AVX512 static __m512i umax(__m512i a, __m512i d) { return _mm512_max_epu8(a, d); }
  KVEVICT_TARGET_AVX512 static M eq(M m, __m512i d, unsigned v) { return _mm512_mask_cmpeq_epi8_mask(m, d, _mm512_set1_epi8(static_cast<char>(v))); }
  KVEVICT_TARGET_AVX512 static unsigned hmax(__m512i a) {
    __m256i h = _mm256_max_epu8(_mm512_castsi512_si256(a), _mm512_extracti64x4_epi64(a, 1));
    __m128i x = _mm_max_epu8(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
    x = _mm_max_epu8(x, _mm_srli_si128(x, 8));
    x = _mm_max_epu8(x, _mm_srli_si128(x, 4));
    x = _mm_max_epu8(x, _mm_srli_si128(x, 2));
    x = _mm_max_epu8(x, _mm_srli_si128(x, 1));
    return static_cast<unsigned>(_mm_cvtsi128_si32(x) & 0xFF);
  }
};

template <>
struct Lanes<2> {
  static constexpr int L = 32;
  using M = __mmask32;
  KVEVICT_TARGET_AVX512 static __m512i query(const std::uint8_t* q) { return _mm512_set1_epi16(static_cast<short>(scalar::load<std::uint16_t>(q))); }
  KVEVICT_TARGET_AVX512 static __m512i load(M m, const std::uint8_t* p) { return _mm512_maskz_loadu_epi16(m, p); }
  KVEVICT_TARGET_AVX512 static __m512i pop(__m512i x) { return _mm512_popcnt_epi16(x); }
  KVEVICT_TARGET_AVX512 static __m512i max(__m512i a, M m, __m512i d) { return _mm512_mask_max_epu16(a, m, a, d); }
  KVEVICT_TARGET_AVX512 static __m512i umax(__m512i a, __m512i d) { return _mm512_max_epu16(a, d); }
  KVEVICT_TARGET_AVX512 static M eq(M m, __m512i d, unsigned v) { return _mm512_mask_cmpeq_epi16_mask(m, d, _mm512_set1_epi16(static_cast<short>(v))); }
  KVEVICT_TARGET_AVX512 static unsigned hmax(__m512i a) {
    __m256i h = _mm256_max_epu16(_mm512_castsi512_si256(a), _mm512_extracti64x4_epi64(a, 1));
    __m128i x = _mm_max_epu16(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
    x = _mm_xor_si128(x, _mm_set1_epi32(-1));  // max = ~minpos(~x)
    return 0xFFFFu - static_cast<unsigned>(_mm_extract_epi16(_mm_minpos_epu16(x), 0));
  }
};

template <>
struct Lanes<4> {
  static constexpr int L = 16;
  using M = __mmask16;
  KVEVICT_TARGET_AVX512 static __m512i query(const std::uint8_t* q) { return _mm512_set1_epi32(static_cast<int>(scalar::load<std::uint32_t>(q))); }
  KVEVICT_TARGET_AVX512 static __m512i load(M m, const std::uint8_t* p) { return _mm512_maskz_loadu_epi32(m, p); }
  KVEVICT_TARGET_AVX512 static __m512i pop(__m512i x) { return _mm512_popcnt_epi32(x); }
  KVEVICT_TARGET_AVX512 static __m512i max(__m512i a, M m, __m512i d) { return _mm512_mask_max_epu32(a, m, a, d); }
  KVEVICT_TARGET_AVX512 static __m512i umax(__m512i a, __m512i d) { return _mm512_max_epu32(a, d); }
  KVEVICT_TARGET_AVX512 static M eq(M m, __m512i d, unsigned v) { return _mm512_mask_cmpeq_epi32_mask(m, d, _mm512_set1_epi32(static_cast<int>(v))); }
  KVEVICT_TARGET_AVX512 static unsigned hmax(__m512i a) { return _mm512_reduce_max_epu32(a); }
};

template <>
struct Lanes<8> {
  static constexpr int L = 8;
  using M = __mmask8;
  KVEVICT_TARGET_AVX512 static __m512i query(const std::uint8_t* q) { return _mm512_set1_epi64(static_cast<long long>(scalar::load<std::uint64_t>(q))); }
  KVEVICT_TARGET_AVX512 static __m512i load(M m, const std::uint8_t* p) { return _mm512_maskz_loadu_epi64(m, p); }
  KVEVICT_TARGET_AVX512 static __m512i pop(__m512i x) { return _mm512_popcnt_epi64(x); }
  KVEVICT_TARGET_AVX512 static __m512i max(__m512i a, M m, __m512i d) { return _mm512_mask_max_epu64(a, m, a, d); }
  KVEVICT_TARGET_AVX512 static __m512i umax(__m512i a, __m512i d) { return _mm512_max_epu64(a, d); }
  KVEVICT_TARGET_AVX512 static M eq(M m, __m512i d, unsigned v) { return _mm512_mask_cmpeq_epi64_mask(m, d, _mm512_set1_epi64(v)); }
  KVEVICT_TARGET_AVX512 static unsigned hmax(__m512i a) { return static_cast<unsigned>(_mm512_reduce_max_epu64(a)); }
};

/// Fully fused Hamming + protected mask + argmax for codes of at most 64 bits: no distance is
/// stored. Per block of 1024 rows the masked lane-wise maximum is kept in a register; a block
/// replaces the best only when strictly larger (ties -> lowest index); the winning block is
/// rescanned with a vector compare for its first row at the maximum.
template <int W>
KVEVICT_TARGET_AVX512 inline std::size_t fused_argmax(const std::uint8_t* q, const std::uint8_t* codes,
                                                      std::size_t n,
                                                      const std::uint64_t* prot) noexcept {
  using V = Lanes<W>;
  using M = typename V::M;
  constexpr int L = V::L, kPerWord = 64 / L;
  constexpr std::size_t kBlock = 1024;
  const __m512i qv = V::query(q);
  auto word = [&](std::size_t g) -> std::uint64_t {  // eligibility of rows [64g, 64g+64)
    std::uint64_t e = prot ? ~prot[g] : ~std::uint64_t{0};
    const std::size_t left = n - 64 * g;
    if (left < 64) e &= (std::uint64_t{1} << left) - 1;
    return e;
  };
  std::size_t best_base = static_cast<std::size_t>(-1);
  unsigned best = 0;
  const std::size_t groups = (n + 63) / 64;
  // Independent accumulators (two groups per step for 16-bit codes) break the merge-masked max
  // dependency chain; groups with no protected row skip the masks. Measured at n = 32K, 64-bit
  // codes: 3.3 us with one masked accumulator, 1.75 us now; 8 accumulators for 16-bit was slower.
  constexpr int kG = kPerWord >= 4 ? 1 : 4 / kPerWord;  // groups per step
  constexpr int kAcc = kG * kPerWord;
  for (std::size_t base = 0; base < n; base += kBlock) {
    __m512i acc[kAcc];
#pragma GCC unroll 8
    for (int a = 0; a < kAcc; ++a) acc[a] = _mm512_setzero_si512();
    std::uint64_t any = 0;
    const std::size_t g_end = std::min(groups, (base + kBlock) / 64);
    std::size_t g = base / 64;
    for (; g + kG <= g_end && 64 * (g + kG) <= n; g += kG) {
#pragma GCC unroll 4
      for (int u = 0; u < kG; ++u) {
        const std::uint64_t e = prot ? ~prot[g + u] : ~std::uint64_t{0};
        any |= e;
        const std::uint8_t* p = codes + (g + u) * 64 * W;
        if (e == ~std::uint64_t{0}) {  // no protected row here (the common case): no masks
#pragma GCC unroll 8
          for (int v = 0; v < kPerWord; ++v) {
            const __m512i x = _mm512_loadu_si512(p + v * 64);
            acc[u * kPerWord + v] = V::umax(acc[u * kPerWord + v], V::pop(_mm512_xor_si512(x, qv)));
          }
        } else {
#pragma GCC unroll 8
          for (int v = 0; v < kPerWord; ++v) {
            const __m512i x = _mm512_loadu_si512(p + v * 64);
            acc[u * kPerWord + v] = V::max(acc[u * kPerWord + v], static_cast<M>(e >> (v * L)),
                                           V::pop(_mm512_xor_si512(x, qv)));
          }
        }
      }
    }
    for (; g < g_end; ++g) {  // leftover groups, the last one possibly partial
      const std::uint64_t e = word(g);
      any |= e;
      const std::uint8_t* p = codes + g * 64 * W;
      const std::uint64_t valid =
          n - 64 * g >= 64 ? ~std::uint64_t{0} : (std::uint64_t{1} << (n - 64 * g)) - 1;
      for (int v = 0; v < kPerWord; ++v) {
        const __m512i x = V::load(static_cast<M>(valid >> (v * L)), p + v * 64);
        acc[0] = V::max(acc[0], static_cast<M>(e >> (v * L)), V::pop(_mm512_xor_si512(x, qv)));
      }
    }
#pragma GCC unroll 8
    for (int a = 1; a < kAcc; ++a) acc[0] = V::max(acc[0], static_cast<M>(~std::uint64_t{0}), acc[a]);
    if (any == 0) continue;
    const unsigned bm = V::hmax(acc[0]);
    if (best_base == static_cast<std::size_t>(-1) || bm > best) {
      best = bm;
      best_base = base;
    }
  }
  if (best_base == static_cast<std::size_t>(-1)) return best_base;
  const std::size_t g_end = std::min(groups, (best_base + kBlock) / 64);
  for (std::size_t g = best_base / 64; g < g_end; ++g) {
    const std::uint64_t e = word(g);
    const std::uint64_t valid = n - 64 * g >= 64 ? ~std::uint64_t{0} : (std::uint64_t{1} << (n - 64 * g)) - 1;
    const std::uint8_t* p = codes + g * 64 * W;
    for (int v = 0; v < kPerWord; ++v) {
      const __m512i x = V::load(static_cast<M>(valid >> (v * L)), p + v * 64);
      const M hit = V::eq(static_cast<M>(e >> (v * L)), V::pop(_mm512_xor_si512(x, qv)), best);
      if (hit) return 64 * g + static_cast<std::size_t>(v * L) + static_cast<std::size_t>(std::countr_zero(static_cast<std::uint64_t>(hit)));
    }
  }
  return static_cast<std::size_t>(-1);  // unreachable
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

/// First i < m with elig bit set and d[i] + 1 == target, or m.
KVEVICT_TARGET_AVX512 inline std::size_t block_find_first(const std::uint16_t* d, std::size_t m,
                                                          const std::uint64_t* elig,
                                                          unsigned target) noexcept {
  const __m512i t = _mm512_set1_epi16(static_cast<short>(target - 1));
  for (std::size_t i = 0; i < m; i += 32) {
    const std::size_t r = m - i < 32 ? m - i : 32;
    const __mmask32 tail = static_cast<__mmask32>((std::uint64_t{1} << r) - 1);
    const auto e = static_cast<__mmask32>((elig[i >> 6] >> (i & 63)) & tail);
    const __mmask32 hit = _mm512_mask_cmpeq_epi16_mask(e, _mm512_maskz_loadu_epi16(tail, d + i), t);
    if (hit) return i + static_cast<std::size_t>(std::countr_zero(static_cast<std::uint32_t>(hit)));
  }
  return m;
}

}  // namespace kvevict::kernels::detail::avx512
KVEVICT_SUPPRESS_INTRIN_WARNINGS_END
#endif
