// Decode attention over quantized K/V rows (kvevict/quantized.hpp formats), dequantising in
// registers: rows are read as stored (bytes), never widened into memory.
//
//   QDesc<kind, G>, qdecode_block<D>   the format and its decoder: quant_format.hpp
//   quant_attention_probs<D>(q, q_stride, G, rows, row_bytes, n, d, scale, probs)
//   quant_attention_output<D>(probs, G, rows, row_bytes, n, d, out, out_stride)
//       Same contracts as attention_decode.hpp's attention_probs / attention_output.
//   quant_attention_probs_qint<D>(...)  same arguments and contract: the opt-in integer q.K
//       (issue 15). Each query head is quantized once per call to int8 with its own scale
//       (quantize_query: s_q = max|q| / 127, codes round-half-even(q / s_q)); a block's dot
//       product with the stored codes is exact in int32 and multiplied once by the block's
//       fp16 scale; the head's sum by scale * s_q. Q8 / Q4 with G a multiple of 32 only;
//       any other format or shape (and a non-finite query) runs quant_attention_probs
//       unchanged. Results differ from the exact path by the query's rounding (docs/quantized.md).
// Levels: scalar (any format), AVX2+FMA+F16C (Q8/Q4 with G a multiple of 8, E4M3 with d a
// multiple of 8; other shapes run the scalar level) and, for the exact path, AVX-512 (Q8/Q4
// with G a multiple of 16; other shapes run the AVX2 level's choice). The AVX-512 level sums
// 16 lanes where AVX2 sums 8, so its results differ from AVX2's in the last bits (both are
// tested against a double reference). Q4 with G a multiple of 32 runs at the AVX-512 level
// in span order (q4_span_order: the nibble lookup's order, the query permuted to it for q.K;
// p.V in the widened bytes' order, put back in element order), so its q.K sums are in another
// order again (p.V's per-column sums are in row order at every level). The
// integer q.K path at the AVX-512 level runs the VNNI kernel (VPDPBUSD, four query heads per
// register) when has_avx512_vnni(), else AVX2's integer scores; the int32 block dots are the
// same at every level, float sums in another order. kvevict::attend selects it with AttendOptions::quant_qk (attention.hpp).
#pragma once
// quant_format.hpp's check that a separate-kernels TU can link a format's kernels: here
// they are defined.
#define KVEVICT_QUANT_KERNELS_DEFINED 1

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "attention_avx2.hpp"
#include "attention_avx512.hpp"
#include "attention_decode.hpp"
#include "attention_scalar.hpp"
#include "dispatch.hpp"
#include "quant_format.hpp"

namespace kvevict::kernels {
namespace detail {

/// Where element e of a row of format D (Q8 / Q4) lives: its block (the fp16 scale first).
template <class D>
KVEVICT_ALWAYS_INLINE const std::uint8_t* q_block_of(const std::uint8_t* row, std::size_t e) noexcept {
  return row + (e / D::group) * D::block_bytes;
}
/// The code bytes from element e on: Q8 its byte; Q4 the byte of its chunk of 8 holding it
/// (e a multiple of 8: the chunk's first byte).
template <class D>
KVEVICT_ALWAYS_INLINE const std::uint8_t* q_codes_at(const std::uint8_t* row, std::size_t e) noexcept {
  if constexpr (D::kind == QKind::q8) return q_block_of<D>(row, e) + 2 + e % D::group;
  else return q_block_of<D>(row, e) + 2 + (e % D::group) / 2;
}

namespace qscalar {

/// s[g * ld + i] = scale x q_g . k_i for n contiguous stored rows (row i at rows + i *
/// row_bytes): one run of a block table (attention_decode.hpp; a dense array is one run).
template <class D>
inline void score_run(const float* q, std::size_t q_stride, std::size_t group,
                      const std::uint8_t* rows, std::size_t row_bytes, std::size_t n,
                      std::size_t d, float scale, float* s, std::size_t ld) noexcept {
  float blk[D::group];
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint8_t* row = rows + i * row_bytes;
    for (std::size_t g = 0; g < group; ++g) s[g * ld + i] = 0.0f;
    for (std::size_t b = 0; b < d / D::group; ++b) {
      qdecode_block<D>(row + b * D::block_bytes, blk);
      for (std::size_t g = 0; g < group; ++g) {
        const float* qg = q + g * q_stride + b * D::group;
        float x = 0.0f;
        for (std::size_t j = 0; j < D::group; ++j) x += qg[j] * blk[j];
        s[g * ld + i] += x;
      }
    }
    for (std::size_t g = 0; g < group; ++g) s[g * ld + i] *= scale;
  }
}

/// out[g * out_stride + j] += sum_i probs[g * ld + i] * v_i[j] over n contiguous stored
/// rows, in row order.
template <class D>
inline void accumulate_run(const float* probs, std::size_t ld, std::size_t group,
                           const std::uint8_t* rows, std::size_t row_bytes, std::size_t n,
                           std::size_t d, float* out, std::size_t out_stride) noexcept {
  float blk[D::group];
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint8_t* row = rows + i * row_bytes;
    for (std::size_t b = 0; b < d / D::group; ++b) {
      qdecode_block<D>(row + b * D::block_bytes, blk);
      for (std::size_t g = 0; g < group; ++g) {
        const float pi = probs[g * ld + i];
        float* o = out + g * out_stride + b * D::group;
        for (std::size_t j = 0; j < D::group; ++j) o[j] += pi * blk[j];
      }
    }
  }
}

}  // namespace qscalar


/// The queries of one call, quantized for the integer q.K path: per head g, d int8 codes in
/// kernel order (Q8: element order; Q4: each 32-element span permuted as the nibbles are
/// unpacked: byte t < 16 of the span is element (t/4)*8 + t%4, byte 16+t element
/// (t/4)*8 + 4 + t%4), the head's scale, and per block the sum of its codes (Q4's offset 8).
struct QuantQuery {
  std::vector<std::int8_t> codes;   // group x d
  std::vector<float> scale;         // group
  std::vector<std::int32_t> bsum;   // group x (d / G)
  // The VNNI kernel's layout (widen_query): per group of 4 heads and per 16 codes of kernel
  // order, 64 bytes = the 4 heads' 16 codes side by side (absent heads zero); per group of 4
  // heads and per block, 16 int32 holding head h's offset correction at lane 4h.
  std::vector<std::int8_t> wide;
  std::vector<std::int32_t> init;
};

/// Element of span position t (0..31) in Q4's unpacked order.
constexpr std::size_t q4_span_element(std::size_t t) noexcept {
  return t < 16 ? (t / 4) * 8 + t % 4 : ((t - 16) / 4) * 8 + 4 + (t - 16) % 4;
}

/// Q4 at the AVX-512 level with G a multiple of 32 works in "span order": kernel position
/// t (0..31) of each 32-element span holds element q4_span512_element(t) (the nibble
/// lookup's natural order, attn_avx512::q_chunk_scaled). Its exact q.K reads the query
/// permuted the same way; its p.V accumulates in q4_span_element's order (the span's bytes
/// widened, attn_avx512::q_output_block) and puts the output back.
template <class D>
inline constexpr bool q4_span_order = D::kind == QKind::q4 && D::group % 32 == 0;
constexpr std::size_t q4_span512_element(std::size_t t) noexcept {
  const std::size_t u = t % 16;  // lane u / 4, dword u % 4: byte 4 (u % 4) + u / 4 of the span
  return 8 * (u % 4) + u / 4 + (t >= 16 ? 4 : 0);
}

