// SimHash (random-hyperplane LSH): sign bits of a seeded Gaussian projection, packed into the
// b-bit codes the Hamming kernels consume.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#include "dispatch.hpp"
#include "hamming.hpp"

namespace kvevict::kernels {

namespace detail {
/// Allocator of 64-byte aligned storage: the AVX-512 SimHash kernel loads a 64-byte row of
/// weights per dim, and a row split over two cache lines costs two loads.
template <class T>
struct Align64Allocator {
  using value_type = T;
  Align64Allocator() noexcept = default;
  template <class U>
  Align64Allocator(const Align64Allocator<U>&) noexcept {}
  T* allocate(std::size_t n) {
    return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{64}));
  }
  void deallocate(T* p, std::size_t) noexcept { ::operator delete(p, std::align_val_t{64}); }
  template <class U>
  bool operator==(const Align64Allocator<U>&) const noexcept { return true; }
};
}  // namespace detail

/// A dim x bits Gaussian projection. hash() maps each dim-float row to a bits-bit code: bit j
/// is set when (x . column j) >= 0 (zero counts as 1; NaN projections give 0), stored in byte
/// j/8, bit j%8 -- the layout hamming_* expect. Columns are drawn in order (column 0 first,
/// rows 0..dim-1 within it), so a wider projection with the same seed and dim extends a
/// narrower one: its first b bits are the narrower code.
class SimHashProjection {
 public:
  /// dim > 0; bits in {8, 16, 32, 64, 128, 256}. Throws std::invalid_argument otherwise.
  SimHashProjection(int dim, int bits, std::uint64_t seed);

  /// Codes for n row-major rows (rows[i*dim + c]); writes n * bits/8 bytes to codes_out.
  KVEVICT_LAZY void hash(const float* rows, std::size_t n, std::uint8_t* codes_out) const;

  /// Code of one dim-float vector; writes bits/8 bytes.
  KVEVICT_LAZY void hash_one(const float* x, std::uint8_t* code_out) const;

  /// hash_one of two vectors: code0 = hash_one(x0), code1 = hash_one(x1), bit for bit. At
  /// AVX-512 with 32 or 64 bits one pass over the weights computes both (HashEvict's query
  /// mode hashes the queries' mean and the incoming key in the same step).
  KVEVICT_LAZY void hash_two(const float* x0, const float* x1, std::uint8_t* code0,
                             std::uint8_t* code1) const;

  /// hash_one by the reference Eigen product (what the FMA path must agree with).
  KVEVICT_LAZY void reference_one(const float* x, std::uint8_t* code_out) const;

  int bits() const noexcept { return bits_; }
  int dim() const noexcept { return dim_; }
  /// The dim x bits projection (column j = hyperplane normal of bit j).
  const Eigen::MatrixXf& matrix() const noexcept { return matrix_; }

 private:
  static constexpr int kMaxBits = 256;  // the widest code check_bits accepts
  /// Widest code for the column-major kernel: at 64 bits bench_kernels measured it no faster
  /// than the row-major one (365-402 ns against 369-402 ns, 2026-12-01), at 16 bits 1.1-1.4x
  /// faster.
  static constexpr int kColsMaxBits = 32;
#if KVEVICT_X86
  /// The FMA projection of one vector (AVX2 + FMA; the caller checks the level): at AVX-512
  /// with 16 bits the blocked zmm kernel (simhash_fma512_b16, any dim), with bits 32 or 64
  /// the row-major zmm kernel (simhash_fma512), else the column-major kernel when
  /// dim % 8 == 0 and bits <= kColsMaxBits, else the row-major one. False: the caller runs
  /// the reference (some projection too near zero for its sign to be certain).
  bool fma_one(const float* x, std::uint8_t* code) const noexcept;
#endif
  void pack_signs(const float* p, std::uint8_t* code) const noexcept {
    for (int b = 0; b < bits_ / 8; ++b) {
      unsigned byte = 0;
      for (int t = 0; t < 8; ++t) byte |= static_cast<unsigned>(p[8 * b + t] >= 0.0f) << t;
      code[b] = static_cast<std::uint8_t>(byte);
    }
  }

