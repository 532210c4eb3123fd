// AVX2 selection kernels: masked argmin/argmax with 8-wide float compares; the counting emit
// and the radix split of small-n float top-k left-pack 8 lanes with a permutation table (AVX2
// has no compress instruction); histograms and the sampled partition pass reuse the portable
// bodies compiled for AVX2.
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
namespace kvevict::kernels::detail::avx2 {

/// Lane indices of the set bits of an 8-bit mask, packed as bytes (left-packing permutation).
struct CompressLut {
  std::uint64_t perm[256];
  constexpr CompressLut() : perm{} {
    for (unsigned m = 0; m < 256; ++m) {
      std::uint64_t p = 0;
      unsigned j = 0;
      for (unsigned b = 0; b < 8; ++b)
        if (m & (1u << b)) p |= static_cast<std::uint64_t>(b) << (8 * j++);
      perm[m] = p;
    }
  }
};
inline constexpr CompressLut kCompressLut{};

KVEVICT_TARGET_AVX2 inline __m256i compress_perm(unsigned m) noexcept {
  return _mm256_cvtepu8_epi32(
      _mm_cvtsi64_si128(static_cast<long long>(kCompressLut.perm[m])));
}

/// Eight keys widened to 32-bit lanes.
template <class K>
KVEVICT_TARGET_AVX2 inline __m256i load8_u32(const K* p) noexcept {
  if constexpr (sizeof(K) == 1)
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  else
    return _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

/// emit with 8-wide compares and a left-packing permutation: the rows beyond t, and the
/// first take_eq rows equal to t, in index order. Vector stores stay inside out[0, k).
template <bool Top, class K>
KVEVICT_TARGET_AVX2 inline std::size_t emit(const K* keys, std::size_t n, K t, std::size_t take_eq,
                                            std::size_t k, std::uint32_t* out) noexcept {
  const __m256i vt = _mm256_set1_epi32(static_cast<int>(t));  // keys < 2^16: signed compares
  const __m256i step = _mm256_set1_epi32(8);
  __m256i id = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  std::size_t pos = 0, i = 0;
  for (; i + 8 <= n && pos + 8 <= k; i += 8) {
    const __m256i x = load8_u32(keys + i);
    const __m256i gt = Top ? _mm256_cmpgt_epi32(x, vt) : _mm256_cmpgt_epi32(vt, x);
    auto m = static_cast<unsigned>(_mm256_movemask_ps(_mm256_castsi256_ps(gt)));
    if (take_eq != 0) {
      auto me = static_cast<unsigned>(
          _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(x, vt))));
      while (static_cast<std::size_t>(std::popcount(me)) > take_eq)
        me &= ~(1u << (31 - std::countl_zero(me)));  // keep the lowest take_eq
      take_eq -= static_cast<std::size_t>(std::popcount(me));
      m |= me;
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + pos),
                        _mm256_permutevar8x32_epi32(id, compress_perm(m)));
    pos += static_cast<std::size_t>(std::popcount(m));
    id = _mm256_add_epi32(id, step);
  }
  if (pos >= k) return pos;
  return pos + scalar::emit_body<Top, K>(keys + i, n - i, t, take_eq, k - pos, out + pos, i);
}

template <bool Filter, class K>
KVEVICT_TARGET_AVX2 inline void hist256(const K* keys, std::size_t n, int shift, unsigned prefix,
                                        std::uint32_t* hist) noexcept {
  scalar::hist256_body<Filter, K>(keys, n, shift, prefix, hist);
}

template <class K>
KVEVICT_TARGET_AVX2 inline void key_range(const K* keys, std::size_t n, unsigned* mn,
                                          unsigned* mx) noexcept {
  scalar::key_range_body<K>(keys, n, mn, mx);
}
template <class K>
KVEVICT_TARGET_AVX2 inline void hist_range(const K* keys, std::size_t n, unsigned base,
                                           std::size_t bins, std::uint32_t* hist) noexcept {
  scalar::hist_range_body<K>(keys, n, base, bins, hist);
}

KVEVICT_TARGET_AVX2 inline std::size_t topk_pass(const float* s, std::size_t n, float thi,
                                                 float tlo, std::uint32_t* above,
                                                 std::uint32_t* mid, std::size_t* n_mid) noexcept {
  return scalar::topk_pass_body(s, n, thi, tlo, above, mid, n_mid);
}

/// Best eligible value (max for Top, min otherwise) of a block of m <= 1024 floats, NaN and
/// protected lanes excluded; *any = whether some lane was eligible.
template <bool Top>
KVEVICT_TARGET_AVX2 inline float block_best(const float* s, std::size_t m,
                                            const std::uint64_t* elig, bool* any) noexcept {
  const float init = Top ? -std::numeric_limits<float>::infinity()
                         : std::numeric_limits<float>::infinity();
  const __m256 fill = _mm256_set1_ps(init);
  const __m256i bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  __m256 acc = fill;
  __m256i seen = _mm256_setzero_si256();
  std::size_t i = 0;
  for (; i + 8 <= m; i += 8) {
    const int byte = static_cast<int>((elig[i >> 6] >> (i & 63)) & 0xFF);
    const __m256i e = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(byte), bits), bits);
    const __m256 v = _mm256_loadu_ps(s + i);
    const __m256 ok = _mm256_and_ps(_mm256_castsi256_ps(e), _mm256_cmp_ps(v, v, _CMP_ORD_Q));
    const __m256 x = _mm256_blendv_ps(fill, v, ok);
    acc = Top ? _mm256_max_ps(acc, x) : _mm256_min_ps(acc, x);
    seen = _mm256_or_si256(seen, _mm256_castps_si256(ok));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  float best = init;
  for (float v : lanes) best = Top ? (v > best ? v : best) : (v < best ? v : best);
  bool found = !_mm256_testz_si256(seen, seen);
  for (; i < m; ++i) {
    if (!((elig[i >> 6] >> (i & 63)) & 1u) || s[i] != s[i]) continue;
    found = true;
    best = Top ? (s[i] > best ? s[i] : best) : (s[i] < best ? s[i] : best);
  }
  *any = found;
  return best;
}

/// First i < m with elig bit set and s[i] == v (v not NaN), or m.
KVEVICT_TARGET_AVX2 inline std::size_t find_first_eq(const float* s, std::size_t m,
                                                     const std::uint64_t* elig, float v) noexcept {
  const __m256 t = _mm256_set1_ps(v);
  std::size_t i = 0;
  for (; i + 8 <= m; i += 8) {
    const auto eq = static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(s + i), t, _CMP_EQ_OQ)));
    const unsigned hit = eq & static_cast<unsigned>((elig[i >> 6] >> (i & 63)) & 0xFF);
    if (hit) return i + static_cast<std::size_t>(std::countr_zero(hit));
  }
  for (; i < m; ++i)
    if (((elig[i >> 6] >> (i & 63)) & 1u) && s[i] == v) return i;
  return m;
}

