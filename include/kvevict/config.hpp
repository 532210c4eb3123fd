#pragma once
// Build mode of kvevict's kernels (docs/benchmarks.md, "Compile cost").
//
// Default: header-only. Every kernel, the SimHash and observation-window products and the
// error-message formatting are inline in the headers; nothing to link.
//
// KVEVICT_SEPARATE_KERNELS (defined by the kvevict::kernels CMake target): the headers only
// declare the dispatched kernel entry points, the quantized attention kernels of the common
// formats (kernels/quant_format.hpp), SimHashProjection's members, the SnapKV
// observation-window product, the number formatting of kvevict::Error messages, the
// metrics (metrics.hpp) and the members of AttentionAgeProfile, XkvLayerAllocator, BuzzBeehive and Random whose bodies
// instantiate standard templates; the kvevict_kernels static library (src/kernels.cpp)
// defines them once. A translation unit then includes neither <immintrin.h> nor <charconv>
// and instantiates no SIMD kernel. The code is the same either way (the library compiles these very headers),
// so results are identical. Link kvevict::kernels or kvevict::kvevict, not both.
// The library also instantiates the common caches (KVCache<P> with FullCache,
// StreamingLLM, H2O, DecayedAttention or SnapKV, float storage) and attend() on them; a
// consumer sees `extern template` declarations (extern_templates.hpp) and compiles none of
// their container and policy code.
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

// KVEVICT_LAZY / KVEVICT_LAZY_DEF: header-only, they make a function whose body instantiates
// heavy templates (the Eigen GEMMs of SimHash and of the observation window; the standard
// containers and algorithms of the policy members above) a function
// template with one defaulted, unused parameter: a translation unit that never calls it
// instantiates nothing (an inline non-template function instantiates what it calls in every
// includer). Calls are written as before (f(args), p.f(args)). KVEVICT_LAZY goes on the
// first declaration (with the default), KVEVICT_LAZY_DEF on a later out-of-class definition.
// Separate-kernels mode: empty (ordinary functions; the heavy ones are in kvevict_kernels).
// A function *defined* in a class or header with KVEVICT_LAZY would be an ordinary inline
// function in that mode, compiled by every includer: use KVEVICT_DEFER there instead.
#if defined(KVEVICT_SEPARATE_KERNELS)
#define KVEVICT_LAZY
#define KVEVICT_LAZY_DEF
#else
#define KVEVICT_LAZY template <class KvevictLazy = void>
#define KVEVICT_LAZY_DEF template <class KvevictLazy>
#endif

// KVEVICT_DEFER: in both modes, makes an in-class member of a non-template class (a policy)
// a function template with one defaulted, unused parameter, as KVEVICT_LAZY does
// header-only: its body's standard templates (vector, deque and hash-map members, the
// sorts, the saved-state readers, kvevict::Error message builders) are instantiated only in
// a translation unit that calls it, not in every includer. Calls are written as before. In
// separate-kernels mode the common caches call these members inside kvevict_kernels only
// (extern_templates.hpp). Not for virtual members or members whose address is taken.
#define KVEVICT_DEFER template <class KvevictLazy = void>
