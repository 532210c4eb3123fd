// Portable selection kernels and the bodies the SIMD levels reuse (compiled again under their
// target attribute, so the compiler may vectorise them for that level).
#pragma once

#include <bit>
#include <cmath>
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "dispatch.hpp"

namespace kvevict::kernels::detail {

/// Order-preserving map float -> uint32 (a < b  =>  key(a) < key(b)); -0.0 maps like +0.0 so
/// that equal scores compare equal. NaNs map above +inf or below -inf depending on sign:
/// callers treat NaN separately.
KVEVICT_ALWAYS_INLINE std::uint32_t float_order_key(float v) noexcept {
  std::uint32_t u = std::bit_cast<std::uint32_t>(v);
  if (u == 0x80000000u) u = 0;
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

/// Composite key sorting "better first" for top-k: larger score first, NaN after every number,
/// lower index first among equals. Ascending order of these keys is the selection order.
KVEVICT_ALWAYS_INLINE std::uint64_t topk_key(float v, std::uint32_t i) noexcept {
  const std::uint32_t primary = std::isnan(v) ? 0xFFFFFFFFu : ~float_order_key(v);
  return (static_cast<std::uint64_t>(primary) << 32) | i;
}

namespace scalar {

/// Reference masked argmax (Top) / argmin (!Top): lowest index on ties, NaN and protected
/// rows skipped, npos when nothing is eligible.
template <bool Top>
inline std::size_t arg_best(const float* s, std::size_t n, const std::uint64_t* prot) noexcept {
  std::size_t best = npos;
  float bv = 0.0f;
  for (std::size_t i = 0; i < n; ++i) {
    if (prot != nullptr && ((prot[i >> 6] >> (i & 63)) & 1u)) continue;
    const float v = s[i];
    if (std::isnan(v)) continue;
    if (best == npos || (Top ? v > bv : v < bv)) {
      best = i;
      bv = v;
    }
  }
  return best;
}

/// Emits, in ascending index order, every i with key beyond t (greater for Top, smaller
/// otherwise) and the first take_eq rows with key == t; stops after k. Returns count written.
template <bool Top, class K>
KVEVICT_ALWAYS_INLINE std::size_t emit_body(const K* keys, std::size_t n, K t, std::size_t take_eq,
                                            std::size_t k, std::uint32_t* out,
                                            std::size_t base = 0) noexcept {
  std::size_t pos = 0;
  for (std::size_t i = 0; i < n && pos < k; ++i) {
    const K v = keys[i];
    const bool beyond = Top ? v > t : v < t;
    const bool tie = (v == t) & (take_eq != 0);
    take_eq -= tie;
    out[pos] = static_cast<std::uint32_t>(base + i);  // pos < k here, so the slot exists
    pos += beyond | tie;
  }
  return pos;
}

template <bool Top, class K>
inline std::size_t emit(const K* keys, std::size_t n, K t, std::size_t take_eq, std::size_t k,
                        std::uint32_t* out) noexcept {
  return emit_body<Top, K>(keys, n, t, take_eq, k, out);
}

/// Histogram of keys >> shift restricted to keys whose (key >> (shift+8)) == prefix (when
/// Filter), into 256 bins. Four sub-histograms hide store-to-load latency on equal keys.
template <bool Filter, class K>
KVEVICT_ALWAYS_INLINE void hist256_body(const K* keys, std::size_t n, int shift, unsigned prefix,
                                        std::uint32_t* hist) noexcept {
  std::uint32_t h[4][256] = {};
  std::size_t i = 0;
  if constexpr (!Filter) {
    for (; i + 4 <= n; i += 4) {
      ++h[0][(keys[i] >> shift) & 0xFF];
      ++h[1][(keys[i + 1] >> shift) & 0xFF];
      ++h[2][(keys[i + 2] >> shift) & 0xFF];
      ++h[3][(keys[i + 3] >> shift) & 0xFF];
    }
  }
  for (; i < n; ++i) {
    const unsigned v = keys[i];
    if (!Filter || (v >> (shift + 8)) == prefix) ++h[i & 3][(v >> shift) & 0xFF];
  }
  for (int b = 0; b < 256; ++b) hist[b] = h[0][b] + h[1][b] + h[2][b] + h[3][b];
}

/// Smallest and largest key (n > 0). Branch-free, so it vectorises.
template <class K>
KVEVICT_ALWAYS_INLINE void key_range_body(const K* keys, std::size_t n, unsigned* mn,
                                          unsigned* mx) noexcept {
  K lo = keys[0], hi = keys[0];
  for (std::size_t i = 0; i < n; ++i) {
    lo = keys[i] < lo ? keys[i] : lo;
    hi = keys[i] > hi ? keys[i] : hi;
  }
  *mn = lo;
  *mx = hi;
}

/// hist[b] = how many keys equal base + b, b < bins <= 256 (every key in [base, base + bins)).
/// Four sub-histograms hide store-to-load latency on equal keys.
template <class K>
KVEVICT_ALWAYS_INLINE void hist_range_body(const K* keys, std::size_t n, unsigned base,
                                           std::size_t bins, std::uint32_t* hist) noexcept {
  std::uint32_t h[4][256];
  for (auto& row : h)
    for (std::size_t b = 0; b < bins; ++b) row[b] = 0;
  std::size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    ++h[0][keys[i] - base];
    ++h[1][keys[i + 1] - base];
    ++h[2][keys[i + 2] - base];
    ++h[3][keys[i + 3] - base];
  }
  for (; i < n; ++i) ++h[0][keys[i] - base];
  for (std::size_t b = 0; b < bins; ++b) hist[b] = h[0][b] + h[1][b] + h[2][b] + h[3][b];
}

template <bool Filter, class K>
inline void hist256(const K* keys, std::size_t n, int shift, unsigned prefix,
                    std::uint32_t* hist) noexcept {
  hist256_body<Filter, K>(keys, n, shift, prefix, hist);
}

/// The partition pass of float top-k: indices with s > thi go to `above`, those with
/// tlo <= s <= thi to `mid` (NaN to neither). Both buffers must hold n entries.
KVEVICT_ALWAYS_INLINE std::size_t topk_pass_body(const float* s, std::size_t n, float thi, float tlo,
                                                 std::uint32_t* above, std::uint32_t* mid,
                                                 std::size_t* n_mid) noexcept {
  std::size_t na = 0, nm = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const float v = s[i];
    const bool a = v > thi;
    const bool m = !a & (v >= tlo);
    above[na] = static_cast<std::uint32_t>(i);
    mid[nm] = static_cast<std::uint32_t>(i);
    na += a;
    nm += m;
  }
  *n_mid = nm;
  return na;
}

inline std::size_t topk_pass(const float* s, std::size_t n, float thi, float tlo,
                             std::uint32_t* above, std::uint32_t* mid, std::size_t* n_mid) noexcept {
  return topk_pass_body(s, n, thi, tlo, above, mid, n_mid);
}

// ---- Small-n float top-k by radix select (n < 8192) ---------------------------------------
// The primary key of topk_key (ascending = better: larger score first, NaN after every
// number, -0.0 == +0.0) is selected by MSD radix on its bytes: a 256-bin histogram per level
// finds the byte of the k-th best, rows with a better byte are emitted, rows equal to it go on
// to the next byte (in index order, so the final ties resolve to the lowest indices).

/// p[i] = the high half of topk_key(s[i], i). Branch-free, so it vectorises.
KVEVICT_ALWAYS_INLINE void topk_primary_body(const float* s, std::size_t n,
                                             std::uint32_t* p) noexcept {
  for (std::size_t i = 0; i < n; ++i) {
    std::uint32_t u = std::bit_cast<std::uint32_t>(s[i]);
    u = u == 0x80000000u ? 0u : u;
    const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
    const std::uint32_t key = (u & 0x80000000u) ? u : (~u & 0x7FFFFFFFu);  // ~float_order_key
    p[i] = nan ? 0xFFFFFFFFu : key;
  }
}
inline void topk_primary(const float* s, std::size_t n, std::uint32_t* p) noexcept {
  topk_primary_body(s, n, p);
}

/// 256-bin histogram of byte (v >> shift) & 0xFF, n < 65536 (16-bit sub-counters: four of
/// them hide store-to-load latency on runs of equal bytes).
KVEVICT_ALWAYS_INLINE void radix_hist_body(const std::uint32_t* v, std::size_t n, int shift,
                                           std::uint32_t* hist) noexcept {
  std::uint16_t h[4][256] = {};
  std::size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    ++h[0][(v[i] >> shift) & 0xFF];
    ++h[1][(v[i + 1] >> shift) & 0xFF];
    ++h[2][(v[i + 2] >> shift) & 0xFF];
    ++h[3][(v[i + 3] >> shift) & 0xFF];
  }
  for (; i < n; ++i) ++h[0][(v[i] >> shift) & 0xFF];
  for (int b = 0; b < 256; ++b)
    hist[b] = static_cast<std::uint32_t>(h[0][b]) + h[1][b] + h[2][b] + h[3][b];
}
inline void radix_hist(const std::uint32_t* v, std::size_t n, int shift,
                       std::uint32_t* hist) noexcept {
  radix_hist_body(v, n, shift, hist);
}