/// protect_outside with 4-wide 64-bit compares (unsigned range test via the sign flip).
KVEVICT_TARGET_AVX2 inline void protect_outside(const std::uint64_t* seqs, std::size_t n,
                                                std::uint64_t lo, std::uint64_t hi,
                                                std::uint64_t* bits) noexcept {
  const std::uint64_t span = hi > lo ? hi - lo : 0;
  const __m256i flip = _mm256_set1_epi64x(static_cast<long long>(0x8000000000000000ull));
  const __m256i vlo = _mm256_set1_epi64x(static_cast<long long>(lo));
  // x - lo < span (unsigned)  <=>  (span ^ flip) > ((x - lo) ^ flip) (signed)
  const __m256i vspan = _mm256_xor_si256(_mm256_set1_epi64x(static_cast<long long>(span)), flip);
  const std::size_t full = n / 64;
  for (std::size_t w = 0; w < full; ++w) {
    std::uint64_t in = 0;
    const std::uint64_t* q = seqs + w * 64;
    for (std::size_t j = 0; j < 64; j += 4) {
      const __m256i x = _mm256_xor_si256(
          _mm256_sub_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + j)), vlo), flip);
      const auto m = static_cast<unsigned>(
          _mm256_movemask_pd(_mm256_castsi256_pd(_mm256_cmpgt_epi64(vspan, x))));
      in |= static_cast<std::uint64_t>(m) << j;
    }
    bits[w] = ~in;
  }
  if (n % 64) scalar::protect_outside_body(seqs + full * 64, n % 64, lo, hi, bits + full);
}

/// find_eq with 8-wide compares.
KVEVICT_TARGET_AVX2 inline std::size_t find_eq(const float* s, std::size_t n, std::size_t from,
                                               const std::uint64_t* prot, float v) noexcept {
  const __m256 t = _mm256_set1_ps(v);
  std::size_t i = from;
  for (; i < n && (i & 7); ++i)
    if (s[i] == v && !(prot != nullptr && ((prot[i >> 6] >> (i & 63)) & 1u))) return i;
  for (; i + 8 <= n; i += 8) {
    auto hit = static_cast<unsigned>(
        _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(s + i), t, _CMP_EQ_OQ)));
    if (prot != nullptr) hit &= ~static_cast<unsigned>(prot[i >> 6] >> (i & 63)) & 0xFFu;
    if (hit) return i + static_cast<std::size_t>(std::countr_zero(hit));
  }
  for (; i < n; ++i)
    if (s[i] == v && !(prot != nullptr && ((prot[i >> 6] >> (i & 63)) & 1u))) return i;
  return npos;
}

KVEVICT_TARGET_AVX2 inline void topk_primary(const float* s, std::size_t n,
                                             std::uint32_t* p) noexcept {
  scalar::topk_primary_body(s, n, p);
}
KVEVICT_TARGET_AVX2 inline void radix_hist(const std::uint32_t* v, std::size_t n, int shift,
                                           std::uint32_t* hist) noexcept {
  scalar::radix_hist_body(v, n, shift, hist);
}

/// radix_split with 8-wide compares and a left-packing permutation per 8 lanes. Writes up to
/// 7 entries past the counts it returns: out and ids_out need n + 8 entries.
KVEVICT_TARGET_AVX2 inline std::size_t radix_split(std::uint32_t* v, const std::uint32_t* ids,
                                                   std::size_t n, int shift, std::uint32_t b,
                                                   std::uint32_t* out, std::uint32_t* ids_out,
                                                   std::size_t* n_eq) noexcept {
  const __m128i sh = _mm_cvtsi32_si128(shift);
  const __m256i ff = _mm256_set1_epi32(0xFF);
  const __m256i vb = _mm256_set1_epi32(static_cast<int>(b));
  const __m256i step = _mm256_set1_epi32(8);
  __m256i id = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  std::size_t nl = 0, ne = 0, i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + i));
    if (ids) id = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ids + i));
    const __m256i d = _mm256_and_si256(_mm256_srl_epi32(x, sh), ff);  // 0..255: signed compare ok
    const auto ml = static_cast<unsigned>(
        _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(vb, d))));
    const auto me = static_cast<unsigned>(
        _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(vb, d))));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + nl),
                        _mm256_permutevar8x32_epi32(id, compress_perm(ml)));
    if (me) {
      const __m256i pe = compress_perm(me);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(v + ne), _mm256_permutevar8x32_epi32(x, pe));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(ids_out + ne),
                          _mm256_permutevar8x32_epi32(id, pe));
    }
    nl += static_cast<std::size_t>(std::popcount(ml));
    ne += static_cast<std::size_t>(std::popcount(me));
    if (!ids) id = _mm256_add_epi32(id, step);
  }
  return scalar::radix_split_body(v, ids, n, shift, b, out, ids_out, n_eq, i, nl, ne);
}

// ---- Small-n float top-k by bracketing samples (n < 32768) --------------------------------
// Keys are the primary keys of topk_key with the sign bit flipped (signed order: ascending =
// better, -0 == +0, NaN = INT32_MAX), so AVX2's signed compares and min/max apply. A sorted
// sample of 64 keys gives two keys lo <= hi around the wanted rank; one pass left-packs the
// ids of keys < lo (all selected) and the (key, id) pairs in [lo, hi] (the band, in index
// order); the band is narrowed the same way until it has at most 64 keys, which are sorted in
// registers to find the k-th key T; the band's keys < T and its first rows equal to T (lowest
// ids) complete the set. A bracket that misses the rank is redone on the side that holds it.

/// The signed order keys of 8 floats (see above).
KVEVICT_TARGET_AVX2 inline __m256i topk_skey8(__m256 f) noexcept {
  const __m256i sign = _mm256_set1_epi32(static_cast<int>(0x80000000u));
  const __m256i low = _mm256_set1_epi32(0x7FFFFFFF);
  __m256i u = _mm256_castps_si256(f);
  u = _mm256_andnot_si256(_mm256_cmpeq_epi32(u, sign), u);  // -0 -> +0
  const __m256i neg = _mm256_srai_epi32(u, 31);
  __m256i key = _mm256_xor_si256(u, _mm256_andnot_si256(neg, low));
  key = _mm256_or_si256(key, _mm256_cmpgt_epi32(_mm256_and_si256(u, low),
                                                _mm256_set1_epi32(0x7F800000)));  // NaN
  return _mm256_xor_si256(key, sign);
}
/// The same key for one float.
KVEVICT_ALWAYS_INLINE std::int32_t topk_skey(float v) noexcept {
  return static_cast<std::int32_t>((static_cast<std::uint32_t>(topk_key(v, 0) >> 32)) ^
                                   0x80000000u);
}