/// Quantizes the group's queries (false: a query element is not finite; qq is then partial).
template <class D>
inline bool quantize_query(const float* q, std::size_t q_stride, std::size_t group, std::size_t d,
                           QuantQuery& qq) {
  qq.codes.resize(group * d);
  qq.scale.resize(group);
  qq.bsum.resize(group * (d / D::group));
  for (std::size_t g = 0; g < group; ++g) {
    const float* x = q + g * q_stride;
    // Branch-free loops the compiler vectorises (this header is built without -march, where
    // std::nearbyint is a libm call per element: ~5 us per KV head at d 128, G 4).
    float amax = 0.0f;
    bool finite = true;
    for (std::size_t j = 0; j < d; ++j) {
      const float a = std::fabs(x[j]);
      finite &= a <= 3.40282347e+38f;  // false for inf and NaN
      amax = a > amax ? a : amax;
    }
    if (!finite) return false;
    const float s = amax / 127.0f;
    qq.scale[g] = s;
    std::int8_t* c = qq.codes.data() + g * d;
    // Round half to even as std::nearbyint does in the default rounding mode: |x / s| <= 127,
    // so adding and taking off 1.5 x 2^23 leaves the nearest integer (ties to even).
    constexpr float kRound = 12582912.0f;
    for (std::size_t j = 0; j < d; ++j) {
      const std::size_t src = D::kind == QKind::q4 ? (j / 32) * 32 + q4_span_element(j % 32) : j;
      float r = s > 0.0f ? (x[src] / s + kRound) - kRound : 0.0f;
      r = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
      c[j] = static_cast<std::int8_t>(r);
    }
    for (std::size_t b = 0; b < d / D::group; ++b) {
      std::int32_t t = 0;
      for (std::size_t j = 0; j < D::group; ++j) t += c[b * D::group + j];
      qq.bsum[g * (d / D::group) + b] = t;
    }
  }
  return true;
}

/// QuantQuery::wide / init for the AVX-512 VNNI kernel: Q8 keys enter VPDPBUSD as unsigned
/// bytes (code + 128, so the correction is -128 x the block's query-code sum), Q4 nibbles as
/// they are (0..15: -8 x the sum).
template <class D>
inline void widen_query(QuantQuery& qq, std::size_t group, std::size_t d) {
  const std::size_t hgs = (group + 3) / 4, nh = d / 16, nb = d / D::group;
  qq.wide.assign(hgs * nh * 64, 0);
  qq.init.assign(hgs * nb * 16, 0);
  const std::int32_t off = D::kind == QKind::q8 ? -128 : -8;
  for (std::size_t g = 0; g < group; ++g) {
    const std::size_t hg = g / 4, h = g % 4;
    for (std::size_t k = 0; k < nh; ++k)
      std::memcpy(qq.wide.data() + (hg * nh + k) * 64 + h * 16, qq.codes.data() + g * d + k * 16, 16);
    for (std::size_t b = 0; b < nb; ++b) qq.init[(hg * nb + b) * 16 + h * 4] = off * qq.bsum[g * nb + b];
  }
}

/// Exact int32 dot product of block b of a stored row with head g's codes (Q4: the stored
/// nibbles minus 8). The integer part the SIMD kernel must reproduce bit for bit.
template <class D>
inline std::int32_t qint_block_dot(const std::uint8_t* row, std::size_t b, const std::int8_t* codes) noexcept {
  const std::uint8_t* blk = row + b * D::block_bytes + 2;
  const std::int8_t* c = codes + b * D::group;
  std::int32_t t = 0;
  if constexpr (D::kind == QKind::q8) {
    for (std::size_t j = 0; j < D::group; ++j) t += std::int32_t(static_cast<std::int8_t>(blk[j])) * c[j];
  } else {  // per 32-element span: 16 bytes; low nibbles are span positions 0..15, high 16..31
    for (std::size_t s0 = 0; s0 < D::group; s0 += 32)
      for (std::size_t u = 0; u < 16; ++u) {
        const std::uint8_t v = blk[s0 / 2 + u];
        t += (std::int32_t(v & 0xF) - 8) * c[s0 + u] + (std::int32_t(v >> 4) - 8) * c[s0 + 16 + u];
      }
  }
  return t;
}

namespace qscalar {

/// The integer q.K path at the scalar level (the reference of the SIMD form's arithmetic:
/// same int32 block dots; float sums in another order): the scores of one run of n rows
/// into s[g * ld + i].
template <class D>
inline void qint_score_run(const QuantQuery& qq, std::size_t group, const std::uint8_t* rows,
                           std::size_t row_bytes, std::size_t n, std::size_t d, float scale,
                           float* s, std::size_t ld) noexcept {
  for (std::size_t g = 0; g < group; ++g) {
    const std::int8_t* c = qq.codes.data() + g * d;
    const float f = scale * qq.scale[g];
    for (std::size_t i = 0; i < n; ++i) {
      const std::uint8_t* row = rows + i * row_bytes;
      float acc = 0.0f;
      for (std::size_t b = 0; b < d / D::group; ++b)
        acc += static_cast<float>(qint_block_dot<D>(row, b, c)) * load_half(row + b * D::block_bytes);
      s[g * ld + i] = acc * f;
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

/// A block's fp16 scale as a float (F16C; the AVX-512 level calls it too).
KVEVICT_QATTN_INLINE float q_scale_value(const std::uint8_t* blk) noexcept {
  std::uint16_t b;
  std::memcpy(&b, blk, 2);
  return _cvtsh_ss(b);
}
KVEVICT_QATTN_INLINE V q_scale(const std::uint8_t* blk) noexcept { return _mm256_set1_ps(q_scale_value(blk)); }

/// Elements [e, e + 8) of a row as floats, without the block scale (integers for Q8/Q4;
/// E4M3 decoded fully). e is a multiple of 8; for Q8/Q4 the 8 lie in one block.
template <class D>
KVEVICT_QATTN_INLINE V q_chunk(const std::uint8_t* row, std::size_t e) noexcept {
  if constexpr (D::kind == QKind::q8) {
    const std::uint8_t* p = q_codes_at<D>(row, e);
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  } else if constexpr (D::kind == QKind::q4) {
    const std::uint8_t* p = q_codes_at<D>(row, e);
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
  else return q_scale(q_block_of<D>(row, e));
}
/// Q8/Q4: the chunk at e times its block's q_chunk_scale sc.
template <class D>
KVEVICT_QATTN_INLINE V q_chunk_scaled(const std::uint8_t* row, std::size_t e, V sc) noexcept {
  return vmul(q_chunk<D>(row, e), sc);
}

/// s[g n + i + r] = scale x (sum of acc[g][r]'s lanes), r < R, g < GC.
template <int GC, int R>
KVEVICT_QATTN_INLINE void q_reduce_store(float* s, std::size_t n, std::size_t i, const V (&acc)[GC][R],
                                         float scale) noexcept {
  for (int g = 0; g < GC; ++g) vreduce_store<R>(s + static_cast<std::size_t>(g) * n + i, acc[g], scale);
}

#define KVEVICT_QATTN_TARGET KVEVICT_ATTN_TARGET_AVX2
#include "attention_quant_body.hpp"
#undef KVEVICT_QATTN_TARGET

// p.V: column blocks of 2 vectors (16 columns) x GC heads in registers over a tile of rows.
template <class D, int GC>
KVEVICT_ATTN_TARGET_AVX2 inline void q_output_block(const float* probs, std::size_t ld,
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
      const V pb = vset1(probs[static_cast<std::size_t>(g) * ld + i]);
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

/// out[g * out_stride + j] += sum_i probs[g * ld + i] * v_i[j] over one run of n contiguous
/// stored rows, row by row in order whatever the tiling (so runs sum like one array).
template <class D>
KVEVICT_ATTN_TARGET_AVX2 inline void q_accumulate_run(const float* probs, std::size_t ld,
                                                      std::size_t group, const std::uint8_t* rows,
                                                      std::size_t row_bytes, std::size_t n,
                                                      std::size_t d, float* out,
                                                      std::size_t out_stride) noexcept {
  std::size_t tile = 16384 / (row_bytes + 1);
  if (tile < 8) tile = 8;
  for (std::size_t i0 = 0; i0 < n; i0 += tile) {
    const std::size_t i1 = n - i0 < tile ? n : i0 + tile;
    for (std::size_t g0 = 0; g0 < group; g0 += kHeads) {
      const std::size_t gc = group - g0 < static_cast<std::size_t>(kHeads) ? group - g0 : kHeads;
      const float* pg = probs + g0 * ld;
      float* og = out + g0 * out_stride;
      for (std::size_t c0 = 0; c0 < d; c0 += 16) {
        const bool two = c0 + 16 <= d;
        switch (gc) {
          case 1: q_output_block<D, 1>(pg, ld, rows, row_bytes, i0, i1, c0, two, og, out_stride); break;
          case 2: q_output_block<D, 2>(pg, ld, rows, row_bytes, i0, i1, c0, two, og, out_stride); break;
          case 3: q_output_block<D, 3>(pg, ld, rows, row_bytes, i0, i1, c0, two, og, out_stride); break;
          default: q_output_block<D, kHeads>(pg, ld, rows, row_bytes, i0, i1, c0, two, og, out_stride); break;
        }
      }
    }
  }
}

// --- the integer q.K path (quant_attention_probs_qint) -----------------------------------

/// Span [e, e + 32) of a row (e a multiple of 32, inside one block): Q8's int8 codes, or
/// Q4's nibbles as unsigned bytes in kernel order (low nibbles, then high nibbles).
template <class D>
KVEVICT_QATTN_INLINE __m256i qint_span(const std::uint8_t* row, std::size_t e) noexcept {
  const std::uint8_t* blk = q_block_of<D>(row, e) + 2;
  if constexpr (D::kind == QKind::q8) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + e % D::group));
  } else {
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (e % D::group) / 2));
    const __m128i m = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(x, 4), m), _mm_and_si128(x, m));
  }
}