  int dim_;
  int bits_;
  Eigen::MatrixXf matrix_;
  std::vector<float, detail::Align64Allocator<float>> wt_;  ///< matrix_ row-major (dim x bits), 64-byte aligned, for the FMA paths
  /// 16 bits: per block of 16 dims the 16 columns' weights in turn (16 floats each, zero past
  /// dim), 64-byte aligned, for the AVX-512 kernel (simhash_fma512_b16)
  std::vector<float, detail::Align64Allocator<float>> wb_;
  std::vector<float> thr_;  ///< per column: 2 gamma |w_j|, the sign-certainty bound / |x|
};

}  // namespace kvevict::kernels

// SimHashProjection's members that compute: the Gaussian draw, the FMA path (AVX2 intrinsics)
// and the reference Eigen product. In separate-kernels mode (config.hpp) they are compiled
// once into the kvevict_kernels library.
#if !KVEVICT_KERNELS_DECLARE_ONLY
#include "../random_engine.hpp"

#if KVEVICT_X86
#include <immintrin.h>
#endif

namespace kvevict::kernels {

namespace detail {

/// Portable N(0,1) stream: std::mt19937_64 (random_engine.hpp's copy, the same sequence) is
/// specified bit-exactly by the standard, and the
/// Box-Muller transform below replaces std::normal_distribution, whose algorithm differs
/// between standard libraries. Results are identical wherever std::log/sqrt/cos/sin agree
/// (IEEE sqrt is exact; glibc's log/cos/sin are correctly rounded in double in practice).
class PortableGaussian {
 public:
  explicit PortableGaussian(std::uint64_t seed) : rng_(seed) {}
  double operator()() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    constexpr double kTwoPi = 6.283185307179586476925286766559;
    const double u1 = static_cast<double>((rng_() >> 11) + 1) * 0x1.0p-53;  // (0, 1]
    const double u2 = static_cast<double>(rng_() >> 11) * 0x1.0p-53;        // [0, 1)
    const double r = std::sqrt(-2.0 * std::log(u1));
    spare_ = r * std::sin(kTwoPi * u2);
    has_spare_ = true;
    return r * std::cos(kTwoPi * u2);
  }

 private:
  kvevict::detail::Mt19937_64 rng_;
  double spare_ = 0.0;
  bool has_spare_ = false;
};

#if KVEVICT_X86
KVEVICT_SUPPRESS_INTRIN_WARNINGS_BEGIN
/// Projections of 8 L outputs (columns base.. of wt, row stride `bits`) into acc[0..L):
/// the dim loop is split into 8 / L independent chains (8 accumulators in all, kept in
/// registers: L is a compile-time constant) so FMA latency is hidden. The order of the
/// additions does not matter for the sign bound.
template <int L>
__attribute__((target("avx2,fma"), always_inline)) inline void simhash_block(
    const float* x, int dim, int bits, const float* w, __m256* out) noexcept {
  constexpr int P = 8 / L;
  __m256 acc[P][L];
  for (int q = 0; q < P; ++q)
    for (int c = 0; c < L; ++c) acc[q][c] = _mm256_setzero_ps();
  const auto stride = static_cast<std::size_t>(bits);
  int k = 0;
  for (; k + P <= dim; k += P)
    for (int q = 0; q < P; ++q) {
      const __m256 xb = _mm256_set1_ps(x[k + q]);
      const float* wq = w + static_cast<std::size_t>(k + q) * stride;
      for (int c = 0; c < L; ++c) acc[q][c] = _mm256_fmadd_ps(xb, _mm256_loadu_ps(wq + 8 * c), acc[q][c]);
    }
  for (; k < dim; ++k) {
    const __m256 xb = _mm256_set1_ps(x[k]);
    const float* wq = w + static_cast<std::size_t>(k) * stride;
    for (int c = 0; c < L; ++c) acc[0][c] = _mm256_fmadd_ps(xb, _mm256_loadu_ps(wq + 8 * c), acc[0][c]);
  }
  for (int c = 0; c < L; ++c) {
    __m256 s = acc[0][c];
    for (int q = 1; q < P; ++q) s = _mm256_add_ps(s, acc[q][c]);
    out[c] = s;
  }
}

/// Sign code of one vector by FMA: out byte b bit t = (x . column 8b+t >= 0), computed from
/// wt (dim x bits, row-major). Returns false, leaving the code unspecified, when some
/// projection is within its rounding bound thr[j] * |x| of zero (or not finite): there the
/// sign could differ from the reference product's, and the caller recomputes.
__attribute__((target("avx2,fma"))) inline bool simhash_fma(const float* x, int dim, int bits,
                                                             const float* wt, const float* thr,
                                                             std::uint8_t* code) noexcept {
  __m256 sq = _mm256_setzero_ps();
  int i = 0;
  for (; i + 8 <= dim; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    sq = _mm256_fmadd_ps(v, v, sq);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, sq);
  float norm2 = 0.0f;
  for (float l : lanes) norm2 += l;
  for (; i < dim; ++i) norm2 += x[i] * x[i];
  // Tiny (or non-finite) vectors: underflow breaks the relative bound; use the reference.
  if (!(norm2 >= 0x1p-100f) || !(norm2 <= 0x1p+100f)) return false;
  const __m256 xn = _mm256_set1_ps(std::sqrt(norm2));
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int base = 0; base < bits; base += 64) {
    const int lanes8 = std::min(64, bits - base) / 8;  // 1, 2, 4 or 8 registers of 8 outputs
    __m256 acc[8];
    const float* w = wt + base;
    switch (lanes8) {
      case 1: simhash_block<1>(x, dim, bits, w, acc); break;
      case 2: simhash_block<2>(x, dim, bits, w, acc); break;
      case 4: simhash_block<4>(x, dim, bits, w, acc); break;
      default: simhash_block<8>(x, dim, bits, w, acc); break;
    }
    for (int c = 0; c < lanes8; ++c) {
      const __m256 bound = _mm256_mul_ps(_mm256_loadu_ps(thr + base + 8 * c), xn);
      // clear of the bound (false for NaN): the sign is the exact product's sign
      const __m256 safe = _mm256_cmp_ps(_mm256_and_ps(acc[c], abs_mask), bound, _CMP_GT_OQ);
      if (_mm256_movemask_ps(safe) != 0xFF) return false;
      const __m256 ge = _mm256_cmp_ps(acc[c], _mm256_setzero_ps(), _CMP_GE_OQ);
      code[(base >> 3) + c] = static_cast<std::uint8_t>(_mm256_movemask_ps(ge));
    }
  }
  return true;
}

