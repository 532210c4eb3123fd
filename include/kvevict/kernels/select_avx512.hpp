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
#include "select_avx2.hpp"
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

/// Largest n topk_rank takes.
inline constexpr std::size_t kRankMaxN = 32;

/// Tiny-n float top-k (0 < k < n <= kRankMaxN) by ranks: each row's rank is the number of rows
/// before it in the order (a smaller key, or an equal key at a lower index), counted in
/// registers by one broadcast and two masked compares per row (no search, no branch on the
/// data); the rows of rank < k are left-packed in index order. Same set as topk_exact (ties
/// to the lower index, NaN last, -0 == +0). Below ~48 rows std::nth_element beat
/// topk_threshold's fixed cost (its dependent count steps).
KVEVICT_TARGET_AVX512 inline void topk_rank(const float* s, std::size_t n, std::size_t k,
                                            std::uint32_t* out) noexcept {
  alignas(64) std::int32_t key[kRankMaxN];
  const __m512i kmax = _mm512_set1_epi32(std::numeric_limits<std::int32_t>::max());
  const auto v0 = static_cast<__mmask16>(n >= 16 ? 0xFFFFu : (1u << n) - 1u);
  const auto v1 = static_cast<__mmask16>(n >= 32 ? 0xFFFFu : n > 16 ? (1u << (n - 16)) - 1u : 0u);
  // Rows past n hold the largest key and come after every row: never counted, rank >= n.
  const __m512i r0 = _mm512_mask_mov_epi32(kmax, v0, topk_skey16(_mm512_maskz_loadu_ps(v0, s)));
  const __m512i r1 =
      _mm512_mask_mov_epi32(kmax, v1, topk_skey16(_mm512_maskz_loadu_ps(v1, s + 16)));
  _mm512_store_si512(key, r0);
  _mm512_store_si512(key + 16, r1);
  const __m512i one = _mm512_set1_epi32(1);
  __m512i rank0 = _mm512_setzero_si512(), rank1 = rank0;
  for (std::size_t j = 0; j < n; ++j) {
    const __m512i b = _mm512_set1_epi32(key[j]);
    // Lanes i after row j count it when key_j <= key_i, the others when key_j < key_i.
    const auto after0 = static_cast<__mmask16>(j < 15 ? 0xFFFFu << (j + 1) : 0u);
    const auto after1 = static_cast<__mmask16>(j < 16 ? 0xFFFFu : j < 31 ? 0xFFFFu << (j - 15) : 0u);
    rank0 = _mm512_mask_add_epi32(
        rank0,
        static_cast<__mmask16>(_mm512_mask_cmple_epi32_mask(after0, b, r0) |
                               _mm512_mask_cmplt_epi32_mask(static_cast<__mmask16>(~after0), b, r0)),
        rank0, one);
    if (n > 16)
      rank1 = _mm512_mask_add_epi32(
          rank1,
          static_cast<__mmask16>(_mm512_mask_cmple_epi32_mask(after1, b, r1) |
                                 _mm512_mask_cmplt_epi32_mask(static_cast<__mmask16>(~after1), b, r1)),
          rank1, one);
  }
  const __m512i vk = _mm512_set1_epi32(static_cast<int>(k));
  const __mmask16 sel0 = _mm512_mask_cmplt_epi32_mask(v0, rank0, vk);
  const std::size_t c0 =
      compress_store(out, sel0, _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  if (n > 16)
    compress_store(out + c0, _mm512_mask_cmplt_epi32_mask(v1, rank1, vk),
                   _mm512_setr_epi32(16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31));
}

/// byte_step's digit at bits b.. from the counts n[d] of its C candidates (lanes <= each,
/// growing with d): the digit (how many count fewer than k) into *t, the count of the largest
/// such candidate into *c_lt (unchanged when the digit is 0). No serial chain: the counts
/// short of k are a prefix and the largest of them is the last.
template <int C>
KVEVICT_ALWAYS_INLINE void byte_digit(const std::size_t* n, int b, std::size_t k, unsigned* t,
                                      std::size_t* c_lt) noexcept {
  unsigned digit = 0;
  std::size_t below = 0;
  for (int d = 0; d < C; ++d) {
    const bool short_of_k = n[d] < k;
    digit += short_of_k;
    below = std::max(below, short_of_k ? n[d] : 0);
  }
  *c_lt = digit != 0 ? below : *c_lt;
  *t |= digit << b;
}

/// One step of topk_threshold's byte search, W bits at b..b+W-1: the counts of lanes <= each
/// of the 2^W - 1 candidates t | d << b | (2^b - 1), d = 0 .. 2^W - 2 (byte patterns;
/// Signed: lanes and candidates compare as signed bytes, their patterns offset by 0x80), over
/// nb registers of 64 bytes, plus `base`. The digit (how many candidates count fewer than k)
/// goes into *t, and the count of the largest such candidate into *c_lt (unchanged when the
/// digit is 0): at the end, t is the k-th smallest byte and c_lt the count below it.
template <int W, bool Signed>
KVEVICT_TARGET_AVX512 KVEVICT_ALWAYS_INLINE void byte_step(const std::uint8_t* v, std::size_t nb,
                                                          int b, std::size_t k, std::size_t base,
                                                          unsigned* t, std::size_t* c_lt) noexcept {
  constexpr int C = (1 << W) - 1;
  const unsigned first = *t | ((1u << b) - 1), flip = Signed ? 0x80u : 0u;
  __m512i c[C];
  std::size_t cnt[C];
  for (int d = 0; d < C; ++d) {
    c[d] = _mm512_set1_epi8(static_cast<char>((first + (static_cast<unsigned>(d) << b)) ^ flip));
    cnt[d] = base;
  }
  // Two registers per iteration into two sums each: short add chains (the steps wait on them).
  std::size_t cnt2[C];
  for (int d = 0; d < C; ++d) cnt2[d] = 0;
  auto count = [&](const std::uint8_t* p, std::size_t* into)
                   KVEVICT_TARGET_AVX512 __attribute__((always_inline)) {
    const __m512i x = _mm512_load_si512(p);
    for (int d = 0; d < C; ++d) {
      const __mmask64 le = Signed ? _mm512_cmple_epi8_mask(x, c[d]) : _mm512_cmple_epu8_mask(x, c[d]);
      into[d] += static_cast<std::size_t>(_mm_popcnt_u64(_cvtmask64_u64(le)));
    }
  };
  std::size_t r = 0;
  for (; r + 2 <= nb; r += 2) {
    count(v + 64 * r, cnt);
    count(v + 64 * r + 64, cnt2);
  }
  if (r < nb) count(v + 64 * r, cnt);
  for (int d = 0; d < C; ++d) cnt[d] += cnt2[d];
  byte_digit<C>(cnt, b, k, t, c_lt);
}

/// The k-th smallest byte of nb registers (plus `base` lanes below every byte) and the count
/// below it, 2 bits per step (four steps). Up to 256 rows this was 3 + 3 + 2 bits (one step
/// fewer, 17 candidates instead of 12): the compares and mask moves bind there too, and with
/// four 2-bit steps topk_indices took 0.70-0.96x its time at 48-256 rows (N(0,1) scores, a
/// harness loop, best of 30 x 2000 calls; stop 34, branch sel2).
template <bool Signed>
KVEVICT_TARGET_AVX512 KVEVICT_ALWAYS_INLINE unsigned byte_select(const std::uint8_t* v,
                                                                std::size_t nb, std::size_t k,
                                                                std::size_t base,
                                                                std::size_t* c_lt) noexcept {
  unsigned t = 0;
  for (int b = 6; b >= 0; b -= 2) byte_step<2, Signed>(v, nb, b, k, base, &t, c_lt);
  return t;
}

/// The lowest *take_eq lanes of eq (all of them when fewer); *take_eq less those kept.
KVEVICT_TARGET_AVX512 KVEVICT_ALWAYS_INLINE __mmask16 keep_ties(__mmask16 eq,
                                                               std::size_t* take_eq) noexcept {
  if (eq == 0) return eq;
  const auto c = static_cast<std::size_t>(_mm_popcnt_u32(eq));
  if (c > *take_eq) eq = static_cast<__mmask16>(_pdep_u32((1u << *take_eq) - 1, eq));
  *take_eq -= c > *take_eq ? *take_eq : c;
  return eq;
}

/// Left-packs the ids idx of the lanes in sel at out + pos (out holds k entries: a whole
/// register while it fits, the lanes past the count overwritten later; near the end only
/// the selected lanes); returns the position past them.
KVEVICT_TARGET_AVX512 KVEVICT_ALWAYS_INLINE std::size_t emit_ids(std::uint32_t* out,
                                                                std::size_t pos, std::size_t k,
                                                                __mmask16 sel,
                                                                __m512i idx) noexcept {
  const __m512i packed = _mm512_maskz_compress_epi32(sel, idx);
  const auto c = static_cast<std::size_t>(_mm_popcnt_u32(sel));
  if (pos + 16 <= k)
    _mm512_storeu_si512(out + pos, packed);
  else
    _mm512_mask_storeu_epi32(out + pos, static_cast<__mmask16>((1u << c) - 1), packed);
  return pos + c;
}

/// Small-n float top-k (0 < k < n <= kThresholdMaxN) by a threshold search, no sampling and
/// no sort. The signed order keys' high 16 bits T16 of the k-th key are found a byte at a
/// time (byte_select: 2 bits per step; per
/// step one byte compare and one 64-bit popcount per candidate and 64 rows): first the high byte among the keys' high bytes (signed, packed 64 to a register),
/// then the low byte among the second bytes of the keys sharing that high byte (the others
/// set to 0xFF, above every candidate: their count below is known). This also gives the
/// count of keys whose high half is below T16. The keys sharing T16 (usually one to three)
/// are picked out and the wanted rank among their low halves taken
/// (scalar::threshold_key): that is the k-th key T. One pass left-packs (VPCOMPRESSD) the
/// ids of the keys below T and the lowest-index keys equal to T. Same set as topk_exact
/// (ties to the lower index, NaN last, -0 == +0); ids in index order.
/// MaxN: the largest n (the stack buffers' size). Emit false (topk_band): no pass, out
/// unused; returns T with *take_eq, the number of keys equal to T taken (lowest index first).
template <std::size_t MaxN = kThresholdMaxN, bool Emit = true>
KVEVICT_TARGET_AVX512 inline std::int32_t topk_threshold(const float* s, std::size_t n,
                                                         std::size_t k, std::uint32_t* out,
                                                         std::size_t* take_eq_out = nullptr) noexcept {
  static_assert(MaxN % 64 == 0);
  alignas(64) std::int32_t key[MaxN];
  alignas(64) std::uint8_t hb[MaxN];  // key >> 24, in packing order (not row order)
  alignas(64) std::uint8_t lb[MaxN];  // (key >> 16) & 0xFF, same order as hb
  alignas(64) std::int32_t cand[MaxN];
  const std::size_t nv = (n + 15) / 16, nb = (n + 63) / 64;
  const __m512i kmax = _mm512_set1_epi32(std::numeric_limits<std::int32_t>::max());
  for (std::size_t v = 0; v < nv; ++v) {
    const std::size_t r = n - 16 * v < 16 ? n - 16 * v : 16;
    const auto valid = static_cast<__mmask16>((1u << r) - 1);
    _mm512_store_si512(key + 16 * v,
                       _mm512_mask_mov_epi32(kmax, valid,
                                             topk_skey16(_mm512_maskz_loadu_ps(valid, s + 16 * v))));
  }
  // Pad to whole 64-row registers with the largest key (high byte 0x7F, second byte 0xFF):
  // counted only when a candidate is the largest, where the real count is n >= k anyway.
  for (std::size_t v = nv; v < 4 * nb; ++v) _mm512_store_si512(key + 16 * v, kmax);
  // The high halves of 4 key registers, packed (VPACKSSDW: in range, no saturation; the lane
  // order changes, which counting ignores), split into high and second bytes.
  const __m512i low8 = _mm512_set1_epi16(0xFF);
  for (std::size_t r = 0; r < nb; ++r) {
    const std::int32_t* kp = key + 64 * r;
    const __m512i h0 = _mm512_packs_epi32(_mm512_srai_epi32(_mm512_load_si512(kp), 16),
                                          _mm512_srai_epi32(_mm512_load_si512(kp + 16), 16));
    const __m512i h1 = _mm512_packs_epi32(_mm512_srai_epi32(_mm512_load_si512(kp + 32), 16),
                                          _mm512_srai_epi32(_mm512_load_si512(kp + 48), 16));
    _mm512_store_si512(hb + 64 * r, _mm512_packs_epi16(_mm512_srai_epi16(h0, 8),
                                                       _mm512_srai_epi16(h1, 8)));
    _mm512_store_si512(lb + 64 * r, _mm512_packus_epi16(_mm512_and_si512(h0, low8),
                                                        _mm512_and_si512(h1, low8)));
  }
  // The high byte tb (unsigned pattern, sign flipped) and the count of keys below it.
  std::size_t c_lt = 0;
  const unsigned tb = byte_select<true>(hb, nb, k, 0, &c_lt);
  // The keys with high byte tb (m_tb, padding rows included when tb is their byte).
  const __m512i vtb = _mm512_set1_epi8(static_cast<char>(tb ^ 0x80u));
  std::size_t m_tb = 0;
  for (std::size_t r = 0; r < nb; ++r)
    m_tb += static_cast<std::size_t>(_mm_popcnt_u64(
        _cvtmask64_u64(_mm512_cmpeq_epi8_mask(_mm512_load_si512(hb + 64 * r), vtb))));
  std::size_t m = 0, take_eq = 0;
  std::int32_t t = 0, t_cand = 0;  // T, and T as cand holds it
  if (m_tb <= 16) {
    // Few keys share the high byte (the usual case at k = n/2 on spread scores): T is among
    // their full keys, no search of the second byte.
    const __m512i vtb32 = _mm512_set1_epi32(static_cast<std::int8_t>(tb ^ 0x80u));
    for (std::size_t v = 0; v < nv; ++v) {
      const __m512i x = _mm512_load_si512(key + 16 * v);
      const std::size_t r = n - 16 * v < 16 ? n - 16 * v : 16;
      const auto sel = _mm512_mask_cmpeq_epi32_mask(static_cast<__mmask16>((1u << r) - 1),
                                                    _mm512_srai_epi32(x, 24), vtb32);
      m += compress_store(reinterpret_cast<std::uint32_t*>(cand) + m, sel, x);
    }
    t = t_cand = scalar::kth_of(cand, m, k, c_lt, &take_eq);
  } else {
    // Second bytes of the keys with high byte tb; 0xFF elsewhere (candidates stay below
    // 0xFF: the bits of each step's digit are never all ones).
    const __m512i ff = _mm512_set1_epi8(-1);
    for (std::size_t r = 0; r < nb; ++r)
      _mm512_store_si512(lb + 64 * r, _mm512_mask_blend_epi8(
                                          _mm512_cmpeq_epi8_mask(_mm512_load_si512(hb + 64 * r), vtb),
                                          ff, _mm512_load_si512(lb + 64 * r)));
    const unsigned tl = byte_select<false>(lb, nb, k, c_lt, &c_lt);
    const auto t16 = static_cast<std::int16_t>(((tb << 8) | tl) ^ 0x8000u);
    const __m512i vt16 = _mm512_set1_epi32(t16);
    for (std::size_t v = 0; v < nv; ++v)
      for (unsigned eq = _mm512_cmpeq_epi32_mask(
               _mm512_srai_epi32(_mm512_load_si512(key + 16 * v), 16), vt16);
           eq; eq &= eq - 1) {
        const std::size_t j = 16 * v + static_cast<std::size_t>(std::countr_zero(eq));
        cand[m] = key[j] & 0xFFFF;  // keys with one high half order by the low one
        m += j < n;
      }
    t = scalar::threshold_key(cand, m, k, c_lt, t16, &take_eq);
    t_cand = t & 0xFFFF;
  }
  if constexpr (!Emit) {
    *take_eq_out = take_eq;
    return t;
  }
  const __m512i vt = _mm512_set1_epi32(t);
  __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  std::size_t pos = 0;
  // Left-packs the ids of the lanes in sel.
  auto emit = [&](__mmask16 sel) KVEVICT_TARGET_AVX512 __attribute__((always_inline)) {
    pos = emit_ids(out, pos, k, sel, idx);
    idx = _mm512_add_epi32(idx, step);
  };
  std::size_t eq_total = 0;  // keys equal to T (all among cand)
  for (std::size_t j = 0; j < m; ++j) eq_total += cand[j] == t_cand;
  if (take_eq == eq_total && t != std::numeric_limits<std::int32_t>::max()) {
    // Every key equal to T is taken (the usual case): the keys <= T, one compare per
    // register (padding, INT32_MAX, is above T).
    for (std::size_t v = 0; v < nv; ++v)
      emit(_mm512_cmple_epi32_mask(_mm512_load_si512(key + 16 * v), vt));
    return t;
  }
  for (std::size_t v = 0; v < nv; ++v) {
    const __m512i x = _mm512_load_si512(key + 16 * v);
    // Padding equals T only when T is NaN's key: it comes last, after take_eq real ties.
    const __mmask16 eq = keep_ties(_mm512_cmpeq_epi32_mask(x, vt), &take_eq);
    emit(static_cast<__mmask16>(_mm512_cmplt_epi32_mask(x, vt) | eq));
  }
  return t;
}

/// Largest n topk_scaled takes (its buffers live on the stack: about 9 n bytes).
inline constexpr std::size_t kScaledMaxN = 1024;
inline constexpr int kScaledNaNBin = 255;
/// Most rows of topk_scaled's bin t ranked in scalar code (more: topk_rank).
inline constexpr std::size_t kScaledScalarRankMaxM = 8;

/// The bins of 16 floats x for topk_scaled: floor((hi - x) * scale) for numbers (0 .. 254
/// for x in [lo, hi]: non-increasing in x, equal for equal x, -0 == +0), 255 for NaN (the
/// unsigned conversion of NaN is 0xFFFFFFFF). The same instructions wherever a bin is
/// computed, so bit-identical.
KVEVICT_TARGET_AVX512 KVEVICT_ALWAYS_INLINE __m512i scaled_bin16(__m512 x, __m512 vhi,
                                                               __m512 vscale) noexcept {
  return _mm512_min_epu32(_mm512_cvttps_epu32(_mm512_mul_ps(_mm512_sub_ps(vhi, x), vscale)),
                          _mm512_set1_epi32(kScaledNaNBin));
}

/// A 64-bit mask of topk_scaled's packed bins (bit 16 L + 4 q + i: row 16 q + 4 L + i) in
/// row order (bit 16 q + 4 L + i): a transpose of 4 x 4 nibbles by two delta swaps.
KVEVICT_ALWAYS_INLINE constexpr std::uint64_t scaled_pack_rows(std::uint64_t x) noexcept {
  auto swap = [](std::uint64_t v, std::uint64_t lower, int d) {
    const std::uint64_t t = ((v >> d) ^ v) & lower;
    return v ^ t ^ (t << d);
  };
  return swap(swap(x, 0x00000000FF00FF00ull, 24), 0x0000F0F00000F0F0ull, 12);
}

/// topk_scaled's 16-row load: rows past n read as NaN (bin 255, never compared true).
KVEVICT_TARGET_AVX512 KVEVICT_ALWAYS_INLINE __m512 scaled_load16(const float* s, std::size_t n,
                                                                std::size_t v) noexcept {
  if (16 * v + 16 <= n) return _mm512_loadu_ps(s + 16 * v);
  const std::size_t r = n > 16 * v ? n - 16 * v : 0;
  return _mm512_mask_loadu_ps(_mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()),
                              static_cast<__mmask16>((1u << r) - 1), s + 16 * v);
}