/// 8 int32 partial sums of span x (qint_span) times 32 query codes c: Q8 as llama.cpp's
/// q8_0 dot (|x| unsigned times c with x's sign; |x| <= 128, |c| <= 127: pairs fit int16),
/// Q4 as nibbles (0..15) times c (the offset 8 is taken off per block by the caller).
template <class D>
KVEVICT_QATTN_INLINE __m256i qint_dot32(__m256i x, __m256i xa, __m256i c) noexcept {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (D::kind == QKind::q8) return _mm256_madd_epi16(_mm256_maddubs_epi16(xa, _mm256_sign_epi8(c, x)), ones);
  else return _mm256_madd_epi16(_mm256_maddubs_epi16(x, c), ones);
}

template <class D, int GC, int R>
KVEVICT_ATTN_TARGET_AVX2 inline void qint_score_block(const QuantQuery& qq, std::size_t g0,
                                                      const float* fs, const std::uint8_t* rows,
                                                      std::size_t row_bytes, std::size_t i,
                                                      std::size_t d, float* s, std::size_t ld) noexcept {
  const std::size_t nb = d / D::group;
  V acc[GC][R];
  for (int g = 0; g < GC; ++g)
    for (int r = 0; r < R; ++r) acc[g][r] = vzero();
  const std::uint8_t* rp[R];
  for (int r = 0; r < R; ++r) rp[r] = rows + (i + static_cast<std::size_t>(r)) * row_bytes;
  const std::int8_t* cg[GC];
  for (int g = 0; g < GC; ++g) cg[g] = qq.codes.data() + (g0 + static_cast<std::size_t>(g)) * d;
  for (std::size_t b = 0; b < nb; ++b) {
    const std::size_t e0 = b * D::group;
    __m256i dot[GC][R];
    for (std::size_t e = e0; e < e0 + D::group; e += 32) {
      __m256i x[R], xa[R];
      for (int r = 0; r < R; ++r) {
        x[r] = qint_span<D>(rp[r], e);
        if constexpr (D::kind == QKind::q8) xa[r] = _mm256_abs_epi8(x[r]);
        else xa[r] = x[r];
      }
      for (int g = 0; g < GC; ++g) {
        const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cg[g] + e));
        for (int r = 0; r < R; ++r) {
          const __m256i t = qint_dot32<D>(x[r], xa[r], c);
          dot[g][r] = e == e0 ? t : _mm256_add_epi32(dot[g][r], t);
        }
      }
    }
    V sk[R];
    for (int r = 0; r < R; ++r) sk[r] = q_scale(rp[r] + b * D::block_bytes);
    for (int g = 0; g < GC; ++g) {
      if constexpr (D::kind == QKind::q4) {  // the nibbles' offset: -8 x the block's code sum
        const __m256i corr = _mm256_castsi128_si256(_mm_cvtsi32_si128(-8 * qq.bsum[(g0 + static_cast<std::size_t>(g)) * nb + b]));
        for (int r = 0; r < R; ++r) dot[g][r] = _mm256_add_epi32(dot[g][r], corr);
      }
      for (int r = 0; r < R; ++r) acc[g][r] = vfma(_mm256_cvtepi32_ps(dot[g][r]), sk[r], acc[g][r]);
    }
  }
  for (int g = 0; g < GC; ++g) vreduce_store<R>(s + static_cast<std::size_t>(g) * ld + i, acc[g], fs[g]);
}

template <class D, int R>
KVEVICT_ATTN_TARGET_AVX2 inline void qint_score_heads(const QuantQuery& qq, std::size_t group,
                                                      float scale, const std::uint8_t* rows,
                                                      std::size_t row_bytes, std::size_t i,
                                                      std::size_t d, float* s, std::size_t ld) noexcept {
  for (std::size_t g0 = 0; g0 < group; g0 += kHeads) {
    float fs[kHeads];
    const std::size_t gc = group - g0 < static_cast<std::size_t>(kHeads) ? group - g0 : kHeads;
    for (std::size_t g = 0; g < gc; ++g) fs[g] = scale * qq.scale[g0 + g];
    float* sg = s + g0 * ld;
    switch (gc) {
      case 1: qint_score_block<D, 1, R>(qq, g0, fs, rows, row_bytes, i, d, sg, ld); break;
      case 2: qint_score_block<D, 2, R>(qq, g0, fs, rows, row_bytes, i, d, sg, ld); break;
      case 3: qint_score_block<D, 3, R>(qq, g0, fs, rows, row_bytes, i, d, sg, ld); break;
      default: qint_score_block<D, kHeads, R>(qq, g0, fs, rows, row_bytes, i, d, sg, ld); break;
    }
  }
}

