// Eviction-decision kernels of the policies that evict the lowest score among unprotected
// rows (DecayedAttention and H2O, KeyDiff's and ExpectedAttention's masked paths). Each does
// in one call what two or three select.hpp kernels did in turn: at the small heads of a small
// model (~128 rows, head dim 8) every call's fixed cost (entry checks, dispatch, setup, tail)
// weighs as much as its pass over the rows.
//  - open_gather: protect_outside's protection bits and gather_open's candidates in one pass
//    over the arrival indices and the values (the same bits, values and indices, in the same
//    order, as those two calls);
//  - decay_spike_gather: select.hpp's decay_spike (DecayedAttention's observe) then
//    open_gather over the spikes it wrote (the next decision's bits and candidates), one pass
//    at AVX-512;
//  - masked_costs: DecayedAttention's eviction costs (pooled budgets): every row's score
//    times a scale, +infinity for the rows set in two masks, FLT_MAX for those set in the
//    first alone (a blend per vector in place of a store per protected row);
//  - lowest_masked_seq: the unprotected row with the lowest (score, seq), the oldest among
//    equal scores (the row argmin_masked and the equal-score scan of
//    policies::detail::lowest_masked find), from one masked minimum and one equality pass.
// Conventions as select.hpp: protection bits hold ceil(n/64) words, bit set = protected;
// n < 2^32. Each kernel has a form pinned to a level (the Isa argument; throws
// std::invalid_argument when the CPU lacks it) and one that uses active_isa().
#pragma once

#include <cstddef>
#include <cstdint>

#include "dispatch.hpp"

namespace kvevict::kernels {

/// Writes into bits (ceil(n/64) words, bits past n set) the rows whose arrival index lies
/// outside [lo, hi) (unsigned; protect_outside's bits), and gathers, in index order, the rows
/// left open with s[i] > 0 and s[i] >= floor: their values into vals and their indices into
/// idx (n entries each; entries past the count may be overwritten); returns how many (what
/// gather_open(s, n, bits, floor, vals, idx) returns). NaN values are never gathered.
KVEVICT_KERNEL_FN std::size_t open_gather(Isa isa, const std::uint64_t* seqs, const float* s,
                                          std::size_t n, std::uint64_t lo, std::uint64_t hi,
                                          float floor, std::uint64_t* bits, float* vals,
                                          std::uint32_t* idx);
KVEVICT_KERNEL_FN std::size_t open_gather(const std::uint64_t* seqs, const float* s,
                                          std::size_t n, std::uint64_t lo, std::uint64_t hi,
                                          float floor, std::uint64_t* bits, float* vals,
                                          std::uint32_t* idx);
/// decay_spike(score, spike, x, seqs, n, decay, latest, band), then
/// open_gather(seqs, spike, n, lo, hi, floor, bits, vals, idx) over the updated spikes: the
/// same scores, spikes, bits, values and indices, bit for bit; returns open_gather's count.
KVEVICT_KERNEL_FN std::size_t decay_spike_gather(Isa isa, float* score, float* spike,
                                                 const float* x, const std::uint64_t* seqs,
                                                 std::size_t n, float decay,
                                                 std::uint64_t latest, std::uint64_t band,
                                                 std::uint64_t lo, std::uint64_t hi, float floor,
                                                 std::uint64_t* bits, float* vals,
                                                 std::uint32_t* idx);
KVEVICT_KERNEL_FN std::size_t decay_spike_gather(float* score, float* spike, const float* x,
                                                 const std::uint64_t* seqs, std::size_t n,
                                                 float decay, std::uint64_t latest,
                                                 std::uint64_t band, std::uint64_t lo,
                                                 std::uint64_t hi, float floor,
                                                 std::uint64_t* bits, float* vals,
                                                 std::uint32_t* idx);
/// The row with the lowest (s[r], seqs[r]) among the rows whose bit in protected_bits is
/// clear (null: every row): the lowest score, the oldest (lowest seq) among equal scores
/// (-0.0 == +0.0); NaN scores are never chosen; npos when no row qualifies.
KVEVICT_KERNEL_FN std::size_t lowest_masked_seq(Isa isa, const float* s,
                                                const std::uint64_t* seqs, std::size_t n,
                                                const std::uint64_t* protected_bits);
KVEVICT_KERNEL_FN std::size_t lowest_masked_seq(const float* s, const std::uint64_t* seqs,
                                                std::size_t n,
                                                const std::uint64_t* protected_bits);

/// The up to 4 rows lowest_masked_seq would return one after another (each time with the
/// previous ones protected too): out[0..c) in ascending (s[r], seqs[r]) order, equal pairs
/// by lower index; c = min(4, rows that qualify). Returns c.
KVEVICT_KERNEL_FN std::size_t lowest_masked_seq4(Isa isa, const float* s,
                                                 const std::uint64_t* seqs, std::size_t n,
                                                 const std::uint64_t* protected_bits,
                                                 std::size_t* out);
KVEVICT_KERNEL_FN std::size_t lowest_masked_seq4(const float* s, const std::uint64_t* seqs,
                                                 std::size_t n,
                                                 const std::uint64_t* protected_bits,
                                                 std::size_t* out);

/// out[r] = +infinity when row r is set in both `bits` and `outside`, FLT_MAX when set in
/// `bits` alone, else scale * s[r] (one float product, as written). bits and outside hold
/// ceil(n/64) words (bits past n ignored). The same values at every level.
KVEVICT_KERNEL_FN void masked_costs(Isa isa, const float* s, std::size_t n, float scale,
                                    const std::uint64_t* bits, const std::uint64_t* outside,
                                    float* out);
KVEVICT_KERNEL_FN void masked_costs(const float* s, std::size_t n, float scale,
                                    const std::uint64_t* bits, const std::uint64_t* outside,
                                    float* out);

}  // namespace kvevict::kernels

