// Runtime ISA detection and dispatch for kvevict kernels.
//
// Every kernel exists once per level (scalar, avx2, avx512) as a template instantiation with
// its own symbol; the untemplated entry points read active_isa() once per call (never per
// element) and forward. CPUID is read once (function-local static); KVEVICT_ISA in the
// environment forces a lower level; when the compiler flags already guarantee a level, the
// corresponding runtime check is compiled out.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>

#include "../config.hpp"

#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
#define KVEVICT_X86 1
#include <cpuid.h>
// <immintrin.h> (every AVX-512 header, ~0.4 s per TU) is included by the *_avx2 / *_avx512
// kernel headers and simhash.hpp's FMA path, not here.
#else
#define KVEVICT_X86 0
#endif

#if KVEVICT_X86 && defined(__AVX2__) && defined(__POPCNT__)
#define KVEVICT_COMPILED_AVX2 1
#else
#define KVEVICT_COMPILED_AVX2 0
#endif

#if KVEVICT_X86 && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VPOPCNTDQ__) && defined(__AVX512BITALG__) && KVEVICT_COMPILED_AVX2
#define KVEVICT_COMPILED_AVX512 1
#else
#define KVEVICT_COMPILED_AVX512 0
#endif

#if defined(__GNUC__) || defined(__clang__)
#define KVEVICT_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define KVEVICT_ALWAYS_INLINE inline
#endif

// GCC 12's intrinsic headers trip -W(maybe-)uninitialized on _mm*_undefined_*() when the
// intrinsics are inlined into target-attributed functions (GCC PR 105593); silence it locally.
#if defined(__GNUC__) && !defined(__clang__)
#define KVEVICT_SUPPRESS_INTRIN_WARNINGS_BEGIN                     \
  _Pragma("GCC diagnostic push")                                   \
      _Pragma("GCC diagnostic ignored \"-Wuninitialized\"")       \
          _Pragma("GCC diagnostic ignored \"-Wmaybe-uninitialized\"")
#define KVEVICT_SUPPRESS_INTRIN_WARNINGS_END _Pragma("GCC diagnostic pop")
#else
#define KVEVICT_SUPPRESS_INTRIN_WARNINGS_BEGIN
#define KVEVICT_SUPPRESS_INTRIN_WARNINGS_END
#endif

#if KVEVICT_X86
// Per-function targets: the library never needs -march, and code for a level runs only after
// active_isa() said the CPU has it.
#define KVEVICT_TARGET_AVX2 __attribute__((target("avx2,popcnt,bmi,bmi2")))
#define KVEVICT_TARGET_AVX512                                                              \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512vpopcntdq,avx512bitalg,avx2,popcnt," \
                        "bmi,bmi2")))
// AVX-512 plus VBMI (VPERMB) and VBMI2 (VPCOMPRESSB): a sub-level inside avx512, used only
// after has_avx512_vbmi2() (Ice Lake, Zen 4; not Skylake-X).
#define KVEVICT_TARGET_AVX512_VBMI2                                                        \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512vpopcntdq,avx512bitalg,avx512vbmi," \
                        "avx512vbmi2,avx2,popcnt,bmi,bmi2")))
#endif

