// The kvevict_kernels library (CMake target kvevict::kernels): compiles, once, what a
// separate-kernels translation unit only declares (config.hpp): the dispatched kernels at
// every ISA level, the quantized attention kernels of the common formats,
// SimHashProjection's members, the SnapKV observation-window product,
// the number formatting of kvevict::Error messages and the file reads and writes
// (detail::read_file, XKV's Profile::save / load). The definitions are the headers' own.
#ifndef KVEVICT_SEPARATE_KERNELS
#error "src/kernels.cpp is compiled with KVEVICT_SEPARATE_KERNELS (the kvevict::kernels target)"
#endif
#define KVEVICT_KERNELS_DEFINE 1

#include <kvevict/file.hpp>
#include <kvevict/kvevict.hpp>

namespace kvevict::kernels {

// The level-pinned templates, instantiated at each level (the untemplated forms above are
// ordinary functions of this translation unit).
#define KVEVICT_INSTANTIATE_AT(I)                                                              \
  template void counting_topk<I>(const std::uint8_t*, std::size_t, std::size_t,              \
                                 std::uint32_t*);                                              \
  template void counting_topk<I>(const std::uint16_t*, std::size_t, std::size_t,             \
                                 std::uint32_t*);                                              \
  template void counting_bottomk<I>(const std::uint8_t*, std::size_t, std::size_t,           \
                                    std::uint32_t*);                                           \
  template void counting_bottomk<I>(const std::uint16_t*, std::size_t, std::size_t,          \
                                    std::uint32_t*);                                           \
  template void counting_topk<I>(const std::uint16_t*, std::size_t, std::size_t,             \
                                 const std::uint32_t*, std::size_t, std::uint32_t*);           \
  template void counting_bottomk<I>(const std::uint16_t*, std::size_t, std::size_t,          \
                                    const std::uint32_t*, std::size_t, std::uint32_t*);        \
  template void topk_indices<I>(const float*, std::size_t, std::size_t, std::uint32_t*);     \
  template std::size_t argmax_masked<I>(const float*, std::size_t, const std::uint64_t*);    \
  template std::size_t argmin_masked<I>(const float*, std::size_t, const std::uint64_t*);    \
  template void hamming_distances<I>(const std::uint8_t*, const std::uint8_t*, std::size_t,  \
                                     int, std::uint16_t*);                                     \
  template void hamming_distances<I>(const std::uint8_t*, const std::uint8_t*, std::size_t,  \
                                     int, std::uint8_t*);                                      \
  template std::size_t hamming_argmax<I>(const std::uint8_t*, const std::uint8_t*,           \
                                         std::size_t, int, const std::uint64_t*);              \
  template void hamming_histogram<I>(const std::uint8_t*, const std::uint8_t*, std::size_t,  \
                                     int, std::uint16_t*, std::uint32_t*);                     \
  template bool attention_probs<I>(const float*, std::size_t, std::size_t, const void*,      \
                                   std::size_t, KvFormat, std::size_t, std::size_t, float,     \
                                   float*);                                                    \
  template void attention_output<I>(const float*, std::size_t, const void*, std::size_t,     \
                                    KvFormat, std::size_t, std::size_t, float*, std::size_t);

KVEVICT_INSTANTIATE_AT(Isa::scalar)
KVEVICT_INSTANTIATE_AT(Isa::avx2)
KVEVICT_INSTANTIATE_AT(Isa::avx512)
#undef KVEVICT_INSTANTIATE_AT

// The format-pinned attention entry points (attention_decode.hpp).
#define KVEVICT_INSTANTIATE_FORMAT(F)                                                          \
  template bool attention_probs_as<F>(const float*, std::size_t, std::size_t, const void*,    \
                                      std::size_t, std::size_t, std::size_t, float, float*);   \
  template void attention_output_as<F>(const float*, std::size_t, const void*, std::size_t,   \
                                       std::size_t, std::size_t, float*, std::size_t);         \
  template bool attention_probs_paged_as<F>(const float*, std::size_t, std::size_t,          \
                                            const void*, std::size_t, BlockTable, std::size_t, \
                                            std::size_t, float, float*);                       \
  template void attention_output_paged_as<F>(const float*, std::size_t, const void*,         \
                                             std::size_t, BlockTable, std::size_t,             \
                                             std::size_t, float*, std::size_t);

KVEVICT_INSTANTIATE_FORMAT(KvFormat::f32)
KVEVICT_INSTANTIATE_FORMAT(KvFormat::f16)
KVEVICT_INSTANTIATE_FORMAT(KvFormat::bf16)
#undef KVEVICT_INSTANTIATE_FORMAT

// The quantized attention entry points (attention_quant.hpp) for the formats of
// compiled_quant_format<D> (quant_format.hpp): Q8 / Q4 at G in {8, 16, 32, 64, 128}, E4M3.
#define KVEVICT_INSTANTIATE_QUANT(K, G)                                                        \
  template bool quant_attention_probs<QDesc<K, G>>(const float*, std::size_t, std::size_t,     \
                                                   const std::uint8_t*, std::size_t,            \
                                                   std::size_t, std::size_t, float, float*)     \
      noexcept;                                                                                \
  template void quant_attention_output<QDesc<K, G>>(const float*, std::size_t,                 \
                                                    const std::uint8_t*, std::size_t,           \
                                                    std::size_t, std::size_t, float*,           \
                                                    std::size_t) noexcept;                      \
  template bool quant_attention_probs_qint<QDesc<K, G>>(const float*, std::size_t, std::size_t, \
                                                        const std::uint8_t*, std::size_t,       \
                                                        std::size_t, std::size_t, float, float*); \
  template bool quant_attention_probs_paged<QDesc<K, G>>(                                      \
      const float*, std::size_t, std::size_t, const std::uint8_t*, std::size_t, BlockTable,    \
      std::size_t, std::size_t, float, float*) noexcept;                                       \
  template void quant_attention_output_paged<QDesc<K, G>>(                                     \
      const float*, std::size_t, const std::uint8_t*, std::size_t, BlockTable, std::size_t,    \
      std::size_t, float*, std::size_t) noexcept;                                              \
  template bool quant_attention_probs_qint_paged<QDesc<K, G>>(                                 \
      const float*, std::size_t, std::size_t, const std::uint8_t*, std::size_t, BlockTable,    \
      std::size_t, std::size_t, float, float*);
#define KVEVICT_INSTANTIATE_QUANT_GROUPS(K)                                                    \
  KVEVICT_INSTANTIATE_QUANT(K, 8)                                                              \
  KVEVICT_INSTANTIATE_QUANT(K, 16)                                                             \
  KVEVICT_INSTANTIATE_QUANT(K, 32)                                                             \
  KVEVICT_INSTANTIATE_QUANT(K, 64)                                                             \
  KVEVICT_INSTANTIATE_QUANT(K, 128)

KVEVICT_INSTANTIATE_QUANT_GROUPS(QKind::q8)
KVEVICT_INSTANTIATE_QUANT_GROUPS(QKind::q4)
KVEVICT_INSTANTIATE_QUANT(QKind::e4m3, 1)
#undef KVEVICT_INSTANTIATE_QUANT_GROUPS
#undef KVEVICT_INSTANTIATE_QUANT

// The key-type templates of the untemplated counting selections.
template void counting_topk<std::uint8_t>(const std::uint8_t*, std::size_t, std::size_t,
                                          std::uint32_t*);
template void counting_topk<std::uint16_t>(const std::uint16_t*, std::size_t, std::size_t,
                                           std::uint32_t*);
template void counting_bottomk<std::uint8_t>(const std::uint8_t*, std::size_t, std::size_t,
                                             std::uint32_t*);
template void counting_bottomk<std::uint16_t>(const std::uint16_t*, std::size_t, std::size_t,
                                              std::uint32_t*);

}  // namespace kvevict::kernels

// The common cache types and attend() on them (extern_templates.hpp): instantiated here,
// declared `extern template` in every separate-kernels translation unit.
#define KVEVICT_INSTANTIATE_COMMON 1
#include <kvevict/extern_templates.hpp>
