// The anchors bench_decode compares kvevict's attend against, compiled with -march=native
// (see bench/decode.cmake). Must not include kvevict headers (an inline library function
// compiled here with -march=native could be merged, ODR, with the generic copy measured).
//
//  - read_bandwidth: XOR-reduce every byte of K and V (4 independent vector streams): the
//    memory ceiling of one decode step.
//  - decode_attention: a hand-written decode attention for the G query heads of one KV head
//    at the best ISA -march=native gives (AVX-512, else AVX2+FMA+F16C), written the way an
//    engine author would: per K row, the G dot products with one FMA accumulator per head
//    and a horizontal sum per row; softmax with a polynomial exp; p.V over tiles of 32 rows
//    with a 4-head column block of the output in registers (each V byte read from memory
//    once). fp32 rows, or fp16 rows widened by VCVTPH2PS.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace kvevict_bench_native {

bool have_anchor() {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
  return true;
#else
  return false;
#endif
}

std::uint64_t read_bandwidth(const void* a, std::size_t a_bytes, const void* b,
                             std::size_t b_bytes) {
  std::uint64_t r = 0;
  for (int s = 0; s < 2; ++s) {
    const auto* p = static_cast<const std::uint8_t*>(s ? b : a);
    const std::size_t bytes = s ? b_bytes : a_bytes;
    std::size_t i = 0;
#if defined(__AVX512F__)
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    for (; i + 256 <= bytes; i += 256) {
      a0 = _mm512_xor_si512(a0, _mm512_loadu_si512(p + i));
      a1 = _mm512_xor_si512(a1, _mm512_loadu_si512(p + i + 64));
      a2 = _mm512_xor_si512(a2, _mm512_loadu_si512(p + i + 128));
      a3 = _mm512_xor_si512(a3, _mm512_loadu_si512(p + i + 192));
    }
    r ^= static_cast<std::uint64_t>(
        _mm512_reduce_or_epi64(_mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3))));
#elif defined(__AVX2__)
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    for (; i + 128 <= bytes; i += 128) {
      a0 = _mm256_xor_si256(a0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i)));
      a1 = _mm256_xor_si256(a1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 32)));
      a2 = _mm256_xor_si256(a2, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 64)));
      a3 = _mm256_xor_si256(a3, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 96)));
    }
    const __m256i a = _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3));
    alignas(32) std::uint64_t t[4];
    _mm256_store_si256(reinterpret_cast<__m256i*>(t), a);
    r ^= t[0] ^ t[1] ^ t[2] ^ t[3];