#define KVEVICT_TARGET_AVX2_FMA_LAMBDA __attribute__((target("avx2,fma"), always_inline))
/// 8 columns' dot products with x (dim % 8 == 0) into acc[0..8) (8 lanes each, unreduced),
/// and (First) x's squares into *sq.
template <bool First>
__attribute__((target("avx2,fma"), always_inline)) inline void simhash_cols8(
    const float* x, std::size_t d, const float* w, __m256* acc, __m256* sq) noexcept {
  const float* w0 = w;
  const float* w1 = w0 + d;
  const float* w2 = w1 + d;
  const float* w3 = w2 + d;
  const float* w4 = w3 + d;
  const float* w5 = w4 + d;
  const float* w6 = w5 + d;
  const float* w7 = w6 + d;
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  __m256 q = a0;
  for (std::size_t i = 0; i < d; i += 8) {
    const __m256 xb = _mm256_loadu_ps(x + i);
    if constexpr (First) q = _mm256_fmadd_ps(xb, xb, q);
    a0 = _mm256_fmadd_ps(xb, _mm256_loadu_ps(w0 + i), a0);
    a1 = _mm256_fmadd_ps(xb, _mm256_loadu_ps(w1 + i), a1);
    a2 = _mm256_fmadd_ps(xb, _mm256_loadu_ps(w2 + i), a2);
    a3 = _mm256_fmadd_ps(xb, _mm256_loadu_ps(w3 + i), a3);
    a4 = _mm256_fmadd_ps(xb, _mm256_loadu_ps(w4 + i), a4);
    a5 = _mm256_fmadd_ps(xb, _mm256_loadu_ps(w5 + i), a5);
    a6 = _mm256_fmadd_ps(xb, _mm256_loadu_ps(w6 + i), a6);
    a7 = _mm256_fmadd_ps(xb, _mm256_loadu_ps(w7 + i), a7);
  }
  acc[0] = a0, acc[1] = a1, acc[2] = a2, acc[3] = a3;
  acc[4] = a4, acc[5] = a5, acc[6] = a6, acc[7] = a7;
  if constexpr (First) *sq = q;
}