/// topk_scaled's bin form, from one pass over the numbers' range [lo, hi].
struct ScaledForm {
  float lo, hi, scale;
  /// Positive scores over more than 4 octaves (heavy-tailed, like accumulated attention):
  /// bins linear in the float bits instead (about log-scaled), else most rows share the
  /// lowest bins. bin = (bits(hi) - bits(x)) >> shift, 0 .. 254 for x in [lo, hi]
  /// (non-increasing in x, equal for equal x), NaN 255.
  bool log_bins;
  int shift;
};

/// The range pass of topk_scaled: false when the numbers have no finite positive range
/// (fewer than two distinct numbers, an infinity, a range too small or too large).
KVEVICT_TARGET_AVX512 KVEVICT_ALWAYS_INLINE bool scaled_form(const float* s, std::size_t n,
                                                            ScaledForm* f) noexcept {
  const std::size_t nv = (n + 15) / 16;
  const float inf = std::numeric_limits<float>::infinity();
  // The numbers' range: MINPS / MAXPS return their second operand when either is NaN.
  // Four registers each (short MINPS / MAXPS chains), whole 64-row blocks without a test
  // (eight each read 0.93-0.96x at 512 rows, stop 39).
  __m512 mn[4], mx[4];
  for (int j = 0; j < 4; ++j) mn[j] = _mm512_set1_ps(inf), mx[j] = _mm512_set1_ps(-inf);
  std::size_t v = 0;
  for (; 16 * v + 64 <= n; v += 4)
    for (std::size_t j = 0; j < 4; ++j) {
      const __m512 x = _mm512_loadu_ps(s + 16 * (v + j));
      mn[j] = _mm512_min_ps(x, mn[j]);
      mx[j] = _mm512_max_ps(x, mx[j]);
    }
  for (; v < nv; ++v) {
    const __m512 x = scaled_load16(s, n, v);
    mn[0] = _mm512_min_ps(x, mn[0]);
    mx[0] = _mm512_max_ps(x, mx[0]);
  }
  const float lo = _mm512_reduce_min_ps(
      _mm512_min_ps(_mm512_min_ps(mn[0], mn[1]), _mm512_min_ps(mn[2], mn[3])));
  const float hi = _mm512_reduce_max_ps(
      _mm512_max_ps(_mm512_max_ps(mx[0], mx[1]), _mm512_max_ps(mx[2], mx[3])));
  const float range = hi - lo;
  const float scale = static_cast<float>(kScaledNaNBin - 1) / range;
  if (!(range > 0.0f && range <= std::numeric_limits<float>::max() &&
        scale <= std::numeric_limits<float>::max()))
    return false;
  f->lo = lo;
  f->hi = hi;
  f->scale = scale;
  f->log_bins = lo > 0.0f && hi > 16.0f * lo;
  // The smallest shift with (bits(hi) - bits(lo)) >> shift <= 254, only for bit bins (no
  // loop: on N(0,1) scores the wrapped difference of signed bits needs ~24 steps of one).
  f->shift = 0;
  if (f->log_bins) {
    const std::uint32_t d = std::bit_cast<std::uint32_t>(hi) - std::bit_cast<std::uint32_t>(lo);
    f->shift = std::max(0, static_cast<int>(std::bit_width(d)) - 8);
    f->shift += (d >> f->shift) > static_cast<std::uint32_t>(kScaledNaNBin - 1);
  }
  return true;
}