/// The integer scores of one run of n contiguous stored rows into s[g * ld + i] (the
/// AVX-512 level without VNNI runs this too).
template <class D>
KVEVICT_ATTN_TARGET_AVX2 inline void qint_score_run(const QuantQuery& qq, std::size_t group,
                                                    const std::uint8_t* rows, std::size_t row_bytes,
                                                    std::size_t n, std::size_t d, float scale,
                                                    float* s, std::size_t ld) noexcept {
  std::size_t i = 0;
  for (; i + kRows <= n; i += kRows) qint_score_heads<D, kRows>(qq, group, scale, rows, row_bytes, i, d, s, ld);
  for (; i < n; ++i) qint_score_heads<D, 1>(qq, group, scale, rows, row_bytes, i, d, s, ld);
}

#undef KVEVICT_QATTN_INLINE
}  // namespace attn_avx2
KVEVICT_SUPPRESS_INTRIN_WARNINGS_END
#endif

#if KVEVICT_X86
KVEVICT_SUPPRESS_INTRIN_WARNINGS_BEGIN
namespace attn_avx512 {
#define KVEVICT_QATTN_INLINE KVEVICT_ATTN_TARGET_AVX512 KVEVICT_ALWAYS_INLINE

/// The AVX-512 level handles this shape (else the AVX2 level's choice runs).
template <class D>
constexpr bool q_simd_shape(std::size_t /*d*/) noexcept {
  return D::kind != QKind::e4m3 && D::group % 16 == 0;
}

KVEVICT_QATTN_INLINE V q_scale(const std::uint8_t* blk) noexcept {
  // The fp16 bits broadcast, then widened (VPBROADCASTW + VCVTPH2PS: one instruction fewer
  // than converting one half and broadcasting the float).
  std::uint16_t h;
  std::memcpy(&h, blk, 2);
  return _mm512_cvtph_ps(_mm256_set1_epi16(static_cast<short>(h)));
}

/// Elements [e, e + 16) of a row as floats without the block scale (e a multiple of 16,
/// the 16 inside one block). Q4: chunks of 8 (quantized.hpp's layout), byte j of a chunk
/// holds element j (low nibble) and j + 4 (high).
template <class D>
KVEVICT_QATTN_INLINE V q_chunk(const std::uint8_t* row, std::size_t e) noexcept {
  if constexpr (D::kind == QKind::q8) {
    const std::uint8_t* p = q_codes_at<D>(row, e);
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  } else {
    const std::uint8_t* p = q_codes_at<D>(row, e);
    const __m128i x = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    const __m128i dup = _mm_shuffle_epi8(x, _mm_setr_epi8(0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 4, 5, 6, 7));
    const __m512i sh = _mm512_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4, 0, 0, 0, 0, 4, 4, 4, 4);
    const __m512i nib = _mm512_and_si512(_mm512_srlv_epi32(_mm512_cvtepu8_epi32(dup), sh), _mm512_set1_epi32(0xF));
    return _mm512_cvtepi32_ps(_mm512_sub_epi32(nib, _mm512_set1_epi32(8)));
  }
}

/// The block scale of element e; for Q4 the block's 16 values instead, (v - 8) x scale for
/// v = 0..15 (q_chunk_scaled looks the nibbles up: one VPERMPS per 16 elements, the same
/// floats as converting and multiplying).
template <class D>
KVEVICT_QATTN_INLINE V q_chunk_scale(const std::uint8_t* row, std::size_t e) noexcept {
  if constexpr (D::kind == QKind::q4)
    return vmul(_mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7),
                q_scale(q_block_of<D>(row, e)));
  else
    return q_scale(q_block_of<D>(row, e));
}
/// The chunk at e times its block's scale (sc = q_chunk_scale<D>(row, e)). Q4 with G a
/// multiple of 32 (q4_span_order): in kernel order, the span's 16 bytes broadcast to the
/// four 128-bit lanes, lane l shifted right by 8l (the first 16 of the span: low nibbles)
/// or 8l + 4 (the last 16: high nibbles), so that VPERMPS (which reads bits 0-3 only) looks
/// up byte 4k + l's nibble at position 4l + k: one load, one shift, one VPERMPS per 16
/// elements. Q4 with G = 16: element order, the 8 stored bytes, each twice (low nibble for
/// elements j, high for j + 4 of each chunk of 8), shifted so that the nibble is in bits 0-3.
template <class D>
KVEVICT_QATTN_INLINE V q_chunk_scaled(const std::uint8_t* row, std::size_t e, V sc) noexcept {
  if constexpr (q4_span_order<D>) {
    const std::uint8_t* p = q_codes_at<D>(row, e & ~std::size_t(31));
    const __m512i x = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m512i sh = (e & 16) ? _mm512_setr_epi32(4, 4, 4, 4, 12, 12, 12, 12, 20, 20, 20, 20, 28, 28, 28, 28)
                                : _mm512_setr_epi32(0, 0, 0, 0, 8, 8, 8, 8, 16, 16, 16, 16, 24, 24, 24, 24);
    return _mm512_permutexvar_ps(_mm512_srlv_epi32(x, sh), sc);
  } else if constexpr (D::kind == QKind::q4) {
    const std::uint8_t* p = q_codes_at<D>(row, e);
    const __m128i x = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    const __m128i dup = _mm_shuffle_epi8(x, _mm_setr_epi8(0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 4, 5, 6, 7));
    const __m512i sh = _mm512_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4, 0, 0, 0, 0, 4, 4, 4, 4);
    return _mm512_permutexvar_ps(_mm512_srlv_epi32(_mm512_cvtepu8_epi32(dup), sh), sc);
  } else {
    return vmul(q_chunk<D>(row, e), sc);
  }
}

/// Asks for bytes [p, p + bytes) to be brought to L2 (reads overlap the arithmetic: the
/// quantized passes are arithmetic-bound, and without it memory time adds to theirs).
KVEVICT_QATTN_INLINE void prefetch_l2(const std::uint8_t* p, std::size_t bytes) noexcept {
  for (std::size_t o = 0; o < bytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(p + o), _MM_HINT_T1);
}

/// The lane sums of x[0..3] times scale, in lanes 0-3, each summed in the order of the 4 x 4
/// tree of q_reduce_store: f_l = x_l + x_(l+8), w_l = f_l + f_(l+4), (w_0 + w_2) + (w_1 + w_3).
KVEVICT_QATTN_INLINE __m128 q_sum4(const V (&x)[4], float scale) noexcept {
  const V t0 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const V t1 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(3, 2, 3, 2)));
  // quarter k: x[k]'s w_0..w_3
  const V w = _mm512_add_ps(_mm512_shuffle_f32x4(t0, t1, _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm512_shuffle_f32x4(t0, t1, _MM_SHUFFLE(3, 1, 3, 1)));
  const V h = _mm512_add_ps(w, _mm512_permute_ps(w, _MM_SHUFFLE(1, 0, 3, 2)));  // w0+w2, w1+w3
  const V f = _mm512_add_ps(h, _mm512_permute_ps(h, _MM_SHUFFLE(2, 3, 0, 1)));  // lane 4k: x[k]'s sum
  const V lo = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), f);
  return _mm_mul_ps(_mm512_castps512_ps128(lo), _mm_set1_ps(scale));
}