/// simhash_fma for dim % 8 == 0, from the column-major matrix (column j = the dim weights of
/// bit j, contiguous): per 8 output bits, one pass over x with 8 accumulators (x loaded once
/// per 8 dims and reused by the 8 columns, where the row-major form loads a broadcast per
/// dim), the 8 sums reduced by a horizontal-add tree straight into lane order, so one compare
/// and movemask give the code byte. The norm is summed in the first pass. Same contract and
/// the same bound as simhash_fma (any order of the products and sums is within it), so the
/// codes it returns are the ones simhash_fma returns.
__attribute__((target("avx2,fma"))) inline bool simhash_fma_cols(const float* x, int dim,
                                                                  int bits, const float* wc,
                                                                  const float* thr,
                                                                  std::uint8_t* code) noexcept {
  const auto d = static_cast<std::size_t>(dim);
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 xn = _mm256_setzero_ps();
  // The code bytes of 8 sums in lane order; false when one is within its bound of zero.
  auto byte_of = [&](const __m256* acc, int base) KVEVICT_TARGET_AVX2_FMA_LAMBDA {
    const __m256 t0 = _mm256_hadd_ps(acc[0], acc[1]), t1 = _mm256_hadd_ps(acc[2], acc[3]);
    const __m256 t2 = _mm256_hadd_ps(acc[4], acc[5]), t3 = _mm256_hadd_ps(acc[6], acc[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    // u0 = (s0..s3 over the low 4 dims of each 8 | s0..s3 over the high 4), u1 likewise s4..s7
    const __m256 sum = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                                     _mm256_permute2f128_ps(u0, u1, 0x31));
    const __m256 bound = _mm256_mul_ps(_mm256_loadu_ps(thr + base), xn);
    const __m256 safe = _mm256_cmp_ps(_mm256_and_ps(sum, abs_mask), bound, _CMP_GT_OQ);
    code[base >> 3] = static_cast<std::uint8_t>(
        _mm256_movemask_ps(_mm256_cmp_ps(sum, _mm256_setzero_ps(), _CMP_GE_OQ)));
    return _mm256_movemask_ps(safe) == 0xFF;
  };
  auto set_norm = [&](__m256 sq) KVEVICT_TARGET_AVX2_FMA_LAMBDA {
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(sq), _mm256_extractf128_ps(sq, 1));
    const __m128 h2 = _mm_add_ps(h, _mm_movehl_ps(h, h));
    const float norm2 = _mm_cvtss_f32(_mm_add_ss(h2, _mm_movehdup_ps(h2)));
    // Tiny (or non-finite) vectors: underflow breaks the relative bound; use the reference.
    if (!(norm2 >= 0x1p-100f) || !(norm2 <= 0x1p+100f)) return false;
    xn = _mm256_set1_ps(std::sqrt(norm2));
    return true;
  };
  __m256 acc[8], sq;
  int base = 0;
  for (; base < bits; base += 8) {
    const float* w = wc + static_cast<std::size_t>(base) * d;
    if (base == 0) {
      simhash_cols8<true>(x, d, w, acc, &sq);
      if (!set_norm(sq)) return false;
    } else {
      simhash_cols8<false>(x, d, w, acc, nullptr);
    }
    if (!byte_of(acc, base)) return false;
  }
  return true;
}
#undef KVEVICT_TARGET_AVX2_FMA_LAMBDA

