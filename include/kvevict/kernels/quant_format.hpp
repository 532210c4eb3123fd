// The quantized K/V row formats as the kernels see them (quantized.hpp's Q8 / Q4 / E4M3) and
// their scalar decoder, without the kernels: no intrinsics, so quantized.hpp and the
// separate-kernels headers include this, not attention_quant.hpp (issue 19's include cost).
//
//   QDesc<kind, G>              the format: Q8 / Q4 blocks of G elements with an fp16
//                               scale, or E4M3 bytes (G = 1). Row bytes: (d / G) x block_bytes.
//   detail::qdecode_block<D>    one block -> G floats (the one decoder: quantized.hpp's
//                               Codec::decode and the scalar kernel call it)
//   detail::qint_shape<D>(d)    whether the integer q.K path handles D (attention_quant.hpp)
//
// The kernels, quant_attention_probs / _output / _probs_qint<D> and their _paged forms (over
// a BlockTable), are defined in attention_quant.hpp. In a separate-kernels translation unit (config.hpp) they are only
// declared here: kvevict_kernels compiles them for the formats of compiled_quant_format<D>
// (Q8<G> and Q4<G> with G in {8, 16, 32, 64, 128}, and E4M3). A translation unit that attends
// over another group size includes <kvevict/kernels/attention_quant.hpp> before the other
// kvevict headers (it then compiles that format's kernels itself); else
// require_quant_kernels<D>() stops the build with that advice.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "attention_scalar.hpp"
#include "dispatch.hpp"
#if KVEVICT_KERNELS_DECLARE_ONLY
#include "attention_decode.hpp"  // BlockTable (declarations only in this mode: no intrinsics)
#endif

namespace kvevict::kernels {

enum class QKind : int { q8 = 0, q4 = 1, e4m3 = 2 };

template <QKind K, int G>
struct QDesc {
  static constexpr QKind kind = K;
  static constexpr std::size_t group = static_cast<std::size_t>(G);
  static constexpr std::size_t block_bytes =
      K == QKind::q8 ? 2 + static_cast<std::size_t>(G)
                     : (K == QKind::q4 ? 2 + static_cast<std::size_t>(G) / 2 : 1);
  static constexpr std::size_t row_bytes(std::size_t d) noexcept { return d / group * block_bytes; }
};

/// The formats whose quantized kernels the kvevict_kernels library compiles (src/kernels.cpp).
template <class D>
inline constexpr bool compiled_quant_format =
    D::kind == QKind::e4m3 || D::group == 8 || D::group == 16 || D::group == 32 ||
    D::group == 64 || D::group == 128;

/// Called where a kernel of format D is used: in a separate-kernels translation unit that
/// has not included attention_quant.hpp, D must be one kvevict_kernels compiles.
template <class D>
constexpr void require_quant_kernels() noexcept {
#if KVEVICT_KERNELS_DECLARE_ONLY && !defined(KVEVICT_QUANT_KERNELS_DEFINED)
  static_assert(compiled_quant_format<D>,
                "kvevict::kernels (KVEVICT_SEPARATE_KERNELS) compiles the quantized attention "
                "kernels of Q8<G> / Q4<G> for G in {8, 16, 32, 64, 128} and of E4M3 only: for "
                "another group size, #include <kvevict/kernels/attention_quant.hpp> before the "
                "other kvevict headers in this translation unit");
#endif
}

namespace detail {

KVEVICT_ALWAYS_INLINE float load_half(const std::uint8_t* p) noexcept {
  std::uint16_t b;
  std::memcpy(&b, p, 2);
  return half_bits_to_float(b);
}

/// E4M3 ("fn") bits -> float, exact.
KVEVICT_ALWAYS_INLINE float e4m3_to_float(std::uint8_t b) noexcept {
  // The 7 magnitude bits placed under a float's exponent/mantissa are the value times
  // 2^-120 (normal and subnormal alike); rescale and put the sign back.
  const float a = std::bit_cast<float>(static_cast<std::uint32_t>(b & 0x7F) << 20) * 0x1p120f;
  return (b & 0x80) ? -a : a;
}

/// One block of D (G elements) -> out[0, G).
template <class D>
KVEVICT_ALWAYS_INLINE void qdecode_block(const std::uint8_t* blk, float* out) noexcept {
  if constexpr (D::kind == QKind::e4m3) {
    out[0] = e4m3_to_float(blk[0]);
  } else {
    const float s = load_half(blk);
    const std::uint8_t* q = blk + 2;
    if constexpr (D::kind == QKind::q8) {
      for (std::size_t j = 0; j < D::group; ++j) out[j] = s * static_cast<float>(static_cast<std::int8_t>(q[j]));
    } else {  // chunks of 8 (last c): byte j holds element j (low) and j + c/2 (high)
      for (std::size_t c0 = 0; c0 < D::group; c0 += 8) {
        const std::size_t c = D::group - c0 < 8 ? D::group - c0 : 8, h = c / 2;
        for (std::size_t j = 0; j < h; ++j) {
          const std::uint8_t v = q[c0 / 2 + j];
          out[c0 + j] = s * static_cast<float>((v & 0xF) - 8);
          out[c0 + j + h] = s * static_cast<float>((v >> 4) - 8);
        }
      }
    }
  }
}

/// A whole row of d elements.
template <class D>
inline void qdecode_row(const std::uint8_t* row, std::size_t d, float* out) noexcept {
  for (std::size_t b = 0; b < d / D::group; ++b) qdecode_block<D>(row + b * D::block_bytes, out + b * D::group);
}

/// Whether the integer q.K path handles format D at head dim d (else the exact path runs).
template <class D>
constexpr bool qint_shape(std::size_t /*d*/) noexcept {
  return D::kind != QKind::e4m3 && D::group % 32 == 0;
}

}  // namespace detail

#if KVEVICT_KERNELS_DECLARE_ONLY
// Separate-kernels mode: the entry points of attention_quant.hpp, declared (see above).
template <class D>
bool quant_attention_probs(const float* q, std::size_t q_stride, std::size_t group,
                           const std::uint8_t* rows, std::size_t row_bytes, std::size_t n,
                           std::size_t d, float scale, float* probs) noexcept;
template <class D>
void quant_attention_output(const float* probs, std::size_t group, const std::uint8_t* rows,
                            std::size_t row_bytes, std::size_t n, std::size_t d, float* out,
                            std::size_t out_stride) noexcept;
template <class D>
bool quant_attention_probs_qint(const float* q, std::size_t q_stride, std::size_t group,
                                const std::uint8_t* rows, std::size_t row_bytes, std::size_t n,
                                std::size_t d, float scale, float* probs);
template <class D>
bool quant_attention_probs_paged(const float* q, std::size_t q_stride, std::size_t group,
                                 const std::uint8_t* rows, std::size_t row_bytes, BlockTable table,
                                 std::size_t n, std::size_t d, float scale, float* probs) noexcept;
template <class D>
void quant_attention_output_paged(const float* probs, std::size_t group, const std::uint8_t* rows,
                                  std::size_t row_bytes, BlockTable table, std::size_t n,
                                  std::size_t d, float* out, std::size_t out_stride) noexcept;
template <class D>
bool quant_attention_probs_qint_paged(const float* q, std::size_t q_stride, std::size_t group,
                                      const std::uint8_t* rows, std::size_t row_bytes,
                                      BlockTable table, std::size_t n, std::size_t d, float scale,
                                      float* probs);
#endif

}  // namespace kvevict::kernels