#if !KVEVICT_KERNELS_DECLARE_ONLY
#include <bit>
#include <limits>
#include <stdexcept>
#include <string>

#include "select_scalar.hpp"
#if KVEVICT_X86
#include <immintrin.h>

#include "select_avx2.hpp"
#endif

namespace kvevict::kernels::detail {
namespace scalar {

/// open_gather over the rows of word w's [from, m) (row base + j): the open bits into *in,
/// the candidates appended at count; returns the new count.
KVEVICT_ALWAYS_INLINE std::size_t open_gather_rows(const std::uint64_t* seqs, const float* s,
                                                   std::size_t base, std::size_t from,
                                                   std::size_t m, std::uint64_t lo,
                                                   std::uint64_t span, float floor,
                                                   std::uint64_t* in, float* vals,
                                                   std::uint32_t* idx,
                                                   std::size_t count) noexcept {
  for (std::size_t j = from; j < m; ++j) {
    const std::size_t r = base + j;
    if (!(seqs[r] - lo < span)) continue;
    *in |= std::uint64_t{1} << j;
    const float v = s[r];
    if (v > 0.0f && v >= floor) {
      vals[count] = v;
      idx[count] = static_cast<std::uint32_t>(r);
      ++count;
    }
  }
  return count;
}
inline std::size_t open_gather(const std::uint64_t* seqs, const float* s, std::size_t n,
                               std::uint64_t lo, std::uint64_t hi, float floor,
                               std::uint64_t* bits, float* vals, std::uint32_t* idx) noexcept {
  const std::uint64_t span = hi > lo ? hi - lo : 0;
  std::size_t count = 0;
  for (std::size_t base = 0, w = 0; base < n; base += 64, ++w) {
    std::uint64_t in = 0;
    count = open_gather_rows(seqs, s, base, 0, n - base < 64 ? n - base : 64, lo, span, floor,
                             &in, vals, idx, count);
    bits[w] = ~in;
  }
  return count;
}
inline std::size_t lowest_masked_seq(const float* s, const std::uint64_t* seqs, std::size_t n,
                                     const std::uint64_t* prot, std::size_t from = 0,
                                     LowestOpen best = {}) noexcept {
  for (std::size_t r = from; r < n; ++r)
    if (prot == nullptr || ((prot[r >> 6] >> (r & 63)) & 1u) == 0) best.offer(s[r], seqs[r], r);
  return best.index;
}

/// lowest_masked_seq4's order: (value, seq, row) ascending (-0.0 == +0.0).
struct Low4 {
  float v;
  std::uint64_t q;
  std::size_t r;
  bool before(const Low4& o) const noexcept {
    return v < o.v || (v == o.v && (q < o.q || (q == o.q && r < o.r)));
  }
};
/// Inserts x into the ascending list low[0..c) of at most 4 entries.
KVEVICT_ALWAYS_INLINE void insert_low4(Low4* low, std::size_t& c, const Low4& x) noexcept {
  if (c == 4 && !x.before(low[3])) return;
  std::size_t p = c < 4 ? c++ : 3;
  for (; p > 0 && x.before(low[p - 1]); --p) low[p] = low[p - 1];
  low[p] = x;
}
inline std::size_t lowest_masked_seq4(const float* s, const std::uint64_t* seqs, std::size_t n,
                                      const std::uint64_t* prot, std::size_t* out) noexcept {
  Low4 low[4];
  std::size_t c = 0;
  for (std::size_t r = 0; r < n; ++r) {
    if (prot != nullptr && ((prot[r >> 6] >> (r & 63)) & 1u) != 0) continue;
    if (s[r] != s[r]) continue;  // NaN: never chosen
    insert_low4(low, c, {s[r], seqs[r], r});
  }
  for (std::size_t i = 0; i < c; ++i) out[i] = low[i].r;
  return c;
}

/// masked_costs: the products, then each protected row's value (a store per set bit).
inline void masked_costs(const float* s, std::size_t n, float scale, const std::uint64_t* bits,
                         const std::uint64_t* outside, float* out, std::size_t from = 0) noexcept {
  for (std::size_t r = from; r < n; ++r) out[r] = scale * s[r];
  const auto mark = [&](std::size_t w, std::uint64_t b, float value) {
    for (; b != 0; b &= b - 1) {
      const std::size_t r = w * 64 + static_cast<std::size_t>(std::countr_zero(b));
      if (r >= n) break;
      if (r >= from) out[r] = value;
    }
  };
  for (std::size_t w = from / 64; w * 64 < n; ++w) {
    mark(w, bits[w] & outside[w], std::numeric_limits<float>::infinity());
    mark(w, bits[w] & ~outside[w], std::numeric_limits<float>::max());
  }
}

}  // namespace scalar

#if KVEVICT_X86
KVEVICT_SUPPRESS_INTRIN_WARNINGS_BEGIN
namespace avx2 {

/// The eligible (unprotected) lanes of rows [r, r + 8) as an 8-bit mask (r % 8 == 0).
KVEVICT_ALWAYS_INLINE unsigned eligible8(const std::uint64_t* prot, std::size_t r) noexcept {
  return prot == nullptr ? 0xFFu : static_cast<unsigned>(~(prot[r >> 6] >> (r & 63)) & 0xFFu);
}

/// open_gather 8 rows at a time: the range test as two 4-wide unsigned 64-bit compares (sign
/// flip), then gather_open's two float compares and left-packing permutation. Each vector
/// store writes 8 lanes at the running count, at most the block's first row: n entries do.
KVEVICT_TARGET_AVX2 inline std::size_t open_gather(const std::uint64_t* seqs, const float* s,
                                                   std::size_t n, std::uint64_t lo,
                                                   std::uint64_t hi, float floor,
                                                   std::uint64_t* bits, float* vals,
                                                   std::uint32_t* idx) noexcept {
  const std::uint64_t span = hi > lo ? hi - lo : 0;
  const __m256i flip = _mm256_set1_epi64x(static_cast<long long>(0x8000000000000000ull));
  const __m256i vlo = _mm256_set1_epi64x(static_cast<long long>(lo));
  // seq - lo < span (unsigned)  <=>  (span ^ flip) > ((seq - lo) ^ flip) (signed)
  const __m256i vspan = _mm256_xor_si256(_mm256_set1_epi64x(static_cast<long long>(span)), flip);
  const __m256 zero = _mm256_setzero_ps();
  const __m256 vfloor = _mm256_set1_ps(floor);
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  std::size_t count = 0;
  for (std::size_t base = 0, w = 0; base < n; base += 64, ++w) {
    const std::size_t m = n - base < 64 ? n - base : 64;
    std::uint64_t in = 0;
    std::size_t j = 0;
    for (; j + 8 <= m; j += 8) {
      const std::size_t r = base + j;
      const __m256i d0 = _mm256_xor_si256(
          _mm256_sub_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(seqs + r)), vlo),
          flip);
      const __m256i d1 = _mm256_xor_si256(
          _mm256_sub_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(seqs + r + 4)),
                           vlo),
          flip);
      const unsigned open =
          static_cast<unsigned>(_mm256_movemask_pd(_mm256_castsi256_pd(_mm256_cmpgt_epi64(vspan, d0)))) |
          (static_cast<unsigned>(_mm256_movemask_pd(_mm256_castsi256_pd(_mm256_cmpgt_epi64(vspan, d1))))
           << 4);
      if (open == 0) continue;
      in |= static_cast<std::uint64_t>(open) << j;
      const __m256 v = _mm256_loadu_ps(s + r);
      const __m256 ok = _mm256_and_ps(_mm256_cmp_ps(v, zero, _CMP_GT_OQ),
                                      _mm256_cmp_ps(v, vfloor, _CMP_GE_OQ));
      const unsigned c = static_cast<unsigned>(_mm256_movemask_ps(ok)) & open;
      if (c == 0) continue;
      const __m256i perm = compress_perm(c);
      _mm256_storeu_ps(vals + count, _mm256_permutevar8x32_ps(v, perm));
      const __m256i id = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(r)), iota);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(idx + count),
                          _mm256_permutevar8x32_epi32(id, perm));
      count += static_cast<std::size_t>(std::popcount(c));
    }
    count = scalar::open_gather_rows(seqs, s, base, j, m, lo, span, floor, &in, vals, idx, count);
    bits[w] = ~in;
  }
  return count;
}