/// simhash_fma for bits = 16 B (B = 1, 2, 4; hash_one uses it for 32 and 64) at AVX-512, of
/// NV vectors xs[0..NV) into codes[0..NV), from the row-major matrix wt: row i of wt is B zmm
/// vectors of weights (bit j in lane j % 16 of vector j / 16), so each dim is one broadcast
/// of x[i] per vector and B FMAs per vector into 16-lane accumulators that hold the
/// projections in bit order: no horizontal reduction of the projections, and one compare
/// per 16 bits gives two code bytes as a mask. Each weight row is loaded once for the NV
/// vectors (hash_two: the weights, 8 KiB per 16 bits at dim 128, come from L2 in a decode
/// step, and one pass serves two codes). max(1, 8 / (B NV)) partial sums per accumulator
/// (dims i mod P) keep 8 or more FMA chains in flight. Same contract and bound as
/// simhash_fma, per vector (any order of the products and sums is within it), so the codes
/// it returns are the ones simhash_fma returns; false when any vector needs the reference.
template <int B, int NV = 1>
__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma"))) inline bool simhash_fma512(
    const float* const* xs, std::size_t d, const float* wt, const float* thr,
    std::uint8_t* const* codes) noexcept {
  constexpr int P = 8 / (B * NV) > 0 ? 8 / (B * NV) : 1;
  constexpr std::size_t bits = 16 * B;
  const float* x[NV];
  __m512 xn[NV];
  for (int v = 0; v < NV; ++v) {
    x[v] = xs[v];
    // The norm first: its reduction and square root overlap the projection's FMA stream.
    __m512 q = _mm512_setzero_ps();
    for (std::size_t j = 0; j < d; j += 16) {
      const __mmask16 m = d - j >= 16 ? __mmask16{0xFFFF}
                                      : static_cast<__mmask16>((1u << (d - j)) - 1u);
      const __m512 xv = _mm512_maskz_loadu_ps(m, x[v] + j);
      q = _mm512_fmadd_ps(xv, xv, q);
    }
    const float norm2 = _mm512_reduce_add_ps(q);
    // Tiny (or non-finite) vectors: underflow breaks the relative bound; use the reference.
    if (!(norm2 >= 0x1p-100f) || !(norm2 <= 0x1p+100f)) return false;
    xn[v] = _mm512_set1_ps(std::sqrt(norm2));
  }
  __m512 acc[NV][P][B];
  for (int v = 0; v < NV; ++v)
    for (int p = 0; p < P; ++p)
      for (int b = 0; b < B; ++b) acc[v][p][b] = _mm512_setzero_ps();
  std::size_t i = 0;
  for (; i + P <= d; i += P)
    for (int p = 0; p < P; ++p) {
      const float* w = wt + (i + static_cast<std::size_t>(p)) * bits;
      for (int v = 0; v < NV; ++v) {
        const __m512 xb = _mm512_set1_ps(x[v][i + static_cast<std::size_t>(p)]);
        for (int b = 0; b < B; ++b)
          acc[v][p][b] = _mm512_fmadd_ps(xb, _mm512_loadu_ps(w + 16 * b), acc[v][p][b]);
      }
    }
  for (; i < d; ++i)
    for (int v = 0; v < NV; ++v) {
      const __m512 xb = _mm512_set1_ps(x[v][i]);
      for (int b = 0; b < B; ++b)
        acc[v][0][b] = _mm512_fmadd_ps(xb, _mm512_loadu_ps(wt + i * bits + 16 * b), acc[v][0][b]);
    }
  for (int v = 0; v < NV; ++v)
    for (int b = 0; b < B; ++b) {
      for (int h = P / 2; h >= 1; h /= 2)  // pairwise: log2(P) dependent adds
        for (int p = 0; p < h; ++p) acc[v][p][b] = _mm512_add_ps(acc[v][p][b], acc[v][p + h][b]);
      const __m512 s = acc[v][0][b];
      const __m512 bound = _mm512_mul_ps(_mm512_loadu_ps(thr + 16 * b), xn[v]);
      if (_mm512_cmp_ps_mask(_mm512_abs_ps(s), bound, _CMP_GT_OQ) != 0xFFFF) return false;
      const auto m = static_cast<unsigned>(_mm512_cmp_ps_mask(s, _mm512_setzero_ps(), _CMP_GE_OQ));
      codes[v][2 * b] = static_cast<std::uint8_t>(m);
      codes[v][2 * b + 1] = static_cast<std::uint8_t>(m >> 8);
    }
  return true;
}

/// One level of simhash_fma512_b16's reduction: a and b seen as pairs of S-lane halves
/// (each 2 S lanes aligned); the result holds a's pair sums in the lower half of each pair
/// and b's in the upper (a blend, a swap of the halves, an add). After S = 1, 2, 4, 8 on 16
/// accumulators, lane l holds the sum of accumulator l's lanes.
template <int S>
__attribute__((target("avx512f"), always_inline)) inline __m512 simhash_fold(__m512 a,
                                                                             __m512 b) noexcept {
  constexpr __mmask16 hi = S == 1 ? 0xAAAA : S == 2 ? 0xCCCC : S == 4 ? 0xF0F0 : 0xFF00;
  const __m512 lo_a = _mm512_mask_blend_ps(hi, a, b);  // a in the lower halves, b in the upper
  const __m512 rest = _mm512_mask_blend_ps(hi, b, a);  // the other half of each pair
  __m512 swapped;
  if constexpr (S == 1)
    swapped = _mm512_permute_ps(rest, _MM_SHUFFLE(2, 3, 0, 1));
  else if constexpr (S == 2)
    swapped = _mm512_permute_ps(rest, _MM_SHUFFLE(1, 0, 3, 2));
  else if constexpr (S == 4)
    swapped = _mm512_shuffle_f32x4(rest, rest, _MM_SHUFFLE(2, 3, 0, 1));
  else
    swapped = _mm512_shuffle_f32x4(rest, rest, _MM_SHUFFLE(1, 0, 3, 2));
  return _mm512_add_ps(lo_a, swapped);
}