namespace kvevict::kernels {

/// Instruction-set levels, ordered: a higher level implies the lower ones.
/// avx2   = AVX2 + POPCNT + BMI1/2 (and OS support for YMM state).
/// avx512 = AVX-512 F, BW, VL, VPOPCNTDQ, BITALG (and OS support for ZMM/opmask state);
///          Ice Lake, Zen 4 and later.
enum class Isa : int { scalar = 0, avx2 = 1, avx512 = 2 };

/// Returned by the argmax/argmin kernels when no row is eligible.
inline constexpr std::size_t npos = std::numeric_limits<std::size_t>::max();

/// Human-readable name of a level ("scalar", "avx2", "avx512").
constexpr const char* isa_name(Isa isa) noexcept {
  switch (isa) {
    case Isa::avx512: return "avx512";
    case Isa::avx2: return "avx2";
    default: return "scalar";
  }
}

namespace detail {

#if KVEVICT_X86
inline std::uint64_t read_xcr0() noexcept {
  std::uint32_t eax = 0, edx = 0;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<std::uint64_t>(edx) << 32) | eax;
}

inline Isa cpuid_isa() noexcept {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return Isa::scalar;
  const bool osxsave = (c >> 27) & 1, avx = (c >> 28) & 1, popcnt = (c >> 23) & 1;
  if (!osxsave || !avx || !popcnt) return Isa::scalar;
  const std::uint64_t xcr0 = read_xcr0();
  if ((xcr0 & 0x6) != 0x6) return Isa::scalar;  // XMM and YMM state enabled by the OS
  if (__get_cpuid_max(0, nullptr) < 7) return Isa::scalar;
  __cpuid_count(7, 0, a, b, c, d);
  const bool avx2 = (b >> 5) & 1, bmi1 = (b >> 3) & 1, bmi2 = (b >> 8) & 1;
  if (!avx2 || !bmi1 || !bmi2) return Isa::scalar;
  const bool f = (b >> 16) & 1, bw = (b >> 30) & 1, vl = (b >> 31) & 1;
  const bool bitalg = (c >> 12) & 1, vpopcntdq = (c >> 14) & 1;
  const bool zmm_state = (xcr0 & 0xE0) == 0xE0;  // opmask, ZMM0-15 upper, ZMM16-31
  if (f && bw && vl && bitalg && vpopcntdq && zmm_state) return Isa::avx512;
  return Isa::avx2;
}
#endif

/// Parses a KVEVICT_ISA value; throws std::invalid_argument on anything unknown.
/// "avx512vbmi2" is the avx512 level with its VBMI2 sub-level allowed (as when unset);
/// "avx512" caps below that sub-level (has_avx512_vbmi2() false).
inline Isa parse_isa(std::string_view s) {
  if (s == "scalar") return Isa::scalar;
  if (s == "avx2") return Isa::avx2;
  if (s == "avx512" || s == "avx512vbmi2") return Isa::avx512;
  throw std::invalid_argument("KVEVICT_ISA='" + std::string(s) +
                              "': expected one of scalar, avx2, avx512, avx512vbmi2");
}

/// True when KVEVICT_ISA leaves the VBMI2 sub-level allowed: unset, empty or "avx512vbmi2".
inline bool env_allows_vbmi2() {
  const char* v = std::getenv("KVEVICT_ISA");
  if (v == nullptr || *v == '\0') return true;
  parse_isa(v);  // throws on an unknown value
  return std::string_view(v) == "avx512vbmi2";
}

inline Isa env_isa_cap() {
  const char* v = std::getenv("KVEVICT_ISA");
  if (v == nullptr || *v == '\0') return Isa::avx512;
  return parse_isa(v);
}

}  // namespace detail

/// The best level this CPU (and OS) supports. CPUID is read once per process; when the
/// compiler flags already guarantee AVX-512 (or AVX2) the check is compiled out.
inline Isa detected_isa() noexcept {
#if KVEVICT_COMPILED_AVX512
  return Isa::avx512;
#elif KVEVICT_X86
  static const Isa isa = detail::cpuid_isa();
  return isa;
#else
  return Isa::scalar;
#endif
}

/// The level the untemplated kernels use: min(detected_isa(), KVEVICT_ISA). The environment
/// variable (scalar|avx2|avx512) can only lower the level; it is read once per process.
/// Throws std::invalid_argument if KVEVICT_ISA holds an unknown value.
inline Isa active_isa() {
  static const Isa isa = [] {
    const Isa cap = detail::env_isa_cap();
    const Isa det = detected_isa();
    return static_cast<int>(cap) < static_cast<int>(det) ? cap : det;
  }();
  return isa;
}