/// An 8-bit mask as an 8-lane vector mask (lane j all ones when bit j is set).
KVEVICT_TARGET_AVX2 KVEVICT_ALWAYS_INLINE __m256 lanes8(unsigned e) noexcept {
  const __m256i lane = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm256_castsi256_ps(
      _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(static_cast<int>(e)), lane), lane));
}

/// lowest_masked_seq: the minimum over the eligible lanes (MINPS returns its second operand
/// when either is NaN, so a NaN score never enters it), then the eligible rows equal to it,
/// the oldest of them (usually one).
KVEVICT_TARGET_AVX2 inline std::size_t lowest_masked_seq(const float* s, const std::uint64_t* seqs,
                                                         std::size_t n,
                                                         const std::uint64_t* prot) noexcept {
  const __m256 inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
  const std::size_t full = n - n % 8;
  __m256 vmin = inf;
  for (std::size_t r = 0; r < full; r += 8) {
    const unsigned e = eligible8(prot, r);
    if (e == 0) continue;
    const __m256 v = _mm256_blendv_ps(inf, _mm256_loadu_ps(s + r), lanes8(e));
    vmin = _mm256_min_ps(v, vmin);
  }
  scalar::LowestOpen best;
  if (full > 0) {
    __m128 m4 = _mm_min_ps(_mm256_castps256_ps128(vmin), _mm256_extractf128_ps(vmin, 1));
    m4 = _mm_min_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_min_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    const float lowest = _mm_cvtss_f32(m4);
    const __m256 vlow = _mm256_set1_ps(lowest);
    for (std::size_t r = 0; r < full; r += 8) {
      const unsigned e = eligible8(prot, r);
      if (e == 0) continue;
      unsigned eq = e & static_cast<unsigned>(_mm256_movemask_ps(
                            _mm256_cmp_ps(_mm256_loadu_ps(s + r), vlow, _CMP_EQ_OQ)));
      for (; eq != 0; eq &= eq - 1) {
        const std::size_t j = r + static_cast<std::size_t>(std::countr_zero(eq));
        best.offer(s[j], seqs[j], j);
      }
    }
  }
  return scalar::lowest_masked_seq(s, seqs, n, prot, full, best);
}