KVEVICT_TARGET_AVX2 inline void cx(__m256i& a, __m256i& b) noexcept {
  const __m256i t = _mm256_min_epi32(a, b);
  b = _mm256_max_epi32(a, b);
  a = t;
}
/// Sorts a bitonic 8-lane vector ascending.
KVEVICT_TARGET_AVX2 inline __m256i bitonic_clean8(__m256i x) noexcept {
  __m256i y = _mm256_permute2x128_si256(x, x, 1);
  x = _mm256_blend_epi32(_mm256_min_epi32(x, y), _mm256_max_epi32(x, y), 0xF0);
  y = _mm256_shuffle_epi32(x, _MM_SHUFFLE(1, 0, 3, 2));
  x = _mm256_blend_epi32(_mm256_min_epi32(x, y), _mm256_max_epi32(x, y), 0xCC);
  y = _mm256_shuffle_epi32(x, _MM_SHUFFLE(2, 3, 0, 1));
  return _mm256_blend_epi32(_mm256_min_epi32(x, y), _mm256_max_epi32(x, y), 0xAA);
}
KVEVICT_TARGET_AVX2 inline __m256i reverse8(__m256i x) noexcept {
  return _mm256_permutevar8x32_epi32(x, _mm256_setr_epi32(7, 6, 5, 4, 3, 2, 1, 0));
}
/// Merges the sorted runs v[0, w) and v[w, 2w) (w vectors each) into one sorted run.
template <int W>
KVEVICT_TARGET_AVX2 inline void bitonic_merge(__m256i* v) noexcept {
  for (int j = 0; j < W; ++j) {
    __m256i b = reverse8(v[2 * W - 1 - j]);
    cx(v[j], b);
    v[2 * W - 1 - j] = reverse8(b);  // the upper half, kept bitonic in reversed order
  }
  // Both halves are bitonic; clean across vectors, then inside each vector.
  for (int h = 0; h < 2; ++h) {
    __m256i* x = v + h * W;
    for (int d = W / 2; d >= 1; d /= 2)
      for (int j = 0; j < W; ++j)
        if ((j & d) == 0) cx(x[j], x[j + d]);
    for (int j = 0; j < W; ++j) x[j] = bitonic_clean8(x[j]);
  }
}
/// Sorts 64 signed 32-bit keys ascending in registers.
KVEVICT_TARGET_AVX2 inline void sort64(std::int32_t* p) noexcept {
  __m256i v[8];
  for (int j = 0; j < 8; ++j) v[j] = _mm256_load_si256(reinterpret_cast<const __m256i*>(p + 8 * j));
  // Columns: Batcher's 19-comparator network for 8.
  cx(v[0], v[1]), cx(v[2], v[3]), cx(v[4], v[5]), cx(v[6], v[7]);
  cx(v[0], v[2]), cx(v[1], v[3]), cx(v[4], v[6]), cx(v[5], v[7]);
  cx(v[1], v[2]), cx(v[5], v[6]);
  cx(v[0], v[4]), cx(v[1], v[5]), cx(v[2], v[6]), cx(v[3], v[7]);
  cx(v[2], v[4]), cx(v[3], v[5]);
  cx(v[1], v[2]), cx(v[3], v[4]), cx(v[5], v[6]);
  // Transpose: each vector becomes a sorted run of 8.
  __m256i t[8];
  for (int j = 0; j < 8; j += 2) {
    t[j] = _mm256_unpacklo_epi32(v[j], v[j + 1]);
    t[j + 1] = _mm256_unpackhi_epi32(v[j], v[j + 1]);
  }
  __m256i u[8];
  for (int j = 0; j < 8; j += 4) {
    u[j] = _mm256_unpacklo_epi64(t[j], t[j + 2]);
    u[j + 1] = _mm256_unpackhi_epi64(t[j], t[j + 2]);
    u[j + 2] = _mm256_unpacklo_epi64(t[j + 1], t[j + 3]);
    u[j + 3] = _mm256_unpackhi_epi64(t[j + 1], t[j + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    v[j] = _mm256_permute2x128_si256(u[j], u[j + 4], 0x20);
    v[j + 4] = _mm256_permute2x128_si256(u[j], u[j + 4], 0x31);
  }
  for (int j = 0; j < 8; j += 2) bitonic_merge<1>(v + j);
  bitonic_merge<2>(v);
  bitonic_merge<2>(v + 4);
  bitonic_merge<4>(v);
  for (int j = 0; j < 8; ++j) _mm256_store_si256(reinterpret_cast<__m256i*>(p + 8 * j), v[j]);
}

/// One bracket pass over m rows: ids of keys < lo to below (returns how many), (key, id) of
/// keys in [lo, hi] to bkeys/bids (count in *n_band), index order kept. Rows come from floats
/// (fs, ids = index) or from a previous band (ks, is). Each output needs 8 spare entries.
template <bool FromFloats>
KVEVICT_TARGET_AVX2 inline std::size_t bracket_pass(const float* fs, const std::int32_t* ks,
                                                    const std::uint32_t* is, std::size_t m,
                                                    std::int32_t lo, std::int32_t hi,
                                                    std::uint32_t* below, std::int32_t* bkeys,
                                                    std::uint32_t* bids,
                                                    std::size_t* n_band) noexcept {
  const __m256i vlo = _mm256_set1_epi32(lo), vhi = _mm256_set1_epi32(hi);
  __m256i id = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i step = _mm256_set1_epi32(8);
  std::size_t nb = 0, nm = 0, i = 0;
  for (; i + 8 <= m; i += 8) {
    __m256i x;
    if constexpr (FromFloats) {
      x = topk_skey8(_mm256_loadu_ps(fs + i));
    } else {
      x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ks + i));
      id = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(is + i));
    }
    const auto mb = static_cast<unsigned>(
        _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(vlo, x))));
    const auto ma = static_cast<unsigned>(
        _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(x, vhi))));
    const unsigned mm = ~(mb | ma) & 0xFFu;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(below + nb),
                        _mm256_permutevar8x32_epi32(id, compress_perm(mb)));
    const __m256i pm = compress_perm(mm);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(bkeys + nm), _mm256_permutevar8x32_epi32(x, pm));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(bids + nm), _mm256_permutevar8x32_epi32(id, pm));
    nb += static_cast<std::size_t>(std::popcount(mb));
    nm += static_cast<std::size_t>(std::popcount(mm));
    if constexpr (FromFloats) id = _mm256_add_epi32(id, step);
  }
  for (; i < m; ++i) {
    const std::int32_t x = FromFloats ? topk_skey(fs[i]) : ks[i];
    const std::uint32_t d = FromFloats ? static_cast<std::uint32_t>(i) : is[i];
    below[nb] = d;
    bkeys[nm] = x;
    bids[nm] = d;
    nb += x < lo;
    nm += (x >= lo) & (x <= hi);
  }
  *n_band = nm;
  return nb;
}

/// The scratch topk_bracket works in: below 2n + 16 entries, the two band buffers n + 8 each.
struct BracketBuffers {
  std::uint32_t* below;
  std::int32_t* keys[2];
  std::uint32_t* ids[2];
};

/// Where topk_bracket resumes: rows from the floats fs (ids = index) or from a band (ks, is)
/// of m rows; b.below[0, emitted) already selected, need more wanted (0 < need <= m); the
/// next band is written to buffer dst.
struct BracketState {
  const float* fs;
  const std::int32_t* ks;
  const std::uint32_t* is;
  std::size_t m, need, emitted;
  int dst;
};