/// True when the CPU runs the AVX-512 level and has AVX512_VNNI (VPDPBUSD), used by the
/// integer q.K of the quantized attention kernels (attention_quant.hpp); read once per
/// process (compiled in when the flags guarantee it). Not capped by KVEVICT_ISA: callers ask
/// only after choosing the avx512 level.
inline bool has_avx512_vnni() noexcept {
#if KVEVICT_COMPILED_AVX512 && defined(__AVX512VNNI__)
  return true;
#elif KVEVICT_X86
  static const bool vnni = [] {
    if (detected_isa() != Isa::avx512) return false;
    unsigned a = 0, b = 0, c = 0, d = 0;
    __cpuid_count(7, 0, a, b, c, d);
    return ((c >> 11) & 1) != 0;
  }();
  return vnni;
#else
  return false;
#endif
}

namespace detail {
/// True when the CPU runs the AVX-512 level and has AVX512_VBMI and AVX512_VBMI2 (VPERMB,
/// VPCOMPRESSB), whatever KVEVICT_ISA says; read once per process.
inline bool cpu_has_avx512_vbmi2() noexcept {
#if KVEVICT_COMPILED_AVX512 && defined(__AVX512VBMI__) && defined(__AVX512VBMI2__)
  return true;
#elif KVEVICT_X86
  static const bool vbmi2 = [] {
    if (detected_isa() != Isa::avx512) return false;
    unsigned a = 0, b = 0, c = 0, d = 0;
    __cpuid_count(7, 0, a, b, c, d);
    return ((c >> 1) & 1) != 0 && ((c >> 6) & 1) != 0;
  }();
  return vbmi2;
#else
  return false;
#endif
}
}  // namespace detail

/// The AVX-512 level's VBMI2 sub-level: the CPU has AVX512_VBMI and AVX512_VBMI2
/// (detail::cpu_has_avx512_vbmi2) and KVEVICT_ISA allows it (unset or "avx512vbmi2";
/// "avx512" keeps the plain AVX-512 kernels, so both run on such a CPU). Read once per
/// process; used by the AVX-512 float top-k (select.hpp). Throws std::invalid_argument if
/// KVEVICT_ISA holds an unknown value.
inline bool has_avx512_vbmi2() {
  static const bool vbmi2 = detail::cpu_has_avx512_vbmi2() && detail::env_allows_vbmi2();
  return vbmi2;
}

/// True when kernels pinned to `isa` may run on this CPU.
inline bool isa_supported(Isa isa) noexcept {
  return static_cast<int>(isa) <= static_cast<int>(detected_isa());
}

namespace detail {

/// Guards the explicitly pinned template overloads: running an unsupported level would SIGILL.
inline void require_isa(Isa isa) {
  if (!isa_supported(isa))
    throw std::invalid_argument(std::string("kvevict::kernels: ISA level ") + isa_name(isa) +
                                " requested but this CPU supports at most " +
                                isa_name(detected_isa()));
}

inline void require_nonnull(const void* p, std::size_t n, const char* what) {
  if (p == nullptr && n > 0)
    throw std::invalid_argument(std::string("kvevict::kernels: ") + what +
                                " is null but n = " + std::to_string(n) + " (expected non-null)");
}

/// Calls f(std::integral_constant<Isa, level>) for a runtime level.
template <class F>
decltype(auto) with_isa(Isa isa, F&& f) {
  switch (isa) {
    case Isa::avx512: return f(std::integral_constant<Isa, Isa::avx512>{});
    case Isa::avx2: return f(std::integral_constant<Isa, Isa::avx2>{});
    default: return f(std::integral_constant<Isa, Isa::scalar>{});
  }
}

/// Eligibility words for rows [base, base+m) (base a multiple of 64): bit set = not protected
/// and inside the range. prot == nullptr means nothing is protected.
inline void eligibility_words(const std::uint64_t* prot, std::size_t base, std::size_t m,
                              std::uint64_t* elig) noexcept {
  const std::size_t words = (m + 63) / 64;
  for (std::size_t w = 0; w < words; ++w)
    elig[w] = prot ? ~prot[base / 64 + w] : ~std::uint64_t{0};
  if (m % 64) elig[words - 1] &= (std::uint64_t{1} << (m % 64)) - 1;
}

}  // namespace detail
}  // namespace kvevict::kernels