/// One radix level over (v, id) pairs: ids whose byte (v >> shift) & 0xFF is below b go to
/// out (returns how many); pairs whose byte equals b are compacted in place to the front of
/// (v, id), their count in *n_eq. ids == nullptr means id = index (then *ids_out receives the
/// ids of the equal pairs). Order is preserved.
/// (i0, nl, ne: where a caller that handled [0, i0) resumes, with its counts so far.)
KVEVICT_ALWAYS_INLINE std::size_t radix_split_body(std::uint32_t* v, const std::uint32_t* ids,
                                                   std::size_t n, int shift, std::uint32_t b,
                                                   std::uint32_t* out, std::uint32_t* ids_out,
                                                   std::size_t* n_eq, std::size_t i0 = 0,
                                                   std::size_t nl = 0,
                                                   std::size_t ne = 0) noexcept {
  for (std::size_t i = i0; i < n; ++i) {
    const std::uint32_t x = v[i];
    const std::uint32_t id = ids ? ids[i] : static_cast<std::uint32_t>(i);
    const std::uint32_t d = (x >> shift) & 0xFF;
    out[nl] = id;
    v[ne] = x;
    ids_out[ne] = id;
    nl += d < b;
    ne += d == b;
  }
  *n_eq = ne;
  return nl;
}
inline std::size_t radix_split(std::uint32_t* v, const std::uint32_t* ids, std::size_t n, int shift,
                               std::uint32_t b, std::uint32_t* out, std::uint32_t* ids_out,
                               std::size_t* n_eq) noexcept {
  return radix_split_body(v, ids, n, shift, b, out, ids_out, n_eq);
}