/// topk_bracket from a given state (see BracketState).
KVEVICT_TARGET_AVX2 inline void topk_bracket_from(BracketState st, std::uint32_t* out,
                                                  const BracketBuffers& b) noexcept {
  constexpr std::int32_t kMin = std::numeric_limits<std::int32_t>::min();
  constexpr std::int32_t kMax = std::numeric_limits<std::int32_t>::max();
  constexpr std::ptrdiff_t kDelta = 8;  // sample ranks either side of the expected one
  std::size_t emitted = st.emitted, need = st.need, m = st.m;
  const float* fs = st.fs;  // rows from the floats until the first band exists
  const std::int32_t* ks = st.ks;
  const std::uint32_t* is = st.is;
  int dst = st.dst;
  std::ptrdiff_t delta = kDelta;
  alignas(32) std::int32_t smp[64];
  auto key_at = [&](std::size_t i) { return fs ? topk_skey(fs[i]) : ks[i]; };
  auto pass = [&](std::int32_t lo, std::int32_t hi, std::size_t* nm) {
    return fs ? bracket_pass<true>(fs, nullptr, nullptr, m, lo, hi, b.below + emitted,
                                   b.keys[dst], b.ids[dst], nm)
              : bracket_pass<false>(nullptr, ks, is, m, lo, hi, b.below + emitted, b.keys[dst],
                                    b.ids[dst], nm);
  };
  while (m > 128) {
    if (fs) {  // 64 scores spread evenly over the rows, their keys computed 8 at a time
      alignas(32) float f[64];
      for (std::size_t j = 0; j < 64; ++j) f[j] = fs[((2 * j + 1) * m) >> 7];
      for (std::size_t j = 0; j < 64; j += 8)
        _mm256_store_si256(reinterpret_cast<__m256i*>(smp + j), topk_skey8(_mm256_load_ps(f + j)));
    } else {
      for (std::size_t j = 0; j < 64; ++j) smp[j] = ks[((2 * j + 1) * m) >> 7];
    }
    sort64(smp);
    const auto r = static_cast<std::ptrdiff_t>((need - 1) * 64 / m);
    const std::int32_t lo = r - delta >= 0 ? smp[r - delta] : kMin;
    const std::int32_t hi = r + delta <= 63 ? smp[r + delta] : kMax;
    std::size_t nm = 0;
    const std::size_t nb = pass(lo, hi, &nm);
    if (nb >= need) {
      pass(kMin, lo - 1, &nm);  // the k-th key is below lo (lo > kMin here): keys < lo
    } else if (nb + nm < need) {
      // The k-th key is above hi (hi < kMax here): below and band are all selected.
      std::copy_n(b.ids[dst], nm, b.below + emitted + nb);
      emitted += nb + nm;
      need -= nb + nm;
      pass(hi + 1, kMax, &nm);  // what it writes below is ignored (already emitted)
    } else {
      emitted += nb;
      need -= nb;
      if (lo == hi) {  // the k-th key is lo, and the band holds exactly the rows equal to it
        std::copy_n(b.ids[dst], need, b.below + emitted);
        emitted += need;
        std::copy_n(b.below, emitted, out);
        return;
      }
      if (nm == m) {  // no progress (few distinct keys): retry with lo = hi
        delta = 0;
        continue;
      }
    }
    delta = kDelta;
    m = nm;
    fs = nullptr;
    ks = b.keys[dst];
    is = b.ids[dst];
    dst ^= 1;
  }
  // At most 128 rows hold the rest: sort their keys in two blocks of 64 to find the k-th, T,
  // and how many keys are below it.
  alignas(32) std::int32_t s2[64];
  for (std::size_t j = 0; j < 64; ++j) smp[j] = j < m ? key_at(j) : kMax;
  if (m > 64)
    for (std::size_t j = 0; j < 64; ++j) s2[j] = j + 64 < m ? key_at(j + 64) : kMax;
  sort64(smp);
  std::int32_t t;
  std::size_t below_t;
  if (m <= 64) {
    t = smp[need - 1];
    below_t = static_cast<std::size_t>(std::lower_bound(smp, smp + 64, t) - smp);
  } else {
    sort64(s2);
    // i keys from smp and need - i from s2 form the need smallest.
    std::size_t lo = need > 64 ? need - 64 : 0, hi = need < 64 ? need : 64;
    while (lo < hi) {
      const std::size_t i = (lo + hi) / 2;  // i < hi <= 64, need - i - 1 < 64
      if (smp[i] < s2[need - i - 1]) lo = i + 1; else hi = i;
    }
    const std::size_t i = lo, j = need - lo;
    t = i == 0 ? s2[j - 1] : j == 0 ? smp[i - 1] : std::max(smp[i - 1], s2[j - 1]);
    below_t = static_cast<std::size_t>((std::lower_bound(smp, smp + 64, t) - smp) +
                                       (std::lower_bound(s2, s2 + 64, t) - s2));
  }
  std::size_t take_eq = need - below_t;  // rows equal to T taken (the lowest ids)
  std::uint32_t* o = b.below + emitted;
  std::size_t e = 0, j = 0;
  if (!fs) {  // the band: 8 rows at a time (its buffers have 8 spare entries; lanes >= m masked)
    const __m256i vt = _mm256_set1_epi32(t);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (; j < m; j += 8) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ks + j));
      const auto valid = static_cast<unsigned>(_mm256_movemask_ps(_mm256_castsi256_ps(
          _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(m - j)), lane))));
      unsigned sel = static_cast<unsigned>(
                         _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(vt, x)))) &
                     valid;
      if (take_eq != 0) {
        auto me = static_cast<unsigned>(
                      _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(x, vt)))) &
                  valid;
        while (static_cast<std::size_t>(std::popcount(me)) > take_eq)
          me &= ~(1u << (31 - std::countl_zero(me)));  // keep the lowest take_eq
        take_eq -= static_cast<std::size_t>(std::popcount(me));
        sel |= me;
      }
      const __m256i id = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(is + j));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + e),
                          _mm256_permutevar8x32_epi32(id, compress_perm(sel)));
      e += static_cast<std::size_t>(std::popcount(sel));
    }
  }
  for (; j < m; ++j) {
    const std::int32_t x = key_at(j);
    const bool tie = (x == t) & (take_eq != 0);
    take_eq -= tie;
    o[e] = fs ? static_cast<std::uint32_t>(j) : is[j];
    e += (x < t) | tie;
  }
  std::copy_n(b.below, emitted + e, out);
}

/// Exact top-k (the set topk_exact selects) for 0 < k < n < 2^31 (see above).
KVEVICT_TARGET_AVX2 inline void topk_bracket(const float* s, std::size_t n, std::size_t k,
                                             std::uint32_t* out, const BracketBuffers& b) noexcept {
  topk_bracket_from(BracketState{s, nullptr, nullptr, n, k, 0, 0}, out, b);
}

/// The float with signed order key x (topk_skey's inverse; x not a NaN's key).
KVEVICT_ALWAYS_INLINE float topk_skey_float(std::int32_t x) noexcept {
  const std::uint32_t fok = ~(static_cast<std::uint32_t>(x) ^ 0x80000000u);  // float_order_key
  return std::bit_cast<float>((fok & 0x80000000u) ? (fok & 0x7FFFFFFFu) : ~fok);
}

