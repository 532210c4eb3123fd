#pragma once
// Build mode of kvevict's kernels (docs/benchmarks.md, "Compile cost").
//
// Default: header-only. Every kernel, the SimHash and observation-window products and the
// error-message formatting are inline in the headers; nothing to link but fmt (header-only).
//
// KVEVICT_SEPARATE_KERNELS (defined by the kvevict::kernels CMake target): the headers only
// declare the dispatched kernel entry points, SimHashProjection's members, the SnapKV
// observation-window product and the number formatting of kvevict::Error messages; the
// kvevict_kernels static library (src/kernels.cpp) defines them once. A translation unit
// then includes neither <immintrin.h> nor <fmt/format.h> (only <fmt/core.h>) and instantiates
// no SIMD kernel. The code is the same either way (the library compiles these very headers),
// so results are identical. Link kvevict::kernels or kvevict::kvevict, not both.
//
// KVEVICT_KERNEL_FN marks those functions: `inline` header-only, nothing in separate mode.
// KVEVICT_KERNELS_DECLARE_ONLY is 1 in a separate-mode consumer (definitions hidden) and 0
// in header-only mode and inside the library's own translation unit.

#if defined(KVEVICT_SEPARATE_KERNELS)
#define KVEVICT_KERNEL_FN
#if defined(KVEVICT_KERNELS_DEFINE)
#define KVEVICT_KERNELS_DECLARE_ONLY 0
#else
#define KVEVICT_KERNELS_DECLARE_ONLY 1
#endif
#else
#define KVEVICT_KERNEL_FN inline
#define KVEVICT_KERNELS_DECLARE_ONLY 0
#endif
