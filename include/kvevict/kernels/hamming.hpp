// Hamming distance of one query code against n packed codes, and the fused forms HashEvict
// needs (distance + protected-mask argmax, distance + histogram for counting select).
//
// Codes: a b-bit code (b in {8,16,32,64,128,256}) occupies b/8 bytes, bit j in byte j/8, bit
// j%8; n codes are contiguous (row i at codes + i*b/8). No alignment is required.
//
// Each function has a template overload pinned to a level (hamming_distances<Isa::avx2>(...)),
// which throws if the CPU lacks that level, and an untemplated overload that uses
// active_isa(). The width is resolved once per call, the level once per call.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>

#include "dispatch.hpp"

namespace kvevict::kernels {
// The entry points, declared here and defined below (in separate-kernels mode, config.hpp,
// the definitions are compiled once into the kvevict_kernels library).
KVEVICT_KERNEL_FN unsigned hamming_distance(const std::uint8_t* a, const std::uint8_t* b, int bits);
template <Isa I>
KVEVICT_KERNEL_FN void hamming_distances(const std::uint8_t* query, const std::uint8_t* codes,
                                         std::size_t n, int bits, std::uint16_t* out);
KVEVICT_KERNEL_FN void hamming_distances(const std::uint8_t* query, const std::uint8_t* codes,
                                         std::size_t n, int bits, std::uint16_t* out);
template <Isa I>
KVEVICT_KERNEL_FN void hamming_distances(const std::uint8_t* query, const std::uint8_t* codes,
                                         std::size_t n, int bits, std::uint8_t* out);
KVEVICT_KERNEL_FN void hamming_distances(const std::uint8_t* query, const std::uint8_t* codes,
                                         std::size_t n, int bits, std::uint8_t* out);
template <Isa I>
KVEVICT_KERNEL_FN std::size_t hamming_argmax(const std::uint8_t* query, const std::uint8_t* codes,
                                             std::size_t n, int bits,
                                             const std::uint64_t* protected_bits);
KVEVICT_KERNEL_FN std::size_t hamming_argmax(const std::uint8_t* query, const std::uint8_t* codes,
                                             std::size_t n, int bits,
                                             const std::uint64_t* protected_bits);
template <Isa I>
KVEVICT_KERNEL_FN void hamming_histogram(const std::uint8_t* query, const std::uint8_t* codes,
                                         std::size_t n, int bits, std::uint16_t* out,
                                         std::uint32_t* histogram);
KVEVICT_KERNEL_FN void hamming_histogram(const std::uint8_t* query, const std::uint8_t* codes,
                                         std::size_t n, int bits, std::uint16_t* out,
                                         std::uint32_t* histogram);
}  // namespace kvevict::kernels

#if !KVEVICT_KERNELS_DECLARE_ONLY
#include "hamming_avx2.hpp"
#include "hamming_avx512.hpp"
#include "hamming_scalar.hpp"