/// lowest_masked_seq4: one pass keeps the 4 smallest values of each of the 8 lanes (a
/// min/max insertion network; protected and NaN rows count as +inf), whose 4th smallest t is
/// the 4th smallest value of all; a second pass collects the eligible rows with value <= t
/// (the 4 lowest are among them) and orders them. More than 64 such rows (ties at t): the
/// scalar form.
KVEVICT_TARGET_AVX2 inline std::size_t lowest_masked_seq4(const float* s,
                                                          const std::uint64_t* seqs,
                                                          std::size_t n,
                                                          const std::uint64_t* prot,
                                                          std::size_t* out) noexcept {
  const std::size_t full = n - n % 8;
  const __m256 inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
  __m256 m0 = inf, m1 = inf, m2 = inf, m3 = inf;
  for (std::size_t r = 0; r < full; r += 8) {
    const __m256 x = _mm256_loadu_ps(s + r);
    const __m256 ok = _mm256_and_ps(lanes8(eligible8(prot, r)), _mm256_cmp_ps(x, x, _CMP_ORD_Q));
    __m256 t = _mm256_blendv_ps(inf, x, ok);
    const __m256 a0 = _mm256_min_ps(m0, t);
    t = _mm256_max_ps(m0, t);
    const __m256 a1 = _mm256_min_ps(m1, t);
    t = _mm256_max_ps(m1, t);
    const __m256 a2 = _mm256_min_ps(m2, t);
    t = _mm256_max_ps(m2, t);
    m3 = _mm256_min_ps(m3, t);
    m0 = a0;
    m1 = a1;
    m2 = a2;
  }
  alignas(32) float lane[32 + 8];
  _mm256_store_ps(lane, m0);
  _mm256_store_ps(lane + 8, m1);
  _mm256_store_ps(lane + 16, m2);
  _mm256_store_ps(lane + 24, m3);
  std::size_t nv = 32;
  for (std::size_t r = full; r < n; ++r)
    lane[nv++] = ((prot == nullptr || ((prot[r >> 6] >> (r & 63)) & 1u) == 0) && s[r] == s[r])
                     ? s[r]
                     : std::numeric_limits<float>::infinity();
  // The 4th smallest of the lane values (ascending insertion into 4 slots).
  float four[4] = {lane[0], std::numeric_limits<float>::infinity(),
                   std::numeric_limits<float>::infinity(), std::numeric_limits<float>::infinity()};
  for (std::size_t i = 1; i < nv; ++i) {
    float x = lane[i];
    for (std::size_t j = 0; j < 4; ++j)
      if (x < four[j]) {
        const float y = four[j];
        four[j] = x;
        x = y;
      }
  }
  const __m256 vt = _mm256_set1_ps(four[3]);
  scalar::Low4 cand[64];
  std::size_t m = 0;
  const auto take = [&](std::size_t r) {
    if (m == 64) return false;
    cand[m++] = {s[r], seqs[r], r};
    return true;
  };
  for (std::size_t r = 0; r < full; r += 8) {
    auto hit = eligible8(prot, r) &
               static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(s + r), vt, _CMP_LE_OQ)));
    for (; hit != 0; hit &= hit - 1)
      if (!take(r + static_cast<std::size_t>(std::countr_zero(hit))))
        return scalar::lowest_masked_seq4(s, seqs, n, prot, out);
  }
  for (std::size_t r = full; r < n; ++r)
    if ((prot == nullptr || ((prot[r >> 6] >> (r & 63)) & 1u) == 0) && s[r] <= four[3] && !take(r))
      return scalar::lowest_masked_seq4(s, seqs, n, prot, out);
  scalar::Low4 low[4];
  std::size_t c = 0;
  for (std::size_t i = 0; i < m; ++i) scalar::insert_low4(low, c, cand[i]);
  for (std::size_t i = 0; i < c; ++i) out[i] = low[i].r;
  return c;
}

/// The 8 bits of `byte` as lane masks (lane i all ones when bit i is set); `lane` holds 1 << i.
KVEVICT_TARGET_AVX2 KVEVICT_ALWAYS_INLINE __m256 lanes_of(std::uint64_t byte, __m256i lane) noexcept {
  const __m256i b = _mm256_set1_epi32(static_cast<int>(byte));
  return _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(b, lane), lane));
}
/// masked_costs 8 rows at a time: each lane's bit of the word's byte by AND with its power
/// of two, then two blends.
KVEVICT_TARGET_AVX2 inline void masked_costs(const float* s, std::size_t n, float scale,
                                             const std::uint64_t* bits,
                                             const std::uint64_t* outside, float* out) noexcept {
  const __m256 vscale = _mm256_set1_ps(scale);
  const __m256 vinf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
  const __m256 vmax = _mm256_set1_ps(std::numeric_limits<float>::max());
  const __m256i lane = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  std::size_t r = 0;
  for (; r + 8 <= n; r += 8) {
    const std::uint64_t b = (bits[r >> 6] >> (r & 63)) & 0xFFu;
    const std::uint64_t o = (outside[r >> 6] >> (r & 63)) & 0xFFu;
    __m256 x = _mm256_mul_ps(vscale, _mm256_loadu_ps(s + r));
    x = _mm256_blendv_ps(x, vmax, lanes_of(b & ~o, lane));
    x = _mm256_blendv_ps(x, vinf, lanes_of(b & o, lane));
    _mm256_storeu_ps(out + r, x);
  }
  scalar::masked_costs(s, n, scale, bits, outside, out, r);
}

}  // namespace avx2