#endif
    for (; i + 8 <= bytes; i += 8) {
      std::uint64_t w;
      std::memcpy(&w, p + i, 8);
      r ^= w;
    }
  }
  return r;
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
namespace {

#if defined(__AVX512F__)
using V = __m512;
constexpr std::size_t W = 16;
constexpr int kVecs = 4;  // p.V column block: 4 heads x 4 vectors in registers
inline V vzero() { return _mm512_setzero_ps(); }
inline V vset1(float x) { return _mm512_set1_ps(x); }
inline V vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, V x) { _mm512_storeu_ps(p, x); }
inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V vmax(V a, V b) { return _mm512_max_ps(a, b); }
inline V vadd(V a, V b) { return _mm512_add_ps(a, b); }
inline V vsub(V a, V b) { return _mm512_sub_ps(a, b); }
inline V vmul(V a, V b) { return _mm512_mul_ps(a, b); }
inline float vsum(V x) { return _mm512_reduce_add_ps(x); }
inline float vmaxr(V x) { return _mm512_reduce_max_ps(x); }
template <bool Half>
inline V load_row(const void* rows, std::size_t idx) {
  if constexpr (Half)
    return _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const std::uint16_t*>(rows) + idx)));
  else
    return _mm512_loadu_ps(static_cast<const float*>(rows) + idx);
}
inline V vexp(V x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const V n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.442695041f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const V r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.6931471806f), x);
  V y = _mm512_set1_ps(1.0f / 720);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f / 120));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f / 24));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f / 6));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(0.5f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(y, n);
}
#else
using V = __m256;
constexpr std::size_t W = 8;
constexpr int kVecs = 2;  // p.V column block: 4 heads x 2 vectors in registers
inline V vzero() { return _mm256_setzero_ps(); }
inline V vset1(float x) { return _mm256_set1_ps(x); }
inline V vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, V x) { _mm256_storeu_ps(p, x); }
inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline V vmax(V a, V b) { return _mm256_max_ps(a, b); }
inline V vadd(V a, V b) { return _mm256_add_ps(a, b); }
inline V vsub(V a, V b) { return _mm256_sub_ps(a, b); }
inline V vmul(V a, V b) { return _mm256_mul_ps(a, b); }
inline float vsum(V x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(s);
}
inline float vmaxr(V x) {
  alignas(32) float t[8];
  _mm256_store_ps(t, x);
  float m = t[0];
  for (int i = 1; i < 8; ++i) m = t[i] > m ? t[i] : m;
  return m;
}
template <bool Half>
inline V load_row(const void* rows, std::size_t idx) {
  if constexpr (Half)
    return _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const std::uint16_t*>(rows) + idx)));
  else
    return _mm256_loadu_ps(static_cast<const float*>(rows) + idx);
}
inline V vexp(V x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const V n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.442695041f)),
                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const V r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.6931471806f), x);
  V y = _mm256_set1_ps(1.0f / 720);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.0f / 120));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.0f / 24));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.0f / 6));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(0.5f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.0f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif

// d a multiple of W * kVecs, n a multiple of W, G <= 8 (the benchmark: d = 128, G = 4).
template <bool Half>
void decode_impl(const float* q, int G, const void* K, const void* Vr, std::size_t n, std::size_t d,
                 float scale, float* scores, float* out) {
  // q . K^T: one accumulator per head, a horizontal sum per row and head
  for (std::size_t i = 0; i < n; ++i) {
    V acc[8];
    for (int g = 0; g < G; ++g) acc[g] = vzero();
    for (std::size_t c = 0; c < d; c += W) {
      const V k = load_row<Half>(K, i * d + c);
      for (int g = 0; g < G; ++g) acc[g] = vfma(vload(q + std::size_t(g) * d + c), k, acc[g]);
    }
    for (int g = 0; g < G; ++g) scores[std::size_t(g) * n + i] = vsum(acc[g]) * scale;
  }
  // softmax
  for (int g = 0; g < G; ++g) {
    float* s = scores + std::size_t(g) * n;
    V m = vset1(-INFINITY);
    for (std::size_t i = 0; i < n; i += W) m = vmax(m, vload(s + i));
    const V mb = vset1(vmaxr(m));
    V z = vzero();
    for (std::size_t i = 0; i < n; i += W) {
      const V e = vexp(vsub(vload(s + i), mb));
      vstore(s + i, e);
      z = vadd(z, e);
    }
    const V inv = vset1(1.0f / vsum(z));
    for (std::size_t i = 0; i < n; i += W) vstore(s + i, vmul(vload(s + i), inv));
  }
  // p . V: tiles of 32 rows; per tile, column blocks of 4 heads x kVecs vectors in registers
  for (int g = 0; g < G; ++g)
    for (std::size_t c = 0; c < d; ++c) out[std::size_t(g) * d + c] = 0.0f;
  constexpr std::size_t tile = 32;
  for (std::size_t i0 = 0; i0 < n; i0 += tile) {
    const std::size_t i1 = n - i0 < tile ? n : i0 + tile;
    for (int g0 = 0; g0 < G; g0 += 4) {
      const int gc = G - g0 < 4 ? G - g0 : 4;
      for (std::size_t c = 0; c < d; c += W * kVecs) {
        V acc[4][kVecs];
        for (int g = 0; g < gc; ++g)
          for (int v = 0; v < kVecs; ++v) acc[g][v] = vload(out + std::size_t(g0 + g) * d + c + v * W);
        for (std::size_t i = i0; i < i1; ++i) {
          V x[kVecs];
          for (int v = 0; v < kVecs; ++v) x[v] = load_row<Half>(Vr, i * d + c + v * W);
          for (int g = 0; g < gc; ++g) {
            const V p = vset1(scores[std::size_t(g0 + g) * n + i]);
            for (int v = 0; v < kVecs; ++v) acc[g][v] = vfma(p, x[v], acc[g][v]);
          }
        }
        for (int g = 0; g < gc; ++g)
          for (int v = 0; v < kVecs; ++v) vstore(out + std::size_t(g0 + g) * d + c + v * W, acc[g][v]);
      }
    }
  }
}

}  // namespace
#define KVEVICT_BENCH_HAVE_ANCHOR 1
#endif

const char* anchor_isa() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(KVEVICT_BENCH_HAVE_ANCHOR)
  return "avx2+fma+f16c";
#else
  return "none";
#endif
}

void decode_attention_f32(const float* q, int G, const float* K, const float* V, std::size_t n,
                          std::size_t d, float scale, float* scores, float* out) {
#if defined(KVEVICT_BENCH_HAVE_ANCHOR)
  decode_impl<false>(q, G, K, V, n, d, scale, scores, out);
#else
  (void)q, (void)G, (void)K, (void)V, (void)n, (void)d, (void)scale, (void)scores, (void)out;
#endif
}

void decode_attention_f16(const float* q, int G, const void* K, const void* V, std::size_t n,
                          std::size_t d, float scale, float* scores, float* out) {
#if defined(KVEVICT_BENCH_HAVE_ANCHOR)
  decode_impl<true>(q, G, K, V, n, d, scale, scores, out);
#else
  (void)q, (void)G, (void)K, (void)V, (void)n, (void)d, (void)scale, (void)scores, (void)out;
#endif
}

}  // namespace kvevict_bench_native