/// s[g n + i + r] = scale x (sum of acc[g][r]'s lanes), r < R, g < GC. With 4 heads x 4 rows
/// the 16 sums come out of one tree (45 shuffles and adds, one multiply): 256-bit halves of
/// pairs, then 128-bit quarters, so that quarter g of w[r] holds (head g, row r)'s 4 partial
/// sums; a 4 x 4 transpose-add inside the quarters leaves (g, r)'s sum in lane 4g + r.
template <int GC, int R>
KVEVICT_QATTN_INLINE void q_reduce_store(float* s, std::size_t n, std::size_t i, const V (&acc)[GC][R],
                                         float scale) noexcept {
  if constexpr (GC == 4 && R == 4) {
    V w[4];
    for (int r = 0; r < 4; ++r) {
      const V t0 = _mm512_add_ps(_mm512_shuffle_f32x4(acc[0][r], acc[1][r], _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_f32x4(acc[0][r], acc[1][r], _MM_SHUFFLE(3, 2, 3, 2)));
      const V t1 = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2][r], acc[3][r], _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_f32x4(acc[2][r], acc[3][r], _MM_SHUFFLE(3, 2, 3, 2)));
      w[r] = _mm512_add_ps(_mm512_shuffle_f32x4(t0, t1, _MM_SHUFFLE(2, 0, 2, 0)),
                           _mm512_shuffle_f32x4(t0, t1, _MM_SHUFFLE(3, 1, 3, 1)));
    }
    const V f01 = _mm512_add_ps(_mm512_unpacklo_ps(w[0], w[1]), _mm512_unpackhi_ps(w[0], w[1]));
    const V f23 = _mm512_add_ps(_mm512_unpacklo_ps(w[2], w[3]), _mm512_unpackhi_ps(w[2], w[3]));
    const __m512d a = _mm512_castps_pd(f01), b = _mm512_castps_pd(f23);
    const V sum = _mm512_mul_ps(_mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                                              _mm512_castpd_ps(_mm512_unpackhi_pd(a, b))),
                                _mm512_set1_ps(scale));
    _mm_storeu_ps(s + i, _mm512_castps512_ps128(sum));
    _mm_storeu_ps(s + n + i, _mm512_extractf32x4_ps(sum, 1));
    _mm_storeu_ps(s + 2 * n + i, _mm512_extractf32x4_ps(sum, 2));
    _mm_storeu_ps(s + 3 * n + i, _mm512_extractf32x4_ps(sum, 3));
  } else {
    // Any other shape (fewer heads, the last rows of a run): the same order per sum, four
    // sums at a time (q_sum4; zero vectors fill the free slots), so that a row's score does
    // not depend on which rows share its block (a block table's runs group rows differently
    // from a dense array).
    constexpr int K = GC * R;
    for (int k0 = 0; k0 < K; k0 += 4) {
      V x[4];
      for (int j = 0; j < 4; ++j) x[j] = k0 + j < K ? acc[(k0 + j) / R][(k0 + j) % R] : vzero();
      alignas(16) float t[4];
      _mm_store_ps(t, q_sum4(x, scale));
      for (int j = 0; j < 4 && k0 + j < K; ++j)
        s[static_cast<std::size_t>((k0 + j) / R) * n + i + static_cast<std::size_t>((k0 + j) % R)] = t[j];
    }
  }
}

#define KVEVICT_QATTN_TARGET KVEVICT_ATTN_TARGET_AVX512
#include "attention_quant_body.hpp"
#undef KVEVICT_QATTN_TARGET

// p.V: column blocks of NV vectors (16 NV columns, NV <= kVecs) x GC heads in registers.
// Rows [i0, i1) of a run of n rows; probs[g * ld + i]; rows pf_rows ahead (inside the run)
// are prefetched.
template <class D, int GC, int NV>
KVEVICT_ATTN_TARGET_AVX512 inline void q_output_block(const float* probs, std::size_t ld,
                                                      std::size_t n, const std::uint8_t* rows,
                                                      std::size_t row_bytes, std::size_t i0,
                                                      std::size_t i1, std::size_t c0, float* out,
                                                      std::size_t out_stride,
                                                      std::size_t pf_rows) noexcept {
  V acc[GC][NV];
  for (int g = 0; g < GC; ++g)
    for (int v = 0; v < NV; ++v)
      acc[g][v] = vload(out + static_cast<std::size_t>(g) * out_stride + c0 + static_cast<std::size_t>(v) * 16);
  for (std::size_t i = i0; i < i1; ++i) {
    const std::uint8_t* row = rows + i * row_bytes;
    if (i + pf_rows < n && pf_rows != 0) prefetch_l2(row + pf_rows * row_bytes, row_bytes);
    // c0 is a multiple of 16 kVecs = 64 (q_accumulate_run): with G a multiple of 32 (64),
    // vectors v and v + 1 (v + 1..3) share a block, whose scale is computed once.
    static_assert(kVecs * 16 % 64 == 0, "column blocks start at multiples of 64");
    constexpr int share = D::group % 64 == 0 ? 4 : (D::group % 32 == 0 ? 2 : 1);
    V x[NV], sc = vzero();
    if constexpr (q4_span_order<D>) {
      // p.V's lanes are free (each column is summed alone, put back by q_output_order): a
      // span's 16 bytes widened to 16 dwords (VPMOVZXBD) index its low nibbles directly
      // (VPERMPS reads bits 0-3), the same dwords shifted by 4 its high nibbles. Lane t of
      // the two vectors: elements q4_span_element(t) and q4_span_element(16 + t).
      for (int v = 0; v < NV; v += 2) {
        const std::size_t e = c0 + static_cast<std::size_t>(v) * 16;
        if (v % share == 0) sc = q_chunk_scale<D>(row, e);
        const __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q_codes_at<D>(row, e))));
        x[v] = _mm512_permutexvar_ps(w, sc);
        if (v + 1 < NV) x[v + 1] = _mm512_permutexvar_ps(_mm512_srli_epi32(w, 4), sc);
      }
    } else {
      for (int v = 0; v < NV; ++v) {
        const std::size_t e = c0 + static_cast<std::size_t>(v) * 16;
        if (v % share == 0) sc = q_chunk_scale<D>(row, e);
        x[v] = q_chunk_scaled<D>(row, e, sc);
      }
    }
    for (int g = 0; g < GC; ++g) {
      const V pb = vset1(probs[static_cast<std::size_t>(g) * ld + i]);
      for (int v = 0; v < NV; ++v) acc[g][v] = vfma(pb, x[v], acc[g][v]);
    }
  }
  for (int g = 0; g < GC; ++g)
    for (int v = 0; v < NV; ++v)
      vstore(out + static_cast<std::size_t>(g) * out_stride + c0 + static_cast<std::size_t>(v) * 16, acc[g][v]);
}

template <class D, int GC>
KVEVICT_ATTN_TARGET_AVX512 inline void q_output_nv(std::size_t nv, const float* probs, std::size_t ld,
                                                   std::size_t n, const std::uint8_t* rows,
                                                   std::size_t row_bytes, std::size_t i0,
                                                   std::size_t i1, std::size_t c0, float* out,
                                                   std::size_t out_stride, std::size_t pf) noexcept {
  switch (nv) {
    case 1: q_output_block<D, GC, 1>(probs, ld, n, rows, row_bytes, i0, i1, c0, out, out_stride, pf); break;
    case 2: q_output_block<D, GC, 2>(probs, ld, n, rows, row_bytes, i0, i1, c0, out, out_stride, pf); break;
    case 3: q_output_block<D, GC, 3>(probs, ld, n, rows, row_bytes, i0, i1, c0, out, out_stride, pf); break;
    default: q_output_block<D, GC, kVecs>(probs, ld, n, rows, row_bytes, i0, i1, c0, out, out_stride, pf); break;
  }
}