/// simhash_fma for 16 bits at AVX-512, from the blocked copy wb (SimHashProjection::wb_: per
/// 16 dims, the 16 columns' 16 weights in turn, column j at offset 16 j; zero past dim): per
/// block one (masked) load of x, its square into the norm and 16 FMAs with the weights as
/// memory operands at fixed offsets from one pointer, into 16 independent accumulators
/// (chains of dim / 16 FMAs); then the 16 accumulators folded into one vector in bit order
/// by four levels of simhash_fold (15 shuffles in all), one compare mask giving
/// both code bytes. Same contract and bound as simhash_fma (any order of the products and
/// sums is within it), so the codes it returns are the reference's.
__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma"))) inline bool simhash_fma512_b16(
    const float* x, std::size_t d, const float* wb, const float* thr,
    std::uint8_t* code) noexcept {
  __m512 q = _mm512_setzero_ps();
  __m512 a0 = q, a1 = q, a2 = q, a3 = q, a4 = q, a5 = q, a6 = q, a7 = q;
  __m512 a8 = q, a9 = q, a10 = q, a11 = q, a12 = q, a13 = q, a14 = q, a15 = q;
  for (std::size_t c = 0; c < d; c += 16, wb += 256) {
    const __mmask16 m = d - c >= 16 ? __mmask16{0xFFFF}
                                    : static_cast<__mmask16>((1u << (d - c)) - 1u);
    const __m512 xv = _mm512_maskz_loadu_ps(m, x + c);
    q = _mm512_fmadd_ps(xv, xv, q);
    a0 = _mm512_fmadd_ps(xv, _mm512_load_ps(wb), a0);
    a1 = _mm512_fmadd_ps(xv, _mm512_load_ps(wb + 16), a1);
    a2 = _mm512_fmadd_ps(xv, _mm512_load_ps(wb + 32), a2);
    a3 = _mm512_fmadd_ps(xv, _mm512_load_ps(wb + 48), a3);
    a4 = _mm512_fmadd_ps(xv, _mm512_load_ps(wb + 64), a4);
    a5 = _mm512_fmadd_ps(xv, _mm512_load_ps(wb + 80), a5);
    a6 = _mm512_fmadd_ps(xv, _mm512_load_ps(wb + 96), a6);
    a7 = _mm512_fmadd_ps(xv, _mm512_load_ps(wb + 112), a7);
    a8 = _mm512_fmadd_ps(xv, _mm512_load_ps(wb + 128), a8);
    a9 = _mm512_fmadd_ps(xv, _mm512_load_ps(wb + 144), a9);
    a10 = _mm512_fmadd_ps(xv, _mm512_load_ps(wb + 160), a10);
    a11 = _mm512_fmadd_ps(xv, _mm512_load_ps(wb + 176), a11);
    a12 = _mm512_fmadd_ps(xv, _mm512_load_ps(wb + 192), a12);
    a13 = _mm512_fmadd_ps(xv, _mm512_load_ps(wb + 208), a13);
    a14 = _mm512_fmadd_ps(xv, _mm512_load_ps(wb + 224), a14);
    a15 = _mm512_fmadd_ps(xv, _mm512_load_ps(wb + 240), a15);
  }
  const float norm2 = _mm512_reduce_add_ps(q);
  // Tiny (or non-finite) vectors: underflow breaks the relative bound; use the reference.
  if (!(norm2 >= 0x1p-100f) || !(norm2 <= 0x1p+100f)) return false;
  const __m512 t0 = simhash_fold<1>(a0, a1), t1 = simhash_fold<1>(a2, a3);
  const __m512 t2 = simhash_fold<1>(a4, a5), t3 = simhash_fold<1>(a6, a7);
  const __m512 t4 = simhash_fold<1>(a8, a9), t5 = simhash_fold<1>(a10, a11);
  const __m512 t6 = simhash_fold<1>(a12, a13), t7 = simhash_fold<1>(a14, a15);
  const __m512 r0 = simhash_fold<2>(t0, t1), r1 = simhash_fold<2>(t2, t3);
  const __m512 r2 = simhash_fold<2>(t4, t5), r3 = simhash_fold<2>(t6, t7);
  const __m512 s = simhash_fold<8>(simhash_fold<4>(r0, r1), simhash_fold<4>(r2, r3));
  const __m512 bound = _mm512_mul_ps(_mm512_loadu_ps(thr), _mm512_set1_ps(std::sqrt(norm2)));
  if (_mm512_cmp_ps_mask(_mm512_abs_ps(s), bound, _CMP_GT_OQ) != 0xFFFF) return false;
  const auto m = static_cast<unsigned>(_mm512_cmp_ps_mask(s, _mm512_setzero_ps(), _CMP_GE_OQ));
  code[0] = static_cast<std::uint8_t>(m);
  code[1] = static_cast<std::uint8_t>(m >> 8);
  return true;
}
KVEVICT_SUPPRESS_INTRIN_WARNINGS_END
#endif

}  // namespace detail