/// topk_scaled's bit bins (ScaledForm::log_bins) of 16 floats, NaN 255.
KVEVICT_TARGET_AVX512 KVEVICT_ALWAYS_INLINE __m512i scaled_log_bin16(__m512 x, __m512i vhib,
                                                                   __m128i vshift) noexcept {
  return _mm512_mask_mov_epi32(
      _mm512_srl_epi32(_mm512_sub_epi32(vhib, _mm512_castps_si512(x)), vshift),
      _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(kScaledNaNBin));
}

/// 64 bins (0 .. 255 in int32 lanes) packed to bytes by VPACKUSDW + VPACKUSWB, which
/// interleave 4-row groups: byte 16 L + 4 q + i is row 16 q + 4 L + i (scaled_pack_rows).
KVEVICT_TARGET_AVX512 KVEVICT_ALWAYS_INLINE __m512i scaled_pack64(__m512i b0, __m512i b1,
                                                                 __m512i b2, __m512i b3) noexcept {
  return _mm512_packus_epi16(_mm512_packus_epi32(b0, b1), _mm512_packus_epi32(b2, b3));
}

/// Stores topk_scaled's register r of packed bins and counts byte_select's first step on
/// it in the bin pass (bins <= 63, 127, 191: constants), so that its compares overlap the
/// bin arithmetic: one dependent step less.
KVEVICT_TARGET_AVX512 KVEVICT_ALWAYS_INLINE void scaled_keep(std::uint8_t* qb, std::size_t r,
                                                            __m512i q, std::size_t* c1) noexcept {
  _mm512_store_si512(qb + 64 * r, q);
  for (int d = 0; d < 3; ++d)
    c1[d] += static_cast<std::size_t>(_mm_popcnt_u64(_cvtmask64_u64(
        _mm512_cmple_epu8_mask(q, _mm512_set1_epi8(static_cast<char>(64 * d + 63))))));
}

/// topk_scaled's k-th smallest bin t among nb registers of bins, and the rows below it
/// (*c_lt), from the first step's counts c1 and three dependent 2-bit steps.
KVEVICT_TARGET_AVX512 KVEVICT_ALWAYS_INLINE unsigned scaled_kth_bin(const std::size_t* c1,
                                                                   const std::uint8_t* qb,
                                                                   std::size_t nb, std::size_t k,
                                                                   std::size_t* c_lt) noexcept {
  unsigned t = 0;
  *c_lt = 0;
  byte_digit<3>(c1, 6, k, &t, c_lt);
  for (int b = 4; b >= 0; b -= 2) byte_step<2, false>(qb, nb, b, k, 0, &t, c_lt);
  return t;
}

KVEVICT_TARGET_AVX512 inline bool topk_scaled(const float* s, std::size_t n, std::size_t k,
                                              std::uint32_t* out, int depth = 0) noexcept;

/// topk_scaled's end: the need best (0 < need <= m) of bin t's m rows (floats cand, ids
/// cid, index order) appended at out: up to 8 by ranks counted in scalar code, up to 32 by
/// ranks counted in registers (topk_rank), more by binning again or topk_threshold's k-th key.
KVEVICT_TARGET_AVX512 KVEVICT_ALWAYS_INLINE void scaled_take(const float* cand,
                                                            const std::uint32_t* cid,
                                                            std::size_t m, std::size_t need,
                                                            std::uint32_t* out,
                                                            int depth) noexcept {
  if (need == m) {
    std::copy_n(cid, m, out);
    return;
  }
  if (m <= kScaledScalarRankMaxM) {
    // A few rows in bin t (the usual case on spread scores): each one's rank counted in
    // scalar code, cheaper than topk_rank's register setup. Bin t holds numbers only (NaN
    // is bin 255, refused before); float compares make -0 == +0; cand is in index order, so
    // an equal float at a lower position ranks first.
    // No branch on the data: every id stored at pos, which advances when it is taken (pos
    // stays below need until the last taken id).
    std::size_t pos = 0;
    for (std::size_t j = 0; j < m && pos < need; ++j) {
      const float c = cand[j];
      std::size_t rank = 0;
      for (std::size_t i = 0; i < m; ++i)
        rank += static_cast<std::size_t>((cand[i] > c) | ((cand[i] == c) & (i < j)));
      out[pos] = cid[j];
      pos += rank < need;
    }
    return;
  }
  if (m <= kRankMaxN) {  // the need best of bin t's rows by their ranks
    alignas(64) std::uint32_t local[kRankMaxN];
    topk_rank(cand, m, need, local);
    for (std::size_t j = 0; j < need; ++j) out[j] = cid[local[j]];
    return;
  }
  // Many rows in bin t (clustered or heavy-tailed scores): bin t's rows binned again over
  // their own range (twice at most), else the k-th key among them.
  if (depth < 2) {
    alignas(64) std::uint32_t local[kScaledMaxN];
    if (topk_scaled(cand, m, need, local, depth + 1)) {
      for (std::size_t j = 0; j < need; ++j) out[j] = cid[local[j]];
      return;
    }
  }
  std::size_t take_eq = 0, pos = 0;
  const float tf = avx2::topk_skey_float(
      topk_threshold<kScaledMaxN, false>(cand, m, need, nullptr, &take_eq));
  for (std::size_t j = 0; j < m; ++j) {
    const bool eq = cand[j] == tf;
    if (cand[j] > tf || (eq && take_eq != 0)) out[pos++] = cid[j];
    take_eq -= eq && take_eq != 0;
  }
}

