// Decode attention for the G query heads of one KV head (one step): fused q.K^T -> softmax ->
// p.V over fp32 / fp16 / bf16 rows, runtime-dispatched (scalar, AVX2+FMA+F16C, AVX-512).
//
//   attention_probs(q, q_stride, G, keys, k_stride, fmt, n, d, scale, probs)
//       probs[g * n + i] = softmax_i(scale * q_g . k_i); returns false (probs unspecified)
//       when a score is infinite or NaN.
//   attention_output(probs, G, values, v_stride, fmt, n, d, out, out_stride)
//       out[g * out_stride + j] = sum_i probs[g * n + i] * v_i[j].
//   decode_attention(...) = both.
//   attention_probs_paged_as<F>(q, q_stride, G, keys, k_stride, table, n, d, scale, probs),
//   attention_output_paged_as<F>(probs, G, values, v_stride, table, n, d, out, out_stride)
//       the same over rows held in blocks (a paged pool): row i of the head at
//       keys + table.blocks[i / table.block_rows] * table.block_stride
//          + (i % table.block_rows) * k_stride   (elements)
//       read in place. Rows of blocks that lie back to back in memory are one run; the
//       results equal the dense kernels' on the same rows copied into one array, bit for
//       bit (every score is one row's; the softmax is over the whole array; p.V adds the
//       rows in table order whatever the runs). A dense array is one block.
//   attention_probs_as<F>(...), attention_output_as<F>(...): the same with the format a
//       template argument (a typed caller compiles one format's kernels, not three).
//
// Strides are in elements. Every K/V row is read once for all G heads; fp16/bf16 rows are
// widened in registers; nothing is allocated. kvevict::decode_attention (attention.hpp) is
// the checked, typed front end; these are the raw kernels.
#pragma once

#include <cstddef>
#include <cstdint>

#include "attention_scalar.hpp"
#include "dispatch.hpp"