/// out[g * out_stride + k] += sum_i probs[g * ld + i] * v_i[k] over one run of n contiguous
/// stored rows, row by row in order whatever the tiling; k in kernel order (Q4 with G a
/// multiple of 32: q4_span_element's order, put back by q_output_order once every run is
/// added).
template <class D>
KVEVICT_ATTN_TARGET_AVX512 inline void q_accumulate_run(const float* probs, std::size_t ld,
                                                        std::size_t group, const std::uint8_t* rows,
                                                        std::size_t row_bytes, std::size_t n,
                                                        std::size_t d, float* out,
                                                        std::size_t out_stride) noexcept {
  std::size_t tile = 16384 / (row_bytes + 1);
  if (tile < 8) tile = 8;
  const std::size_t nvec = d / 16;  // d is a multiple of G, a multiple of 16
  for (std::size_t i0 = 0; i0 < n; i0 += tile) {
    const std::size_t i1 = n - i0 < tile ? n : i0 + tile;
    for (std::size_t g0 = 0; g0 < group; g0 += kHeads) {
      const std::size_t gc = group - g0 < static_cast<std::size_t>(kHeads) ? group - g0 : kHeads;
      const float* pg = probs + g0 * ld;
      float* og = out + g0 * out_stride;
      for (std::size_t cv = 0; cv < nvec; cv += kVecs) {
        const std::size_t nv = nvec - cv < static_cast<std::size_t>(kVecs) ? nvec - cv : kVecs;
        const std::size_t c0 = cv * 16;
        const std::size_t pf = g0 == 0 && cv == 0 ? tile : 0;  // the next tile, once
        switch (gc) {
          case 1: q_output_nv<D, 1>(nv, pg, ld, n, rows, row_bytes, i0, i1, c0, og, out_stride, pf); break;
          case 2: q_output_nv<D, 2>(nv, pg, ld, n, rows, row_bytes, i0, i1, c0, og, out_stride, pf); break;
          case 3: q_output_nv<D, 3>(nv, pg, ld, n, rows, row_bytes, i0, i1, c0, og, out_stride, pf); break;
          default: q_output_nv<D, kHeads>(nv, pg, ld, n, rows, row_bytes, i0, i1, c0, og, out_stride, pf); break;
        }
      }
    }
  }
}

/// Kernel order -> element order (Q4 with G a multiple of 32; nothing for other formats).
template <class D>
KVEVICT_ATTN_TARGET_AVX512 inline void q_output_order(std::size_t group, std::size_t d, float* out,
                                                      std::size_t out_stride) noexcept {
  if constexpr (q4_span_order<D>) {  // q_output_block's order -> element order
    for (std::size_t g = 0; g < group; ++g)
      for (std::size_t s0 = 0; s0 < d; s0 += 32) {
        float* o = out + g * out_stride + s0;
        alignas(64) float t[32];
        std::memcpy(t, o, sizeof t);
        for (std::size_t k = 0; k < 32; ++k) o[q4_span_element(k)] = t[k];
      }
  }
}

// --- the integer q.K path with AVX512_VNNI (VPDPBUSD) ---------------------------------------
// Four query heads share one register: 16 key bytes are broadcast to the four 128-bit lanes
// and multiplied with the 4 heads' 16 query codes (QuantQuery::wide) by one VPDPBUSD (u8 x
// s8, four products per int32 lane, exact). A block's int32 lanes start at QuantQuery::init
// (the unsigned offset's correction), are converted once and accumulated with the row's
// block scale by one FMA for all four heads. Q4: one AND (low nibbles) and one shift + AND
// (high nibbles) per 16 stored bytes. Lanes 4h..4h+3 of a row's accumulator are head h's
// partial sums, added as (l0 + l2) + (l1 + l3).
#define KVEVICT_ATTN_TARGET_AVX512_VNNI                                                     \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512vpopcntdq,avx512bitalg," \
                        "avx2,fma,f16c,popcnt,bmi,bmi2")))

/// Scores of R rows (R a multiple of 4, or 1) x the 4 heads of head group hg (gc of them real).
/// d >= G (the caller's guard): the block loop runs at least once and is written so, and the
/// function is inlined into the row loop, so that the R accumulators stay in registers (with
/// a zero-trip loop GCC gave them a stack home, zeroed by `rep stos` on every call of 8 rows:
/// 12% of the pass's samples, perf record -e cpu-clock, stop 34).
template <class D, int R>
KVEVICT_ATTN_TARGET_AVX512_VNNI KVEVICT_ALWAYS_INLINE void qint_vnni_block(const QuantQuery& qq, std::size_t hg,
                                                            std::size_t gc, __m512 fsv,
                                                            const std::uint8_t* rows,
                                                            std::size_t row_bytes, std::size_t i,
                                                            std::size_t d, float* s,
                                                            std::size_t n) noexcept {
  const std::size_t nb = d / D::group, nh = d / 16;
  const std::int8_t* qw = qq.wide.data() + hg * nh * 64;
  const std::int32_t* init = qq.init.data() + hg * nb * 16;
  const std::uint8_t* rp[R];
  for (int r = 0; r < R; ++r) rp[r] = rows + (i + static_cast<std::size_t>(r)) * row_bytes;
  V acc[R];
  for (int r = 0; r < R; ++r) acc[r] = vzero();
  const __m512i lo4 = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  std::size_t b = 0;
  do {
    const __m512i iv = _mm512_loadu_si512(init + b * 16);
    __m512i dot[R];
    for (int r = 0; r < R; ++r) dot[r] = iv;
    for (std::size_t e = b * D::group; e < (b + 1) * D::group; e += 32) {
      const __m512i qa = _mm512_loadu_si512(qw + (e / 16) * 64);
      const __m512i qb = _mm512_loadu_si512(qw + (e / 16 + 1) * 64);
      for (int r = 0; r < R; ++r) {
        const std::uint8_t* blk = rp[r] + b * D::block_bytes + 2;
        __m512i ka, kb;
        if constexpr (D::kind == QKind::q8) {
          const std::uint8_t* p = blk + e % D::group;
          ka = _mm512_xor_si512(_mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), flip);
          kb = _mm512_xor_si512(_mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))), flip);
        } else {
          const __m512i x = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (e % D::group) / 2)));
          ka = _mm512_and_si512(x, lo4);
          kb = _mm512_and_si512(_mm512_srli_epi16(x, 4), lo4);
        }
        dot[r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(dot[r], ka, qa), kb, qb);
      }
    }
    for (int r = 0; r < R; ++r) {
      const std::uint8_t* sb = rp[r] + b * D::block_bytes;
      std::uint16_t h;
      std::memcpy(&h, sb, 2);
      const V sk = _mm512_cvtph_ps(_mm256_set1_epi16(static_cast<short>(h)));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), sk, acc[r]);
    }
  } while (++b < nb);
  alignas(64) float t[16];
  if constexpr (R == 1) {
    alignas(64) float f[16];
    _mm512_store_ps(t, acc[0]);
    _mm512_store_ps(f, fsv);
    for (std::size_t h = 0; h < gc; ++h)
      s[h * n + i] = ((t[4 * h] + t[4 * h + 2]) + (t[4 * h + 1] + t[4 * h + 3])) * f[4 * h];
  } else {
    for (int r0 = 0; r0 < R; r0 += 4) {
      const V s01 = _mm512_add_ps(_mm512_unpacklo_ps(acc[r0], acc[r0 + 1]), _mm512_unpackhi_ps(acc[r0], acc[r0 + 1]));
      const V s23 = _mm512_add_ps(_mm512_unpacklo_ps(acc[r0 + 2], acc[r0 + 3]), _mm512_unpackhi_ps(acc[r0 + 2], acc[r0 + 3]));
      const __m512d a = _mm512_castps_pd(s01), c = _mm512_castps_pd(s23);
      const V sum = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, c)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, c)));
      _mm512_store_ps(t, _mm512_mul_ps(sum, fsv));
      for (std::size_t h = 0; h < gc; ++h) std::memcpy(s + h * n + i + static_cast<std::size_t>(r0), t + 4 * h, 16);
    }
  }
}