/// Small-n float top-k (0 < k < n <= kScaledMaxN) by scaled bins: one pass takes the
/// numbers' range [lo, hi]; each row's bin floor((hi - x) * 254 / (hi - lo)) (NaN 255) is
/// packed 64 to a register and the k-th smallest bin t, with the count of rows below it,
/// found by byte_select (a smaller bin is a larger score). On spread scores a bin holds a
/// few rows (N(0,1), 256 rows: about 2 near any rank), where the order keys' high byte
/// that topk_threshold searches first holds up to ~70 (one exponent). One pass left-packs
/// the ids of the rows in bins below t (all taken) into out and the floats and ids of bin
/// t's rows (index order) apart; the k - (rows below) best of those (larger first, ties to
/// the lower index) are appended: up to 8 by ranks counted in scalar code, up to 32 by
/// ranks counted in registers (topk_rank), more by binning again or topk_threshold's k-th key. Same set as topk_exact (ties to the lower index, NaN last,
/// -0 == +0); the ids are not in index order (bin t's come last). Returns false, out
/// unwritten, when the numbers have no finite positive range (fewer than two distinct
/// numbers, infinities) or the k-th row is a NaN.
KVEVICT_TARGET_AVX512 inline bool topk_scaled(const float* s, std::size_t n, std::size_t k,
                                              std::uint32_t* out, int depth) noexcept {
  alignas(64) std::uint8_t qb[kScaledMaxN];            // bins, packing order (not row order)
  alignas(64) float cand[kScaledMaxN + 16];            // bin t's floats, index order
  alignas(64) std::uint32_t cid[kScaledMaxN + 16];     // and their ids
  std::uint16_t hit_v[kScaledMaxN / 64];                // 64-row blocks holding bin t's rows
  std::uint64_t hit_m[kScaledMaxN / 64];                // and those rows
  const std::size_t nb = (n + 63) / 64;
  ScaledForm f;
  if (!scaled_form(s, n, &f)) return false;
  auto load = [&](std::size_t v) KVEVICT_TARGET_AVX512 __attribute__((always_inline)) {
    return scaled_load16(s, n, v);
  };
  const __m512 vhi = _mm512_set1_ps(f.hi), vscale = _mm512_set1_ps(f.scale);
  const __m512i vhib = _mm512_set1_epi32(static_cast<int>(std::bit_cast<std::uint32_t>(f.hi)));
  const __m128i vshift = _mm_cvtsi32_si128(f.shift);
  // The rest, compiled once per bin form.
  auto finish = [&](auto log_form) KVEVICT_TARGET_AVX512 __attribute__((always_inline)) {
  auto bin = [&](__m512 x) KVEVICT_TARGET_AVX512 __attribute__((always_inline)) {
    if constexpr (!decltype(log_form)::value)
      return scaled_bin16(x, vhi, vscale);
    else
      return scaled_log_bin16(x, vhib, vshift);
  };
  // The bins, 64 to a register, packed by VPACKUSDW + VPACKUSWB (bins <= 255: no
  // saturation; NaN's 0xFFFFFFFF is clamped to 255 first), which interleave 4-row groups:
  // byte 16 L + 4 q + i of block r is row 64 r + 16 q + 4 L + i (scaled_pack_rows); rows past
  // n in bin 255.
  // byte_select's first step counted here (scaled_keep).
  std::size_t c1[3] = {0, 0, 0};
  for (std::size_t r = 0; r < nb; ++r) {
    scaled_keep(qb, r,
                scaled_pack64(bin(load(4 * r)), bin(load(4 * r + 1)), bin(load(4 * r + 2)),
                              bin(load(4 * r + 3))),
                c1);
  }
  std::size_t c_lt;  // rows in bins below t
  const unsigned t = scaled_kth_bin(c1, qb, nb, k, &c_lt);
  if (t == kScaledNaNBin) return false;  // the k-th row is a NaN
  // The ids of the rows in bins below t into out (the bins compared 64 at a time, the ids
  // in packing order); the 64-row blocks holding bin t's rows noted, without a branch, their
  // masks put in row order, then their floats and ids left-packed apart (index order).
  const __m512i vt = _mm512_set1_epi8(static_cast<char>(t));
  const __m512i four = _mm512_set1_epi32(4), step = _mm512_set1_epi32(64 - 16);
  __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 32, 33, 34, 35, 48, 49, 50, 51);
  std::size_t pos = 0, nh = 0;
  for (std::size_t r = 0; r < nb; ++r) {
    const __m512i x = _mm512_load_si512(qb + 64 * r);
    const std::uint64_t lt = _cvtmask64_u64(_mm512_cmplt_epu8_mask(x, vt));
    const std::uint64_t eq = _cvtmask64_u64(_mm512_cmpeq_epi8_mask(x, vt));
    for (int j = 0; j < 4; ++j) {
      pos = emit_ids(out, pos, k, static_cast<__mmask16>(lt >> (16 * j)), idx);
      idx = _mm512_add_epi32(idx, four);
    }
    idx = _mm512_add_epi32(idx, step);
    hit_v[nh] = static_cast<std::uint16_t>(r);
    hit_m[nh] = eq;
    nh += eq != 0;
  }
  // Bin t's rows in row order: above 384 rows, up to 16 of them (the usual case) one at a
  // time by their mask bits, else by compresses of each 16-row part (against compresses
  // the bit loop read 1.08x at 512 rows k = 64 and 1.06x at k = 256, 1.11x at 384 rows k =
  // 64 but 0.92-0.93x on the repeated vectors at 320 rows k = 64 and 384 rows k = 192:
  // in-process A/B, stop 38).
  std::size_t m = 0;
  for (std::size_t h = 0; h < nh; ++h) {
    hit_m[h] = scaled_pack_rows(hit_m[h]);
    m += static_cast<std::size_t>(_mm_popcnt_u64(hit_m[h]));
  }
  if (m <= 16 && n > 384) {
    m = 0;
    for (std::size_t h = 0; h < nh; ++h) {
      const std::size_t base = 64 * static_cast<std::size_t>(hit_v[h]);
      for (std::uint64_t e = hit_m[h]; e != 0; e &= e - 1) {
        const std::size_t row = base + static_cast<std::size_t>(std::countr_zero(e));
        cand[m] = s[row];
        cid[m++] = static_cast<std::uint32_t>(row);
      }
    }
  } else {
    m = 0;
    for (std::size_t h = 0; h < nh; ++h) {
      const std::size_t r = hit_v[h];
      for (std::size_t j = 0; j < 4; ++j) {
        const auto e = static_cast<__mmask16>(hit_m[h] >> (16 * j));
        const std::size_t row = 64 * r + 16 * j;
        _mm512_storeu_ps(cand + m, _mm512_maskz_compress_ps(e, _mm512_maskz_loadu_ps(e, s + row)));
        _mm512_storeu_si512(cid + m, _mm512_maskz_compress_epi32(
                                         e, _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(row)),
                                                             _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8,
                                                                               9, 10, 11, 12, 13, 14, 15))));
        m += static_cast<std::size_t>(_mm_popcnt_u32(e));
      }
    }
  }
  scaled_take(cand, cid, m, k - pos, out + pos, depth);  // k - pos: 1 .. m (pos == c_lt)
  return true;
  };
  return f.log_bins ? finish(std::true_type{}) : finish(std::false_type{});
}