/// topk_small's bracket: a sorted 64-key sample gives floats *lo <= *hi around the k-th
/// (hi: the sample key kDelta ranks better, +inf if none; lo: kDelta ranks worse, -inf if
/// none or a NaN's key).
KVEVICT_TARGET_AVX2 inline void topk_small_bracket(const float* s, std::size_t n, std::size_t k,
                                                   float* hi, float* lo) noexcept {
  constexpr std::int32_t kMax = std::numeric_limits<std::int32_t>::max();
  constexpr std::ptrdiff_t kDelta = 6;  // sample ranks either side (band ~ 13n/64)
  alignas(32) std::int32_t smp[64];
  alignas(32) float f[64];
  for (std::size_t j = 0, p = n; j < 64; ++j, p += 2 * n) f[j] = s[p >> 7];  // ((2j + 1) n) / 128
  for (std::size_t j = 0; j < 64; j += 8)
    _mm256_store_si256(reinterpret_cast<__m256i*>(smp + j), topk_skey8(_mm256_load_ps(f + j)));
  sort64(smp);
  const auto r = static_cast<std::ptrdiff_t>((k - 1) * 64 / n);
  const float inf = std::numeric_limits<float>::infinity();
  *hi = r - kDelta >= 0 ? topk_skey_float(smp[r - kDelta]) : inf;
  const std::int32_t lk = r + kDelta <= 63 ? smp[r + kDelta] : kMax;
  *lo = lk == kMax ? -inf : topk_skey_float(lk);
}

/// topk_small after its pass: b.below[0, na) holds the ids of the rows > hi, b.keys[0] (as
/// floats) and b.ids[0] the nm rows in [lo, hi] (8 spare entries each); goes on from the
/// side holding the k-th (see topk_small).
KVEVICT_TARGET_AVX2 inline void topk_small_finish(const float* s, std::size_t n, std::size_t k,
                                                  std::uint32_t* out, const BracketBuffers& b,
                                                  std::size_t na, std::size_t nm,
                                                  float lo) noexcept {
  float* bf = reinterpret_cast<float*>(b.keys[0]);  // band floats, keys computed in place
  std::uint32_t* bi = b.ids[0];
  std::uint32_t* above = b.below;
  if (na >= k) {  // the k-th is above hi: those rows (index order) are the next band
    for (std::size_t j = 0; j < na; ++j) {
      bi[j] = above[j];
      b.keys[0][j] = topk_skey(s[above[j]]);
    }
    return topk_bracket_from(BracketState{nullptr, b.keys[0], bi, na, k, 0, 1}, out, b);
  }
  if (na + nm < k) {  // the k-th is below lo: above and band selected, the rest (NaN too) next
    std::copy_n(bi, nm, above + na);
    std::size_t nr = 0, i = 0;
    const __m256 vlo = _mm256_set1_ps(lo);
    const __m256i step = _mm256_set1_epi32(8);
    __m256i id = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (; i + 8 <= n; i += 8) {
      const __m256 x = _mm256_loadu_ps(s + i);
      const auto mr = static_cast<unsigned>(
          _mm256_movemask_ps(_mm256_cmp_ps(x, vlo, _CMP_NGE_UQ)));  // !(x >= lo)
      const __m256i pr = compress_perm(mr);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(b.keys[0] + nr),
                          _mm256_permutevar8x32_epi32(topk_skey8(x), pr));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(bi + nr), _mm256_permutevar8x32_epi32(id, pr));
      nr += static_cast<std::size_t>(std::popcount(mr));
      id = _mm256_add_epi32(id, step);
    }
    for (; i < n; ++i) {
      b.keys[0][nr] = topk_skey(s[i]);
      bi[nr] = static_cast<std::uint32_t>(i);
      nr += !(s[i] >= lo);
    }
    return topk_bracket_from(BracketState{nullptr, b.keys[0], bi, nr, k - na - nm, na + nm, 1},
                             out, b);
  }
  for (std::size_t j = 0; j < nm; j += 8)  // the band's keys (8 spare entries)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(b.keys[0] + j),
                        topk_skey8(_mm256_loadu_ps(bf + j)));
  topk_bracket_from(BracketState{nullptr, b.keys[0], bi, nm, k - na, na, 1}, out, b);
}

/// Small-n top-k (select.hpp uses it below 32768 rows): topk_bracket's first round with
/// float compares instead of order keys. A sorted 64-key sample gives floats lo <= hi around
/// the k-th; one pass left-packs the ids of x > hi (all selected) and the floats and ids of x
/// in [lo, hi] (the band, index order); NaN rows fall in neither (they rank below every
/// number). Float compares make -0 == +0. The band's order keys are then computed and
/// topk_bracket goes on from them. A bracket that misses the k-th goes on from the side
/// holding it (the rows above hi, or the rows not >= lo, NaN included).
KVEVICT_TARGET_AVX2 inline void topk_small(const float* s, std::size_t n, std::size_t k,
                                           std::uint32_t* out, const BracketBuffers& b) noexcept {
  float hi, lo;
  topk_small_bracket(s, n, k, &hi, &lo);
  const __m256 vhi = _mm256_set1_ps(hi), vlo = _mm256_set1_ps(lo);
  const __m256i step = _mm256_set1_epi32(8);
  __m256i id = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  float* bf = reinterpret_cast<float*>(b.keys[0]);
  std::uint32_t* bi = b.ids[0];
  std::uint32_t* above = b.below;
  std::size_t na = 0, nm = 0, i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(s + i);
    const auto ma = static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(x, vhi, _CMP_GT_OQ)));
    const auto mge = static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(x, vlo, _CMP_GE_OQ)));
    const unsigned mm = mge & ~ma;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(above + na),
                        _mm256_permutevar8x32_epi32(id, compress_perm(ma)));
    const __m256i pm = compress_perm(mm);
    _mm256_storeu_ps(bf + nm, _mm256_permutevar8x32_ps(x, pm));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(bi + nm), _mm256_permutevar8x32_epi32(id, pm));
    na += static_cast<std::size_t>(std::popcount(ma));
    nm += static_cast<std::size_t>(std::popcount(mm));
    id = _mm256_add_epi32(id, step);
  }
  for (; i < n; ++i) {
    const float x = s[i];
    above[na] = static_cast<std::uint32_t>(i);
    bf[nm] = x;
    bi[nm] = static_cast<std::uint32_t>(i);
    na += x > hi;
    nm += (x >= lo) & !(x > hi);
  }
  topk_small_finish(s, n, k, out, b, na, nm, lo);
}

/// Largest n topk_threshold takes (its buffers live on the stack: about 14 n bytes).
inline constexpr std::size_t kThresholdMaxN = 512;