inline constexpr int kVnniRows = 8;

/// The integer scores with VNNI (qq already widened by widen_query<D>) of one run of n
/// contiguous stored rows into s[g * ld + i].
template <class D>
KVEVICT_ATTN_TARGET_AVX512_VNNI inline void qint_vnni_run(const QuantQuery& qq, std::size_t group,
                                                          const std::uint8_t* rows,
                                                          std::size_t row_bytes, std::size_t n,
                                                          std::size_t d, float scale, float* s,
                                                          std::size_t ld) noexcept {
  for (std::size_t hg = 0; hg * 4 < group; ++hg) {
    const std::size_t gc = group - hg * 4 < 4 ? group - hg * 4 : 4;
    alignas(64) float f[16] = {};
    for (std::size_t h = 0; h < gc; ++h)
      for (std::size_t l = 0; l < 4; ++l) f[4 * h + l] = scale * qq.scale[hg * 4 + h];
    const V fsv = _mm512_load_ps(f);
    float* sg = s + hg * 4 * ld;
    std::size_t i = 0;
    constexpr std::size_t ahead = 4 * kVnniRows;  // rows
    for (; i + kVnniRows <= n; i += kVnniRows) {
      if (hg == 0 && i + ahead + kVnniRows <= n) prefetch_l2(rows + (i + ahead) * row_bytes, kVnniRows * row_bytes);
      qint_vnni_block<D, kVnniRows>(qq, hg, gc, fsv, rows, row_bytes, i, d, sg, ld);
    }
    for (; i + 4 <= n; i += 4) qint_vnni_block<D, 4>(qq, hg, gc, fsv, rows, row_bytes, i, d, sg, ld);
    for (; i < n; ++i) qint_vnni_block<D, 1>(qq, hg, gc, fsv, rows, row_bytes, i, d, sg, ld);
  }
}
#undef KVEVICT_ATTN_TARGET_AVX512_VNNI

#undef KVEVICT_QATTN_INLINE
}  // namespace attn_avx512
KVEVICT_SUPPRESS_INTRIN_WARNINGS_END
#endif

/// fn(first row, the run's first stored row, its rows) for the runs of a block table over
/// stored rows `stride` bytes apart (for_each_run, offsets in bytes from `rows`), the next
/// run's first rows (of `bytes` bytes) prefetched.
template <class Fn>
inline void for_each_stored_run(const std::uint8_t* rows, std::size_t stride, std::size_t bytes,
                                const BlockTable& t, std::size_t n, Fn&& fn) noexcept {
  for_each_run(t, stride, n, [&](std::size_t i, std::size_t offset, std::size_t count,
                                 std::size_t next, std::size_t next_rows) {
    prefetch_run(rows + next, next_rows, stride, bytes);
    fn(i, rows + offset, count);
  });
}

}  // namespace detail

/// Pinned level, over a block table (attention_decode.hpp's BlockTable, its strides in
/// bytes; row_bytes: bytes from one row of a block to the next): the runs' scores, then one
/// softmax over all n. A shape the AVX-512 level does not handle runs the AVX2 level, and a
/// shape the AVX2 level does not handle the scalar level. Every score is one row's, summed
/// in the same order whatever the runs: the result equals the dense form's on the rows
/// copied into one array, bit for bit.
template <Isa I, class D>
inline bool quant_attention_probs_at(const float* q, std::size_t q_stride, std::size_t group,
                                     const std::uint8_t* rows, std::size_t row_bytes,
                                     const BlockTable& t, std::size_t n, std::size_t d,
                                     float scale, float* probs) noexcept {
  auto runs = [&](auto&& score) {
    detail::for_each_stored_run(rows, row_bytes, D::row_bytes(d), t, n,
                                [&](std::size_t i, const std::uint8_t* r, std::size_t c) { score(r, c, probs + i); });
  };
#if KVEVICT_X86
  if constexpr (I == Isa::avx512)
    if (detail::attn_avx512::q_simd_shape<D>(d)) {
      const float* qx = q;
      std::size_t qx_stride = q_stride;
      bool have = true;
      if constexpr (detail::q4_span_order<D>) {  // the query in span order (else AVX2's level)
        thread_local std::vector<float> qs;  // grows to the largest group x d, then reused
        try {
          qs.resize(group * d);
        } catch (...) {
          have = false;
        }
        if (have) {
          for (std::size_t g = 0; g < group; ++g)
            for (std::size_t j = 0; j < d; ++j)
              qs[g * d + j] = q[g * q_stride + (j & ~std::size_t(31)) + detail::q4_span512_element(j % 32)];
          qx = qs.data();
          qx_stride = d;
        }
      }
      if (have) {
        runs([&](const std::uint8_t* r, std::size_t c, float* s) {
          detail::attn_avx512::q_score_run<D>(qx, qx_stride, group, r, row_bytes, c, d, scale, s, n);
        });
        return detail::attn_avx512::softmax_rows(probs, group, n);
      }
    }
  if constexpr (I != Isa::scalar)
    if (detail::attn_avx2::q_simd_shape<D>(d)) {
      runs([&](const std::uint8_t* r, std::size_t c, float* s) {
        detail::attn_avx2::q_score_run<D>(q, q_stride, group, r, row_bytes, c, d, scale, s, n);
      });
      return detail::attn_avx2::softmax_rows(probs, group, n);
    }
#endif
  runs([&](const std::uint8_t* r, std::size_t c, float* s) {
    detail::qscalar::score_run<D>(q, q_stride, group, r, row_bytes, c, d, scale, s, n);
  });
  return detail::scalar::softmax_rows(probs, group, n);
}

/// The same over n contiguous rows (row_bytes apart): one block.
template <Isa I, class D>
inline bool quant_attention_probs_at(const float* q, std::size_t q_stride, std::size_t group,
                                     const std::uint8_t* rows, std::size_t row_bytes, std::size_t n,
                                     std::size_t d, float scale, float* probs) noexcept {
  const detail::DenseTable dense(n);
  return quant_attention_probs_at<I, D>(q, q_stride, group, rows, row_bytes, dense.table, n, d,
                                        scale, probs);
}

/// p.V at a pinned level over a block table: the runs added in table order, row by row (bit
/// for bit the dense form's sum on the rows copied into one array).
template <Isa I, class D>
inline void quant_attention_output_at(const float* probs, std::size_t group,
                                      const std::uint8_t* rows, std::size_t row_bytes,
                                      const BlockTable& t, std::size_t n, std::size_t d,
                                      float* out, std::size_t out_stride) noexcept {
  for (std::size_t g = 0; g < group; ++g)
    for (std::size_t j = 0; j < d; ++j) out[g * out_stride + j] = 0.0f;
  auto runs = [&](auto&& add) {
    detail::for_each_stored_run(rows, row_bytes, D::row_bytes(d), t, n,
                                [&](std::size_t i, const std::uint8_t* r, std::size_t c) { add(probs + i, r, c); });
  };
#if KVEVICT_X86
  if constexpr (I == Isa::avx512)
    if (detail::attn_avx512::q_simd_shape<D>(d)) {
      runs([&](const float* p, const std::uint8_t* r, std::size_t c) {
        detail::attn_avx512::q_accumulate_run<D>(p, n, group, r, row_bytes, c, d, out, out_stride);
      });
      detail::attn_avx512::q_output_order<D>(group, d, out, out_stride);
      return;
    }
  if constexpr (I != Isa::scalar)
    if (detail::attn_avx2::q_simd_shape<D>(d)) {
      runs([&](const float* p, const std::uint8_t* r, std::size_t c) {
        detail::attn_avx2::q_accumulate_run<D>(p, n, group, r, row_bytes, c, d, out, out_stride);
      });
      return;
    }
#endif
  runs([&](const float* p, const std::uint8_t* r, std::size_t c) {
    detail::qscalar::accumulate_run<D>(p, n, group, r, row_bytes, c, d, out, out_stride);
  });
}