KVEVICT_KERNEL_FN SimHashProjection::SimHashProjection(int dim, int bits, std::uint64_t seed)
    : dim_(dim), bits_(bits) {
  if (dim <= 0)
    throw std::invalid_argument("kvevict::kernels::SimHashProjection: dim = " +
                                std::to_string(dim) + " (expected dim > 0)");
  detail::check_bits(bits);
  matrix_.resize(dim, bits);
  detail::PortableGaussian g(seed);
  for (int j = 0; j < bits; ++j)
    for (int i = 0; i < dim; ++i) matrix_(i, j) = static_cast<float>(g());
  // The FMA path's copy (row-major) and per-column rounding bounds: any order of the dim
  // products and sums (the reference Eigen product included) is within
  // gamma * sum |x_i w_ij| <= gamma * |x| |w_j| of the exact value, gamma = dim u / (1 - dim u)
  // with u = 2^-24. A projection farther than twice that from zero (the FMA error plus the
  // reference's) has the exact sign in both; nearer, hash_one recomputes by the reference.
  wt_.resize(static_cast<std::size_t>(dim) * static_cast<std::size_t>(bits));
  thr_.resize(static_cast<std::size_t>(bits));
  const double u = 0x1.0p-24, n = dim + 4.0;  // + 4: the norm's own rounding
  const double gamma = n * u / (1.0 - n * u);
  for (int j = 0; j < bits; ++j) {
    double norm2 = 0.0;
    for (int i = 0; i < dim; ++i) {
      const float w = matrix_(i, j);
      wt_[static_cast<std::size_t>(i) * static_cast<std::size_t>(bits) + static_cast<std::size_t>(j)] = w;
      norm2 += static_cast<double>(w) * w;
    }
    thr_[static_cast<std::size_t>(j)] = static_cast<float>(2.0 * gamma * std::sqrt(norm2) * 1.01);
  }
  if (bits == 16) {
    const std::size_t blocks = (static_cast<std::size_t>(dim) + 15) / 16;
    wb_.assign(blocks * 256, 0.0f);
    for (int i = 0; i < dim; ++i)
      for (int j = 0; j < 16; ++j)
        wb_[static_cast<std::size_t>(i / 16) * 256 + static_cast<std::size_t>(j) * 16 +
            static_cast<std::size_t>(i % 16)] = matrix_(i, j);
  }
}

#if KVEVICT_X86
KVEVICT_KERNEL_FN bool SimHashProjection::fma_one(const float* x, std::uint8_t* code) const noexcept {
  if (!wb_.empty() && active_isa() == Isa::avx512)
    return detail::simhash_fma512_b16(x, static_cast<std::size_t>(dim_), wb_.data(),
                                      thr_.data(), code);
  // Other 16-bit shapes stay on the AVX2 kernels: the row-major zmm one measured no faster
  // there (54 against 49 ns in one run, 75 against 91 in another); 2.4x at 64 bits.
  if ((bits_ == 32 || bits_ == 64) && active_isa() == Isa::avx512) {
    const auto d = static_cast<std::size_t>(dim_);
    return bits_ == 32 ? detail::simhash_fma512<2>(&x, d, wt_.data(), thr_.data(), &code)
                       : detail::simhash_fma512<4>(&x, d, wt_.data(), thr_.data(), &code);
  }
  return dim_ % 8 == 0 && bits_ <= kColsMaxBits
             ? detail::simhash_fma_cols(x, dim_, bits_, matrix_.data(), thr_.data(), code)
             : detail::simhash_fma(x, dim_, bits_, wt_.data(), thr_.data(), code);
}
#endif