/// Sum of the 16 signed 16-bit lanes of x.
KVEVICT_TARGET_AVX2 KVEVICT_ALWAYS_INLINE std::size_t hsum16(__m256i x) noexcept {
  const __m256i w = _mm256_madd_epi16(x, _mm256_set1_epi16(1));
  __m128i q = _mm_add_epi32(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
  q = _mm_add_epi32(q, _mm_shuffle_epi32(q, 0x4E));
  q = _mm_add_epi32(q, _mm_shuffle_epi32(q, 0xB1));
  return static_cast<std::size_t>(_mm_cvtsi128_si32(q));
}

/// avx512::topk_threshold's method at AVX2 (0 < k < n <= kThresholdMaxN): the high halves
/// packed 16 to a register (index order restored by a 64-bit lane permute); per step of two
/// bits, three running sums of compare results (halves above each candidate; a lane adds at
/// most nh <= 32) reduced once; the keys sharing the k-th high half found through byte masks;
/// the final pass left-packs ids through the permutation table into a local buffer. Same set
/// as topk_exact; ids in index order.
KVEVICT_TARGET_AVX2 inline void topk_threshold(const float* s, std::size_t n, std::size_t k,
                                               std::uint32_t* out) noexcept {
  alignas(32) std::int32_t key[kThresholdMaxN];
  alignas(32) std::int16_t hi[kThresholdMaxN];
  alignas(32) std::int32_t cand[kThresholdMaxN];
  alignas(32) std::uint32_t ids[kThresholdMaxN + 8];
  constexpr std::int32_t kMax = std::numeric_limits<std::int32_t>::max();
  const std::size_t full = n & ~std::size_t{7};
  for (std::size_t i = 0; i < full; i += 8)
    _mm256_store_si256(reinterpret_cast<__m256i*>(key + i), topk_skey8(_mm256_loadu_ps(s + i)));
  const std::size_t padded = (n + 15) & ~std::size_t{15};  // whole 16-row registers
  for (std::size_t i = full; i < padded; ++i) key[i] = i < n ? topk_skey(s[i]) : kMax;
  const std::size_t nh = padded / 16;
  for (std::size_t h = 0; h < nh; ++h) {  // hi[j] = key[j] >> 16
    const __m256i a = _mm256_load_si256(reinterpret_cast<const __m256i*>(key + 16 * h));
    const __m256i b = _mm256_load_si256(reinterpret_cast<const __m256i*>(key + 16 * h + 8));
    _mm256_store_si256(reinterpret_cast<__m256i*>(hi + 16 * h),
                       _mm256_permute4x64_epi64(_mm256_packs_epi32(_mm256_srai_epi32(a, 16),
                                                                   _mm256_srai_epi32(b, 16)),
                                                0xD8));
  }
  unsigned tu = 0;
  std::size_t c_lt = 0;
  for (int b = 14; b >= 0; b -= 2) {
    const unsigned ones = (1u << b) - 1;
    // The three candidates tu | d << b | ones, d = 0, 1, 2, as signed halves.
    const auto c0 = static_cast<short>((tu | ones) ^ 0x8000u);
    const __m256i c1 = _mm256_set1_epi16(c0),
                  c2 = _mm256_set1_epi16(static_cast<short>(c0 + (1 << b))),
                  c3 = _mm256_set1_epi16(static_cast<short>(c0 + (2 << b)));
    __m256i g1 = _mm256_setzero_si256(), g2 = g1, g3 = g1;
    for (std::size_t h = 0; h < nh; ++h) {
      const __m256i x = _mm256_load_si256(reinterpret_cast<const __m256i*>(hi + 16 * h));
      g1 = _mm256_sub_epi16(g1, _mm256_cmpgt_epi16(x, c1));
      g2 = _mm256_sub_epi16(g2, _mm256_cmpgt_epi16(x, c2));
      g3 = _mm256_sub_epi16(g3, _mm256_cmpgt_epi16(x, c3));
    }
    const std::size_t n1 = padded - hsum16(g1), n2 = padded - hsum16(g2),
                      n3 = padded - hsum16(g3);  // halves <= each candidate
    c_lt = n3 < k ? n3 : n2 < k ? n2 : n1 < k ? n1 : c_lt;
    tu |= (static_cast<unsigned>(n1 < k) + (n2 < k) + (n3 < k)) << b;
  }
  const auto t16 = static_cast<std::int16_t>(tu ^ 0x8000u);
  const __m256i vt16 = _mm256_set1_epi16(t16);
  std::size_t m = 0;
  for (std::size_t h = 0; h < nh; ++h)
    for (auto eq = static_cast<std::uint32_t>(_mm256_movemask_epi8(_mm256_cmpeq_epi16(
             _mm256_load_si256(reinterpret_cast<const __m256i*>(hi + 16 * h)), vt16))) &
                   0x55555555u;
         eq; eq &= eq - 1) {
      const std::size_t j = 16 * h + static_cast<std::size_t>(std::countr_zero(eq)) / 2;
      cand[m] = key[j] & 0xFFFF;
      m += j < n;
    }
  std::size_t take_eq = 0;
  const std::int32_t t = scalar::threshold_key(cand, m, k, c_lt, t16, &take_eq);
  const __m256i vt = _mm256_set1_epi32(t);
  const __m256i step = _mm256_set1_epi32(8);
  __m256i id = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  std::size_t pos = 0;
  for (std::size_t i = 0; i < padded; i += 8) {
    const __m256i x = _mm256_load_si256(reinterpret_cast<const __m256i*>(key + i));
    auto sel = static_cast<unsigned>(
        _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(vt, x))));
    auto eq = static_cast<unsigned>(  // padding only when T is NaN's key: after the real ties
        _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(x, vt))));
    if (eq != 0) {
      const auto c = static_cast<std::size_t>(std::popcount(eq));
      if (c > take_eq)  // keep the lowest take_eq tie lanes
        eq = _pdep_u32((1u << take_eq) - 1, eq);
      take_eq -= c > take_eq ? take_eq : c;
      sel |= eq;
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(ids + pos),
                        _mm256_permutevar8x32_epi32(id, compress_perm(sel)));
    pos += static_cast<std::size_t>(std::popcount(sel));
    id = _mm256_add_epi32(id, step);
  }
  std::copy_n(ids, k, out);
}

/// group_sum compiled for AVX2 (the portable body vectorises 8-wide).
KVEVICT_TARGET_AVX2 inline bool group_sum(const float* p, std::size_t g, std::size_t n,
                                          float* out) noexcept {
  return scalar::group_sum_body(p, g, n, out);
}

/// group_sum_bounded's full 8-column chunks, G rows (G = 0: g rows, known at run time). Each
/// chunk's g values are added in a register in row order from 0.0f (the scalar body's
/// additions) and stored once; the range test keeps the largest bit pattern seen, -0
/// counted as +0. Returns the columns done and that largest pattern.
template <std::size_t G>
KVEVICT_TARGET_AVX2 inline std::size_t group_sum_bounded_chunks(const float* p, std::size_t g,
                                                                std::size_t n, float* out,
                                                                std::uint32_t* top_out) noexcept {
  const std::size_t rows = G == 0 ? g : G;
  const __m256i negz = _mm256_set1_epi32(static_cast<int>(0x80000000u));
  __m256i top = _mm256_setzero_si256();
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 acc = _mm256_setzero_ps();
    for (std::size_t k = 0; k < rows; ++k) {
      const __m256 x = _mm256_loadu_ps(p + k * n + i);
      const __m256i u = _mm256_castps_si256(x);
      top = _mm256_max_epu32(top, _mm256_andnot_si256(_mm256_cmpeq_epi32(u, negz), u));
      acc = _mm256_add_ps(acc, x);
    }
    _mm256_storeu_ps(out + i, acc);
  }
  __m128i t = _mm_max_epu32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1));
  t = _mm_max_epu32(t, _mm_srli_si128(t, 8));
  t = _mm_max_epu32(t, _mm_srli_si128(t, 4));
  *top_out = static_cast<std::uint32_t>(_mm_cvtsi128_si32(t));
  return i;
}