namespace kvevict::kernels {
namespace detail {

inline void check_bits(int bits) {
  if (bits != 8 && bits != 16 && bits != 32 && bits != 64 && bits != 128 && bits != 256)
    throw std::invalid_argument("kvevict::kernels: code width bits = " + std::to_string(bits) +
                                " (expected 8, 16, 32, 64, 128 or 256)");
}

/// Calls f(std::integral_constant<int, bytes>) for the code width: the one place the width
/// turns into a compile-time constant.
template <class F>
decltype(auto) with_width(int bits, F&& f) {
  switch (bits) {
    case 8: return f(std::integral_constant<int, 1>{});
    case 16: return f(std::integral_constant<int, 2>{});
    case 32: return f(std::integral_constant<int, 4>{});
    case 64: return f(std::integral_constant<int, 8>{});
    case 128: return f(std::integral_constant<int, 16>{});
    default: return f(std::integral_constant<int, 32>{});
  }
}

template <Isa I, int W>
inline void distances_at(const std::uint8_t* q, const std::uint8_t* codes, std::size_t n,
                         std::uint16_t* out) noexcept {
#if KVEVICT_X86
  if constexpr (I == Isa::avx512) return avx512::distances<W>(q, codes, n, out);
  if constexpr (I == Isa::avx2) return avx2::distances<W>(q, codes, n, out);
#endif
  scalar::distances<W>(q, codes, n, out);
}

template <Isa I>
inline unsigned block_max_plus1_at(const std::uint16_t* d, std::size_t m,
                                   const std::uint64_t* elig) noexcept {
#if KVEVICT_X86
  if constexpr (I == Isa::avx512) return avx512::block_max_plus1(d, m, elig);
  if constexpr (I == Isa::avx2) return avx2::block_max_plus1(d, m, elig);
#endif
  unsigned best = 0;
  for (std::size_t i = 0; i < m; ++i)
    if ((elig[i >> 6] >> (i & 63)) & 1u) best = std::max(best, d[i] + 1u);
  return best;
}

template <Isa I, int W>
inline void distances_u8_at(const std::uint8_t* q, const std::uint8_t* codes, std::size_t n,
                            std::uint8_t* out) noexcept {
#if KVEVICT_X86
  if constexpr (I == Isa::avx512 && (W == 1 || W == 2 || W == 8))
    return avx512::distances_u8<W>(q, codes, n, out);
#endif
  if constexpr (I == Isa::scalar) {
    for (std::size_t i = 0; i < n; ++i)
      out[i] = static_cast<std::uint8_t>(scalar::distance<W>(q, codes + i * W));
  } else {
    alignas(64) std::uint16_t buf[256];
    for (std::size_t base = 0; base < n; base += 256) {
      const std::size_t m = std::min<std::size_t>(256, n - base);
      distances_at<I, W>(q, codes + base * W, m, buf);
      for (std::size_t i = 0; i < m; ++i) out[base + i] = static_cast<std::uint8_t>(buf[i]);
    }
  }
}

// Rows per block of the fused kernels: distances of a block stay in L1 between the two steps.
inline constexpr std::size_t kHammingBlock = 1024;

template <Isa I, int W>
inline std::size_t argmax_impl(const std::uint8_t* q, const std::uint8_t* codes, std::size_t n,
                               const std::uint64_t* prot) noexcept {
  if constexpr (I == Isa::scalar) {
    return scalar::argmax<W>(q, codes, n, prot);
#if KVEVICT_X86
  } else if constexpr (I == Isa::avx512 && W <= 8) {
    return avx512::fused_argmax<W>(q, codes, n, prot);
#endif
  } else {
    // Per block: distances into L1, then the block's eligible maximum. Only a strictly larger
    // block maximum replaces the best block, so ties resolve to the lowest index; the winning
    // block's distances are kept (buffer swap) and scanned once at the end.
    alignas(64) std::uint16_t buf_a[kHammingBlock], buf_b[kHammingBlock];
    std::uint16_t* cur = buf_a;
    std::uint16_t* best_buf = buf_b;
    std::uint64_t elig[kHammingBlock / 64];
    unsigned best = 0;
    std::size_t best_base = 0;
    for (std::size_t base = 0; base < n; base += kHammingBlock) {
      const std::size_t m = std::min(kHammingBlock, n - base);
      distances_at<I, W>(q, codes + base * W, m, cur);
      eligibility_words(prot, base, m, elig);
      const unsigned bm = block_max_plus1_at<I>(cur, m, elig);
      if (bm > best) {
        best = bm;
        best_base = base;
        std::swap(cur, best_buf);
      }
    }
    if (best == 0) return npos;
    const std::size_t m = std::min(kHammingBlock, n - best_base);
    eligibility_words(prot, best_base, m, elig);
#if KVEVICT_X86
    if constexpr (I == Isa::avx512) return best_base + avx512::block_find_first(best_buf, m, elig, best);
    if constexpr (I == Isa::avx2) return best_base + avx2::block_find_first(best_buf, m, elig, best);
#endif
    for (std::size_t i = 0; i < m; ++i)
      if (((elig[i >> 6] >> (i & 63)) & 1u) && best_buf[i] + 1u == best) return best_base + i;
    return npos;  // unreachable
  }
}

template <Isa I, int W>
inline void histogram_impl(const std::uint8_t* q, const std::uint8_t* codes, std::size_t n,
                           std::uint16_t* out, std::uint32_t* hist) noexcept {
  constexpr int kBins = 8 * W + 1;
  // Four sub-histograms break the store-to-load dependency on runs of equal distances.
  std::uint32_t h[4][kBins] = {};
  alignas(64) std::uint16_t buf[kHammingBlock];
  for (std::size_t base = 0; base < n; base += kHammingBlock) {
    const std::size_t m = std::min(kHammingBlock, n - base);
    std::uint16_t* d = out ? out + base : buf;
    distances_at<I, W>(q, codes + base * W, m, d);
    std::size_t i = 0;
    for (; i + 4 <= m; i += 4) {
      ++h[0][d[i]];
      ++h[1][d[i + 1]];
      ++h[2][d[i + 2]];
      ++h[3][d[i + 3]];
    }
    for (; i < m; ++i) ++h[0][d[i]];
  }
  for (int b = 0; b < kBins; ++b) hist[b] = h[0][b] + h[1][b] + h[2][b] + h[3][b];
}

inline void check_hamming_args(const std::uint8_t* query, const std::uint8_t* codes,
                               std::size_t n, int bits) {
  check_bits(bits);
  require_nonnull(query, n, "query");
  require_nonnull(codes, n, "codes");
}

}  // namespace detail

/// Hamming distance between two codes of `bits` bits (portable; for one-off use).
KVEVICT_KERNEL_FN unsigned hamming_distance(const std::uint8_t* a, const std::uint8_t* b, int bits) {
  detail::check_bits(bits);
  if (a == nullptr || b == nullptr)
    throw std::invalid_argument("kvevict::kernels: hamming_distance got a null code");
  return detail::with_width(bits, [&](auto w) { return detail::scalar::distance<w()>(a, b); });
}

/// out[i] = popcount(query XOR row i) for i < n, pinned to level I (throws if unsupported).
template <Isa I>
KVEVICT_KERNEL_FN void hamming_distances(const std::uint8_t* query, const std::uint8_t* codes, std::size_t n,
                              int bits, std::uint16_t* out) {
  detail::require_isa(I);
  detail::check_hamming_args(query, codes, n, bits);
  detail::require_nonnull(out, n, "out");
  detail::with_width(bits, [&](auto w) { detail::distances_at<I, w()>(query, codes, n, out); });
}

/// out[i] = popcount(query XOR row i) for i < n, at active_isa().
KVEVICT_KERNEL_FN void hamming_distances(const std::uint8_t* query, const std::uint8_t* codes, std::size_t n,
                              int bits, std::uint16_t* out) {
  detail::with_isa(active_isa(), [&](auto isa) {
    hamming_distances<isa()>(query, codes, n, bits, out);
  });
}

/// Byte-output form for bits <= 128 (every distance fits in a byte): less write traffic than
/// the uint16 form. Throws std::invalid_argument for bits = 256. Pinned to level I.
template <Isa I>
KVEVICT_KERNEL_FN void hamming_distances(const std::uint8_t* query, const std::uint8_t* codes, std::size_t n,
                              int bits, std::uint8_t* out) {
  detail::require_isa(I);
  detail::check_hamming_args(query, codes, n, bits);
  if (bits > 128)
    throw std::invalid_argument("kvevict::kernels: uint8 distances need bits <= 128, got bits = " +
                                std::to_string(bits) + " (use the uint16 output)");
  detail::require_nonnull(out, n, "out");
  detail::with_width(bits, [&](auto w) { detail::distances_u8_at<I, w()>(query, codes, n, out); });
}

/// Byte-output form at active_isa().
KVEVICT_KERNEL_FN void hamming_distances(const std::uint8_t* query, const std::uint8_t* codes, std::size_t n,
                              int bits, std::uint8_t* out) {
  detail::with_isa(active_isa(), [&](auto isa) {
    hamming_distances<isa()>(query, codes, n, bits, out);
  });
}

/// Index of the row farthest from `query` among rows whose bit in `protected_bits` is clear
/// (bit i of word i/64; nullptr = nothing protected). Lowest index on ties; npos when n == 0
/// or every row is protected. `protected_bits` must hold ceil(n/64) words. Pinned to level I.
template <Isa I>
KVEVICT_KERNEL_FN std::size_t hamming_argmax(const std::uint8_t* query, const std::uint8_t* codes,
                                  std::size_t n, int bits, const std::uint64_t* protected_bits) {
  detail::require_isa(I);
  detail::check_hamming_args(query, codes, n, bits);
  return detail::with_width(bits, [&](auto w) {
    return detail::argmax_impl<I, w()>(query, codes, n, protected_bits);
  });
}

/// hamming_argmax at active_isa().
KVEVICT_KERNEL_FN std::size_t hamming_argmax(const std::uint8_t* query, const std::uint8_t* codes,
                                  std::size_t n, int bits, const std::uint64_t* protected_bits) {
  return detail::with_isa(active_isa(), [&](auto isa) {
    return hamming_argmax<isa()>(query, codes, n, bits, protected_bits);
  });
}

/// Distances and their histogram in one pass: histogram[d] = number of rows at distance d,
/// for d in [0, bits] (the array must hold bits+1 entries; it is overwritten). `out` may be
/// nullptr when only the histogram is wanted. Feed both to counting_topk/counting_bottomk's
/// histogram overloads to select rows without another pass over the codes. Pinned to level I.
template <Isa I>
KVEVICT_KERNEL_FN void hamming_histogram(const std::uint8_t* query, const std::uint8_t* codes, std::size_t n,
                              int bits, std::uint16_t* out, std::uint32_t* histogram) {
  detail::require_isa(I);
  detail::check_hamming_args(query, codes, n, bits);
  if (histogram == nullptr)
    throw std::invalid_argument("kvevict::kernels: histogram is null (expected bits+1 entries)");
  detail::with_width(bits, [&](auto w) {
    detail::histogram_impl<I, w()>(query, codes, n, out, histogram);
  });
}

/// hamming_histogram at active_isa().
KVEVICT_KERNEL_FN void hamming_histogram(const std::uint8_t* query, const std::uint8_t* codes, std::size_t n,
                              int bits, std::uint16_t* out, std::uint32_t* histogram) {
  detail::with_isa(active_isa(), [&](auto isa) {
    hamming_histogram<isa()>(query, codes, n, bits, out, histogram);
  });
}

}  // namespace kvevict::kernels

#endif  // !KVEVICT_KERNELS_DECLARE_ONLY