/// Protection bits from arrival indices: bit i set unless lo <= seqs[i] < hi. Writes
/// ceil(n/64) words; bits beyond n are set (never eligible).
KVEVICT_ALWAYS_INLINE void protect_outside_body(const std::uint64_t* seqs, std::size_t n,
                                                std::uint64_t lo, std::uint64_t hi,
                                                std::uint64_t* bits) noexcept {
  const std::uint64_t span = hi > lo ? hi - lo : 0;
  const std::size_t words = (n + 63) / 64;
  for (std::size_t w = 0; w < words; ++w) {
    const std::size_t base = w * 64, m = n - base < 64 ? n - base : 64;
    std::uint64_t word = ~std::uint64_t{0};
    for (std::size_t j = 0; j < m; ++j)
      word &= ~(static_cast<std::uint64_t>(seqs[base + j] - lo < span) << j);
    bits[w] = word;
  }
}
inline void protect_outside(const std::uint64_t* seqs, std::size_t n, std::uint64_t lo,
                            std::uint64_t hi, std::uint64_t* bits) noexcept {
  protect_outside_body(seqs, n, lo, hi, bits);
}

/// First i in [from, n) with protection bit clear and s[i] == v, or npos.
inline std::size_t find_eq(const float* s, std::size_t n, std::size_t from,
                           const std::uint64_t* prot, float v) noexcept {
  for (std::size_t i = from; i < n; ++i)
    if (s[i] == v && !(prot != nullptr && ((prot[i >> 6] >> (i & 63)) & 1u))) return i;
  return npos;
}

/// out[r] = 0 + p[0][r] + p[1][r] + ... + p[g-1][r] (rows of length n, that order of
/// additions), calling test(bits of x) on every input x (the caller's check, OR-reduced).
template <class Test>
KVEVICT_ALWAYS_INLINE void group_sum_tested(const float* p, std::size_t g, std::size_t n, float* out,
                                            Test&& test) noexcept {
  constexpr std::size_t kBlock = 512;  // the block of out stays in L1 across the g rows
  for (std::size_t base = 0; base < n; base += kBlock) {
    const std::size_t m = n - base < kBlock ? n - base : kBlock;
    float* o = out + base;
    const float* r0 = p + base;
    for (std::size_t i = 0; i < m; ++i) {
      const float x = r0[i];
      test(std::bit_cast<std::uint32_t>(x));
      o[i] = 0.0f + x;
    }
    for (std::size_t k = 1; k < g; ++k) {
      const float* r = p + k * n + base;
      for (std::size_t i = 0; i < m; ++i) {
        const float x = r[i];
        test(std::bit_cast<std::uint32_t>(x));
        o[i] += x;
      }
    }
  }
}