namespace avx512 {

/// open_gather 16 rows at a time: the range test as two 8-lane unsigned 64-bit compares,
/// the two float compares under the open mask, VPCOMPRESS to a register and a full store
/// at the running count (at most the block's first row: n entries do).
KVEVICT_TARGET_AVX512 inline std::size_t open_gather(const std::uint64_t* seqs, const float* s,
                                                     std::size_t n, std::uint64_t lo,
                                                     std::uint64_t hi, float floor,
                                                     std::uint64_t* bits, float* vals,
                                                     std::uint32_t* idx) noexcept {
  const std::uint64_t span = hi > lo ? hi - lo : 0;
  const __m512i vlo = _mm512_set1_epi64(static_cast<long long>(lo));
  const __m512i vspan = _mm512_set1_epi64(static_cast<long long>(span));
  const __m512 zero = _mm512_setzero_ps();
  const __m512 vfloor = _mm512_set1_ps(floor);
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  std::size_t count = 0;
  for (std::size_t base = 0, w = 0; base < n; base += 64, ++w) {
    const std::size_t m = n - base < 64 ? n - base : 64;
    std::uint64_t in = 0;
    std::size_t j = 0;
    for (; j + 16 <= m; j += 16) {
      const std::size_t r = base + j;
      const __mmask8 o0 = _mm512_cmplt_epu64_mask(
          _mm512_sub_epi64(_mm512_loadu_si512(seqs + r), vlo), vspan);
      const __mmask8 o1 = _mm512_cmplt_epu64_mask(
          _mm512_sub_epi64(_mm512_loadu_si512(seqs + r + 8), vlo), vspan);
      const auto open = static_cast<__mmask16>(static_cast<unsigned>(o0) |
                                               (static_cast<unsigned>(o1) << 8));
      if (open == 0) continue;
      in |= static_cast<std::uint64_t>(open) << j;
      const __m512 v = _mm512_loadu_ps(s + r);
      const __mmask16 c = _mm512_mask_cmp_ps_mask(_mm512_mask_cmp_ps_mask(open, v, zero, _CMP_GT_OQ),
                                                  v, vfloor, _CMP_GE_OQ);
      if (c == 0) continue;
      _mm512_storeu_ps(vals + count, _mm512_maskz_compress_ps(c, v));
      const __m512i id = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(r)), iota);
      _mm512_storeu_si512(idx + count, _mm512_maskz_compress_epi32(c, id));
      count += static_cast<std::size_t>(std::popcount(static_cast<unsigned>(c)));
    }
    count = scalar::open_gather_rows(seqs, s, base, j, m, lo, span, floor, &in, vals, idx, count);
    bits[w] = ~in;
  }
  return count;
}

/// decay_spike_gather, 16 rows [r, r + 16) of which the `lanes` are live (all but in the
/// tail): the decayed score (the product kept in a register through an empty asm, so it is
/// never contracted into an FMA: a multiply, then an add, as the scalar body), the age test
/// and the open test as 8-lane unsigned 64-bit compares, the spike as max(x, spike) under
/// the age mask (spike < x ? x : spike), then open_gather's compares and compress on the new
/// spikes, without a branch. Full blocks store 16 candidate lanes at the running count (at
/// most r: n entries do), the tail only the gathered ones. Returns the open lanes.
template <bool Tail>
KVEVICT_TARGET_AVX512 KVEVICT_ALWAYS_INLINE unsigned decay_spike_gather16(
    float* score, float* spike, const float* x, const std::uint64_t* seqs, std::size_t r,
    __mmask16 lanes, __m512 g, __m512i vlatest, __m512i vband, __m512i vlo, __m512i vspan,
    __m512 vfloor, __m512i id, float* vals, std::uint32_t* idx, std::size_t& count) noexcept {
  const auto lo8 = static_cast<__mmask8>(lanes & 0xFFu);
  const auto hi8 = static_cast<__mmask8>(lanes >> 8);
  const __m512 xs = Tail ? _mm512_maskz_loadu_ps(lanes, x + r) : _mm512_loadu_ps(x + r);
  __m512 prod =
      _mm512_mul_ps(g, Tail ? _mm512_maskz_loadu_ps(lanes, score + r) : _mm512_loadu_ps(score + r));
  __asm__("" : "+v"(prod));
  if (Tail)
    _mm512_mask_storeu_ps(score + r, lanes, _mm512_add_ps(prod, xs));
  else
    _mm512_storeu_ps(score + r, _mm512_add_ps(prod, xs));
  const __m512i s0 = Tail ? _mm512_maskz_loadu_epi64(lo8, seqs + r) : _mm512_loadu_si512(seqs + r);
  const __m512i s1 =
      Tail ? _mm512_maskz_loadu_epi64(hi8, seqs + r + 8) : _mm512_loadu_si512(seqs + r + 8);
  const unsigned old =
      static_cast<unsigned>(_mm512_mask_cmpge_epu64_mask(lo8, _mm512_sub_epi64(vlatest, s0), vband)) |
      (static_cast<unsigned>(_mm512_mask_cmpge_epu64_mask(hi8, _mm512_sub_epi64(vlatest, s1), vband))
       << 8);
  const __m512 sp0 = Tail ? _mm512_maskz_loadu_ps(lanes, spike + r) : _mm512_loadu_ps(spike + r);
  const __m512 v = _mm512_mask_max_ps(sp0, static_cast<__mmask16>(old), xs, sp0);
  if (Tail)
    _mm512_mask_storeu_ps(spike + r, lanes, v);
  else
    _mm512_storeu_ps(spike + r, v);
  const unsigned open =
      static_cast<unsigned>(_mm512_mask_cmplt_epu64_mask(lo8, _mm512_sub_epi64(s0, vlo), vspan)) |
      (static_cast<unsigned>(_mm512_mask_cmplt_epu64_mask(hi8, _mm512_sub_epi64(s1, vlo), vspan))
       << 8);
  // No branch on the open or gathered lanes (they vary from block to block): an empty
  // compress stores nothing that counts.
  const __mmask16 c = _mm512_mask_cmp_ps_mask(
      _mm512_mask_cmp_ps_mask(static_cast<__mmask16>(open), v, _mm512_setzero_ps(), _CMP_GT_OQ),
      v, vfloor, _CMP_GE_OQ);
  const auto k = static_cast<unsigned>(std::popcount(static_cast<unsigned>(c)));
  if (Tail) {
    const auto first = static_cast<__mmask16>((1u << k) - 1u);
    _mm512_mask_storeu_ps(vals + count, first, _mm512_maskz_compress_ps(c, v));
    _mm512_mask_storeu_epi32(idx + count, first, _mm512_maskz_compress_epi32(c, id));
  } else {
    _mm512_storeu_ps(vals + count, _mm512_maskz_compress_ps(c, v));
    _mm512_storeu_si512(idx + count, _mm512_maskz_compress_epi32(c, id));
  }
  count += k;
  return open;
}