/// Appends base + i for the set bits i of sel at dst + pos (VPCOMPRESSB of the lane numbers,
/// widened 16 at a time; whole 16-id stores while they end at or below cap, else masked);
/// returns the position past them.
KVEVICT_TARGET_AVX512_VBMI2 KVEVICT_ALWAYS_INLINE std::size_t emit_lanes(std::uint32_t* dst,
                                                                        std::size_t pos,
                                                                        std::size_t cap,
                                                                        __mmask64 sel,
                                                                        std::size_t base) noexcept {
  const __m512i lanes = _mm512_set_epi8(
      63, 62, 61, 60, 59, 58, 57, 56, 55, 54, 53, 52, 51, 50, 49, 48, 47, 46, 45, 44, 43, 42, 41,
      40, 39, 38, 37, 36, 35, 34, 33, 32, 31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18,
      17, 16, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i packed = _mm512_maskz_compress_epi8(sel, lanes);
  const auto c = static_cast<std::size_t>(_mm_popcnt_u64(_cvtmask64_u64(sel)));
  const __m512i vbase = _mm512_set1_epi32(static_cast<int>(base));
  auto part = [&](std::size_t j, __m128i bytes)
                  KVEVICT_TARGET_AVX512_VBMI2 __attribute__((always_inline)) {
    const __m512i ids = _mm512_add_epi32(_mm512_cvtepu8_epi32(bytes), vbase);
    if (pos + 16 * j + 16 <= cap)
      _mm512_storeu_si512(dst + pos + 16 * j, ids);
    else
      _mm512_mask_storeu_epi32(dst + pos + 16 * j,
                               static_cast<__mmask16>((1u << std::min<std::size_t>(c - 16 * j, 16)) - 1),
                               ids);
  };
  part(0, _mm512_castsi512_si128(packed));
  if (c > 16) {
    part(1, _mm512_extracti32x4_epi32(packed, 1));
    if (c > 32) {
      part(2, _mm512_extracti32x4_epi32(packed, 2));
      if (c > 48) part(3, _mm512_extracti32x4_epi32(packed, 3));
    }
  }
  return pos + c;
}

/// topk_scaled with AVX512_VBMI / VBMI2 (has_avx512_vbmi2(); same set, same refusals):
/// each packed register of bins is put back in row order by one VPERMB, and the ids of the
/// rows in bins below t and in bin t come from one VPCOMPRESSB of the lane numbers per 64
/// rows each (emit_lanes) instead of 4 VPCOMPRESSD, bin t's in index order without mask
/// transposes. Scaled bins as floor((x - lo) * 253 / (hi - lo) + 1) by one FMA (1 .. 254
/// for numbers, non-decreasing in x, equal for equal x, -0 == +0; NaN converts to INT32_MIN,
/// which VPACKUSDW saturates to 0), complemented once per 64 rows (255 - bin: a larger score
/// in a smaller bin, NaN 255): no VPMINUD per 16 rows. Bit bins as topk_scaled's.
/// 512 rows k = 64 (N(0,1)): about 0.85x topk_scaled's time (stop 39).
KVEVICT_TARGET_AVX512_VBMI2 inline bool topk_scaled_vbmi2(const float* s, std::size_t n,
                                                          std::size_t k,
                                                          std::uint32_t* out) noexcept {
  alignas(64) std::uint8_t qb[kScaledMaxN];         // bins, row order
  alignas(64) float cand[kScaledMaxN + 16];         // bin t's floats, index order
  alignas(64) std::uint32_t cid[kScaledMaxN + 16];  // and their ids
  const std::size_t nb = (n + 63) / 64;
  ScaledForm f;
  if (!scaled_form(s, n, &f)) return false;
  const __m512 vlo = _mm512_set1_ps(f.lo), one = _mm512_set1_ps(1.0f);
  const __m512 vscale = _mm512_set1_ps(static_cast<float>(kScaledNaNBin - 2) / (f.hi - f.lo));
  const __m512i vhib = _mm512_set1_epi32(static_cast<int>(std::bit_cast<std::uint32_t>(f.hi)));
  const __m128i vshift = _mm_cvtsi32_si128(f.shift);
  // Byte p of a row-order register: the packed byte of row p (scaled_pack_rows' order).
  const __m512i row_of = _mm512_set_epi8(
      63, 62, 61, 60, 47, 46, 45, 44, 31, 30, 29, 28, 15, 14, 13, 12, 59, 58, 57, 56, 43, 42, 41,
      40, 27, 26, 25, 24, 11, 10, 9, 8, 55, 54, 53, 52, 39, 38, 37, 36, 23, 22, 21, 20, 7, 6, 5, 4,
      51, 50, 49, 48, 35, 34, 33, 32, 19, 18, 17, 16, 3, 2, 1, 0);
  auto finish = [&](auto log_form) KVEVICT_TARGET_AVX512_VBMI2 __attribute__((always_inline)) {
    constexpr bool kLog = decltype(log_form)::value;
    auto bin = [&](std::size_t v) KVEVICT_TARGET_AVX512_VBMI2 __attribute__((always_inline)) {
      const __m512 x = scaled_load16(s, n, v);
      if constexpr (kLog)
        return scaled_log_bin16(x, vhib, vshift);
      else
        return _mm512_cvttps_epi32(_mm512_fmadd_ps(_mm512_sub_ps(x, vlo), vscale, one));
    };
    // byte_select's first step counted in the bin pass, as in topk_scaled.
    std::size_t c1[3] = {0, 0, 0};
    for (std::size_t r = 0; r < nb; ++r) {
      __m512i q = _mm512_permutexvar_epi8(
          row_of, scaled_pack64(bin(4 * r), bin(4 * r + 1), bin(4 * r + 2), bin(4 * r + 3)));
      if constexpr (!kLog) q = _mm512_xor_si512(q, _mm512_set1_epi8(-1));
      scaled_keep(qb, r, q, c1);
    }
    std::size_t c_lt;  // rows in bins below t
    const unsigned t = scaled_kth_bin(c1, qb, nb, k, &c_lt);
    if (t == kScaledNaNBin) return false;  // the k-th row is a NaN
    const __m512i vt = _mm512_set1_epi8(static_cast<char>(t));
    std::size_t pos = 0, m = 0;
    for (std::size_t r = 0; r < nb; ++r) {
      const __m512i x = _mm512_load_si512(qb + 64 * r);
      pos = emit_lanes(out, pos, k, _mm512_cmplt_epu8_mask(x, vt), 64 * r);
      m = emit_lanes(cid, m, kScaledMaxN + 16, _mm512_cmpeq_epi8_mask(x, vt), 64 * r);
    }
    for (std::size_t j = 0; j < m; ++j) cand[j] = s[cid[j]];
    scaled_take(cand, cid, m, k - pos, out + pos, 0);  // k - pos: 1 .. m (pos == c_lt)
    return true;
  };
  return f.log_bins ? finish(std::true_type{}) : finish(std::false_type{});
}

/// Most candidates topk_filter and topk_group_max keep before they give up (their buffers
/// live on the stack).
inline constexpr std::size_t kFilterMaxM = kThresholdMaxN;

/// Most candidates past k topk_drop_worst takes (candidates: at most kRankMaxN).
inline constexpr std::size_t kDropMaxD = 4;

/// The k best of m candidates (k < m <= 16 R, m - k small: a bound that was not exact),
/// floats cf and ids ci in index order: the m - k worst removed one at a time (the largest
/// order key in registers, the highest index among equal keys: ties go to the lower
/// index), the others' ids left-packed into out (index order). Some 30 cycles a removal,
/// where topk_rank's m dependent broadcast steps took ~25-40 ns at m ~ 20 (stop 37).
template <std::size_t R>
KVEVICT_TARGET_AVX512 inline void topk_drop_worst(const float* cf, const std::uint32_t* ci,
                                                  std::size_t m, std::size_t k,
                                                  std::uint32_t* out) noexcept {
  static_assert(R == 1 || R == 2);
  const __m512i gone = _mm512_set1_epi32(std::numeric_limits<std::int32_t>::min());
  __m512i key[R];
  __mmask16 alive[R];
  for (std::size_t r = 0; r < R; ++r) {
    const std::size_t left = m > 16 * r ? m - 16 * r : 0;
    alive[r] = static_cast<__mmask16>(left >= 16 ? 0xFFFFu : (1u << left) - 1);
    // Removed and missing lanes hold INT32_MIN, below every order key (+inf's is above it).
    key[r] = _mm512_mask_mov_epi32(gone, alive[r],
                                   topk_skey16(_mm512_maskz_loadu_ps(alive[r], cf + 16 * r)));
  }
  for (std::size_t d = m - k; d != 0; --d) {
    __m512i mx = R == 2 ? _mm512_max_epi32(key[0], key[R - 1]) : key[0];
    mx = _mm512_max_epi32(mx, _mm512_shuffle_i32x4(mx, mx, 0x4E));
    mx = _mm512_max_epi32(mx, _mm512_shuffle_i32x4(mx, mx, 0xB1));
    mx = _mm512_max_epi32(mx, _mm512_shuffle_epi32(mx, _MM_PERM_BADC));
    mx = _mm512_max_epi32(mx, _mm512_shuffle_epi32(mx, _MM_PERM_CDAB));
    std::uint32_t eq = _mm512_cmpeq_epi32_mask(key[0], mx);
    if constexpr (R == 2) eq |= static_cast<std::uint32_t>(_mm512_cmpeq_epi32_mask(key[1], mx)) << 16;
    const std::uint32_t last = 1u << (31 - std::countl_zero(eq));
    for (std::size_t r = 0; r < R; ++r) {
      const auto w = static_cast<__mmask16>(last >> (16 * r));
      key[r] = _mm512_mask_mov_epi32(key[r], w, gone);
      alive[r] = static_cast<__mmask16>(alive[r] & ~w);
    }
  }
  const std::size_t c0 = compress_store(out, alive[0], _mm512_maskz_loadu_epi32(alive[0], ci));
  if constexpr (R == 2)
    compress_store(out + c0, alive[1], _mm512_maskz_loadu_epi32(alive[1], ci + 16));
}

/// topk_above's finish: the k best (0 < k <= m <= kFilterMaxM) of m candidates, floats cf
/// and ids ci in index order (ties to the lower index), ids into out.
KVEVICT_TARGET_AVX512 inline void topk_of_candidates(const float* cf, const std::uint32_t* ci,
                                                     std::size_t m, std::size_t k,
                                                     std::uint32_t* out) noexcept {
  if (m == k) {  // one register up to 16 ids (a call to memmove cost more at k = 8)
    if (k > 16) return static_cast<void>(std::copy_n(ci, k, out));
    const auto w = static_cast<__mmask16>((1u << k) - 1);
    _mm512_mask_storeu_epi32(out, w, _mm512_maskz_loadu_epi32(w, ci));
    return;
  }
  if (m - k <= kDropMaxD && m <= kRankMaxN)
    return m <= 16 ? topk_drop_worst<1>(cf, ci, m, k, out) : topk_drop_worst<2>(cf, ci, m, k, out);
  alignas(64) std::uint32_t local[kFilterMaxM];
  if (m <= kRankMaxN)
    topk_rank(cf, m, k, local);
  else if (!topk_scaled(cf, m, k, local))
    topk_threshold(cf, m, k, local);
  for (std::size_t j = 0; j < k; ++j) out[j] = ci[local[j]];
}

/// The k best rows (0 < k < n) given a lower bound lb on the k-th largest score: one pass
/// left-packs the scores >= lb and their ids (float compares: NaN never, -0 == +0);
/// topk_rank (up to 32), topk_scaled or topk_threshold takes the k best among them, ids
/// mapped back (the candidates keep index order, so ties still go to the lower index). Same
/// set as topk_exact. Returns false, having written nothing, when the candidates are fewer
/// than k (NaN among the k best) or more than kFilterMaxM. Sparse (few candidates, most
/// 16-row blocks without one): no VPCOMPRESSD for a block without a candidate (about 1.4 ns
/// each on this AVX-512 CPU, stop 36); dense (topk_filter's few hundred): no branch.
template <bool Sparse>
KVEVICT_TARGET_AVX512 inline bool topk_above(const float* s, std::size_t n, std::size_t k,
                                             float lb, std::uint32_t* out) noexcept {
  alignas(64) float cf[kFilterMaxM + 16];
  alignas(64) std::uint32_t ci[kFilterMaxM + 16];
  const __m512 vl = _mm512_set1_ps(lb);
  __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  std::size_t m = 0;
  for (std::size_t i = 0; i < n; i += 16) {
    const std::size_t r = n - i < 16 ? n - i : 16;
    const auto valid = static_cast<__mmask16>((1u << r) - 1);
    const __m512 x = _mm512_maskz_loadu_ps(valid, s + i);
    const __mmask16 sel = _mm512_mask_cmp_ps_mask(valid, x, vl, _CMP_GE_OQ);
    if (!Sparse || sel != 0) {
      _mm512_storeu_ps(cf + m, _mm512_maskz_compress_ps(sel, x));  // 16 spare entries
      _mm512_storeu_si512(ci + m, _mm512_maskz_compress_epi32(sel, idx));
      m += static_cast<std::size_t>(_mm_popcnt_u32(sel));
      if (m > kFilterMaxM) return false;
    }
    idx = _mm512_add_epi32(idx, step);
  }
  if (m < k) return false;
  topk_of_candidates(cf, ci, m, k, out);
  return true;
}

/// Float top-k for k <= 64 (0 < k < n) by a lower bound: the rows fall in 32 groups (row i
/// in group (i / 16) % 2 * 16 + i % 16: two registers of running maxima and second maxima),
/// and the smallest of the 32 second maxima, L, is at most the k-th largest score (each
/// group has two rows >= L: 64 rows); topk_above finishes. Same set as topk_exact. Returns
/// false, having written nothing, when topk_above does.
KVEVICT_TARGET_AVX512 inline bool topk_filter(const float* s, std::size_t n, std::size_t k,
                                              std::uint32_t* out) noexcept {
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 m1[2] = {ninf, ninf}, m2[2] = {ninf, ninf};
  // MAXPS / MINPS return their second operand when either is NaN: max(x, m1) keeps m1 and
  // min(m1, x) gives NaN, which max(., m2) drops: a NaN score never enters a group's two.
  auto add = [&](int g, __m512 x) KVEVICT_TARGET_AVX512 __attribute__((always_inline)) {
    m2[g] = _mm512_max_ps(_mm512_min_ps(m1[g], x), m2[g]);
    m1[g] = _mm512_max_ps(x, m1[g]);
  };
  std::size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    add(0, _mm512_loadu_ps(s + i));
    add(1, _mm512_loadu_ps(s + i + 16));
  }
  for (int g = 0; i + 16 * static_cast<std::size_t>(g) < n; ++g) {  // the last 1-31 rows
    const std::size_t r = std::min<std::size_t>(n - i - 16 * static_cast<std::size_t>(g), 16);
    add(g, _mm512_mask_loadu_ps(ninf, static_cast<__mmask16>((1u << r) - 1),
                                s + i + 16 * static_cast<std::size_t>(g)));
  }
  // A group with fewer than two numbers keeps -inf: L = -inf, every number a candidate.
  return topk_above<false>(s, n, k, _mm512_reduce_min_ps(_mm512_min_ps(m2[0], m2[1])), out);
}