/// group_sum_bounded 8 columns at a time (the common group sizes unrolled), then the last
/// n % 8 columns as the scalar body adds them.
KVEVICT_TARGET_AVX2 inline bool group_sum_bounded(const float* p, std::size_t g, std::size_t n,
                                                  float hi, float* out) noexcept {
  const std::uint32_t hb = std::bit_cast<std::uint32_t>(hi);
  std::uint32_t top = 0;
  std::size_t i = 0;
  switch (g) {
    case 1: i = group_sum_bounded_chunks<1>(p, g, n, out, &top); break;
    case 2: i = group_sum_bounded_chunks<2>(p, g, n, out, &top); break;
    case 4: i = group_sum_bounded_chunks<4>(p, g, n, out, &top); break;
    case 8: i = group_sum_bounded_chunks<8>(p, g, n, out, &top); break;
    default: i = group_sum_bounded_chunks<0>(p, g, n, out, &top); break;
  }
  bool ok = top <= hb;
  for (; i < n; ++i) {
    float acc = 0.0f;
    for (std::size_t k = 0; k < g; ++k) {
      const float x = p[k * n + i];
      const std::uint32_t u = std::bit_cast<std::uint32_t>(x);
      ok = ok && (u <= hb || u == 0x80000000u);
      acc += x;
    }
    out[i] = acc;
  }
  return ok;
}

/// abs_below over up to kAbsBelowArrays arrays at once: each round reads a chunk of every
/// array, 32 floats of the shortest and proportionally more of the longer ones (whole
/// 32-float units), so the arrays' cache misses are in flight together instead of one
/// array after the other; the rest of each array after the last full round goes 8 floats,
/// then one, at a time. Same test as the scalar body (abs_below_body).
inline constexpr std::size_t kAbsBelowArrays = 4;
/// acc | ((bits of p[0..8)) & 0x7fffffff) + a): bit 31 of a lane set once a value failed.
KVEVICT_TARGET_AVX2 inline __m256i abs_test8(__m256i acc, const float* p, __m256i a) noexcept {
  const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm256_or_si256(acc, _mm256_add_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), a));
}
/// abs_below_group's rounds: each array's chunk per round (whole `unit`s, in proportion to
/// its length over the shortest non-empty one; 0 for an empty array) and how many full
/// rounds fit every array.
inline std::size_t abs_below_rounds(const std::size_t* ns, std::size_t count, std::size_t unit,
                                    std::size_t* chunk) noexcept {
  std::size_t shortest = 0;
  for (std::size_t j = 0; j < count; ++j)
    if (ns[j] > 0 && (shortest == 0 || ns[j] < shortest)) shortest = ns[j];
  std::size_t rounds = shortest / unit;
  for (std::size_t j = 0; j < count; ++j) {
    chunk[j] = ns[j] == 0 ? 0 : unit * (ns[j] / shortest);
    if (chunk[j] > 0) rounds = std::min(rounds, ns[j] / chunk[j]);
  }
  return rounds;
}
/// Software prefetch kAbsBelowAhead rounds ahead (a line is 16 floats): the hardware
/// prefetchers ramp up over a stream's first lines, and these arrays are a few KB each.
/// Round r's call requests array j's chunk of round r + kAbsBelowAhead; the first call
/// (r = npos) the first rounds'.
inline constexpr std::size_t kAbsBelowAhead = 2;
inline void abs_below_prefetch(const float* x, std::size_t chunk, std::size_t r,
                               std::size_t rounds) noexcept {
  if (r == static_cast<std::size_t>(-1)) {
    for (std::size_t o = 0; o < std::min(kAbsBelowAhead, rounds) * chunk; o += 16) __builtin_prefetch(x + o);
  } else if (r + kAbsBelowAhead < rounds) {
    for (std::size_t o = 0; o < chunk; o += 16) __builtin_prefetch(x + (r + kAbsBelowAhead) * chunk + o);
  }
}
KVEVICT_TARGET_AVX2 inline bool abs_below_group(const float* const* xs, const std::size_t* ns,
                                                const std::uint32_t* limits,
                                                std::size_t count) noexcept {
  constexpr std::size_t unit = 32;
  __m256i acc0 = _mm256_setzero_si256(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
  std::size_t chunk[kAbsBelowArrays];
  const std::size_t rounds = abs_below_rounds(ns, count, unit, chunk);
  for (std::size_t j = 0; j < count; ++j) abs_below_prefetch(xs[j], chunk[j], static_cast<std::size_t>(-1), rounds);
  for (std::size_t r = 0; r < rounds; ++r)
    for (std::size_t j = 0; j < count; ++j) {
      const __m256i a = _mm256_set1_epi32(static_cast<int>(0x80000000u - limits[j]));
      abs_below_prefetch(xs[j], chunk[j], r, rounds);
      const float* p = xs[j] + r * chunk[j];
      const float* end = p + chunk[j];
      for (; p < end; p += unit) {
        acc0 = abs_test8(acc0, p, a);
        acc1 = abs_test8(acc1, p + 8, a);
        acc2 = abs_test8(acc2, p + 16, a);
        acc3 = abs_test8(acc3, p + 24, a);
      }
    }
  bool ok = true;
  for (std::size_t j = 0; j < count; ++j) {
    const __m256i a = _mm256_set1_epi32(static_cast<int>(0x80000000u - limits[j]));
    std::size_t i = rounds * chunk[j];
    for (; i + 8 <= ns[j]; i += 8) acc0 = abs_test8(acc0, xs[j] + i, a);
    ok &= scalar::abs_below_body(xs[j], ns[j], limits[j], i);
  }
  const __m256i acc = _mm256_or_si256(_mm256_or_si256(acc0, acc1), _mm256_or_si256(acc2, acc3));
  return ok && _mm256_movemask_ps(_mm256_castsi256_ps(acc)) == 0;
}
KVEVICT_TARGET_AVX2 inline bool abs_below(const float* const* xs, const std::size_t* ns,
                                          const std::uint32_t* limits, std::size_t count) noexcept {
  bool ok = true;
  for (std::size_t j = 0; j < count; j += kAbsBelowArrays) {
    const std::size_t c = std::min(kAbsBelowArrays, count - j);
    ok &= abs_below_group(xs + j, ns + j, limits + j, c);
  }
  return ok;
}

/// decay_spike 8 rows at a time: the decayed score with a separate multiply and add (this
/// target has no FMA, so nothing is contracted), the age test as two 4-wide unsigned 64-bit
/// compares (sign flip) narrowed to one 8-lane mask, the spike as max(x, spike), which is
/// spike < x ? x : spike like the scalar body.
KVEVICT_TARGET_AVX2 inline void decay_spike(float* score, float* spike, const float* x,
                                            const std::uint64_t* seqs, std::size_t n,
                                            float decay, std::uint64_t latest,
                                            std::uint64_t band) noexcept {
  const __m256 g = _mm256_set1_ps(decay);
  const __m256i flip = _mm256_set1_epi64x(static_cast<long long>(0x8000000000000000ull));
  const __m256i vlatest = _mm256_set1_epi64x(static_cast<long long>(latest));
  // latest - seq >= band (unsigned)  <=>  not ((band ^ flip) > ((latest - seq) ^ flip)) (signed)
  const __m256i vband = _mm256_xor_si256(_mm256_set1_epi64x(static_cast<long long>(band)), flip);
  std::size_t r = 0;
  for (; r + 8 <= n; r += 8) {
    const __m256 xs = _mm256_loadu_ps(x + r);
    _mm256_storeu_ps(score + r, _mm256_add_ps(_mm256_mul_ps(g, _mm256_loadu_ps(score + r)), xs));
    const __m256i d0 = _mm256_xor_si256(
        _mm256_sub_epi64(vlatest, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(seqs + r))),
        flip);
    const __m256i d1 = _mm256_xor_si256(
        _mm256_sub_epi64(vlatest,
                         _mm256_loadu_si256(reinterpret_cast<const __m256i*>(seqs + r + 4))),
        flip);
    // young = band > age, per 64-bit lane (both 32-bit halves equal)
    const __m256 y0 = _mm256_castsi256_ps(_mm256_cmpgt_epi64(vband, d0));
    const __m256 y1 = _mm256_castsi256_ps(_mm256_cmpgt_epi64(vband, d1));
    // lanes (r0 r1 r4 r5 | r2 r3 r6 r7), then reordered to r0..r7
    const __m256 y = _mm256_castpd_ps(_mm256_permute4x64_pd(
        _mm256_castps_pd(_mm256_shuffle_ps(y0, y1, _MM_SHUFFLE(2, 0, 2, 0))), 0xD8));
    const __m256 sp = _mm256_loadu_ps(spike + r);
    _mm256_storeu_ps(spike + r, _mm256_blendv_ps(_mm256_max_ps(xs, sp), sp, y));
  }
  scalar::decay_spike_body(score, spike, x, seqs, n, decay, latest, band, r);
}

