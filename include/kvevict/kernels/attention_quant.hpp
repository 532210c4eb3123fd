// Decode attention over quantized K/V rows (kvevict/quantized.hpp formats), dequantising in
// registers: rows are read as stored (bytes), never widened into memory.
//
//   QDesc<kind, G>        the format: Q8 / Q4 blocks of G elements with an fp16 scale, or
//                         E4M3 bytes (G = 1). Row bytes: (d / G) x block_bytes.
//   qdecode_block<D>(blk, out)      one block -> G floats (the one decoder: quantized.hpp's
//                                   Codec::decode calls it, the scalar kernel uses it)
//   quant_attention_probs<D>(q, q_stride, G, rows, row_bytes, n, d, scale, probs)
//   quant_attention_output<D>(probs, G, rows, row_bytes, n, d, out, out_stride)
//       Same contracts as attention_decode.hpp's attention_probs / attention_output.
// Levels: scalar (any format) and AVX2+FMA+F16C (Q8/Q4 with G a multiple of 8, E4M3 with
// d a multiple of 8; other shapes run the scalar level). AVX-512 CPUs run the AVX2 form.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "attention_avx2.hpp"
#include "attention_decode.hpp"
#include "attention_scalar.hpp"
#include "dispatch.hpp"

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

namespace qscalar {

template <class D>
inline bool attention_probs(const float* q, std::size_t q_stride, std::size_t group,
                            const std::uint8_t* rows, std::size_t row_bytes, std::size_t n,
                            std::size_t d, float scale, float* probs) noexcept {
  float blk[D::group];
  for (std::size_t g = 0; g < group * n; ++g) probs[g] = 0.0f;
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint8_t* row = rows + i * row_bytes;
    for (std::size_t b = 0; b < d / D::group; ++b) {
      qdecode_block<D>(row + b * D::block_bytes, blk);
      for (std::size_t g = 0; g < group; ++g) {
        const float* qg = q + g * q_stride + b * D::group;
        float s = 0.0f;
        for (std::size_t j = 0; j < D::group; ++j) s += qg[j] * blk[j];
        probs[g * n + i] += s;
      }
    }
  }
  std::uint32_t bad = 0;
  for (std::size_t g = 0; g < group; ++g) {
    float* p = probs + g * n;
    float m = -INFINITY;
    for (std::size_t i = 0; i < n; ++i) {
      p[i] *= scale;
      bad |= nonfinite_bit(p[i]);
      m = p[i] > m ? p[i] : m;
    }
    if (bad) return false;
    scalar::exp_normalise(p, n, m);
  }
  return true;
}

template <class D>
inline void attention_output(const float* probs, std::size_t group, const std::uint8_t* rows,
                             std::size_t row_bytes, std::size_t n, std::size_t d, float* out,
                             std::size_t out_stride) noexcept {
  float blk[D::group];
  for (std::size_t g = 0; g < group; ++g)
    for (std::size_t j = 0; j < d; ++j) out[g * out_stride + j] = 0.0f;
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint8_t* row = rows + i * row_bytes;
    for (std::size_t b = 0; b < d / D::group; ++b) {
      qdecode_block<D>(row + b * D::block_bytes, blk);
      for (std::size_t g = 0; g < group; ++g) {
        const float pi = probs[g * n + i];
        float* o = out + g * out_stride + b * D::group;
        for (std::size_t j = 0; j < D::group; ++j) o[j] += pi * blk[j];
      }
    }
  }
}

}  // namespace qscalar