namespace kvevict::kernels {
/// Where a head's rows live in a block pool (see the file comment): blocks[b] is the pool
/// index of the head's b-th block, block_rows rows per block (the last block may hold
/// fewer), block_stride elements from pool block j to block j + 1. Unchecked here:
/// kvevict::decode_attention_paged (attention.hpp) is the checked front end.
struct BlockTable {
  const std::uint32_t* blocks = nullptr;
  std::size_t block_rows = 0;
  std::size_t block_stride = 0;
};

// The entry points, declared here and defined below (in separate-kernels mode, config.hpp,
// the definitions are compiled once into the kvevict_kernels library).
KVEVICT_KERNEL_FN Isa attention_isa();
template <Isa I>
KVEVICT_KERNEL_FN bool attention_probs(const float* q, std::size_t q_stride, std::size_t group,
                                       const void* keys, std::size_t k_stride, KvFormat fmt,
                                       std::size_t n, std::size_t d, float scale, float* probs);
template <Isa I>
KVEVICT_KERNEL_FN void attention_output(const float* probs, std::size_t group, const void* values,
                                        std::size_t v_stride, KvFormat fmt, std::size_t n,
                                        std::size_t d, float* out, std::size_t out_stride);
// The untemplated forms (format at run time) are KVEVICT_LAZY (config.hpp): header-only, a
// translation unit that does not call them compiles none of their nine kernel variants.
KVEVICT_LAZY KVEVICT_KERNEL_FN bool attention_probs(const float* q, std::size_t q_stride,
                                                    std::size_t group, const void* keys,
                                                    std::size_t k_stride, KvFormat fmt,
                                                    std::size_t n, std::size_t d, float scale,
                                                    float* probs);
KVEVICT_LAZY KVEVICT_KERNEL_FN void attention_output(const float* probs, std::size_t group,
                                                     const void* values, std::size_t v_stride,
                                                     KvFormat fmt, std::size_t n, std::size_t d,
                                                     float* out, std::size_t out_stride);
// Format-pinned forms (attention_isa() decided per call, the format a template argument):
// what a typed caller (KVCache<Policy, Scalar>, decode_attention<Scalar>) uses, so that a
// translation unit compiles the kernels of its own storage format only, not all three.
template <KvFormat F>
KVEVICT_KERNEL_FN bool attention_probs_as(const float* q, std::size_t q_stride, std::size_t group,
                                          const void* keys, std::size_t k_stride, std::size_t n,
                                          std::size_t d, float scale, float* probs);
template <KvFormat F>
KVEVICT_KERNEL_FN void attention_output_as(const float* probs, std::size_t group,
                                           const void* values, std::size_t v_stride,
                                           std::size_t n, std::size_t d, float* out,
                                           std::size_t out_stride);
template <KvFormat F>
KVEVICT_KERNEL_FN bool attention_probs_paged_as(const float* q, std::size_t q_stride,
                                                std::size_t group, const void* keys,
                                                std::size_t k_stride, BlockTable table,
                                                std::size_t n, std::size_t d, float scale,
                                                float* probs);
template <KvFormat F>
KVEVICT_KERNEL_FN void attention_output_paged_as(const float* probs, std::size_t group,
                                                 const void* values, std::size_t v_stride,
                                                 BlockTable table, std::size_t n, std::size_t d,
                                                 float* out, std::size_t out_stride);

// The walk over a block table's runs: no intrinsics, so also declared in separate-kernels
// mode (attention_quant.hpp, which such a translation unit may include, walks it too).
namespace detail {

/// fn(first row, element offset of the run's first row, rows, the next run's element
/// offset, its rows (0 after the last run)) for the rows [0, n) of a block table, as
/// maximal runs of rows that lie back to back in memory (consecutive pool blocks when
/// block_stride is block_rows x row_stride).
template <class Fn>
inline void for_each_run(const BlockTable& t, std::size_t row_stride, std::size_t n,
                         Fn&& fn) noexcept {
  if (n == 0) return;
  const bool packed = t.block_stride == t.block_rows * row_stride;
  // The run starting at row i, block b: its rows, and the block after it.
  auto run = [&](std::size_t i, std::size_t b, std::size_t& rows) {
    rows = n - i < t.block_rows ? n - i : t.block_rows;
    std::size_t e = b + 1;
    if (packed)
      for (; i + rows < n && t.blocks[e] == t.blocks[e - 1] + 1; ++e)
        rows += n - i - rows < t.block_rows ? n - i - rows : t.block_rows;
    return e;
  };
  std::size_t i = 0, b = 0, rows = 0;
  std::size_t e = run(i, b, rows);
  while (i < n) {
    std::size_t next_rows = 0, next_e = e;
    if (i + rows < n) next_e = run(i + rows, e, next_rows);
    fn(i, static_cast<std::size_t>(t.blocks[b]) * t.block_stride, rows,
       next_rows ? static_cast<std::size_t>(t.blocks[e]) * t.block_stride : 0, next_rows);
    i += rows;
    b = e;
    e = next_e;
    rows = next_rows;
  }
}

/// Prefetches the first `rows` rows (up to 64) of the next run into the cache: a pool's
/// blocks are scattered, and the hardware prefetcher restarts at every block. Rows of
/// `bytes` bytes, `step` bytes apart, from p.
inline void prefetch_run(const void* p, std::size_t rows, std::size_t step,
                         std::size_t bytes) noexcept {
  const char* c = static_cast<const char*>(p);
  if (rows > 64) rows = 64;
  for (std::size_t r = 0; r < rows; ++r, c += step)
    for (std::size_t o = 0; o < bytes; o += 64) __builtin_prefetch(c + o);
}

/// A dense array of n rows: one block.
struct DenseTable {
  std::uint32_t zero = 0;
  BlockTable table;
  explicit DenseTable(std::size_t n) noexcept : table{&zero, n, 0} {}
};

}  // namespace detail
}  // namespace kvevict::kernels

#if !KVEVICT_KERNELS_DECLARE_ONLY
#include "attention_avx2.hpp"
#include "attention_avx512.hpp"

