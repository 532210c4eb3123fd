// Portable Hamming kernels: std::popcount over memcpy loads (no type punning). This is the
// reference every SIMD level is tested against, and the path non-x86 CPUs take.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "dispatch.hpp"

namespace kvevict::kernels::detail::scalar {

template <class T>
KVEVICT_ALWAYS_INLINE T load(const std::uint8_t* p) noexcept {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

/// Hamming distance between two W-byte codes.
template <int W>
KVEVICT_ALWAYS_INLINE unsigned distance(const std::uint8_t* a, const std::uint8_t* b) noexcept {
  if constexpr (W == 1) {
    return static_cast<unsigned>(std::popcount(static_cast<std::uint8_t>(a[0] ^ b[0])));
  } else if constexpr (W == 2) {
    return static_cast<unsigned>(
        std::popcount(static_cast<std::uint16_t>(load<std::uint16_t>(a) ^ load<std::uint16_t>(b))));
  } else if constexpr (W == 4) {
    return static_cast<unsigned>(std::popcount(load<std::uint32_t>(a) ^ load<std::uint32_t>(b)));
  } else {
    unsigned d = 0;
    for (int w = 0; w < W; w += 8)
      d += static_cast<unsigned>(
          std::popcount(load<std::uint64_t>(a + w) ^ load<std::uint64_t>(b + w)));
    return d;
  }
}

template <int W>
KVEVICT_ALWAYS_INLINE void distances_body(const std::uint8_t* q, const std::uint8_t* codes,
                                          std::size_t n, std::uint16_t* out) noexcept {
  for (std::size_t i = 0; i < n; ++i)
    out[i] = static_cast<std::uint16_t>(distance<W>(q, codes + i * W));
}

template <int W>
inline void distances(const std::uint8_t* q, const std::uint8_t* codes, std::size_t n,
                      std::uint16_t* out) noexcept {
  distances_body<W>(q, codes, n, out);
}

/// Reference fused argmax: farthest row whose protected bit is clear, lowest index on ties.
template <int W>
inline std::size_t argmax(const std::uint8_t* q, const std::uint8_t* codes, std::size_t n,
                          const std::uint64_t* prot) noexcept {
  std::size_t best = static_cast<std::size_t>(-1);
  unsigned best_d = 0;
  for (std::size_t i = 0; i < n; ++i) {
    if (prot != nullptr && ((prot[i >> 6] >> (i & 63)) & 1u)) continue;
    const unsigned d = distance<W>(q, codes + i * W);
    if (best == static_cast<std::size_t>(-1) || d > best_d) {
      best = i;
      best_d = d;
    }
  }
  return best;
}

}  // namespace kvevict::kernels::detail::scalar