/// decay_spike_gather in one pass, 16 rows at a time; the tail (n % 16 rows) as one masked
/// block, not the scalar body: in this function the compiler may fuse a scalar multiply and
/// add.
KVEVICT_TARGET_AVX512 inline std::size_t decay_spike_gather(
    float* score, float* spike, const float* x, const std::uint64_t* seqs, std::size_t n,
    float decay, std::uint64_t latest, std::uint64_t band, std::uint64_t lo, std::uint64_t hi,
    float floor, std::uint64_t* bits, float* vals, std::uint32_t* idx) noexcept {
  const std::uint64_t span = hi > lo ? hi - lo : 0;
  const __m512 g = _mm512_set1_ps(decay);
  const __m512i vlatest = _mm512_set1_epi64(static_cast<long long>(latest));
  const __m512i vband = _mm512_set1_epi64(static_cast<long long>(band));
  const __m512i vlo = _mm512_set1_epi64(static_cast<long long>(lo));
  const __m512i vspan = _mm512_set1_epi64(static_cast<long long>(span));
  const __m512 vfloor = _mm512_set1_ps(floor);
  const __m512i sixteen = _mm512_set1_epi32(16);
  // The row indices of the block's lanes, advanced by 16 per block.
  __m512i id = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  std::size_t count = 0;
  for (std::size_t base = 0, w = 0; base < n; base += 64, ++w) {
    const std::size_t m = n - base < 64 ? n - base : 64;
    std::uint64_t in = 0;
    std::size_t j = 0;
    for (; j + 16 <= m; j += 16, id = _mm512_add_epi32(id, sixteen))
      in |= static_cast<std::uint64_t>(decay_spike_gather16<false>(
                score, spike, x, seqs, base + j, 0xFFFF, g, vlatest, vband, vlo, vspan, vfloor,
                id, vals, idx, count))
            << j;
    if (j < m)
      in |= static_cast<std::uint64_t>(decay_spike_gather16<true>(
                score, spike, x, seqs, base + j, static_cast<__mmask16>((1u << (m - j)) - 1u), g,
                vlatest, vband, vlo, vspan, vfloor, id, vals, idx, count))
            << j;
    bits[w] = ~in;
  }
  return count;
}

/// The eligible (unprotected) lanes of rows [r, r + 16) (r % 16 == 0).
KVEVICT_ALWAYS_INLINE __mmask16 eligible16(const std::uint64_t* prot, std::size_t r) noexcept {
  return prot == nullptr ? static_cast<__mmask16>(0xFFFFu)
                         : static_cast<__mmask16>(~(prot[r >> 6] >> (r & 63)) & 0xFFFFu);
}

/// lowest_masked_seq 16 lanes at a time (the AVX2 form's two passes; VMINPS as MINPS).
KVEVICT_TARGET_AVX512 inline std::size_t lowest_masked_seq(const float* s,
                                                           const std::uint64_t* seqs,
                                                           std::size_t n,
                                                           const std::uint64_t* prot) noexcept {
  const std::size_t full = n - n % 16;
  __m512 vmin = _mm512_set1_ps(std::numeric_limits<float>::infinity());
  for (std::size_t r = 0; r < full; r += 16)
    vmin = _mm512_mask_min_ps(vmin, eligible16(prot, r), _mm512_loadu_ps(s + r), vmin);
  scalar::LowestOpen best;
  if (full > 0) {
    const __m512 vlow = _mm512_set1_ps(_mm512_reduce_min_ps(vmin));
    for (std::size_t r = 0; r < full; r += 16) {
      auto eq = static_cast<unsigned>(
          _mm512_mask_cmp_ps_mask(eligible16(prot, r), _mm512_loadu_ps(s + r), vlow, _CMP_EQ_OQ));
      for (; eq != 0; eq &= eq - 1) {
        const std::size_t j = r + static_cast<std::size_t>(std::countr_zero(eq));
        best.offer(s[j], seqs[j], j);
      }
    }
  }
  return scalar::lowest_masked_seq(s, seqs, n, prot, full, best);
}