namespace kvevict::kernels {
namespace detail {

#if KVEVICT_X86
/// FMA and F16C (CPUID leaf 1, ECX bits 12 and 29): the SIMD attention levels need both.
inline bool cpu_has_fma_f16c() noexcept {
  static const bool ok = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return false;
    return ((c >> 12) & 1) != 0 && ((c >> 29) & 1) != 0;
  }();
  return ok;
}
#endif

/// require_isa, plus FMA and F16C for the SIMD levels.
inline void require_attention_isa(Isa isa) {
  require_isa(isa);
#if KVEVICT_X86
  if (isa != Isa::scalar && !cpu_has_fma_f16c())
    throw std::invalid_argument(std::string("kvevict::kernels: attention at ISA level ") +
                                isa_name(isa) + " needs FMA and F16C, which this CPU lacks");
#endif
}

/// prefetch_run of rows of d elements of format F, row_stride elements apart, the first at
/// element `offset` of base.
template <KvFormat F>
inline void prefetch_rows(const void* base, std::size_t offset, std::size_t rows,
                          std::size_t row_stride, std::size_t d) noexcept {
  prefetch_run(static_cast<const char*>(base) + offset * kv_format_bytes(F), rows,
               row_stride * kv_format_bytes(F), d * kv_format_bytes(F));
}

template <KvFormat F>
inline const void* element_at(const void* rows, std::size_t offset) noexcept {
  return static_cast<const char*>(rows) + offset * kv_format_bytes(F);
}

template <Isa I, KvFormat F>
inline bool attention_probs_at(const float* q, std::size_t q_stride, std::size_t group,
                               const void* keys, std::size_t k_stride, const BlockTable& t,
                               std::size_t n, std::size_t d, float scale, float* probs) noexcept {
  for_each_run(t, k_stride, n, [&](std::size_t i, std::size_t offset, std::size_t rows,
                                   std::size_t next, std::size_t next_rows) {
    prefetch_rows<F>(keys, next, next_rows, k_stride, d);
    const void* k = element_at<F>(keys, offset);
#if KVEVICT_X86
    if constexpr (I == Isa::avx512)
      return attn_avx512::score_rows<F>(q, q_stride, group, k, k_stride, rows, d, scale, probs + i, n);
    if constexpr (I == Isa::avx2)
      return attn_avx2::score_rows<F>(q, q_stride, group, k, k_stride, rows, d, scale, probs + i, n);
#endif
    scalar::score_rows<F>(q, q_stride, group, k, k_stride, rows, d, scale, probs + i, n);
  });
#if KVEVICT_X86
  if constexpr (I == Isa::avx512) return attn_avx512::softmax_rows(probs, group, n);
  if constexpr (I == Isa::avx2) return attn_avx2::softmax_rows(probs, group, n);
#endif
  return scalar::softmax_rows(probs, group, n);
}

template <Isa I, KvFormat F>
inline void attention_output_at(const float* probs, std::size_t group, const void* values,
                                std::size_t v_stride, const BlockTable& t, std::size_t n,
                                std::size_t d, float* out, std::size_t out_stride) noexcept {
  for (std::size_t g = 0; g < group; ++g)
    for (std::size_t j = 0; j < d; ++j) out[g * out_stride + j] = 0.0f;
  for_each_run(t, v_stride, n, [&](std::size_t i, std::size_t offset, std::size_t rows,
                                   std::size_t next, std::size_t next_rows) {
    prefetch_rows<F>(values, next, next_rows, v_stride, d);
    const void* v = element_at<F>(values, offset);
#if KVEVICT_X86
    if constexpr (I == Isa::avx512)
      return attn_avx512::accumulate_rows<F>(probs + i, n, group, v, v_stride, rows, d, out, out_stride);
    if constexpr (I == Isa::avx2)
      return attn_avx2::accumulate_rows<F>(probs + i, n, group, v, v_stride, rows, d, out, out_stride);
#endif
    scalar::accumulate_rows<F>(probs + i, n, group, v, v_stride, rows, d, out, out_stride);
  });
}

template <Isa I, KvFormat F>
inline bool attention_probs_at(const float* q, std::size_t q_stride, std::size_t group,
                               const void* keys, std::size_t k_stride, std::size_t n,
                               std::size_t d, float scale, float* probs) noexcept {
  const DenseTable dense(n);
  return attention_probs_at<I, F>(q, q_stride, group, keys, k_stride, dense.table, n, d, scale,
                                  probs);
}

template <Isa I, KvFormat F>
inline void attention_output_at(const float* probs, std::size_t group, const void* values,
                                std::size_t v_stride, std::size_t n, std::size_t d, float* out,
                                std::size_t out_stride) noexcept {
  const DenseTable dense(n);
  attention_output_at<I, F>(probs, group, values, v_stride, dense.table, n, d, out, out_stride);
}

template <class Fn>
decltype(auto) with_format(KvFormat f, Fn&& fn) {
  switch (f) {
    case KvFormat::f16: return fn(std::integral_constant<KvFormat, KvFormat::f16>{});
    case KvFormat::bf16: return fn(std::integral_constant<KvFormat, KvFormat::bf16>{});
    default: return fn(std::integral_constant<KvFormat, KvFormat::f32>{});
  }
}

}  // namespace detail