/// One compare-exchange stage of a bitonic network on 16 lanes: lane i meets lane i ^ D and
/// keeps the larger when (i & D) == 0 matches (i & S) == 0 (descending blocks of S lanes,
/// S = 16: all descending). Values are never NaN here (float min / max).
template <unsigned S, unsigned D>
KVEVICT_TARGET_AVX512 KVEVICT_ALWAYS_INLINE __m512 bitonic_step16(__m512 v) noexcept {
  constexpr auto keep_max = [] {
    unsigned m = 0;
    for (unsigned i = 0; i < 16; ++i) m |= static_cast<unsigned>(((i & D) == 0) == ((i & S) == 0)) << i;
    return static_cast<__mmask16>(m);
  }();
  const __m512i partner = _mm512_xor_si512(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(static_cast<int>(D)));
  const __m512 p = _mm512_permutexvar_ps(partner, v);
  return _mm512_mask_blend_ps(keep_max, _mm512_min_ps(v, p), _mm512_max_ps(v, p));
}

/// A bitonic sequence of 16 floats (no NaN) sorted descending (4 steps).
KVEVICT_TARGET_AVX512 KVEVICT_ALWAYS_INLINE __m512 merge16_desc(__m512 v) noexcept {
  return bitonic_step16<16, 1>(bitonic_step16<16, 2>(bitonic_step16<16, 4>(bitonic_step16<16, 8>(v))));
}

/// 16 floats (no NaN) sorted descending by a bitonic network (10 steps).
KVEVICT_TARGET_AVX512 KVEVICT_ALWAYS_INLINE __m512 sort16_desc(__m512 v) noexcept {
  v = bitonic_step16<2, 1>(v);
  v = bitonic_step16<4, 1>(bitonic_step16<4, 2>(v));
  v = bitonic_step16<8, 1>(bitonic_step16<8, 2>(bitonic_step16<8, 4>(v)));
  return merge16_desc(v);
}

/// Row groups topk_group_max takes the maxima of (8 registers of 16 lanes).
inline constexpr std::size_t kGroupMaxG = 128;
/// Largest k whose bound topk_group_max takes from each lane's two best maxima (up to 512
/// rows).
inline constexpr std::size_t kGroupTop2MaxK = 12;

/// Float top-k for k <= 64 (0 < k < n) by a tighter lower bound: the rows fall in 128 groups
/// (row i in group i % 128: eight registers of running maxima, NaN never entering), and any
/// L at most the k-th largest of the 128 maxima is at most the k-th largest score (k
/// distinct rows, the groups' best, are >= L). L is found by scaled bins on the maxima
/// (topk_scaled's bins over their range, 2 registers of bytes, byte_select): the smallest
/// maximum in bins up to the k-th's bin t (at least k maxima are >= it). On N(0,1) scores
/// (any order-preserving transform alike) that leaves about k + 20 candidates at k = 64
/// (k + 3 at k = 32, at most ~110 at k = 64 over 3000 draws of 320-1024 rows) for
/// topk_above. Up to 512 rows at k <= kGroupTop2MaxK, L is instead the k-th largest of
/// each lane's two best maxima (sorting networks, no bins). Any L above the k-th score
/// leaves fewer than k candidates (a refusal), never a wrong set. Same set as topk_exact.
/// Returns false, having written nothing, when topk_above does (NaN among the k best, more
/// than kFilterMaxM candidates).
KVEVICT_TARGET_AVX512 inline bool topk_group_max(const float* s, std::size_t n, std::size_t k,
                                                 std::uint32_t* out) noexcept {
  constexpr std::size_t R = kGroupMaxG / 16;
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 mx[R];
  for (std::size_t r = 0; r < R; ++r) mx[r] = ninf;
  // MAXPS returns its second operand when either is NaN: max(x, m) keeps m on a NaN.
  std::size_t i = 0;
  for (; i + kGroupMaxG <= n; i += kGroupMaxG)
    for (std::size_t r = 0; r < R; ++r) mx[r] = _mm512_max_ps(_mm512_loadu_ps(s + i + 16 * r), mx[r]);
  for (std::size_t r = 0; i + 16 * r < n; ++r) {  // the last 1-127 rows
    const std::size_t c = std::min<std::size_t>(n - i - 16 * r, 16);
    mx[r] = _mm512_max_ps(_mm512_mask_loadu_ps(ninf, static_cast<__mmask16>((1u << c) - 1),
                                               s + i + 16 * r),
                          mx[r]);
  }
  if (n <= 4 * kGroupMaxG && k <= kGroupTop2MaxK) {
    // Up to 512 rows at k <= 12 (stop 37): each lane's two best of its 8 maxima (a tree of
    // pairs), both sorted, their 16 best merged (bitonic networks in registers): the k-th of
    // those 32 is at most the k-th of the 128 (the same unless a lane holds 3 of the k best
    // maxima), without the range, bins and byte search below (1.12-1.23x at 256-512 rows,
    // k 4-12; at k = 16 a lane holding 3 of the 16 best left too many candidates).
    auto top2 = [](__m512 a1, __m512 a2, __m512 b1, __m512 b2, __m512* h, __m512* l)
                    KVEVICT_TARGET_AVX512 __attribute__((always_inline)) {
      *h = _mm512_max_ps(a1, b1);
      *l = _mm512_max_ps(_mm512_min_ps(a1, b1), _mm512_max_ps(a2, b2));
    };
    __m512 h[4], l[4];
    for (std::size_t r = 0; r < 4; ++r) {
      h[r] = _mm512_max_ps(mx[2 * r], mx[2 * r + 1]);
      l[r] = _mm512_min_ps(mx[2 * r], mx[2 * r + 1]);
    }
    top2(h[0], l[0], h[1], l[1], &h[0], &l[0]);
    top2(h[2], l[2], h[3], l[3], &h[2], &l[2]);
    top2(h[0], l[0], h[2], l[2], &h[0], &l[0]);
    const __m512 a = sort16_desc(h[0]), b = sort16_desc(l[0]);
    const __m512 rev = _mm512_permutexvar_ps(
        _mm512_setr_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), b);
    const __m512 top = merge16_desc(_mm512_max_ps(a, rev));
    const float lb2 = _mm512_cvtss_f32(
        _mm512_permutexvar_ps(_mm512_set1_epi32(static_cast<int>(k - 1)), top));
    return topk_above<true>(s, n, k, lb2, out);
  }
  __m512 lo4 = _mm512_min_ps(_mm512_min_ps(mx[0], mx[1]), _mm512_min_ps(mx[2], mx[3]));
  __m512 hi4 = _mm512_max_ps(_mm512_max_ps(mx[0], mx[1]), _mm512_max_ps(mx[2], mx[3]));
  lo4 = _mm512_min_ps(lo4, _mm512_min_ps(_mm512_min_ps(mx[4], mx[5]), _mm512_min_ps(mx[6], mx[7])));
  hi4 = _mm512_max_ps(hi4, _mm512_max_ps(_mm512_max_ps(mx[4], mx[5]), _mm512_max_ps(mx[6], mx[7])));
  const float lo = _mm512_reduce_min_ps(lo4), hi = _mm512_reduce_max_ps(hi4);
  const float range = hi - lo;
  const float scale = static_cast<float>(kScaledNaNBin - 1) / range;
  // The smallest maximum is always a bound (all 128 are >= it); the bins only tighten it,
  // and only over a finite positive range (no infinity, two distinct maxima).
  float lb = lo;
  if (range > 0.0f && range <= std::numeric_limits<float>::max() &&
      scale <= std::numeric_limits<float>::max()) {
    const __m512 vhi = _mm512_set1_ps(hi), vscale = _mm512_set1_ps(scale);
    __m512i b[R];
    for (std::size_t r = 0; r < R; ++r) b[r] = scaled_bin16(mx[r], vhi, vscale);
    alignas(64) std::uint8_t qb[kGroupMaxG];
    for (std::size_t h = 0; h < R / 4; ++h)
      _mm512_store_si512(
          qb + 64 * h,
          _mm512_inserti32x4(
              _mm512_inserti32x4(
                  _mm512_inserti32x4(_mm512_castsi128_si512(_mm512_cvtusepi32_epi8(b[4 * h])),
                                     _mm512_cvtusepi32_epi8(b[4 * h + 1]), 1),
                  _mm512_cvtusepi32_epi8(b[4 * h + 2]), 2),
              _mm512_cvtusepi32_epi8(b[4 * h + 3]), 3));
    std::size_t c_lt = 0;
    const unsigned t = byte_select<false>(qb, R / 4, k, 0, &c_lt);
    const __m512i vt = _mm512_set1_epi32(static_cast<int>(t));
    __m512 m = _mm512_set1_ps(std::numeric_limits<float>::infinity());
    for (std::size_t r = 0; r < R; ++r)
      m = _mm512_mask_min_ps(m, _mm512_cmple_epu32_mask(b[r], vt), mx[r], m);
    lb = _mm512_reduce_min_ps(m);
  }
  return topk_above<true>(s, n, k, lb, out);
}

