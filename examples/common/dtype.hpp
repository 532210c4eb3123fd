#pragma once
// Element types of stored tensors (safetensors traces, Hugging Face checkpoints) and their
// exact conversions to and from float: shared by examples/eval and the model readers.
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace kvevict::tensor {

enum class DType { f32, f16, bf16 };

inline std::size_t dtype_size(DType t) { return t == DType::f32 ? 4 : 2; }
inline const char* dtype_name(DType t) {
  return t == DType::f32 ? "F32" : t == DType::f16 ? "F16" : "BF16";
}

inline float half_to_float(std::uint16_t h) {
  const std::uint32_t sign = (h & 0x8000u) << 16;
  std::uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu, bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    exp = 113;
    while ((man & 0x400u) == 0) {
      man <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((man & 0x3FFu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline std::uint16_t float_to_half(float f) {  // round to nearest even
  std::uint32_t x;
  std::memcpy(&x, &f, 4);
  const std::uint32_t sign = (x >> 16) & 0x8000u;
  const std::uint32_t ax = x & 0x7FFFFFFFu;
  if (ax >= 0x7F800000u)
    return static_cast<std::uint16_t>(sign | 0x7C00u | (ax > 0x7F800000u ? 0x200u : 0));
  if (ax >= 0x477FF000u) return static_cast<std::uint16_t>(sign | 0x7C00u);  // overflow
  if (ax < 0x38800000u) {                                                    // subnormal or zero
    if (ax < 0x33000000u) return static_cast<std::uint16_t>(sign);
    const std::uint32_t e = ax >> 23, m = (ax & 0x7FFFFFu) | 0x800000u;
    const std::uint32_t shift = 126 - e;  // value = M * 2^(e - 150) = (M >> shift) * 2^-24
    std::uint32_t r = m >> shift;
    const std::uint32_t rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return static_cast<std::uint16_t>(sign | r);
  }
  std::uint32_t r = ((ax >> 13) - (112u << 10));
  const std::uint32_t rem = ax & 0x1FFFu;
  if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) ++r;
  return static_cast<std::uint16_t>(sign | r);
}

inline float bf16_to_float(std::uint16_t h) {
  const std::uint32_t bits = static_cast<std::uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline std::uint16_t float_to_bf16(float f) {  // round to nearest even, NaN stays NaN
  std::uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<std::uint16_t>((x >> 16) | 0x40u);
  x += 0x7FFFu + ((x >> 16) & 1u);
  return static_cast<std::uint16_t>(x >> 16);
}

}  // namespace kvevict::tensor
