// Decode attention for the G query heads of one KV head (one step): fused q.K^T -> softmax ->
// p.V over fp32 / fp16 / bf16 rows, runtime-dispatched (scalar, AVX2+FMA+F16C, AVX-512).
//
//   attention_probs(q, q_stride, G, keys, k_stride, fmt, n, d, scale, probs)
//       probs[g * n + i] = softmax_i(scale * q_g . k_i); returns false (probs unspecified)
//       when a score is infinite or NaN.
//   attention_output(probs, G, values, v_stride, fmt, n, d, out, out_stride)
//       out[g * out_stride + j] = sum_i probs[g * n + i] * v_i[j].
//   decode_attention(...) = both.
//   attention_probs_as<F>(...), attention_output_as<F>(...): the same with the format a
//       template argument (a typed caller compiles one format's kernels, not three).
//
// Strides are in elements. Every K/V row is read once for all G heads; fp16/bf16 rows are
// widened in registers; nothing is allocated. kvevict::decode_attention (attention.hpp) is
// the checked, typed front end; these are the raw kernels.
#pragma once

#include <cstddef>

#include "attention_scalar.hpp"
#include "dispatch.hpp"

namespace kvevict::kernels {
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

template <Isa I, KvFormat F>
inline bool attention_probs_at(const float* q, std::size_t q_stride, std::size_t group,
                               const void* keys, std::size_t k_stride, std::size_t n,
                               std::size_t d, float scale, float* probs) noexcept {
#if KVEVICT_X86
  if constexpr (I == Isa::avx512)
    return attn_avx512::attention_probs<F>(q, q_stride, group, keys, k_stride, n, d, scale, probs);
  if constexpr (I == Isa::avx2)
    return attn_avx2::attention_probs<F>(q, q_stride, group, keys, k_stride, n, d, scale, probs);
#endif
  return scalar::attention_probs<F>(q, q_stride, group, keys, k_stride, n, d, scale, probs);
}

template <Isa I, KvFormat F>
inline void attention_output_at(const float* probs, std::size_t group, const void* values,
                                std::size_t v_stride, std::size_t n, std::size_t d, float* out,
                                std::size_t out_stride) noexcept {
#if KVEVICT_X86
  if constexpr (I == Isa::avx512)
    return attn_avx512::attention_output<F>(probs, group, values, v_stride, n, d, out, out_stride);
  if constexpr (I == Isa::avx2)
    return attn_avx2::attention_output<F>(probs, group, values, v_stride, n, d, out, out_stride);
#endif
  scalar::attention_output<F>(probs, group, values, v_stride, n, d, out, out_stride);
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