#if KVEVICT_X86
KVEVICT_SUPPRESS_INTRIN_WARNINGS_BEGIN
namespace attn_avx2 {
#define KVEVICT_QATTN_INLINE KVEVICT_ATTN_TARGET_AVX2 KVEVICT_ALWAYS_INLINE

/// The AVX2 level handles this shape (else the scalar level runs).
template <class D>
constexpr bool q_simd_shape(std::size_t d) noexcept {
  if constexpr (D::kind == QKind::e4m3) return d % 8 == 0;
  else return D::group % 8 == 0;
}

KVEVICT_QATTN_INLINE V q_scale(const std::uint8_t* blk) noexcept {
  std::uint16_t b;
  std::memcpy(&b, blk, 2);
  return _mm256_set1_ps(_cvtsh_ss(b));
}

/// Elements [e, e + 8) of a row as floats, without the block scale (integers for Q8/Q4;
/// E4M3 decoded fully). e is a multiple of 8; for Q8/Q4 the 8 lie in one block.
template <class D>
KVEVICT_QATTN_INLINE V q_chunk(const std::uint8_t* row, std::size_t e) noexcept {
  if constexpr (D::kind == QKind::q8) {
    const std::uint8_t* p = row + (e / D::group) * D::block_bytes + 2 + e % D::group;
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  } else if constexpr (D::kind == QKind::q4) {
    const std::uint8_t* p = row + (e / D::group) * D::block_bytes + 2 + (e % D::group) / 2;
    std::int32_t w;
    std::memcpy(&w, p, 4);
    const __m256i sh = _mm256_setr_epi32(0, 8, 16, 24, 4, 12, 20, 28);
    const __m256i nib = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(w), sh), _mm256_set1_epi32(0xF));
    return _mm256_cvtepi32_ps(_mm256_sub_epi32(nib, _mm256_set1_epi32(8)));
  } else {
    const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + e)));
    const __m256i mag = _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x7F)), 20);
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x80)), 24);
    const V a = _mm256_mul_ps(_mm256_castsi256_ps(mag), _mm256_set1_ps(0x1p120f));
    return _mm256_or_ps(a, _mm256_castsi256_ps(sign));
  }
}
/// The block scale of element e (1 for E4M3).
template <class D>
KVEVICT_QATTN_INLINE V q_chunk_scale(const std::uint8_t* row, std::size_t e) noexcept {
  if constexpr (D::kind == QKind::e4m3) return _mm256_set1_ps(1.0f);
  else return q_scale(row + (e / D::group) * D::block_bytes);
}

// Scores of R rows x GC heads: per block, the chunk dot products of the R rows are scaled
// by their block scale before accumulating (one multiply per chunk and row).
template <class D, int GC, int R>
KVEVICT_ATTN_TARGET_AVX2 inline void q_score_block(const float* q, std::size_t q_stride,
                                                   const std::uint8_t* rows, std::size_t row_bytes,
                                                   std::size_t i, std::size_t d, float scale,
                                                   float* s, std::size_t n) noexcept {
  V acc[GC][R];
  for (int g = 0; g < GC; ++g)
    for (int r = 0; r < R; ++r) acc[g][r] = vzero();
  const std::uint8_t* rp[R];
  for (int r = 0; r < R; ++r) rp[r] = rows + (i + static_cast<std::size_t>(r)) * row_bytes;
  constexpr std::size_t step = D::kind == QKind::e4m3 ? 8 : D::group;
  for (std::size_t b0 = 0; b0 < d; b0 += step) {
    V sc[R];
    for (int r = 0; r < R; ++r) sc[r] = q_chunk_scale<D>(rp[r], b0);
    for (std::size_t e = b0; e < b0 + step; e += 8) {
      V kv[R];
      for (int r = 0; r < R; ++r) kv[r] = q_chunk<D>(rp[r], e);
      if constexpr (D::kind != QKind::e4m3)
        for (int r = 0; r < R; ++r) kv[r] = vmul(kv[r], sc[r]);
      for (int g = 0; g < GC; ++g) {
        const V qv = vload(q + static_cast<std::size_t>(g) * q_stride + e);
        for (int r = 0; r < R; ++r) acc[g][r] = vfma(qv, kv[r], acc[g][r]);
      }
    }
  }
  for (int g = 0; g < GC; ++g) vreduce_store<R>(s + static_cast<std::size_t>(g) * n + i, acc[g], scale);
}