/// Most band rows topk_band hands to topk_threshold.
inline constexpr std::size_t kBandMaxM = 1536;

/// Float top-k for 0 < k < n, n > 64 (select.hpp: 513 to 4096 rows, k > 64) by one bracket
/// round: avx2::topk_small_bracket's floats lo <= hi around the k-th (a sorted 64-row
/// sample); one pass 16 rows at a time (float compares: NaN in neither class, -0 == +0)
/// counts the rows > hi and left-packs the floats in [lo, hi] (the band, index order) into
/// bf (n + 16 entries); topk_threshold finds the band's (k - rows above)-th key T and how
/// many rows equal to T are taken; a second pass left-packs the ids of the rows > T and the
/// first such rows equal to T (every row equal to T is in the band, so that count holds for
/// all rows). Two compresses per 16 rows (VPCOMPRESSD binds: a third, the ids of the rows
/// above hi in the first pass, cost more than the second pass). Same set as topk_exact.
/// Returns false, out unwritten, when the bracket misses the k-th or the band has more than
/// kBandMaxM rows.
KVEVICT_TARGET_AVX512 inline bool topk_band(const float* s, std::size_t n, std::size_t k,
                                            std::uint32_t* out, float* bf) noexcept {
  float hi, lo;
  avx2::topk_small_bracket(s, n, k, &hi, &lo);
  const __m512 vhi = _mm512_set1_ps(hi), vlo = _mm512_set1_ps(lo);
  std::size_t na = 0, nm = 0;
  for (std::size_t i = 0; i < n; i += 16) {
    const std::size_t r = n - i < 16 ? n - i : 16;
    const auto valid = static_cast<__mmask16>((1u << r) - 1);
    const __m512 x = _mm512_maskz_loadu_ps(valid, s + i);
    const __mmask16 ma = _mm512_mask_cmp_ps_mask(valid, x, vhi, _CMP_GT_OQ);
    const __mmask16 mm =
        _mm512_mask_cmp_ps_mask(static_cast<__mmask16>(valid & ~ma), x, vlo, _CMP_GE_OQ);
    _mm512_storeu_ps(bf + nm, _mm512_maskz_compress_ps(mm, x));  // 16 spare entries
    na += static_cast<std::size_t>(_mm_popcnt_u32(ma));
    nm += static_cast<std::size_t>(_mm_popcnt_u32(mm));
  }
  if (na >= k || na + nm < k || nm > kBandMaxM) return false;
  const std::size_t need = k - na;
  float tf = lo;     // need == nm: every row >= lo
  std::size_t take_eq = n;
  if (need < nm)  // T is a number's key (the band has no NaN)
    tf = avx2::topk_skey_float(topk_threshold<kBandMaxM, false>(bf, nm, need, nullptr, &take_eq));
  const __m512 vt = _mm512_set1_ps(tf);
  __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  std::size_t pos = 0;
  for (std::size_t i = 0; i < n; i += 16) {
    const std::size_t r = n - i < 16 ? n - i : 16;
    const auto valid = static_cast<__mmask16>((1u << r) - 1);
    const __m512 x = _mm512_maskz_loadu_ps(valid, s + i);
    const __mmask16 gt = _mm512_mask_cmp_ps_mask(valid, x, vt, _CMP_GT_OQ);
    const __mmask16 eq = keep_ties(_mm512_mask_cmp_ps_mask(valid, x, vt, _CMP_EQ_OQ), &take_eq);
    pos = emit_ids(out, pos, k, static_cast<__mmask16>(gt | eq), idx);
    idx = _mm512_add_epi32(idx, step);
  }
  return true;
}

/// lowest_open's open lanes of rows [r, r + 16), of which `lanes` are live (all but in the
/// tail), and their new scores in *v: with Decay, decay * s + x (the product kept in a
/// register through an empty asm, so it is never contracted into an FMA: a multiply, then an
/// add, as the scalar body), stored back; the open test seq - lo < span as unsigned compares
/// (two 8-lane 64-bit ones for 64-bit seqs, one 16-lane 32-bit one for 32-bit keys).
template <bool Decay, class K, bool Tail>
KVEVICT_TARGET_AVX512 KVEVICT_ALWAYS_INLINE __mmask16 lowest_open16(
    float* s, const float* x, const K* seqs, std::size_t r, __mmask16 lanes, __m512 g,
    __m512i vlo, __m512i vspan, __m512* v) noexcept {
  __m512 a = Tail ? _mm512_maskz_loadu_ps(lanes, s + r) : _mm512_loadu_ps(s + r);
  if constexpr (Decay) {
    __m512 prod = _mm512_mul_ps(g, a);
    __asm__("" : "+v"(prod));
    a = _mm512_add_ps(prod, Tail ? _mm512_maskz_loadu_ps(lanes, x + r) : _mm512_loadu_ps(x + r));
    if (Tail)
      _mm512_mask_storeu_ps(s + r, lanes, a);
    else
      _mm512_storeu_ps(s + r, a);
  }
  *v = a;
  if constexpr (sizeof(K) == 8) {
    const auto lo8 = static_cast<__mmask8>(lanes & 0xFFu);
    const auto hi8 = static_cast<__mmask8>(lanes >> 8);
    const __m512i s0 = Tail ? _mm512_maskz_loadu_epi64(lo8, seqs + r) : _mm512_loadu_si512(seqs + r);
    const __m512i s1 =
        Tail ? _mm512_maskz_loadu_epi64(hi8, seqs + r + 8) : _mm512_loadu_si512(seqs + r + 8);
    return static_cast<__mmask16>(
        static_cast<unsigned>(_mm512_mask_cmplt_epu64_mask(lo8, _mm512_sub_epi64(s0, vlo), vspan)) |
        (static_cast<unsigned>(_mm512_mask_cmplt_epu64_mask(hi8, _mm512_sub_epi64(s1, vlo), vspan))
         << 8));
  } else {
    const __m512i k =
        Tail ? _mm512_maskz_loadu_epi32(lanes, seqs + r) : _mm512_loadu_si512(seqs + r);
    return _mm512_mask_cmplt_epu32_mask(lanes, _mm512_sub_epi32(k, vlo), vspan);
  }
}

/// Offers to `best`, in row order, the candidate lanes m of rows [r, r + 16) (open, at or
/// below the running best value, so no NaN): when more than one, only those equal to their
/// minimum (the others cannot end up lowest: the same result as offering them all).
template <class K>
KVEVICT_TARGET_AVX512 KVEVICT_ALWAYS_INLINE void lowest_open_offer(__m512 v, unsigned m,
                                                                  const K* seqs, std::size_t r,
                                                                  scalar::LowestOpen& best) noexcept {
  if ((m & (m - 1)) != 0)
    m = _mm512_mask_cmp_ps_mask(static_cast<__mmask16>(m), v,
                                _mm512_set1_ps(_mm512_mask_reduce_min_ps(static_cast<__mmask16>(m), v)),
                                _CMP_EQ_OQ);
  alignas(64) float vals[16];
  _mm512_store_ps(vals, v);
  do {
    const auto j = static_cast<std::size_t>(std::countr_zero(m));
    best.offer(vals[j], seqs[r + j], r + j);
    m &= m - 1;
  } while (m != 0);
}

