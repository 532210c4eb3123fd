#pragma once
// Quantized K/V storage formats for KVCache<Policy, Format> (docs/quantized.md).
//
//   Q8<G>    symmetric 8-bit, one fp16 scale per group of G consecutive elements of a row
//            (llama.cpp q8_0 at G = 32): block = [scale: fp16][G x int8],
//            q = clamp(round_half_even(x / s), -127, 127), s = fp16(max|x| / 127).
//   Q4<G>    symmetric 4-bit, G even: block = [scale: fp16][G/2 bytes],
//            q = clamp(round_half_even(x / s), -7, 7), s = fp16(max|x| / 7), stored as q + 8.
//            Nibble order inside a block: elements go in chunks of 8 (the last chunk of a
//            block may be shorter, c elements); byte j of a chunk holds element j in its low
//            nibble and element j + c/2 in its high nibble (one broadcast + variable shift
//            unpacks 8 elements in AVX2).
//   E4M3     fp8 E4M3 ("fn": bias 7, no infinities, largest finite 448), one byte per
//            element, round to nearest even, no scale.
//   KV<KF, VF>  keys in format KF, values in VF (e.g. KV<Q8<32>, Q4<32>>, or Eigen::half
//            keys beside Q4 values is NOT supported: both sides are quantized formats).
//
// Scales are per row (per token), never per channel across tokens: KIVI's per-channel
// keys share one scale over a group of tokens, and swap-remove eviction would then have
// to re-quantize the survivors of a group, so a kept row would no longer be a bit-exact
// copy of what was stored. kvevict keeps that guarantee and supports per-token groups
// only (keys and values may still use different formats and group sizes).
//
// Encoding rejects (kvevict::Error naming the value) what it cannot store: NaN and
// infinities, and magnitudes whose scale overflows fp16 (Q8: |x| >= 65520 x 127,
// Q4: |x| >= 65520 x 7) or that overflow E4M3 (|x| >= 464, which rounds past 448).
// A group size that does not divide head_dim is rejected when the cache is built.
#include <Eigen/Core>
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "errors.hpp"
#include "kernels/quant_format.hpp"