template <Isa I, class D>
inline void quant_attention_output_at(const float* probs, std::size_t group,
                                      const std::uint8_t* rows, std::size_t row_bytes,
                                      std::size_t n, std::size_t d, float* out,
                                      std::size_t out_stride) noexcept {
  const detail::DenseTable dense(n);
  quant_attention_output_at<I, D>(probs, group, rows, row_bytes, dense.table, n, d, out,
                                  out_stride);
}

/// The integer q.K path at a pinned level over a block table (Isa::avx512: the VNNI kernel
/// when has_avx512_vnni(), else the AVX2 integer scores; the AVX-512 softmax). Formats and
/// shapes outside qint_shape, and a non-finite query, run quant_attention_probs_at<I, D>.
template <Isa I, class D>
inline bool quant_attention_probs_qint_at(const float* q, std::size_t q_stride, std::size_t group,
                                          const std::uint8_t* rows, std::size_t row_bytes,
                                          const BlockTable& t, std::size_t n, std::size_t d,
                                          float scale, float* probs) {
  if constexpr (D::kind != QKind::e4m3) {
    if (detail::qint_shape<D>(d) && n > 0 && d > 0) {  // d = 0: every score 0 either way
      thread_local detail::QuantQuery qq;  // grows to the largest group x d, then reused
      if (detail::quantize_query<D>(q, q_stride, group, d, qq)) {
        auto runs = [&](auto&& score) {
          detail::for_each_stored_run(rows, row_bytes, D::row_bytes(d), t, n,
                                      [&](std::size_t i, const std::uint8_t* r, std::size_t c) { score(r, c, probs + i); });
        };
#if KVEVICT_X86
        if constexpr (I == Isa::avx512) {
          if (has_avx512_vnni()) {
            detail::widen_query<D>(qq, group, d);
            runs([&](const std::uint8_t* r, std::size_t c, float* s) {
              detail::attn_avx512::qint_vnni_run<D>(qq, group, r, row_bytes, c, d, scale, s, n);
            });
          } else {
            runs([&](const std::uint8_t* r, std::size_t c, float* s) {
              detail::attn_avx2::qint_score_run<D>(qq, group, r, row_bytes, c, d, scale, s, n);
            });
          }
          return detail::attn_avx512::softmax_rows(probs, group, n);
        }
        if constexpr (I != Isa::scalar) {
          runs([&](const std::uint8_t* r, std::size_t c, float* s) {
            detail::attn_avx2::qint_score_run<D>(qq, group, r, row_bytes, c, d, scale, s, n);
          });
          return detail::attn_avx2::softmax_rows(probs, group, n);
        }
#endif
        runs([&](const std::uint8_t* r, std::size_t c, float* s) {
          detail::qscalar::qint_score_run<D>(qq, group, r, row_bytes, c, d, scale, s, n);
        });
        return detail::scalar::softmax_rows(probs, group, n);
      }
    }
  }
  return quant_attention_probs_at<I, D>(q, q_stride, group, rows, row_bytes, t, n, d, scale, probs);
}

template <Isa I, class D>
inline bool quant_attention_probs_qint_at(const float* q, std::size_t q_stride, std::size_t group,
                                          const std::uint8_t* rows, std::size_t row_bytes,
                                          std::size_t n, std::size_t d, float scale, float* probs) {
  const detail::DenseTable dense(n);
  return quant_attention_probs_qint_at<I, D>(q, q_stride, group, rows, row_bytes, dense.table, n,
                                             d, scale, probs);
}

/// At attention_isa() (attention_decode.hpp), over a block table.
template <class D>
KVEVICT_KERNEL_FN bool quant_attention_probs_paged(const float* q, std::size_t q_stride,
                                                   std::size_t group, const std::uint8_t* rows,
                                                   std::size_t row_bytes, BlockTable table,
                                                   std::size_t n, std::size_t d, float scale,
                                                   float* probs) noexcept {
  return detail::with_isa(attention_isa(), [&](auto isa) {
    return quant_attention_probs_at<decltype(isa)::value, D>(q, q_stride, group, rows, row_bytes,
                                                             table, n, d, scale, probs);
  });
}

template <class D>
KVEVICT_KERNEL_FN void quant_attention_output_paged(const float* probs, std::size_t group,
                                                    const std::uint8_t* rows, std::size_t row_bytes,
                                                    BlockTable table, std::size_t n, std::size_t d,
                                                    float* out, std::size_t out_stride) noexcept {
  detail::with_isa(attention_isa(), [&](auto isa) {
    quant_attention_output_at<decltype(isa)::value, D>(probs, group, rows, row_bytes, table, n, d,
                                                       out, out_stride);
  });
}

/// The opt-in integer q.K at attention_isa() over a block table (see the header comment).
template <class D>
KVEVICT_KERNEL_FN bool quant_attention_probs_qint_paged(const float* q, std::size_t q_stride,
                                                        std::size_t group, const std::uint8_t* rows,
                                                        std::size_t row_bytes, BlockTable table,
                                                        std::size_t n, std::size_t d, float scale,
                                                        float* probs) {
  return detail::with_isa(attention_isa(), [&](auto isa) {
    return quant_attention_probs_qint_at<decltype(isa)::value, D>(q, q_stride, group, rows,
                                                                  row_bytes, table, n, d, scale,
                                                                  probs);
  });
}

/// At attention_isa(), over n contiguous rows: the one-block case of the paged forms.
template <class D>
KVEVICT_KERNEL_FN bool quant_attention_probs(const float* q, std::size_t q_stride, std::size_t group,
                                  const std::uint8_t* rows, std::size_t row_bytes, std::size_t n,
                                  std::size_t d, float scale, float* probs) noexcept {
  const detail::DenseTable dense(n);
  return quant_attention_probs_paged<D>(q, q_stride, group, rows, row_bytes, dense.table, n, d,
                                        scale, probs);
}

template <class D>
KVEVICT_KERNEL_FN void quant_attention_output(const float* probs, std::size_t group, const std::uint8_t* rows,
                                   std::size_t row_bytes, std::size_t n, std::size_t d, float* out,
                                   std::size_t out_stride) noexcept {
  const detail::DenseTable dense(n);
  quant_attention_output_paged<D>(probs, group, rows, row_bytes, dense.table, n, d, out,
                                  out_stride);
}

/// At attention_isa(): the opt-in integer q.K (see the header comment).
template <class D>
KVEVICT_KERNEL_FN bool quant_attention_probs_qint(const float* q, std::size_t q_stride, std::size_t group,
                                       const std::uint8_t* rows, std::size_t row_bytes, std::size_t n,
                                       std::size_t d, float scale, float* probs) {
  const detail::DenseTable dense(n);
  return quant_attention_probs_qint_paged<D>(q, q_stride, group, rows, row_bytes, dense.table, n,
                                             d, scale, probs);
}

}  // namespace kvevict::kernels
