// Selection kernels: counting (histogram) top-k / bottom-k over small-integer keys, float
// top-k by sampled thresholds, and masked argmin/argmax over float scores.
//
// Conventions shared by every function here:
//  - indices are std::uint32_t, so n must be < 2^32;
//  - ties resolve to the lowest index (the selected *set* is deterministic);
//  - `protected_bits` (nullable) holds ceil(n/64) words, bit i of word i/64 set = row i may not
//    be chosen;
//  - each function has an overload pinned to a level (f<Isa::avx512>(...), throws when the CPU
//    lacks it) and one that uses active_isa().
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "dispatch.hpp"

namespace kvevict::kernels {
// The entry points, declared here and defined below (in separate-kernels mode, config.hpp,
// the definitions are compiled once into the kvevict_kernels library).
template <Isa I>
KVEVICT_KERNEL_FN void counting_topk(const std::uint8_t* keys, std::size_t n, std::size_t k,
                                     std::uint32_t* out);
template <Isa I>
KVEVICT_KERNEL_FN void counting_topk(const std::uint16_t* keys, std::size_t n, std::size_t k,
                                     std::uint32_t* out);
template <Isa I>
KVEVICT_KERNEL_FN void counting_bottomk(const std::uint8_t* keys, std::size_t n, std::size_t k,
                                        std::uint32_t* out);
template <Isa I>
KVEVICT_KERNEL_FN void counting_bottomk(const std::uint16_t* keys, std::size_t n, std::size_t k,
                                        std::uint32_t* out);
template <Isa I>
KVEVICT_KERNEL_FN void counting_topk(const std::uint16_t* keys, std::size_t n, std::size_t k,
                                     const std::uint32_t* histogram, std::size_t bins,
                                     std::uint32_t* out);
template <Isa I>
KVEVICT_KERNEL_FN void counting_bottomk(const std::uint16_t* keys, std::size_t n, std::size_t k,
                                        const std::uint32_t* histogram, std::size_t bins,
                                        std::uint32_t* out);
template <class K>
KVEVICT_KERNEL_FN void counting_topk(const K* keys, std::size_t n, std::size_t k,
                                     std::uint32_t* out);
template <class K>
KVEVICT_KERNEL_FN void counting_bottomk(const K* keys, std::size_t n, std::size_t k,
                                        std::uint32_t* out);
KVEVICT_KERNEL_FN void counting_topk(const std::uint16_t* keys, std::size_t n, std::size_t k,
                                     const std::uint32_t* histogram, std::size_t bins,
                                     std::uint32_t* out);
KVEVICT_KERNEL_FN void counting_bottomk(const std::uint16_t* keys, std::size_t n, std::size_t k,
                                        const std::uint32_t* histogram, std::size_t bins,
                                        std::uint32_t* out);
template <Isa I>
KVEVICT_KERNEL_FN void topk_indices(const float* scores, std::size_t n, std::size_t k,
                                    std::uint32_t* out);
KVEVICT_KERNEL_FN void topk_indices(const float* scores, std::size_t n, std::size_t k,
                                    std::uint32_t* out);
template <Isa I>
KVEVICT_KERNEL_FN std::size_t argmax_masked(const float* s, std::size_t n,
                                            const std::uint64_t* protected_bits);
KVEVICT_KERNEL_FN std::size_t argmax_masked(const float* s, std::size_t n,
                                            const std::uint64_t* protected_bits);
template <Isa I>
KVEVICT_KERNEL_FN std::size_t argmin_masked(const float* s, std::size_t n,
                                            const std::uint64_t* protected_bits);
KVEVICT_KERNEL_FN std::size_t argmin_masked(const float* s, std::size_t n,
                                            const std::uint64_t* protected_bits);
KVEVICT_KERNEL_FN void protect_outside(const std::uint64_t* seqs, std::size_t n, std::uint64_t lo,
                                       std::uint64_t hi, std::uint64_t* bits);
KVEVICT_KERNEL_FN std::size_t find_equal_masked(const float* s, std::size_t n, std::size_t from,
                                                const std::uint64_t* protected_bits, float v);
KVEVICT_KERNEL_FN bool group_sum_checked(const float* p, std::size_t g, std::size_t n,
                                         float* out);
KVEVICT_KERNEL_FN bool group_sum_bounded(const float* p, std::size_t g, std::size_t n, float hi,
                                         float* out);
KVEVICT_KERNEL_FN void decay_spike(float* score, float* spike, const float* x,
                                   const std::uint64_t* seqs, std::size_t n, float decay,
                                   std::uint64_t latest, std::uint64_t band);
KVEVICT_KERNEL_FN bool abs_below(const float* const* xs, const std::size_t* ns,
                                 const std::uint32_t* limits, std::size_t count);
KVEVICT_KERNEL_FN std::size_t gather_open(const float* s, std::size_t n,
                                          const std::uint64_t* protected_bits, float lo,
                                          float* vals, std::uint32_t* idx);
KVEVICT_KERNEL_FN std::size_t lowest_open(const float* s, const std::uint64_t* seqs, std::size_t n,
                                          std::uint64_t lo, std::uint64_t hi);
KVEVICT_KERNEL_FN std::size_t decay_lowest_open(float* s, const float* x, const std::uint64_t* seqs,
                                                std::size_t n, float decay, std::uint64_t lo,
                                                std::uint64_t hi);
KVEVICT_KERNEL_FN std::size_t lowest_open(const float* s, const std::uint32_t* keys, std::size_t n,
                                          std::uint32_t lo, std::uint32_t hi);
KVEVICT_KERNEL_FN std::size_t decay_lowest_open(float* s, const float* x, const std::uint32_t* keys,
                                                std::size_t n, float decay, std::uint32_t lo,
                                                std::uint32_t hi);
}  // namespace kvevict::kernels