namespace kvevict {

/// Symmetric 8-bit blocks of G elements with an fp16 scale (G >= 1).
template <int G>
struct Q8 {
  static_assert(G >= 1 && G <= 4096, "Q8<G>: group size G must be in [1, 4096]");
  static constexpr int group = G;
};
/// Symmetric 4-bit blocks of G elements with an fp16 scale (G even).
template <int G>
struct Q4 {
  static_assert(G >= 2 && G <= 4096 && G % 2 == 0, "Q4<G>: group size G must be even, in [2, 4096]");
  static constexpr int group = G;
};
/// fp8 E4M3 (finite-only variant, largest 448), one byte per element.
struct E4M3 {
  static constexpr int group = 1;
};
/// Keys stored in KF, values in VF (both quantized formats).
template <class KF, class VF>
struct KV {
  using key_format = KF;
  using value_format = VF;
};

namespace detail {

inline std::uint16_t fp16_bits(float x) noexcept {
  return Eigen::numext::bit_cast<std::uint16_t>(Eigen::half(x));
}
inline float fp16_value(const std::uint8_t* p) noexcept { return kernels::detail::load_half(p); }

/// float -> E4M3 bits, round to nearest even; |x| < 464 and finite (checked by the caller).
inline std::uint8_t e4m3_bits(float x) noexcept {
  const std::uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  const float a = std::fabs(x);
  if (a < 0x1p-6f) {  // subnormal range: steps of 2^-9 (m = 8 is the smallest normal, 0x08)
    const auto m = static_cast<std::uint8_t>(std::nearbyint(a * 512.0f));
    return static_cast<std::uint8_t>(sign | m);
  }
  int e = 0;
  const float f = std::frexp(a, &e);  // a = f 2^e, f in [0.5, 1)
  int exp = e - 1;                    // a = (2f) 2^exp, 2f in [1, 2)
  int m = static_cast<int>(std::nearbyint((2.0f * f - 1.0f) * 8.0f));
  if (m == 8) {
    m = 0;
    ++exp;
  }
  return static_cast<std::uint8_t>(sign | ((exp + 7) << 3) | m);
}
/// E4M3 bits -> float (exact).
inline float e4m3_value(std::uint8_t b) noexcept { return kernels::detail::e4m3_to_float(b); }

/// A symmetric block of g elements: writes the fp16 scale s = fp16(max|x| / qmax) to
/// scale_out (2 bytes) and the codes clamp(round_half_even(x / s), -qmax, qmax) to q.
inline void encode_block_scale(const float* x, std::size_t g, float qmax, std::uint8_t* scale_out,
                               int* q) noexcept {
  float amax = 0.0f;
  for (std::size_t j = 0; j < g; ++j) amax = std::max(amax, std::fabs(x[j]));
  const std::uint16_t sb = fp16_bits(amax / qmax);
  std::memcpy(scale_out, &sb, 2);
  const float s = fp16_value(scale_out);
  for (std::size_t j = 0; j < g; ++j)
    q[j] = s > 0.0f ? static_cast<int>(std::clamp(std::nearbyint(x[j] / s), -qmax, qmax)) : 0;
}

/// Encoding and decoding of one row of d elements in a format.
template <class F>
struct Codec;

/// What Q8<G> and Q4<G> share: blocks of G elements behind an fp16 scale.
template <int Bits, int G>
struct SymmetricBlocks {
  static constexpr int bits = Bits;
  static constexpr std::size_t group = G;
  static constexpr std::size_t block_bytes = 2 + (Bits == 8 ? G : G / 2);
  static constexpr float qmax = Bits == 8 ? 127.0f : 7.0f;
  using desc = kernels::QDesc<Bits == 8 ? kernels::QKind::q8 : kernels::QKind::q4, G>;
  static std::string name() { return (Bits == 8 ? "Q8<" : "Q4<") + std::to_string(G) + ">"; }
  static std::size_t row_bytes(std::size_t d) noexcept { return d / G * block_bytes; }
  /// Magnitudes at or above this overflow the fp16 scale (max|x| / qmax rounds to inf).
  static float limit() noexcept { return 65520.0f * qmax; }
  static void decode(const std::uint8_t* in, std::size_t d, float* out) noexcept {
    kernels::detail::qdecode_row<desc>(in, d, out);
  }
};

template <int G>
struct Codec<Q8<G>> : SymmetricBlocks<8, G> {
  static void encode(const float* x, std::size_t d, std::uint8_t* out) noexcept {
    constexpr std::size_t bb = SymmetricBlocks<8, G>::block_bytes;
    int q[G];
    for (std::size_t b = 0; b < d / G; ++b, x += G, out += bb) {
      encode_block_scale(x, G, 127.0f, out, q);
      for (std::size_t j = 0; j < G; ++j) out[2 + j] = static_cast<std::uint8_t>(static_cast<std::int8_t>(q[j]));
    }
  }
};

template <int G>
struct Codec<Q4<G>> : SymmetricBlocks<4, G> {
  static void encode(const float* x, std::size_t d, std::uint8_t* out) noexcept {
    constexpr std::size_t bb = SymmetricBlocks<4, G>::block_bytes;
    int q[G];
    for (std::size_t b = 0; b < d / G; ++b, x += G, out += bb) {
      encode_block_scale(x, G, 7.0f, out, q);
      std::uint8_t* bytes = out + 2;  // chunks of 8 (last: c): byte j = element j | j + c/2
      for (std::size_t c0 = 0; c0 < G; c0 += 8) {
        const std::size_t c = std::min<std::size_t>(8, G - c0), h = c / 2;
        for (std::size_t j = 0; j < h; ++j)
          bytes[c0 / 2 + j] = static_cast<std::uint8_t>((q[c0 + j] + 8) | ((q[c0 + j + h] + 8) << 4));
      }
    }
  }
};

template <>
struct Codec<E4M3> {
  static constexpr int bits = 8;
  static constexpr std::size_t group = 1;
  static std::string name() { return "E4M3"; }
  static std::size_t row_bytes(std::size_t d) noexcept { return d; }
  /// 464 is the midpoint between 448 and the next step (480): it and above round past 448.
  static float limit() noexcept { return 464.0f; }
  static void encode(const float* x, std::size_t d, std::uint8_t* out) noexcept {
    for (std::size_t j = 0; j < d; ++j) out[j] = e4m3_bits(x[j]);
  }
  using desc = kernels::QDesc<kernels::QKind::e4m3, 1>;
  static void decode(const std::uint8_t* in, std::size_t d, float* out) noexcept {
    kernels::detail::qdecode_row<desc>(in, d, out);
  }
};

template <class F>
concept QuantFormat = requires { Codec<F>::group; };

/// How a KVCache Scalar stores rows: plain element types (float, Eigen::half,
/// Eigen::bfloat16, double) are their own element; quantized formats store bytes and hand
/// policies dequantised float views.
template <class S>
struct StorageOf {
  static constexpr bool quantized = false;
  using unit = S;  ///< element of the stored arrays
  using view = S;  ///< what HeadView rows hold
};
template <QuantFormat F>
struct StorageOf<F> {
  static constexpr bool quantized = true;
  using unit = std::uint8_t;
  using view = float;
  using key_codec = Codec<F>;
  using value_codec = Codec<F>;
};
template <QuantFormat KF, QuantFormat VF>
struct StorageOf<KV<KF, VF>> {
  static constexpr bool quantized = true;
  using unit = std::uint8_t;
  using view = float;
  using key_codec = Codec<KF>;
  using value_codec = Codec<VF>;
};

template <class S>
concept QuantizedStorage = StorageOf<S>::quantized;

/// A group size must divide head_dim: kvevict::Error naming both otherwise.
template <class C>
void check_codec_dim(std::size_t head_dim, const char* role) {
  require(head_dim % C::group == 0, role, " format ", C::name(), ": group size ", C::group,
          " does not divide head_dim ", head_dim, ", expected a group size dividing head_dim");
}

/// Values to be encoded in C: finite and below C::limit() in magnitude (one branch-free
/// pass; the slow loop only runs to name the bad value).
template <class C>
void check_encodable(const float* x, std::size_t n, const char* what) {
  const std::uint32_t lim = std::bit_cast<std::uint32_t>(C::limit());
  std::uint32_t bad = 0;
  for (std::size_t i = 0; i < n; ++i)
    bad |= static_cast<std::uint32_t>((std::bit_cast<std::uint32_t>(x[i]) & 0x7fffffffu) >= lim);
  if (bad == 0) return;
  for (std::size_t i = 0; i < n; ++i) {
    require(std::isfinite(x[i]), what, "[", i, "] = ", x[i], ", expected a finite value");
    require(std::fabs(x[i]) < C::limit(), what, "[", i, "] = ", x[i], " does not fit ",
            C::name(), ", expected |value| < ", C::limit());
  }
}

}  // namespace detail
}  // namespace kvevict