/// The level the attention kernels run at: active_isa(), lowered to scalar on the (rare)
/// x86 CPUs with AVX2 but without FMA or F16C.
KVEVICT_KERNEL_FN Isa attention_isa() {
  const Isa isa = active_isa();
#if KVEVICT_X86
  if (isa != Isa::scalar && !detail::cpu_has_fma_f16c()) return Isa::scalar;
#endif
  return isa;
}

/// Pinned level (throws std::invalid_argument if this CPU lacks it); see the file comment.
template <Isa I>
KVEVICT_KERNEL_FN bool attention_probs(const float* q, std::size_t q_stride, std::size_t group,
                            const void* keys, std::size_t k_stride, KvFormat fmt, std::size_t n,
                            std::size_t d, float scale, float* probs) {
  detail::require_attention_isa(I);
  return detail::with_format(fmt, [&](auto f) {
    return detail::attention_probs_at<I, decltype(f)::value>(q, q_stride, group, keys, k_stride, n,
                                                             d, scale, probs);
  });
}

template <Isa I>
KVEVICT_KERNEL_FN void attention_output(const float* probs, std::size_t group, const void* values,
                             std::size_t v_stride, KvFormat fmt, std::size_t n, std::size_t d,
                             float* out, std::size_t out_stride) {
  detail::require_attention_isa(I);
  detail::with_format(fmt, [&](auto f) {
    detail::attention_output_at<I, decltype(f)::value>(probs, group, values, v_stride, n, d, out,
                                                       out_stride);
  });
}

template <KvFormat F>
KVEVICT_KERNEL_FN bool attention_probs_as(const float* q, std::size_t q_stride, std::size_t group,
                                          const void* keys, std::size_t k_stride, std::size_t n,
                                          std::size_t d, float scale, float* probs) {
  return detail::with_isa(attention_isa(), [&](auto isa) {
    return detail::attention_probs_at<decltype(isa)::value, F>(q, q_stride, group, keys, k_stride,
                                                               n, d, scale, probs);
  });
}

template <KvFormat F>
KVEVICT_KERNEL_FN void attention_output_as(const float* probs, std::size_t group,
                                           const void* values, std::size_t v_stride,
                                           std::size_t n, std::size_t d, float* out,
                                           std::size_t out_stride) {
  detail::with_isa(attention_isa(), [&](auto isa) {
    detail::attention_output_at<decltype(isa)::value, F>(probs, group, values, v_stride, n, d,
                                                         out, out_stride);
  });
}

template <KvFormat F>
KVEVICT_KERNEL_FN bool attention_probs_paged_as(const float* q, std::size_t q_stride,
                                                std::size_t group, const void* keys,
                                                std::size_t k_stride, BlockTable table,
                                                std::size_t n, std::size_t d, float scale,
                                                float* probs) {
  return detail::with_isa(attention_isa(), [&](auto isa) {
    return detail::attention_probs_at<decltype(isa)::value, F>(q, q_stride, group, keys, k_stride,
                                                               table, n, d, scale, probs);
  });
}

template <KvFormat F>
KVEVICT_KERNEL_FN void attention_output_paged_as(const float* probs, std::size_t group,
                                                 const void* values, std::size_t v_stride,
                                                 BlockTable table, std::size_t n, std::size_t d,
                                                 float* out, std::size_t out_stride) {
  detail::with_isa(attention_isa(), [&](auto isa) {
    detail::attention_output_at<decltype(isa)::value, F>(probs, group, values, v_stride, table, n,
                                                         d, out, out_stride);
  });
}

/// Untemplated forms: attention_isa(), decided once per call; the format at run time.
KVEVICT_LAZY_DEF KVEVICT_KERNEL_FN bool attention_probs(const float* q, std::size_t q_stride, std::size_t group,
                            const void* keys, std::size_t k_stride, KvFormat fmt, std::size_t n,
                            std::size_t d, float scale, float* probs) {
  return detail::with_format(fmt, [&](auto f) {
    return attention_probs_as<decltype(f)::value>(q, q_stride, group, keys, k_stride, n, d, scale,
                                                  probs);
  });
}

KVEVICT_LAZY_DEF KVEVICT_KERNEL_FN void attention_output(const float* probs, std::size_t group, const void* values,
                             std::size_t v_stride, KvFormat fmt, std::size_t n, std::size_t d,
                             float* out, std::size_t out_stride) {
  detail::with_format(fmt, [&](auto f) {
    attention_output_as<decltype(f)::value>(probs, group, values, v_stride, n, d, out, out_stride);
  });
}

}  // namespace kvevict::kernels

#endif  // !KVEVICT_KERNELS_DECLARE_ONLY