/// The group sum; returns whether every input value is finite (exponent test, OR-reduced).
KVEVICT_ALWAYS_INLINE bool group_sum_body(const float* p, std::size_t g, std::size_t n,
                                          float* out) noexcept {
  std::uint32_t carry = 0;
  group_sum_tested(p, g, n, out, [&](std::uint32_t u) { carry |= (u & 0x7fffffffu) + 0x00800000u; });
  return (carry & 0x80000000u) == 0;
}
inline bool group_sum(const float* p, std::size_t g, std::size_t n, float* out) noexcept {
  return group_sum_body(p, g, n, out);
}

/// The group sum with a range test instead of the finiteness test: returns whether every
/// input is a probability, +-0 or in (0, hi] (bit pattern u <= bits(hi) or u == -0; NaN,
/// infinities and negatives fail). hi must be a positive finite float.
KVEVICT_ALWAYS_INLINE bool group_sum_bounded_body(const float* p, std::size_t g, std::size_t n,
                                                  float hi, float* out) noexcept {
  const std::uint32_t hb = std::bit_cast<std::uint32_t>(hi);
  std::uint32_t bad = 0;
  group_sum_tested(p, g, n, out, [&](std::uint32_t u) {
    bad |= static_cast<std::uint32_t>((u & 0x7fffffffu) > hb) |
           static_cast<std::uint32_t>(u > 0x80000000u);
  });
  return bad == 0;
}
inline bool group_sum_bounded(const float* p, std::size_t g, std::size_t n, float hi,
                              float* out) noexcept {
  return group_sum_bounded_body(p, g, n, hi, out);
}

/// score[r] = decay * score[r] + x[r] (a multiply then an add, never fused) for every row,
/// and spike[r] = max(spike[r], x[r]) for the rows with latest - seqs[r] >= band (unsigned
/// difference): DecayedAttention's observe with a recall reserve.
KVEVICT_ALWAYS_INLINE void decay_spike_body(float* score, float* spike, const float* x,
                                            const std::uint64_t* seqs, std::size_t n,
                                            float decay, std::uint64_t latest,
                                            std::uint64_t band, std::size_t from = 0) noexcept {
  for (std::size_t r = from; r < n; ++r) {
    const float prod = decay * score[r];
    score[r] = prod + x[r];
    if (latest - seqs[r] >= band && spike[r] < x[r]) spike[r] = x[r];
  }
}
inline void decay_spike(float* score, float* spike, const float* x, const std::uint64_t* seqs,
                        std::size_t n, float decay, std::uint64_t latest,
                        std::uint64_t band) noexcept {
  decay_spike_body(score, spike, x, seqs, n, decay, latest, band);
}

/// Whether every |x[i]| of x[from, n) has a bit pattern below `limit` (at most 0x80000000):
/// (u & 0x7fffffff) + (0x80000000 - limit) carries into bit 31 exactly when it does not, so
/// the test is an OR over the values, branch-free (it vectorises).
KVEVICT_ALWAYS_INLINE bool abs_below_body(const float* x, std::size_t n, std::uint32_t limit,
                                          std::size_t from = 0) noexcept {
  const std::uint32_t add = 0x80000000u - limit;
  std::uint32_t carry = 0;
  for (std::size_t i = from; i < n; ++i) carry |= (std::bit_cast<std::uint32_t>(x[i]) & 0x7fffffffu) + add;
  return (carry & 0x80000000u) == 0;
}
inline bool abs_below(const float* const* xs, const std::size_t* ns, const std::uint32_t* limits,
                      std::size_t count) noexcept {
  bool ok = true;
  for (std::size_t j = 0; j < count; ++j) ok &= abs_below_body(xs[j], ns[j], limits[j]);
  return ok;
}

/// The unprotected rows (bit clear in prot) with s[i] > 0 and s[i] >= lo, in index order:
/// their values into vals and indices into idx; returns how many.
KVEVICT_ALWAYS_INLINE std::size_t gather_open_body(const float* s, std::size_t n,
                                                   const std::uint64_t* prot, float lo,
                                                   float* vals, std::uint32_t* idx,
                                                   std::size_t from = 0,
                                                   std::size_t count = 0) noexcept {
  for (std::size_t i = from; i < n; ++i) {
    const float v = s[i];
    if (((prot[i >> 6] >> (i & 63)) & 1u) == 0 && v > 0.0f && v >= lo) {
      vals[count] = v;
      idx[count] = static_cast<std::uint32_t>(i);
      ++count;
    }
  }
  return count;
}
inline std::size_t gather_open(const float* s, std::size_t n, const std::uint64_t* prot, float lo,
                               float* vals, std::uint32_t* idx) noexcept {
  return gather_open_body(s, n, prot, lo, vals, idx);
}