template <class D, int R>
KVEVICT_ATTN_TARGET_AVX2 inline void q_score_heads(const float* q, std::size_t q_stride,
                                                   std::size_t group, const std::uint8_t* rows,
                                                   std::size_t row_bytes, std::size_t i,
                                                   std::size_t d, float scale, float* s,
                                                   std::size_t n) noexcept {
  for (std::size_t g0 = 0; g0 < group; g0 += kHeads) {
    const float* qg = q + g0 * q_stride;
    float* sg = s + g0 * n;
    switch (group - g0 < static_cast<std::size_t>(kHeads) ? group - g0 : kHeads) {
      case 1: q_score_block<D, 1, R>(qg, q_stride, rows, row_bytes, i, d, scale, sg, n); break;
      case 2: q_score_block<D, 2, R>(qg, q_stride, rows, row_bytes, i, d, scale, sg, n); break;
      case 3: q_score_block<D, 3, R>(qg, q_stride, rows, row_bytes, i, d, scale, sg, n); break;
      default: q_score_block<D, kHeads, R>(qg, q_stride, rows, row_bytes, i, d, scale, sg, n); break;
    }
  }
}

template <class D>
KVEVICT_ATTN_TARGET_AVX2 inline bool q_attention_probs(const float* q, std::size_t q_stride,
                                                       std::size_t group, const std::uint8_t* rows,
                                                       std::size_t row_bytes, std::size_t n,
                                                       std::size_t d, float scale,
                                                       float* probs) noexcept {
  for (std::size_t i = 0; i < n;) {  // blocks of kRows rows, then single rows
    if (n - i >= static_cast<std::size_t>(kRows)) {
      q_score_heads<D, kRows>(q, q_stride, group, rows, row_bytes, i, d, scale, probs, n);
      i += kRows;
    } else {
      q_score_heads<D, 1>(q, q_stride, group, rows, row_bytes, i, d, scale, probs, n);
      ++i;
    }
  }
  return softmax_rows(probs, group, n);
}

// p.V: column blocks of 2 vectors (16 columns) x GC heads in registers over a tile of rows.
template <class D, int GC>
KVEVICT_ATTN_TARGET_AVX2 inline void q_output_block(const float* probs, std::size_t n,
                                                    const std::uint8_t* rows, std::size_t row_bytes,
                                                    std::size_t i0, std::size_t i1, std::size_t c0,
                                                    bool two, float* out,
                                                    std::size_t out_stride) noexcept {
  V acc[GC][2];
  for (int g = 0; g < GC; ++g) {
    const float* o = out + static_cast<std::size_t>(g) * out_stride + c0;
    acc[g][0] = vload(o);
    acc[g][1] = two ? vload(o + 8) : vzero();
  }
  for (std::size_t i = i0; i < i1; ++i) {
    const std::uint8_t* row = rows + i * row_bytes;
    V x0 = q_chunk<D>(row, c0);
    if constexpr (D::kind != QKind::e4m3) x0 = vmul(x0, q_chunk_scale<D>(row, c0));
    V x1 = vzero();
    if (two) {
      x1 = q_chunk<D>(row, c0 + 8);
      if constexpr (D::kind != QKind::e4m3) {
        // c0 is a multiple of 16: with G a multiple of 16 both chunks share a block
        if constexpr (D::group % 16 == 0) x1 = vmul(x1, q_chunk_scale<D>(row, c0));
        else x1 = vmul(x1, q_chunk_scale<D>(row, c0 + 8));
      }
    }
    for (int g = 0; g < GC; ++g) {
      const V pb = vset1(probs[static_cast<std::size_t>(g) * n + i]);
      acc[g][0] = vfma(pb, x0, acc[g][0]);
      acc[g][1] = vfma(pb, x1, acc[g][1]);
    }
  }
  for (int g = 0; g < GC; ++g) {
    float* o = out + static_cast<std::size_t>(g) * out_stride + c0;
    vstore(o, acc[g][0]);
    if (two) vstore(o + 8, acc[g][1]);
  }
}