KVEVICT_LAZY_DEF KVEVICT_KERNEL_FN void SimHashProjection::hash(const float* rows, std::size_t n,
                                               std::uint8_t* codes_out) const {
  detail::require_nonnull(rows, n, "rows");
  detail::require_nonnull(codes_out, n, "codes_out");
#if KVEVICT_X86
  // A few rows (a group's queries): the FMA path per row; if any projection is too near
  // zero, the whole call runs the reference product below (identical codes either way).
  if (n <= 16 && active_isa() != Isa::scalar) {
    bool ok = true;
    for (std::size_t i = 0; i < n && ok; ++i)
      ok = fma_one(rows + i * static_cast<std::size_t>(dim_),
                   codes_out + i * static_cast<std::size_t>(bits_ / 8));
    if (ok) return;
  }
#endif
  using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  constexpr std::size_t kChunk = 256;  // bounds the temporary to kChunk x bits floats
  RowMat proj;
  const std::size_t bytes = static_cast<std::size_t>(bits_) / 8;
  for (std::size_t base = 0; base < n; base += kChunk) {
    const auto m = static_cast<Eigen::Index>(std::min(kChunk, n - base));
    Eigen::Map<const RowMat> x(rows + base * static_cast<std::size_t>(dim_), m, dim_);
    proj.noalias() = x * matrix_;
    for (Eigen::Index i = 0; i < m; ++i)
      pack_signs(proj.data() + i * bits_, codes_out + (base + static_cast<std::size_t>(i)) * bytes);
  }
}

KVEVICT_LAZY_DEF KVEVICT_KERNEL_FN void SimHashProjection::hash_one(const float* x, std::uint8_t* code_out) const {
  if (x == nullptr || code_out == nullptr)
    throw std::invalid_argument("kvevict::kernels::SimHashProjection::hash_one: null pointer");
#if KVEVICT_X86
  // Dispatched FMA projection; falls back to the reference product below only when a
  // projection is too near zero for its sign to be certain (identical codes either way).
  if (active_isa() != Isa::scalar && fma_one(x, code_out)) return;
#endif
  reference_one(x, code_out);
}

KVEVICT_LAZY_DEF KVEVICT_KERNEL_FN void SimHashProjection::hash_two(const float* x0,
                                                                   const float* x1,
                                                                   std::uint8_t* code0,
                                                                   std::uint8_t* code1) const {
  if (x0 == nullptr || x1 == nullptr || code0 == nullptr || code1 == nullptr)
    throw std::invalid_argument("kvevict::kernels::SimHashProjection::hash_two: null pointer");
#if KVEVICT_X86
  if ((bits_ == 32 || bits_ == 64) && active_isa() == Isa::avx512) {
    const float* xs[2] = {x0, x1};
    std::uint8_t* codes[2] = {code0, code1};
    const auto d = static_cast<std::size_t>(dim_);
    // False (a projection too near zero, or a tiny vector): both codes by hash_one below.
    if (bits_ == 32 ? detail::simhash_fma512<2, 2>(xs, d, wt_.data(), thr_.data(), codes)
                    : detail::simhash_fma512<4, 2>(xs, d, wt_.data(), thr_.data(), codes))
      return;
  }
#endif
  hash_one(x0, code0);
  hash_one(x1, code1);
}

KVEVICT_LAZY_DEF KVEVICT_KERNEL_FN void SimHashProjection::reference_one(const float* x,
                                                        std::uint8_t* code_out) const {
  Eigen::Map<const Eigen::RowVectorXf> v(x, dim_);
  // bits <= 256: the projection fits a stack buffer, so hashing allocates nothing.
  Eigen::Matrix<float, 1, Eigen::Dynamic, Eigen::RowMajor, 1, kMaxBits> p;
  p.noalias() = v * matrix_;
  pack_signs(p.data(), code_out);
}

}  // namespace kvevict::kernels

#endif  // !KVEVICT_KERNELS_DECLARE_ONLY
