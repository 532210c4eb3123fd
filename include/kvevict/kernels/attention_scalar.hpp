// Portable decode-attention kernel (the scalar level) and the storage-format helpers every
// level shares: fp32, IEEE fp16 and bfloat16 rows, widened to float.
#pragma once

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "dispatch.hpp"

namespace kvevict::kernels {

/// Storage format of K/V rows handed to the attention kernels.
enum class KvFormat : int { f32 = 0, f16 = 1, bf16 = 2 };

/// Bytes per element of a format.
constexpr std::size_t kv_format_bytes(KvFormat f) noexcept { return f == KvFormat::f32 ? 4 : 2; }

namespace detail {

/// IEEE binary16 bits -> float, exact (subnormals, infinities and NaN included).
KVEVICT_ALWAYS_INLINE float half_bits_to_float(std::uint16_t h) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1Fu;
  std::uint32_t man = h & 0x3FFu;
  std::uint32_t bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    int e = -1;
    do {
      ++e;
      man <<= 1;
    } while ((man & 0x400u) == 0);
    bits = sign | ((112u - static_cast<std::uint32_t>(e)) << 23) | ((man & 0x3FFu) << 13);
  }
  return std::bit_cast<float>(bits);
}

/// bfloat16 bits -> float (exact: bf16 is the top half of a float).
KVEVICT_ALWAYS_INLINE float bf16_bits_to_float(std::uint16_t b) noexcept {
  return std::bit_cast<float>(static_cast<std::uint32_t>(b) << 16);
}

template <KvFormat F>
KVEVICT_ALWAYS_INLINE float widen_one(const void* rows, std::size_t index) noexcept {
  if constexpr (F == KvFormat::f32) {
    return static_cast<const float*>(rows)[index];
  } else {
    const std::uint16_t b = static_cast<const std::uint16_t*>(rows)[index];
    if constexpr (F == KvFormat::f16) return half_bits_to_float(b);
    else return bf16_bits_to_float(b);
  }
}

/// Nonzero when x is infinite or NaN (exponent bits all ones).
KVEVICT_ALWAYS_INLINE std::uint32_t nonfinite_bit(float x) noexcept {
  return ((std::bit_cast<std::uint32_t>(x) & 0x7fffffffu) + 0x00800000u) & 0x80000000u;
}

namespace scalar {

/// p[i] = exp(p[i] - m) / sum: the softmax of finite scores whose maximum is m.
inline void exp_normalise(float* p, std::size_t n, float m) noexcept {
  float z = 0.0f;
  for (std::size_t i = 0; i < n; ++i) z += (p[i] = std::exp(p[i] - m));
  const float inv = 1.0f / z;
  for (std::size_t i = 0; i < n; ++i) p[i] *= inv;
}

/// s[g * ld + i] = scale * q_g . k_i for n contiguous K rows (row i at keys + i * k_stride):
/// one run of a block table (attention_decode.hpp).
template <KvFormat F>
inline void score_rows(const float* q, std::size_t q_stride, std::size_t group, const void* keys,
                       std::size_t k_stride, std::size_t n, std::size_t d, float scale, float* s,
                       std::size_t ld) noexcept {
  for (std::size_t g = 0; g < group; ++g) {
    const float* qg = q + g * q_stride;
    float* p = s + g * ld;
    for (std::size_t i = 0; i < n; ++i) {
      float x = 0.0f;
      const std::size_t base = i * k_stride;
      for (std::size_t j = 0; j < d; ++j) x += qg[j] * widen_one<F>(keys, base + j);
      p[i] = x * scale;
    }
  }
}

/// Softmax of each of the group's n scores (row g at probs + g * n) in place; false if a
/// score is not finite.
inline bool softmax_rows(float* probs, std::size_t group, std::size_t n) noexcept {
  for (std::size_t g = 0; g < group; ++g) {
    float* p = probs + g * n;
    std::uint32_t bad = 0;
    float m = -INFINITY;
    for (std::size_t i = 0; i < n; ++i) {
      bad |= nonfinite_bit(p[i]);
      m = p[i] > m ? p[i] : m;
    }
    if (bad) return false;
    exp_normalise(p, n, m);
  }
  return true;
}

/// out[g * out_stride + j] += sum_i probs[g * ld + i] * v_i[j] over n contiguous V rows, in
/// row order.
template <KvFormat F>
inline void accumulate_rows(const float* probs, std::size_t ld, std::size_t group,
                            const void* values, std::size_t v_stride, std::size_t n,
                            std::size_t d, float* out, std::size_t out_stride) noexcept {
  for (std::size_t i = 0; i < n; ++i) {
    const std::size_t base = i * v_stride;
    for (std::size_t g = 0; g < group; ++g) {
      const float pi = probs[g * ld + i];
      float* o = out + g * out_stride;
      for (std::size_t j = 0; j < d; ++j) o[j] += pi * widen_one<F>(values, base + j);
    }
  }
}

}  // namespace scalar
}  // namespace detail
}  // namespace kvevict::kernels