/// lowest_open / decay_lowest_open 16 rows at a time, one pass (the AVX2 form's method): the
/// open lanes (lowest_open16) at or below the running best value (rare once a low value is
/// found) go through the scalar (value, seq) rule; the tail (n % 16 rows) as one masked
/// block, not the scalar body: in this function the compiler may fuse a scalar multiply and
/// add.
template <bool Decay, class K>
KVEVICT_TARGET_AVX512 inline std::size_t lowest_open(float* s, const float* x, const K* seqs,
                                                     std::size_t n, float decay, K lo,
                                                     K hi) noexcept {
  constexpr bool wide = sizeof(K) == 8;
  const K span = hi > lo ? static_cast<K>(hi - lo) : K{0};
  scalar::LowestOpen best;
  const __m512 g = _mm512_set1_ps(decay);
  const __m512i vlo = wide ? _mm512_set1_epi64(static_cast<long long>(lo))
                           : _mm512_set1_epi32(static_cast<int>(static_cast<std::uint32_t>(lo)));
  const __m512i vspan = wide ? _mm512_set1_epi64(static_cast<long long>(span))
                             : _mm512_set1_epi32(static_cast<int>(static_cast<std::uint32_t>(span)));
  __m512 vbest = _mm512_set1_ps(best.value);
  std::size_t r = 0;
  for (; r + 16 <= n; r += 16) {
    __m512 v;
    const __mmask16 open =
        lowest_open16<Decay, K, false>(s, x, seqs, r, 0xFFFF, g, vlo, vspan, &v);
    const auto m = static_cast<unsigned>(_mm512_mask_cmp_ps_mask(open, v, vbest, _CMP_LE_OQ));
    if (m != 0) {
      lowest_open_offer<K>(v, m, seqs, r, best);
      vbest = _mm512_set1_ps(best.value);
    }
  }
  if (r < n) {
    __m512 v;
    const auto lanes = static_cast<__mmask16>((1u << (n - r)) - 1u);
    const __mmask16 open = lowest_open16<Decay, K, true>(s, x, seqs, r, lanes, g, vlo, vspan, &v);
    const auto m = static_cast<unsigned>(_mm512_mask_cmp_ps_mask(open, v, vbest, _CMP_LE_OQ));
    if (m != 0) lowest_open_offer<K>(v, m, seqs, r, best);
  }
  return best.index;
}

/// group_sum_bounded 16 columns at a time, G rows (G = 0: g rows, known at run time), the
/// last n % 16 columns as one masked block: each column's g values added in a register in
/// row order from 0.0f (the scalar body's additions, so the same sums bit for bit), stored
/// once; the range test keeps the largest bit pattern seen with -0 left out (the AVX2
/// form's test: every value +-0 or in (0, hi]). Half the instructions of the AVX2 form per
/// column: a mask compare and a masked max per value in place of a compare, an and-not and
/// a max.
/// One value vector of group_sum_bounded_cols: into the column sums, and into the running
/// maximum of the bit patterns unless -0.
KVEVICT_TARGET_AVX512 KVEVICT_ALWAYS_INLINE void group_sum_add(__m512 x, __m512i negz, __m512i& top,
                                                              __m512& acc) noexcept {
  const __m512i u = _mm512_castps_si512(x);
  top = _mm512_mask_max_epu32(top, _mm512_cmpneq_epi32_mask(u, negz), top, u);
  acc = _mm512_add_ps(acc, x);
}
template <std::size_t G>
KVEVICT_TARGET_AVX512 inline std::uint32_t group_sum_bounded_cols(const float* p, std::size_t g,
                                                                  std::size_t n,
                                                                  float* out) noexcept {
  const std::size_t rows = G == 0 ? g : G;
  const __m512i negz = _mm512_set1_epi32(static_cast<int>(0x80000000u));
  // One running maximum per row (G known) so that no chain of masked maxima runs through
  // the whole pass; a single one for a group size known only at run time.
  constexpr std::size_t T = G == 0 ? 1 : G;
  __m512i top[T];
  for (std::size_t k = 0; k < T; ++k) top[k] = _mm512_setzero_si512();
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 acc = _mm512_setzero_ps();
    for (std::size_t k = 0; k < rows; ++k)
      group_sum_add(_mm512_loadu_ps(p + k * n + i), negz, top[G == 0 ? 0 : k], acc);
    _mm512_storeu_ps(out + i, acc);
  }
  if (i < n) {
    const auto m = static_cast<__mmask16>((1u << (n - i)) - 1u);
    __m512 acc = _mm512_setzero_ps();
    for (std::size_t k = 0; k < rows; ++k)  // 0 in the unused lanes
      group_sum_add(_mm512_maskz_loadu_ps(m, p + k * n + i), negz, top[G == 0 ? 0 : k], acc);
    _mm512_mask_storeu_ps(out + i, m, acc);
  }
  for (std::size_t k = 1; k < T; ++k) top[0] = _mm512_max_epu32(top[0], top[k]);
  return static_cast<std::uint32_t>(_mm512_reduce_max_epu32(top[0]));
}
KVEVICT_TARGET_AVX512 inline bool group_sum_bounded(const float* p, std::size_t g, std::size_t n,
                                                    float hi, float* out) noexcept {
  std::uint32_t top = 0;
  switch (g) {
    case 1: top = group_sum_bounded_cols<1>(p, g, n, out); break;
    case 2: top = group_sum_bounded_cols<2>(p, g, n, out); break;
    case 4: top = group_sum_bounded_cols<4>(p, g, n, out); break;
    case 8: top = group_sum_bounded_cols<8>(p, g, n, out); break;
    default: top = group_sum_bounded_cols<0>(p, g, n, out); break;
  }
  return top <= std::bit_cast<std::uint32_t>(hi);
}

/// abs_below over up to avx2::kAbsBelowArrays arrays at once, the AVX2 form's method at 16
/// floats a vector: each round reads a chunk of every array, 64 floats of the shortest
/// and proportionally more of the longer ones (whole 64-float units), with a software
/// prefetch two rounds ahead; the rest of each array after the last full round goes 16
/// floats, then one masked block. Same test as the scalar body (abs_below_body): bit 31 of
/// (bits & 0x7fffffff) + (0x80000000 - limit) is set once a value fails.
KVEVICT_TARGET_AVX512 KVEVICT_ALWAYS_INLINE __m512i abs_test16(__m512i acc, __m512i u,
                                                              __m512i a) noexcept {
  return _mm512_or_si512(acc, _mm512_add_epi32(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), a));
}
KVEVICT_TARGET_AVX512 inline bool abs_below_group(const float* const* xs, const std::size_t* ns,
                                                  const std::uint32_t* limits,
                                                  std::size_t count) noexcept {
  constexpr std::size_t unit = 64;
  __m512i acc0 = _mm512_setzero_si512(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
  std::size_t chunk[avx2::kAbsBelowArrays];
  const std::size_t rounds = avx2::abs_below_rounds(ns, count, unit, chunk);
  for (std::size_t j = 0; j < count; ++j)
    avx2::abs_below_prefetch(xs[j], chunk[j], static_cast<std::size_t>(-1), rounds);
  for (std::size_t r = 0; r < rounds; ++r)
    for (std::size_t j = 0; j < count; ++j) {
      const __m512i a = _mm512_set1_epi32(static_cast<int>(0x80000000u - limits[j]));
      avx2::abs_below_prefetch(xs[j], chunk[j], r, rounds);
      const float* p = xs[j] + r * chunk[j];
      const float* end = p + chunk[j];
      for (; p < end; p += unit) {
        acc0 = abs_test16(acc0, _mm512_loadu_si512(p), a);
        acc1 = abs_test16(acc1, _mm512_loadu_si512(p + 16), a);
        acc2 = abs_test16(acc2, _mm512_loadu_si512(p + 32), a);
        acc3 = abs_test16(acc3, _mm512_loadu_si512(p + 48), a);
      }
    }
  for (std::size_t j = 0; j < count; ++j) {
    const __m512i a = _mm512_set1_epi32(static_cast<int>(0x80000000u - limits[j]));
    std::size_t i = rounds * chunk[j];
    for (; i + 16 <= ns[j]; i += 16) acc0 = abs_test16(acc0, _mm512_loadu_si512(xs[j] + i), a);
    if (i < ns[j]) {  // the unused lanes' 0 passes every limit above 0; limit 0 fails it
      const auto m = static_cast<__mmask16>((1u << (ns[j] - i)) - 1u);
      acc1 = _mm512_mask_mov_epi32(acc1, m, abs_test16(acc1, _mm512_maskz_loadu_epi32(m, xs[j] + i), a));
    }
  }
  const __m512i acc = _mm512_or_si512(_mm512_or_si512(acc0, acc1), _mm512_or_si512(acc2, acc3));
  return _mm512_test_epi32_mask(acc, _mm512_set1_epi32(static_cast<int>(0x80000000u))) == 0;
}
KVEVICT_TARGET_AVX512 inline bool abs_below(const float* const* xs, const std::size_t* ns,
                                            const std::uint32_t* limits, std::size_t count) noexcept {
  bool ok = true;
  for (std::size_t j = 0; j < count; j += avx2::kAbsBelowArrays) {
    const std::size_t c = std::min(avx2::kAbsBelowArrays, count - j);
    ok &= abs_below_group(xs + j, ns + j, limits + j, c);
  }
  return ok;
}

}  // namespace kvevict::kernels::detail::avx512
KVEVICT_SUPPRESS_INTRIN_WARNINGS_END
#endif