/// masked_costs 16 rows at a time: the protected value of each lane (+infinity where set in
/// `outside`, FLT_MAX elsewhere), overwritten by the product where the bit is clear (one
/// masked multiply; the scores of protected rows are not loaded).
KVEVICT_TARGET_AVX512 inline void masked_costs(const float* s, std::size_t n, float scale,
                                               const std::uint64_t* bits,
                                               const std::uint64_t* outside, float* out) noexcept {
  const __m512 times = _mm512_set1_ps(scale);
  const __m512 reserve = _mm512_set1_ps(std::numeric_limits<float>::max()), never = _mm512_set1_ps(std::numeric_limits<float>::infinity());
  for (std::size_t r = 0; r < n; r += 16) {
    const std::size_t left = n - r;
    const __mmask16 live = left >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << left) - 1u);
    const auto o = static_cast<__mmask16>((outside[r >> 6] >> (r & 63)) & 0xFFFFu);
    const auto open = static_cast<__mmask16>(~(bits[r >> 6] >> (r & 63)) & live);
    const __m512 protected_value = _mm512_mask_blend_ps(o, reserve, never);
    const __m512 x = _mm512_mask_mul_ps(protected_value, open, times, _mm512_maskz_loadu_ps(open, s + r));
    _mm512_mask_storeu_ps(out + r, live, x);
  }
}

}  // namespace avx512
KVEVICT_SUPPRESS_INTRIN_WARNINGS_END
#endif  // KVEVICT_X86

inline void check_masked_victim_n(std::size_t n) {
  if (n > std::numeric_limits<std::uint32_t>::max())
    throw std::invalid_argument("kvevict::kernels: n = " + std::to_string(n) +
                                " (expected n < 2^32: indices are 32-bit)");
}

/// open_gather's argument checks (before anything is written).
inline void check_open_gather(const std::uint64_t* seqs, const float* s, std::size_t n,
                              const std::uint64_t* bits, const float* vals,
                              const std::uint32_t* idx) {
  require_nonnull(seqs, n, "seqs");
  require_nonnull(s, n, "values");
  require_nonnull(bits, n, "bits");
  require_nonnull(vals, n, "vals");
  require_nonnull(idx, n, "idx");
  check_masked_victim_n(n);
}

/// open_gather at `isa`, arguments checked.
inline std::size_t open_gather_level(Isa isa, const std::uint64_t* seqs, const float* s,
                                     std::size_t n, std::uint64_t lo, std::uint64_t hi,
                                     float floor, std::uint64_t* bits, float* vals,
                                     std::uint32_t* idx) noexcept {
#if KVEVICT_X86
  if (isa == Isa::avx512) return avx512::open_gather(seqs, s, n, lo, hi, floor, bits, vals, idx);
  if (isa == Isa::avx2) return avx2::open_gather(seqs, s, n, lo, hi, floor, bits, vals, idx);
#endif
  return scalar::open_gather(seqs, s, n, lo, hi, floor, bits, vals, idx);
}

inline std::size_t open_gather_at(Isa isa, const std::uint64_t* seqs, const float* s,
                                  std::size_t n, std::uint64_t lo, std::uint64_t hi, float floor,
                                  std::uint64_t* bits, float* vals, std::uint32_t* idx) {
  check_open_gather(seqs, s, n, bits, vals, idx);
  return open_gather_level(isa, seqs, s, n, lo, hi, floor, bits, vals, idx);
}

/// decay_spike_gather: one pass at AVX-512; below it, decay_spike then open_gather.
inline std::size_t decay_spike_gather_at(Isa isa, float* score, float* spike, const float* x,
                                         const std::uint64_t* seqs, std::size_t n, float decay,
                                         std::uint64_t latest, std::uint64_t band,
                                         std::uint64_t lo, std::uint64_t hi, float floor,
                                         std::uint64_t* bits, float* vals, std::uint32_t* idx) {
  require_nonnull(score, n, "score");
  require_nonnull(x, n, "x");
  check_open_gather(seqs, spike, n, bits, vals, idx);
#if KVEVICT_X86
  if (isa == Isa::avx512)
    return avx512::decay_spike_gather(score, spike, x, seqs, n, decay, latest, band, lo, hi,
                                      floor, bits, vals, idx);
  if (isa == Isa::avx2)
    avx2::decay_spike(score, spike, x, seqs, n, decay, latest, band);
  else
#endif
    scalar::decay_spike(score, spike, x, seqs, n, decay, latest, band);
  return open_gather_level(isa, seqs, spike, n, lo, hi, floor, bits, vals, idx);
}

inline std::size_t lowest_masked_seq_at(Isa isa, const float* s, const std::uint64_t* seqs,
                                        std::size_t n, const std::uint64_t* prot) {
  require_nonnull(s, n, "scores");
  require_nonnull(seqs, n, "seqs");
#if KVEVICT_X86
  if (isa == Isa::avx512) return avx512::lowest_masked_seq(s, seqs, n, prot);
  if (isa == Isa::avx2) return avx2::lowest_masked_seq(s, seqs, n, prot);
#endif
  return scalar::lowest_masked_seq(s, seqs, n, prot);
}