/// The k-th smallest key overall from the keys cand[0, m) that hold it, c_lt keys being
/// smaller than all of them; *take_eq = how many keys equal to it complete the k (>= 1).
/// Usually m is small: an insertion sort; many (clustered scores) use std::nth_element.
/// Reorders cand.
inline std::int32_t kth_of(std::int32_t* cand, std::size_t m, std::size_t k, std::size_t c_lt,
                           std::size_t* take_eq) noexcept {
  const std::size_t need = k - c_lt;  // 1 <= need <= m
  if (m <= 16) {
    for (std::size_t i = 1; i < m; ++i) {
      const std::int32_t x = cand[i];
      std::size_t j = i;
      for (; j > 0 && cand[j - 1] > x; --j) cand[j] = cand[j - 1];
      cand[j] = x;
    }
  } else {
    std::nth_element(cand, cand + (need - 1), cand + m);
  }
  const std::int32_t t = cand[need - 1];
  std::size_t below = c_lt;  // keys < t
  for (std::size_t j = 0; j < m; ++j) below += cand[j] < t;
  *take_eq = k - below;
  return t;
}

/// The k-th key T of the threshold top-k (select_avx2 / select_avx512 topk_threshold), from
/// the low halves cand[0, m) of the keys whose high half is the k-th high half t16, c_lt keys
/// having a smaller one (kth_of on the low halves); *take_eq as kth_of's. Usually m is 1-3.
/// Reorders cand.
inline std::int32_t threshold_key(std::int32_t* cand, std::size_t m, std::size_t k,
                                  std::size_t c_lt, std::int32_t t16,
                                  std::size_t* take_eq) noexcept {
  const std::int32_t tlo = kth_of(cand, m, k, c_lt, take_eq);
  return static_cast<std::int32_t>((static_cast<std::uint32_t>(t16) << 16) |
                                   static_cast<std::uint32_t>(tlo));
}

/// The running best of lowest_open: the lowest (value, seq) seen among open rows.
struct LowestOpen {
  float value = std::numeric_limits<float>::infinity();
  std::uint64_t seq = ~std::uint64_t{0};
  std::size_t index = npos;
  /// Takes row r (value v, arrival seq q) when it is lower: a lower value, or an equal
  /// value (-0.0 == +0.0) and an older seq. NaN never compares lower.
  KVEVICT_ALWAYS_INLINE void offer(float v, std::uint64_t q, std::size_t r) noexcept {
    if (v < value || (v == value && q < seq)) {
      value = v;
      seq = q;
      index = r;
    }
  }
};

/// lowest_open / decay_lowest_open over rows [from, n): with Decay, s[r] = decay * s[r] +
/// x[r] (a multiply then an add, never fused) first; then every row with seqs[r] - lo <
/// span (unsigned: lo <= seq < lo + span) is offered to `best`. K: 64-bit seqs or 32-bit
/// keys (the same rule in 32-bit unsigned arithmetic).
template <bool Decay, class K>
KVEVICT_ALWAYS_INLINE void lowest_open_body(float* s, const float* x, const K* seqs,
                                            std::size_t n, float decay, K lo, K span,
                                            LowestOpen& best, std::size_t from = 0) noexcept {
  static_assert(std::is_same_v<K, std::uint64_t> || std::is_same_v<K, std::uint32_t>);
  for (std::size_t r = from; r < n; ++r) {
    float v = s[r];
    if constexpr (Decay) {
      const float prod = decay * v;
      v = prod + x[r];
      s[r] = v;
    }
    if (static_cast<K>(seqs[r] - lo) < span) best.offer(v, seqs[r], r);
  }
}
template <bool Decay, class K>
inline std::size_t lowest_open(float* s, const float* x, const K* seqs, std::size_t n,
                               float decay, K lo, K hi) noexcept {
  LowestOpen best;
  lowest_open_body<Decay, K>(s, x, seqs, n, decay, lo, hi > lo ? static_cast<K>(hi - lo) : K{0}, best);
  return best.index;
}

}  // namespace scalar
}  // namespace kvevict::kernels::detail