template <class D>
KVEVICT_ATTN_TARGET_AVX2 inline void q_attention_output(const float* probs, std::size_t group,
                                                        const std::uint8_t* rows,
                                                        std::size_t row_bytes, std::size_t n,
                                                        std::size_t d, float* out,
                                                        std::size_t out_stride) noexcept {
  for (std::size_t g = 0; g < group; ++g)
    for (std::size_t j = 0; j < d; ++j) out[g * out_stride + j] = 0.0f;
  std::size_t tile = 16384 / (row_bytes + 1);
  if (tile < 8) tile = 8;
  for (std::size_t i0 = 0; i0 < n; i0 += tile) {
    const std::size_t i1 = n - i0 < tile ? n : i0 + tile;
    for (std::size_t g0 = 0; g0 < group; g0 += kHeads) {
      const std::size_t gc = group - g0 < static_cast<std::size_t>(kHeads) ? group - g0 : kHeads;
      const float* pg = probs + g0 * n;
      float* og = out + g0 * out_stride;
      for (std::size_t c0 = 0; c0 < d; c0 += 16) {
        const bool two = c0 + 16 <= d;
        switch (gc) {
          case 1: q_output_block<D, 1>(pg, n, rows, row_bytes, i0, i1, c0, two, og, out_stride); break;
          case 2: q_output_block<D, 2>(pg, n, rows, row_bytes, i0, i1, c0, two, og, out_stride); break;
          case 3: q_output_block<D, 3>(pg, n, rows, row_bytes, i0, i1, c0, two, og, out_stride); break;
          default: q_output_block<D, kHeads>(pg, n, rows, row_bytes, i0, i1, c0, two, og, out_stride); break;
        }
      }
    }
  }
}

#undef KVEVICT_QATTN_INLINE
}  // namespace attn_avx2
KVEVICT_SUPPRESS_INTRIN_WARNINGS_END
#endif

}  // namespace detail

/// Pinned level (Isa::avx512 runs the AVX2 form); a shape the SIMD level does not handle
/// runs the scalar level.
template <Isa I, class D>
inline bool quant_attention_probs_at(const float* q, std::size_t q_stride, std::size_t group,
                                     const std::uint8_t* rows, std::size_t row_bytes, std::size_t n,
                                     std::size_t d, float scale, float* probs) noexcept {
#if KVEVICT_X86
  if constexpr (I != Isa::scalar)
    if (detail::attn_avx2::q_simd_shape<D>(d))
      return detail::attn_avx2::q_attention_probs<D>(q, q_stride, group, rows, row_bytes, n, d,
                                                     scale, probs);
#endif
  return detail::qscalar::attention_probs<D>(q, q_stride, group, rows, row_bytes, n, d, scale, probs);
}

template <Isa I, class D>
inline void quant_attention_output_at(const float* probs, std::size_t group,
                                      const std::uint8_t* rows, std::size_t row_bytes,
                                      std::size_t n, std::size_t d, float* out,
                                      std::size_t out_stride) noexcept {
#if KVEVICT_X86
  if constexpr (I != Isa::scalar)
    if (detail::attn_avx2::q_simd_shape<D>(d)) {
      detail::attn_avx2::q_attention_output<D>(probs, group, rows, row_bytes, n, d, out, out_stride);
      return;
    }
#endif
  detail::qscalar::attention_output<D>(probs, group, rows, row_bytes, n, d, out, out_stride);
}

/// At attention_isa() (attention_decode.hpp).
template <class D>
inline bool quant_attention_probs(const float* q, std::size_t q_stride, std::size_t group,
                                  const std::uint8_t* rows, std::size_t row_bytes, std::size_t n,
                                  std::size_t d, float scale, float* probs) noexcept {
  if (attention_isa() == Isa::scalar)
    return quant_attention_probs_at<Isa::scalar, D>(q, q_stride, group, rows, row_bytes, n, d, scale, probs);
  return quant_attention_probs_at<Isa::avx2, D>(q, q_stride, group, rows, row_bytes, n, d, scale, probs);
}

template <class D>
inline void quant_attention_output(const float* probs, std::size_t group, const std::uint8_t* rows,
                                   std::size_t row_bytes, std::size_t n, std::size_t d, float* out,
                                   std::size_t out_stride) noexcept {
  if (attention_isa() == Isa::scalar)
    quant_attention_output_at<Isa::scalar, D>(probs, group, rows, row_bytes, n, d, out, out_stride);
  else
    quant_attention_output_at<Isa::avx2, D>(probs, group, rows, row_bytes, n, d, out, out_stride);
}

}  // namespace kvevict::kernels