inline std::size_t lowest_masked_seq4_at(Isa isa, const float* s, const std::uint64_t* seqs,
                                         std::size_t n, const std::uint64_t* prot,
                                         std::size_t* out) {
  require_nonnull(s, n, "scores");
  require_nonnull(seqs, n, "seqs");
  require_nonnull(out, n > 0 ? 4 : 0, "out");
#if KVEVICT_X86
  if (isa == Isa::avx2 || isa == Isa::avx512)  // AVX-512 CPUs run the AVX2 form
    return avx2::lowest_masked_seq4(s, seqs, n, prot, out);
#endif
  (void)isa;
  return scalar::lowest_masked_seq4(s, seqs, n, prot, out);
}

inline void masked_costs_at(Isa isa, const float* s, std::size_t n, float scale,
                            const std::uint64_t* bits, const std::uint64_t* outside, float* out) {
  require_nonnull(s, n, "scores");
  require_nonnull(bits, n, "bits");
  require_nonnull(outside, n, "outside");
  require_nonnull(out, n, "out");
#if KVEVICT_X86
  if (isa == Isa::avx512) return avx512::masked_costs(s, n, scale, bits, outside, out);
  if (isa == Isa::avx2) return avx2::masked_costs(s, n, scale, bits, outside, out);
#endif
  (void)isa;
  scalar::masked_costs(s, n, scale, bits, outside, out);
}

}  // namespace kvevict::kernels::detail

namespace kvevict::kernels {

KVEVICT_KERNEL_FN void masked_costs(Isa isa, const float* s, std::size_t n, float scale,
                                    const std::uint64_t* bits, const std::uint64_t* outside,
                                    float* out) {
  detail::require_isa(isa);
  detail::masked_costs_at(isa, s, n, scale, bits, outside, out);
}
KVEVICT_KERNEL_FN void masked_costs(const float* s, std::size_t n, float scale,
                                    const std::uint64_t* bits, const std::uint64_t* outside,
                                    float* out) {
  detail::masked_costs_at(active_isa(), s, n, scale, bits, outside, out);
}

KVEVICT_KERNEL_FN std::size_t lowest_masked_seq4(Isa isa, const float* s,
                                                 const std::uint64_t* seqs, std::size_t n,
                                                 const std::uint64_t* protected_bits,
                                                 std::size_t* out) {
  detail::require_isa(isa);
  return detail::lowest_masked_seq4_at(isa, s, seqs, n, protected_bits, out);
}
KVEVICT_KERNEL_FN std::size_t lowest_masked_seq4(const float* s, const std::uint64_t* seqs,
                                                 std::size_t n,
                                                 const std::uint64_t* protected_bits,
                                                 std::size_t* out) {
  return detail::lowest_masked_seq4_at(active_isa(), s, seqs, n, protected_bits, out);
}

KVEVICT_KERNEL_FN std::size_t open_gather(Isa isa, const std::uint64_t* seqs, const float* s,
                                          std::size_t n, std::uint64_t lo, std::uint64_t hi,
                                          float floor, std::uint64_t* bits, float* vals,
                                          std::uint32_t* idx) {
  detail::require_isa(isa);
  return detail::open_gather_at(isa, seqs, s, n, lo, hi, floor, bits, vals, idx);
}
KVEVICT_KERNEL_FN std::size_t open_gather(const std::uint64_t* seqs, const float* s,
                                          std::size_t n, std::uint64_t lo, std::uint64_t hi,
                                          float floor, std::uint64_t* bits, float* vals,
                                          std::uint32_t* idx) {
  return detail::open_gather_at(active_isa(), seqs, s, n, lo, hi, floor, bits, vals, idx);
}

KVEVICT_KERNEL_FN std::size_t decay_spike_gather(Isa isa, float* score, float* spike,
                                                 const float* x, const std::uint64_t* seqs,
                                                 std::size_t n, float decay,
                                                 std::uint64_t latest, std::uint64_t band,
                                                 std::uint64_t lo, std::uint64_t hi, float floor,
                                                 std::uint64_t* bits, float* vals,
                                                 std::uint32_t* idx) {
  detail::require_isa(isa);
  return detail::decay_spike_gather_at(isa, score, spike, x, seqs, n, decay, latest, band, lo,
                                       hi, floor, bits, vals, idx);
}
KVEVICT_KERNEL_FN std::size_t decay_spike_gather(float* score, float* spike, const float* x,
                                                 const std::uint64_t* seqs, std::size_t n,
                                                 float decay, std::uint64_t latest,
                                                 std::uint64_t band, std::uint64_t lo,
                                                 std::uint64_t hi, float floor,
                                                 std::uint64_t* bits, float* vals,
                                                 std::uint32_t* idx) {
  return detail::decay_spike_gather_at(active_isa(), score, spike, x, seqs, n, decay, latest,
                                       band, lo, hi, floor, bits, vals, idx);
}

KVEVICT_KERNEL_FN std::size_t lowest_masked_seq(Isa isa, const float* s,
                                                const std::uint64_t* seqs, std::size_t n,
                                                const std::uint64_t* protected_bits) {
  detail::require_isa(isa);
  return detail::lowest_masked_seq_at(isa, s, seqs, n, protected_bits);
}
KVEVICT_KERNEL_FN std::size_t lowest_masked_seq(const float* s, const std::uint64_t* seqs,
                                                std::size_t n,
                                                const std::uint64_t* protected_bits) {
  return detail::lowest_masked_seq_at(active_isa(), s, seqs, n, protected_bits);
}

}  // namespace kvevict::kernels

#endif  // !KVEVICT_KERNELS_DECLARE_ONLY