/// gather_open 8 rows at a time: two compares, the protection byte, and a left-packing
/// permutation of values and indices. Each vector store writes 8 lanes at the running count,
/// which is at most the block's first row, so vals and idx need only n entries.
KVEVICT_TARGET_AVX2 inline std::size_t gather_open(const float* s, std::size_t n,
                                                   const std::uint64_t* prot, float lo,
                                                   float* vals, std::uint32_t* idx) noexcept {
  const __m256 zero = _mm256_setzero_ps();
  const __m256 vlo = _mm256_set1_ps(lo);
  const __m256i step = _mm256_set1_epi32(8);
  __m256i id = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  std::size_t count = 0, i = 0;
  for (; i + 8 <= n; i += 8) {
    const auto open = static_cast<unsigned>(~(prot[i >> 6] >> (i & 63)) & 0xFFu);
    if (open != 0) {
      const __m256 v = _mm256_loadu_ps(s + i);
      const __m256 ok = _mm256_and_ps(_mm256_cmp_ps(v, zero, _CMP_GT_OQ),
                                      _mm256_cmp_ps(v, vlo, _CMP_GE_OQ));
      const unsigned m = static_cast<unsigned>(_mm256_movemask_ps(ok)) & open;
      if (m != 0) {
        const __m256i perm = compress_perm(m);
        _mm256_storeu_ps(vals + count, _mm256_permutevar8x32_ps(v, perm));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(idx + count),
                            _mm256_permutevar8x32_epi32(id, perm));
        count += static_cast<std::size_t>(std::popcount(m));
      }
    }
    id = _mm256_add_epi32(id, step);
  }
  return scalar::gather_open_body(s, n, prot, lo, vals, idx, i, count);
}

/// lowest_open / decay_lowest_open 8 rows at a time, one pass: the decayed score with a
/// separate multiply and add (no FMA on this target), the open test as unsigned compares
/// (sign flip: two 4-wide 64-bit compares for 64-bit seqs, one 8-wide 32-bit compare for
/// 32-bit keys), and a compare of the 8 values against the running best value; only the
/// open lanes at or below it (rare once a low value is found) go through the scalar
/// (value, seq) rule, in row order.
template <bool Decay, class K>
KVEVICT_TARGET_AVX2 inline std::size_t lowest_open(float* s, const float* x, const K* seqs,
                                                   std::size_t n, float decay, K lo,
                                                   K hi) noexcept {
  constexpr bool wide = sizeof(K) == 8;
  const K span = hi > lo ? static_cast<K>(hi - lo) : K{0};
  scalar::LowestOpen best;
  const __m256 g = _mm256_set1_ps(decay);
  // seq - lo < span (unsigned)  <=>  (span ^ flip) > ((seq - lo) ^ flip) (signed)
  const __m256i flip = wide ? _mm256_set1_epi64x(static_cast<long long>(0x8000000000000000ull))
                            : _mm256_set1_epi32(static_cast<int>(0x80000000u));
  const __m256i vlo = wide ? _mm256_set1_epi64x(static_cast<long long>(lo))
                           : _mm256_set1_epi32(static_cast<int>(static_cast<std::uint32_t>(lo)));
  const __m256i vspan = _mm256_xor_si256(
      wide ? _mm256_set1_epi64x(static_cast<long long>(span))
           : _mm256_set1_epi32(static_cast<int>(static_cast<std::uint32_t>(span))),
      flip);
  __m256 vbest = _mm256_set1_ps(best.value);
  std::size_t r = 0;
  for (; r + 8 <= n; r += 8) {
    __m256 v = _mm256_loadu_ps(s + r);
    if constexpr (Decay) {
      v = _mm256_add_ps(_mm256_mul_ps(g, v), _mm256_loadu_ps(x + r));
      _mm256_storeu_ps(s + r, v);
    }
    unsigned open;
    if constexpr (wide) {
      const __m256i d0 = _mm256_xor_si256(
          _mm256_sub_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(seqs + r)), vlo),
          flip);
      const __m256i d1 = _mm256_xor_si256(
          _mm256_sub_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(seqs + r + 4)), vlo),
          flip);
      open = static_cast<unsigned>(_mm256_movemask_pd(_mm256_castsi256_pd(_mm256_cmpgt_epi64(vspan, d0)))) |
             (static_cast<unsigned>(_mm256_movemask_pd(_mm256_castsi256_pd(_mm256_cmpgt_epi64(vspan, d1))))
              << 4);
    } else {
      const __m256i d = _mm256_xor_si256(
          _mm256_sub_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(seqs + r)), vlo),
          flip);
      open = static_cast<unsigned>(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(vspan, d))));
    }
    unsigned m = open & static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(v, vbest, _CMP_LE_OQ)));
    if (m != 0) {
      alignas(32) float vals[8];
      _mm256_store_ps(vals, v);
      do {
        const auto j = static_cast<std::size_t>(std::countr_zero(m));
        best.offer(vals[j], seqs[r + j], r + j);
        m &= m - 1;
      } while (m != 0);
      vbest = _mm256_set1_ps(best.value);
    }
  }
  scalar::lowest_open_body<Decay, K>(s, x, seqs, n, decay, lo, span, best, r);
  return best.index;
}

}  // namespace kvevict::kernels::detail::avx2
KVEVICT_SUPPRESS_INTRIN_WARNINGS_END
#endif