#if !KVEVICT_KERNELS_DECLARE_ONLY
#include "select_avx2.hpp"
#include "select_avx512.hpp"
#include "select_scalar.hpp"

namespace kvevict::kernels {
namespace detail {

inline void check_select_args(const void* keys, std::size_t n, std::size_t k,
                              const std::uint32_t* out) {
  if (n > std::numeric_limits<std::uint32_t>::max())
    throw std::invalid_argument("kvevict::kernels: n = " + std::to_string(n) +
                                " (expected n < 2^32: indices are 32-bit)");
  if (k > n)
    throw std::invalid_argument("kvevict::kernels: k = " + std::to_string(k) +
                                " exceeds n = " + std::to_string(n) + " (expected k <= n)");
  require_nonnull(keys, n, "keys");
  require_nonnull(out, k, "out");
}

template <Isa I, bool Top, class K>
inline std::size_t emit_at(const K* keys, std::size_t n, K t, std::size_t take_eq, std::size_t k,
                           std::uint32_t* out) noexcept {
#if KVEVICT_X86
  if constexpr (I == Isa::avx512) return avx512::emit<Top, K>(keys, n, t, take_eq, k, out);
  if constexpr (I == Isa::avx2) return avx2::emit<Top, K>(keys, n, t, take_eq, k, out);
#endif
  return scalar::emit<Top, K>(keys, n, t, take_eq, k, out);
}

template <Isa I, bool Filter, class K>
inline void hist256_at(const K* keys, std::size_t n, int shift, unsigned prefix,
                       std::uint32_t* hist) noexcept {
#if KVEVICT_X86
  if constexpr (I == Isa::avx512) return avx512::hist256<Filter, K>(keys, n, shift, prefix, hist);
  if constexpr (I == Isa::avx2) return avx2::hist256<Filter, K>(keys, n, shift, prefix, hist);
#endif
  scalar::hist256<Filter, K>(keys, n, shift, prefix, hist);
}

template <Isa I, class K>
inline void key_range_at(const K* keys, std::size_t n, unsigned* mn, unsigned* mx) noexcept {
#if KVEVICT_X86
  if constexpr (I != Isa::scalar) return avx2::key_range<K>(keys, n, mn, mx);
#endif
  scalar::key_range_body<K>(keys, n, mn, mx);
}
template <Isa I, class K>
inline void hist_range_at(const K* keys, std::size_t n, unsigned base, std::size_t bins,
                          std::uint32_t* hist) noexcept {
#if KVEVICT_X86
  if constexpr (I != Isa::scalar) return avx2::hist_range<K>(keys, n, base, bins, hist);
#endif
  scalar::hist_range_body<K>(keys, n, base, bins, hist);
}

/// Given a histogram, finds the threshold bin t and how many rows equal to t to take so that
/// (rows beyond t) + take_eq == k. Top scans from the highest bin, bottom from the lowest.
template <bool Top>
inline void threshold_from_histogram(const std::uint32_t* hist, std::size_t bins, std::size_t k,
                                     std::size_t* t, std::size_t* take_eq) noexcept {
  std::size_t cum = 0;
  for (std::size_t j = 0; j < bins; ++j) {
    const std::size_t b = Top ? bins - 1 - j : j;
    if (cum + hist[b] >= k) {
      *t = b;
      *take_eq = k - cum;
      return;
    }
    cum += hist[b];
  }
  *t = Top ? 0 : bins - 1;
  *take_eq = k - cum;
}

template <Isa I, bool Top, class K>
inline void counting_select(const K* keys, std::size_t n, std::size_t k, std::uint32_t* out) {
  if (k == 0) return;
  std::uint32_t hist[256];
  std::size_t t = 0, take_eq = 0;
  // One min/max reduction first (vectorised; k > 0, so n > 0). When the keys span fewer than
  // 256 values (every uint8 set; Hamming distances: at most bits + 1), one histogram of
  // key - min with only that many bins decides (no 256-bin table to clear and scan).
  // Otherwise a two-level radix histogram: high byte over all keys, then low byte within the
  // threshold bucket.
  unsigned mn = 0, mx = 0;
  key_range_at<I, K>(keys, n, &mn, &mx);
  if (mx - mn < 256) {
    const std::size_t bins = mx - mn + 1;
    hist_range_at<I, K>(keys, n, mn, bins, hist);
    threshold_from_histogram<Top>(hist, bins, k, &t, &take_eq);
    t += mn;
  } else {
    std::size_t hi = 0, take_hi = 0;
    hist256_at<I, false, K>(keys, n, 8, 0, hist);
    threshold_from_histogram<Top>(hist, 256, k, &hi, &take_hi);
    hist256_at<I, true, K>(keys, n, 0, static_cast<unsigned>(hi), hist);
    std::size_t lo = 0;
    threshold_from_histogram<Top>(hist, 256, take_hi, &lo, &take_eq);
    t = (hi << 8) | lo;
  }
  emit_at<I, Top, K>(keys, n, static_cast<K>(t), take_eq, k, out);
}

template <Isa I, bool Top>
inline void counting_select_hist(const std::uint16_t* keys, std::size_t n, std::size_t k,
                                 const std::uint32_t* hist, std::size_t bins,
                                 std::uint32_t* out) {
  if (k == 0) return;
  std::size_t t = 0, take_eq = 0;
  threshold_from_histogram<Top>(hist, bins, k, &t, &take_eq);
  emit_at<I, Top, std::uint16_t>(keys, n, static_cast<std::uint16_t>(t), take_eq, k, out);
}

template <Isa I>
inline std::size_t topk_pass_at(const float* s, std::size_t n, float thi, float tlo,
                                std::uint32_t* above, std::uint32_t* mid,
                                std::size_t* n_mid) noexcept {
#if KVEVICT_X86
  if constexpr (I == Isa::avx512) return avx512::topk_pass(s, n, thi, tlo, above, mid, n_mid);
  if constexpr (I == Isa::avx2) return avx2::topk_pass(s, n, thi, tlo, above, mid, n_mid);
#endif
  return scalar::topk_pass(s, n, thi, tlo, above, mid, n_mid);
}

/// Per-thread scratch reused across calls, so the hot path does not allocate.
struct TopkScratch {
  std::vector<std::uint32_t> above, mid, prim;
  std::vector<std::uint64_t> keys;
  std::vector<float> sample;
  std::vector<std::uint32_t> below, band_ids[2];  // topk_bracket's buffers (grow only)
  std::vector<std::int32_t> band_keys[2];
};
inline TopkScratch& topk_scratch() {
  thread_local TopkScratch s;
  return s;
}

/// Exact top-k by composite keys (score desc, NaN last, index asc): the fallback and the
/// definition the fast path must match.
inline void topk_exact(const float* s, std::size_t n, std::size_t k, std::uint32_t* out) {
  auto& keys = topk_scratch().keys;
  keys.resize(n);
  for (std::size_t i = 0; i < n; ++i) keys[i] = topk_key(s[i], static_cast<std::uint32_t>(i));
  std::nth_element(keys.begin(), keys.begin() + static_cast<std::ptrdiff_t>(k - 1), keys.end());
  for (std::size_t j = 0; j < k; ++j) out[j] = static_cast<std::uint32_t>(keys[j]);
}

template <Isa I>
inline void radix_level_at(const std::uint32_t* v, std::size_t n, int shift,
                           std::uint32_t* hist) noexcept {
#if KVEVICT_X86
  if constexpr (I != Isa::scalar) return avx2::radix_hist(v, n, shift, hist);
#endif
  scalar::radix_hist(v, n, shift, hist);
}
template <Isa I>
inline std::size_t radix_split_at(std::uint32_t* v, const std::uint32_t* ids, std::size_t n,
                                  int shift, std::uint32_t b, std::uint32_t* out,
                                  std::uint32_t* ids_out, std::size_t* n_eq) noexcept {
#if KVEVICT_X86
  if constexpr (I != Isa::scalar) return avx2::radix_split(v, ids, n, shift, b, out, ids_out, n_eq);
#endif
  return scalar::radix_split(v, ids, n, shift, b, out, ids_out, n_eq);
}

/// Exact top-k for n < 65536 by MSD radix select on the primary keys (select_scalar.hpp):
/// the same set as topk_exact (ties to the lower index, NaN last). (AVX-512 CPUs run the AVX2
/// form.) 0 < k < n.
template <Isa I>
inline void topk_radix(const float* s, std::size_t n, std::size_t k, std::uint32_t* out) {
  TopkScratch& sc = topk_scratch();
  sc.prim.resize(n);
  sc.above.resize(n);
  sc.mid.resize(n);
  std::uint32_t* v = sc.prim.data();
  std::uint32_t* ids = sc.mid.data();
#if KVEVICT_X86
  if constexpr (I != Isa::scalar)
    avx2::topk_primary(s, n, v);
  else
#endif
    scalar::topk_primary(s, n, v);
  std::size_t emitted = 0, m = n, take = k;
  bool implicit_ids = true;  // level 1: id = index
  std::uint32_t hist[256];
  for (int shift = 24; shift >= 0; shift -= 8) {
    radix_level_at<I>(v, m, shift, hist);
    std::size_t cum = 0, b = 0;
    while (cum + hist[b] < take) cum += hist[b++];  // ascending keys: the best bytes first
    std::size_t n_eq = 0;
    const std::size_t nl = radix_split_at<I>(v, implicit_ids ? nullptr : ids, m, shift,
                                             static_cast<std::uint32_t>(b), sc.above.data(),
                                             ids, &n_eq);
    std::copy_n(sc.above.data(), nl, out + emitted);
    emitted += nl;
    take -= nl;
    m = n_eq;
    implicit_ids = false;
    if (take == 0) return;
    if (take == m) break;
  }
  // Either every remaining row is taken, or they all share the k-th key: the lowest ids first.
  std::copy_n(ids, take, out + emitted);
}

template <Isa I>
inline void topk_select(const float* s, std::size_t n, std::size_t k, std::uint32_t* out) {
  if (k == 0) return;
  if (k == n) {
    for (std::size_t i = 0; i < n; ++i) out[i] = static_cast<std::uint32_t>(i);
    return;
  }
  // Below kMinN the sampled path's fixed costs (a 1024-score sample, two nth_elements on it)
  // lost to topk_small (a loop over 16 N(0,1) inputs, 2026-12-02, AVX-512 CPU: 8K / 16K rows,
  // k = n/2, 3.5 / 4.6 us against 8.1-32 / 11.8-50 us).
  constexpr std::size_t kSample = 1024, kMinN = 32768;
#if KVEVICT_X86
  // Threshold search (no sample, no sort) up to 512 rows, where it beat topk_small (a loop
  // over 16 N(0,1) inputs, AVX-512 CPU, 2026-12-02: 75 / 256 / 512 rows AVX-512 level 101 /
  // 141 / 265 ns, AVX2 level 153 / 249 / 385 ns, topk_small 280 / 294-342 / 427-537 ns). At
  // 1K rows it measured 475 against 590-665 ns there but no faster in bench_kernels
  // (float_topk k = 64: 611 against 480-500 ns), so topk_small keeps 1K.
  static_assert(512 <= avx512::kThresholdMaxN && 512 <= avx2::kThresholdMaxN);
  // Small k at AVX-512 (stop 36): a bound from 128 row groups' maxima leaves about k + 20
  // candidates (avx512::topk_group_max): 256-512 rows when 24 k <= n, or 16 k <= n and
  // k <= 16 (k <= 20 from 384 rows) since stop 37's topk_drop_worst (k = 24-32 at 448-512
  // rows and k = 20 at 320 rows stayed slower than topk_scaled), and above 512 rows k <= 32,
  // or k <= 64 from 2048 rows (to 16K), where it beat topk_scaled and topk_filter (N(0,1)
  // scores, in-process A/B, docs/benchmarks.md "Small-n select, stop 36" and "stop 37").
  if constexpr (I == Isa::avx512)
    if (n >= 256 && n <= 16384 && k <= 64 &&
        (n <= 512 ? 24 * k <= n || (16 * k <= n && k <= (n >= 384 ? 20u : 16u))
                  : k <= 32 || n >= 2048) &&
        avx512::topk_group_max(s, n, k, out))
      return;
  if (n <= 512) {
    if constexpr (I == Isa::avx512)
    {
      if (n <= avx512::kRankMaxN) return avx512::topk_rank(s, n, k, out);
      if (has_avx512_vbmi2() ? avx512::topk_scaled_vbmi2(s, n, k, out)
                             : avx512::topk_scaled(s, n, k, out))
        return;
      avx512::topk_threshold(s, n, k, out);
      return;
    }
    if constexpr (I == Isa::avx2) return avx2::topk_threshold(s, n, k, out);
  }
  // Scaled bins at AVX-512 (avx512::topk_scaled, stop 34): 33-512 rows, and k > 64 up to
  // 1024 rows instead of topk_band (bench_kernels float_topk / float_topk_varied, main and
  // branch alternating, docs/benchmarks.md "Branch sel, stop 34").
  // k <= 64 above 512 rows at AVX-512: a bound from 32 groups' two best rows leaves about
  // 150-400 candidates (N(0,1) scores, 1K-16K rows), which topk_threshold finishes (loop over
  // 16 N(0,1) inputs, 2026-12-02: 1K / 4K / 8K / 16K rows 316-341 / 693-746 / 1314-1448 /
  // 3150-3229 ns against 527-536 / 1836-1856 / 6886-14938 / 8492-21438 ns before).
  if constexpr (I == Isa::avx512) {
    if (n > 512 && k <= 64 && avx512::topk_filter(s, n, k, out)) return;
    if (n > 512 && n <= avx512::kScaledMaxN && k > 64 &&
        (has_avx512_vbmi2() ? avx512::topk_scaled_vbmi2(s, n, k, out)
                            : avx512::topk_scaled(s, n, k, out)))
      return;
  }
#endif
  TopkScratch& sc = topk_scratch();
  auto grow = [](auto& v, std::size_t size) {
    if (v.size() < size) v.resize(size);
    return v.data();
  };
#if KVEVICT_X86
  // Other k at AVX-512 up to 4096 rows: one bracket round whose band (about 13n/64 rows)
  // topk_threshold finishes (bench_kernels float_topk/half, main / branch alternating,
  // 2026-12-02, load 5-6: 1K 463-633 against 548-596 ns, 4K 1307-1953 against 1925-2048 ns
  // by topk_bracket); larger bands (8K rows: ~1660) fall back to topk_small.
  if constexpr (I == Isa::avx512)
    if (n > 512 && n <= 4096 &&
        avx512::topk_band(s, n, k, out, reinterpret_cast<float*>(grow(sc.band_keys[0], n + 16))))
      return;
#endif
  // topk_small below kMinN: up to 2048 rows faster than topk_bracket (bench_kernels
  // float_topk, old/new binaries interleaved, 2026-12-01); at 4K 0.93-0.97x of it then, but
  // 1.2-1.6x at 12K-16K rows (loop over 16 N(0,1) inputs, 2026-12-02).
  if (n < kMinN) {
#if KVEVICT_X86
    if constexpr (I != Isa::scalar) {  // AVX-512 CPUs run the AVX2 form
      avx2::BracketBuffers b{grow(sc.below, 2 * n + 16),
                             {grow(sc.band_keys[0], n + 8), grow(sc.band_keys[1], n + 8)},
                             {grow(sc.band_ids[0], n + 8), grow(sc.band_ids[1], n + 8)}};
      return avx2::topk_small(s, n, k, out, b);
    }
#endif
    return topk_radix<I>(s, n, k, out);
  }
  // Stratified pseudo-random sample (fixed seed: deterministic), NaNs dropped.
  sc.sample.clear();
  std::uint64_t h = 0x9E3779B97F4A7C15ull;
  for (std::size_t j = 0; j < kSample; ++j) {
    h ^= h << 13, h ^= h >> 7, h ^= h << 17;
    const std::size_t lo = j * n / kSample, hi = (j + 1) * n / kSample;
    const float v = s[lo + h % (hi - lo)];
    if (!std::isnan(v)) sc.sample.push_back(v);
  }
  const std::size_t ms = sc.sample.size();
  if (ms < kSample / 2) return topk_exact(s, n, k, out);
  // Thresholds bracketing the k-th largest: sample ranks r -/+ delta, delta = 2 sqrt(ms)
  // (about four standard deviations of the sample rank), so the fallback is rare.
  const auto delta = static_cast<std::ptrdiff_t>(2.0 * std::sqrt(static_cast<double>(ms)));
  const auto r = static_cast<std::ptrdiff_t>(static_cast<double>(k) * ms / n);
  const std::ptrdiff_t r_hi = r - delta, r_lo = r + delta;
  auto desc = [](float a, float b) { return a > b; };
  float thi = std::numeric_limits<float>::infinity();
  float tlo = -std::numeric_limits<float>::infinity();
  auto first = sc.sample.begin();
  if (r_lo < static_cast<std::ptrdiff_t>(ms)) {
    std::nth_element(first, first + r_lo, sc.sample.end(), desc);
    tlo = sc.sample[static_cast<std::size_t>(r_lo)];
  }
  if (r_hi >= 0) {
    std::nth_element(first, first + r_hi, first + std::min<std::ptrdiff_t>(r_lo, ms), desc);
    thi = sc.sample[static_cast<std::size_t>(r_hi)];
  }
  sc.above.resize(n);
  sc.mid.resize(n);
  std::size_t nm = 0;
  const std::size_t na = topk_pass_at<I>(s, n, thi, tlo, sc.above.data(), sc.mid.data(), &nm);
  if (na > k || na + nm < k) return topk_exact(s, n, k, out);  // the sample missed
  std::copy(sc.above.begin(), sc.above.begin() + static_cast<std::ptrdiff_t>(na), out);
  const std::size_t need = k - na;
  if (need == 0) return;
  auto& keys = sc.keys;
  keys.resize(nm);
  for (std::size_t j = 0; j < nm; ++j) keys[j] = topk_key(s[sc.mid[j]], sc.mid[j]);
  if (need < nm)
    std::nth_element(keys.begin(), keys.begin() + static_cast<std::ptrdiff_t>(need - 1),
                     keys.end());
  for (std::size_t j = 0; j < need; ++j) out[na + j] = static_cast<std::uint32_t>(keys[j]);
}

template <Isa I, bool Top>
inline std::size_t arg_best_at(const float* s, std::size_t n, const std::uint64_t* prot) noexcept {
  if constexpr (I == Isa::scalar) {
    return scalar::arg_best<Top>(s, n, prot);
  } else {
#if KVEVICT_X86
    // Per block of 1024: the block's best eligible value by SIMD; a block replaces the best
    // only when strictly better (lowest index on ties); one scalar scan of the winner.
    constexpr std::size_t kBlock = 1024;
    std::uint64_t elig[kBlock / 64];
    std::size_t best_base = npos;
    float best = 0.0f;
    for (std::size_t base = 0; base < n; base += kBlock) {
      const std::size_t m = std::min(kBlock, n - base);
      eligibility_words(prot, base, m, elig);
      bool any = false;
      float b;
      if constexpr (I == Isa::avx512)
        b = avx512::block_best<Top>(s + base, m, elig, &any);
      else
        b = avx2::block_best<Top>(s + base, m, elig, &any);
      if (any && (best_base == npos || (Top ? b > best : b < best))) {
        best = b;
        best_base = base;
      }
    }
    if (best_base == npos) return npos;
    const std::size_t m = std::min(kBlock, n - best_base);
    eligibility_words(prot, best_base, m, elig);
    if constexpr (I == Isa::avx512)
      return best_base + avx512::find_first_eq(s + best_base, m, elig, best);
    else
      return best_base + avx2::find_first_eq(s + best_base, m, elig, best);
#else
    return scalar::arg_best<Top>(s, n, prot);
#endif
  }
}

}  // namespace detail

/// k indices of the largest keys, in ascending index order: every key greater than the k-th
/// largest value, then the lowest-indexed rows equal to it. O(n) by histogram (uint8: one
/// counting pass; uint16: two radix-256 passes) plus one emit pass. Throws if k > n.
template <Isa I>
KVEVICT_KERNEL_FN void counting_topk(const std::uint8_t* keys, std::size_t n, std::size_t k,
                          std::uint32_t* out) {
  detail::require_isa(I);
  detail::check_select_args(keys, n, k, out);
  detail::counting_select<I, true>(keys, n, k, out);
}
template <Isa I>
KVEVICT_KERNEL_FN void counting_topk(const std::uint16_t* keys, std::size_t n, std::size_t k,
                          std::uint32_t* out) {
  detail::require_isa(I);
  detail::check_select_args(keys, n, k, out);
  detail::counting_select<I, true>(keys, n, k, out);
}
/// k indices of the smallest keys, ascending index order, lowest indices among ties.
template <Isa I>
KVEVICT_KERNEL_FN void counting_bottomk(const std::uint8_t* keys, std::size_t n, std::size_t k,
                             std::uint32_t* out) {
  detail::require_isa(I);
  detail::check_select_args(keys, n, k, out);
  detail::counting_select<I, false>(keys, n, k, out);
}
template <Isa I>
KVEVICT_KERNEL_FN void counting_bottomk(const std::uint16_t* keys, std::size_t n, std::size_t k,
                             std::uint32_t* out) {
  detail::require_isa(I);
  detail::check_select_args(keys, n, k, out);
  detail::counting_select<I, false>(keys, n, k, out);
}

namespace detail {
inline void check_histogram(const std::uint16_t* keys, std::size_t n, const std::uint32_t* hist,
                            std::size_t bins) {
  if (hist == nullptr || bins == 0 || bins > 65536)
    throw std::invalid_argument("kvevict::kernels: histogram bins = " + std::to_string(bins) +
                                (hist ? "" : " (null)") +
                                " (expected a non-null histogram with 1..65536 bins)");
  std::size_t total = 0;
  for (std::size_t b = 0; b < bins; ++b) total += hist[b];
  if (total != n)
    throw std::invalid_argument("kvevict::kernels: histogram counts " + std::to_string(total) +
                                " rows but n = " + std::to_string(n) +
                                " (expected the histogram of these keys)");
  (void)keys;
}
}  // namespace detail

/// counting_topk with a precomputed histogram of the keys (bins entries, every key < bins),
/// e.g. from hamming_histogram (bins = bits + 1): one emit pass over the keys.
template <Isa I>
KVEVICT_KERNEL_FN void counting_topk(const std::uint16_t* keys, std::size_t n, std::size_t k,
                          const std::uint32_t* histogram, std::size_t bins, std::uint32_t* out) {
  detail::require_isa(I);
  detail::check_select_args(keys, n, k, out);
  detail::check_histogram(keys, n, histogram, bins);
  detail::counting_select_hist<I, true>(keys, n, k, histogram, bins, out);
}
/// counting_bottomk with a precomputed histogram (see counting_topk).
template <Isa I>
KVEVICT_KERNEL_FN void counting_bottomk(const std::uint16_t* keys, std::size_t n, std::size_t k,
                             const std::uint32_t* histogram, std::size_t bins,
                             std::uint32_t* out) {
  detail::require_isa(I);
  detail::check_select_args(keys, n, k, out);
  detail::check_histogram(keys, n, histogram, bins);
  detail::counting_select_hist<I, false>(keys, n, k, histogram, bins, out);
}

// Untemplated forms at active_isa().
template <class K>
KVEVICT_KERNEL_FN void counting_topk(const K* keys, std::size_t n, std::size_t k, std::uint32_t* out) {
  static_assert(sizeof(K) <= 2, "counting_topk keys must be std::uint8_t or std::uint16_t");
  detail::with_isa(active_isa(), [&](auto isa) { counting_topk<isa()>(keys, n, k, out); });
}
template <class K>
KVEVICT_KERNEL_FN void counting_bottomk(const K* keys, std::size_t n, std::size_t k, std::uint32_t* out) {
  static_assert(sizeof(K) <= 2, "counting_bottomk keys must be std::uint8_t or std::uint16_t");
  detail::with_isa(active_isa(), [&](auto isa) { counting_bottomk<isa()>(keys, n, k, out); });
}
KVEVICT_KERNEL_FN void counting_topk(const std::uint16_t* keys, std::size_t n, std::size_t k,
                          const std::uint32_t* histogram, std::size_t bins, std::uint32_t* out) {
  detail::with_isa(active_isa(), [&](auto isa) {
    counting_topk<isa()>(keys, n, k, histogram, bins, out);
  });
}
KVEVICT_KERNEL_FN void counting_bottomk(const std::uint16_t* keys, std::size_t n, std::size_t k,
                             const std::uint32_t* histogram, std::size_t bins,
                             std::uint32_t* out) {
  detail::with_isa(active_isa(), [&](auto isa) {
    counting_bottomk<isa()>(keys, n, k, histogram, bins, out);
  });
}

/// Indices of the k largest scores, in unspecified order (but a deterministic set): larger
/// score first, ties toward the lower index, -0.0 == +0.0, NaN ranks below every number (NaN
/// rows are chosen only when fewer than k scores are numbers, lowest index first).
/// Method up to 512 rows at AVX2 and AVX-512: a threshold search on the order keys (the k-th
/// key's high 16 bits found two or three bits per step by counting compares, then its low
/// bits among the few keys sharing them; one left-packing pass emits the ids:
/// topk_threshold); at AVX-512 up to 32 rows each row's rank counted in registers
/// (topk_rank), above that scaled bins first (avx512::topk_scaled: each row's bin of the
/// numbers' range, 254 bins, found the same way; the few rows of the k-th bin ranked; it
/// refuses infinities, fewer than two distinct numbers and a NaN k-th row, which go to
/// topk_threshold), also for k > 64 up to 1024 rows and for topk_filter's candidates; on
/// CPUs with AVX512_VBMI2 (has_avx512_vbmi2()) the same bins in row order with byte
/// compresses (avx512::topk_scaled_vbmi2). Small k at AVX-512 (256-512 rows when 24 k <= n, or 16 k <= n and k <= 16 (20 from 384);
/// above 512 rows k <= 32, or k <= 64 from 2048 to 16K rows): a lower bound on the k-th
/// score from 128 row groups' maxima (the k-th largest maximum, or a smaller one) leaves
/// about k + 20 candidates, ranked as topk_filter's (avx512::topk_group_max; up to 512 rows
/// at k <= 12 the bound from each lane's two best maxima, sorted in registers). Other k <= 64 beyond 512 rows at AVX-512: a lower bound on the
/// k-th score (the smallest of 32 row groups' second-best scores) leaves a few hundred
/// candidates for topk_threshold (avx512::topk_filter); otherwise up to 4096 rows one sampled bracket's band goes to
/// topk_threshold (avx512::topk_band); either falls back to the next method.
/// Method for n < 32768 beyond that: at AVX2 (and AVX-512) a sampled-bracket select
/// (avx2::topk_small: a sorted 64-key sample brackets the k-th key, a pass comparing the
/// floats directly splits the rows, left-packing passes narrow the band to at most 128 rows,
/// which are sorted: avx2::topk_bracket_from); at the scalar level an MSD radix select on the
/// scores' order-preserving bit patterns (a 256-bin histogram per byte; rows better than the
/// k-th key's byte are emitted, equal ones go on to the next byte). From 32768 on: a
/// stratified sample of 1024 scores brackets the k-th largest; one SIMD pass splits
/// rows into "surely in" and a small band, and only the band is ordered (nth_element on
/// (score, index) keys). Falls back to the exact method when the sample misses. Scratch
/// memory is thread_local and reused (no allocation once warm). Throws if k > n.
template <Isa I>
KVEVICT_KERNEL_FN void topk_indices(const float* scores, std::size_t n, std::size_t k, std::uint32_t* out) {
  detail::require_isa(I);
  detail::check_select_args(scores, n, k, out);
  detail::topk_select<I>(scores, n, k, out);
}
KVEVICT_KERNEL_FN void topk_indices(const float* scores, std::size_t n, std::size_t k, std::uint32_t* out) {
  detail::with_isa(active_isa(), [&](auto isa) { topk_indices<isa()>(scores, n, k, out); });
}

/// Index of the largest score among unprotected rows; lowest index on ties (-0.0 == +0.0);
/// NaN scores are never chosen; npos when n == 0 or nothing is eligible.
template <Isa I>
KVEVICT_KERNEL_FN std::size_t argmax_masked(const float* s, std::size_t n,
                                 const std::uint64_t* protected_bits) {
  detail::require_isa(I);
  detail::require_nonnull(s, n, "scores");
  return detail::arg_best_at<I, true>(s, n, protected_bits);
}
KVEVICT_KERNEL_FN std::size_t argmax_masked(const float* s, std::size_t n,
                                 const std::uint64_t* protected_bits) {
  return detail::with_isa(active_isa(),
                          [&](auto isa) { return argmax_masked<isa()>(s, n, protected_bits); });
}

/// Index of the smallest score among unprotected rows; same tie, NaN and npos rules as
/// argmax_masked.
template <Isa I>
KVEVICT_KERNEL_FN std::size_t argmin_masked(const float* s, std::size_t n,
                                 const std::uint64_t* protected_bits) {
  detail::require_isa(I);
  detail::require_nonnull(s, n, "scores");
  return detail::arg_best_at<I, false>(s, n, protected_bits);
}
KVEVICT_KERNEL_FN std::size_t argmin_masked(const float* s, std::size_t n,
                                 const std::uint64_t* protected_bits) {
  return detail::with_isa(active_isa(),
                          [&](auto isa) { return argmin_masked<isa()>(s, n, protected_bits); });
}

/// Protection bits for rows whose arrival index lies outside [lo, hi): bit i of word i/64
/// set = protected, the layout argmin_masked / argmax_masked take. Writes ceil(n/64) words;
/// bits past n are set. (AVX-512 CPUs run the AVX2 form.)
KVEVICT_KERNEL_FN void protect_outside(const std::uint64_t* seqs, std::size_t n, std::uint64_t lo,
                            std::uint64_t hi, std::uint64_t* bits) {
  detail::require_nonnull(seqs, n, "seqs");
  detail::require_nonnull(bits, n, "bits");
#if KVEVICT_X86
  if (active_isa() != Isa::scalar) return detail::avx2::protect_outside(seqs, n, lo, hi, bits);
#endif
  detail::scalar::protect_outside(seqs, n, lo, hi, bits);
}

/// First index i >= from with s[i] == v among unprotected rows (protected_bits may be
/// null), or npos: the follow-up to argmin_masked when ties need a second key.
KVEVICT_KERNEL_FN std::size_t find_equal_masked(const float* s, std::size_t n, std::size_t from,
                                     const std::uint64_t* protected_bits, float v) {
  detail::require_nonnull(s, n, "scores");
#if KVEVICT_X86
  if (active_isa() != Isa::scalar) return detail::avx2::find_eq(s, n, from, protected_bits, v);
#endif
  return detail::scalar::find_eq(s, n, from, protected_bits, v);
}

/// Sums g rows of n floats (row-major, g x n) into out[0, n) in one row-wise pass, adding
/// in row order starting from 0.0f (bit-identical to that scalar loop), and returns whether
/// every input was finite. out may be written even when it returns false.
KVEVICT_KERNEL_FN bool group_sum_checked(const float* p, std::size_t g, std::size_t n, float* out) {
#if KVEVICT_X86
  if (active_isa() != Isa::scalar) return detail::avx2::group_sum(p, g, n, out);
#endif
  return detail::scalar::group_sum(p, g, n, out);
}

/// group_sum_checked's sums (bit-identical), with a range test in place of the finiteness
/// test: returns whether every input is a probability, +-0 or in (0, hi] (so NaN,
/// infinities and negative values fail). hi must be a positive finite float. One read of
/// the probabilities where a range check and a group sum would take two.
KVEVICT_KERNEL_FN bool group_sum_bounded(const float* p, std::size_t g, std::size_t n, float hi,
                                         float* out) {
#if KVEVICT_X86
  const Isa isa = active_isa();
  if (isa == Isa::avx512) return detail::avx512::group_sum_bounded(p, g, n, hi, out);
  if (isa == Isa::avx2) return detail::avx2::group_sum_bounded(p, g, n, hi, out);
#endif
  return detail::scalar::group_sum_bounded(p, g, n, hi, out);
}

/// Whether every value of `count` float arrays (array j: xs[j], ns[j] floats) has an
/// absolute value below its bound, compared as bit patterns: (bits(x) & 0x7fffffff) <
/// limits[j], so NaN fails every bound and limits[j] = 0x7f800000 (+inf) tests finiteness;
/// each limits[j] must be at most 0x80000000. The input checks of an append or prefill
/// (keys, values, queries) in one pass: the arrays are read interleaved, in proportion to
/// their lengths, so their cache misses overlap.
KVEVICT_KERNEL_FN bool abs_below(const float* const* xs, const std::size_t* ns,
                                 const std::uint32_t* limits, std::size_t count) {
  for (std::size_t j = 0; j < count; ++j) {
    detail::require_nonnull(xs[j], ns[j], "xs[j]");
    if (limits[j] > 0x80000000u)
      throw std::invalid_argument("kvevict::kernels: abs_below: limit " + std::to_string(limits[j]) +
                                  ", expected at most 0x80000000 (2147483648)");
  }
#if KVEVICT_X86
  const Isa isa = active_isa();
  if (isa == Isa::avx512) return detail::avx512::abs_below(xs, ns, limits, count);
  if (isa == Isa::avx2) return detail::avx2::abs_below(xs, ns, limits, count);
#endif
  return detail::scalar::abs_below(xs, ns, limits, count);
}

/// DecayedAttention's observe step over n rows: score[r] = decay * score[r] + x[r] (multiply,
/// then add: never fused) and, for the rows with latest - seqs[r] >= band (unsigned
/// difference: the rows old enough to count as long-range), spike[r] = max(spike[r], x[r])
/// (spike[r] < x[r] ? x[r] : spike[r]). Bit-identical at every level.
KVEVICT_KERNEL_FN void decay_spike(float* score, float* spike, const float* x,
                                   const std::uint64_t* seqs, std::size_t n, float decay,
                                   std::uint64_t latest, std::uint64_t band) {
  detail::require_nonnull(score, n, "score");
  detail::require_nonnull(spike, n, "spike");
  detail::require_nonnull(x, n, "x");
  detail::require_nonnull(seqs, n, "seqs");
#if KVEVICT_X86
  if (active_isa() != Isa::scalar)
    return detail::avx2::decay_spike(score, spike, x, seqs, n, decay, latest, band);
#endif
  detail::scalar::decay_spike(score, spike, x, seqs, n, decay, latest, band);
}

/// The unprotected rows (bit clear in protected_bits, ceil(n/64) words) with s[i] > 0 and
/// s[i] >= lo, in index order: their scores into vals and their indices into idx (each of
/// at least n entries; entries past the returned count may be overwritten); returns how
/// many. NaN scores are never gathered.
KVEVICT_KERNEL_FN std::size_t gather_open(const float* s, std::size_t n,
                                          const std::uint64_t* protected_bits, float lo,
                                          float* vals, std::uint32_t* idx) {
  detail::require_nonnull(s, n, "scores");
  detail::require_nonnull(protected_bits, n, "protected_bits");
  detail::require_nonnull(vals, n, "vals");
  detail::require_nonnull(idx, n, "idx");
  if (n > std::numeric_limits<std::uint32_t>::max())
    throw std::invalid_argument("kvevict::kernels: n = " + std::to_string(n) +
                                " (expected n < 2^32: indices are 32-bit)");
#if KVEVICT_X86
  if (active_isa() != Isa::scalar)
    return detail::avx2::gather_open(s, n, protected_bits, lo, vals, idx);
#endif
  return detail::scalar::gather_open(s, n, protected_bits, lo, vals, idx);
}

namespace detail {
// lowest_open's dispatch for 64-bit seqs and 32-bit keys.
template <bool Decay, class K>
inline std::size_t lowest_open_at(float* s, const float* x, const K* seqs, std::size_t n,
                                  float decay, K lo, K hi) {
  detail::require_nonnull(s, n, "scores");
  if constexpr (Decay) detail::require_nonnull(x, n, "x");
  detail::require_nonnull(seqs, n, "seqs");
#if KVEVICT_X86
  const Isa isa = active_isa();
  if (isa == Isa::avx512) return avx512::lowest_open<Decay, K>(s, x, seqs, n, decay, lo, hi);
  if (isa == Isa::avx2) return avx2::lowest_open<Decay, K>(s, x, seqs, n, decay, lo, hi);
#endif
  return scalar::lowest_open<Decay, K>(s, x, seqs, n, decay, lo, hi);
}
}  // namespace detail

/// The row with the lowest (s[r], seqs[r]) among the open rows, those with lo <= seqs[r] <
/// hi: the lowest score, the oldest (lowest seq) among equal scores (-0.0 == +0.0); NaN
/// scores are never chosen; npos when no row is open. In one pass over s and seqs: the
/// same row as protect_outside(seqs, n, lo, hi) + argmin_masked + the equal-score scan for
/// the lowest seq (policies::detail::lowest_masked). 16 rows per step at AVX-512, 8 at AVX2.
KVEVICT_KERNEL_FN std::size_t lowest_open(const float* s, const std::uint64_t* seqs, std::size_t n,
                                          std::uint64_t lo, std::uint64_t hi) {
  // The no-decay form only reads s.
  return detail::lowest_open_at<false>(const_cast<float*>(s), nullptr, seqs, n, 0.0f, lo, hi);
}

/// s[r] = decay * s[r] + x[r] for every row (a multiply, then an add: never fused; the
/// values of that scalar loop, bit for bit), then lowest_open over the new s: one pass
/// where a decay loop, protection bits, masked argmin and tie scan would take four.
KVEVICT_KERNEL_FN std::size_t decay_lowest_open(float* s, const float* x, const std::uint64_t* seqs,
                                                std::size_t n, float decay, std::uint64_t lo,
                                                std::uint64_t hi) {
  return detail::lowest_open_at<true>(s, x, seqs, n, decay, lo, hi);
}

/// lowest_open with 32-bit keys in place of the 64-bit seqs (the same rule in 32-bit
/// unsigned arithmetic: open iff lo <= keys[r] < hi, ties to the lowest key): half the
/// bytes per row for a caller that keeps order-preserving 32-bit keys of its open range
/// (ExpectedAttention's seq keys).
KVEVICT_KERNEL_FN std::size_t lowest_open(const float* s, const std::uint32_t* keys, std::size_t n,
                                          std::uint32_t lo, std::uint32_t hi) {
  return detail::lowest_open_at<false>(const_cast<float*>(s), nullptr, keys, n, 0.0f, lo, hi);
}

/// decay_lowest_open with 32-bit keys (lowest_open's 32-bit form after the same decay).
KVEVICT_KERNEL_FN std::size_t decay_lowest_open(float* s, const float* x, const std::uint32_t* keys,
                                                std::size_t n, float decay, std::uint32_t lo,
                                                std::uint32_t hi) {
  return detail::lowest_open_at<true>(s, x, keys, n, decay, lo, hi);
}

}  // namespace kvevict::kernels

#endif  // !KVEVICT_KERNELS_DECLARE_ONLY
