// The kvevict_kernels library (CMake target kvevict::kernels): compiles, once, what a
// separate-kernels translation unit only declares (config.hpp): the dispatched kernels at
// every ISA level, SimHashProjection's members, the SnapKV observation-window product,
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
