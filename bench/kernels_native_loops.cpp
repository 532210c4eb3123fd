// Comparison loops for bench_kernels compiled with -march=native (see bench/kernels.cmake).
// This file must not include kvevict headers: inline library functions compiled here with
// -march=native could be merged (ODR) with the generic copies the benchmark measures.
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace kvevict_bench_native {

// The hardware read ceiling: XOR-reduce every byte, no other work.
std::uint64_t read_xor(const std::uint8_t* p, std::size_t bytes) {
  std::size_t i = 0;
  std::uint64_t r = 0;
#if defined(__AVX512F__)
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  for (; i + 256 <= bytes; i += 256) {
    a0 = _mm512_xor_si512(a0, _mm512_loadu_si512(p + i));
    a1 = _mm512_xor_si512(a1, _mm512_loadu_si512(p + i + 64));
    a2 = _mm512_xor_si512(a2, _mm512_loadu_si512(p + i + 128));
    a3 = _mm512_xor_si512(a3, _mm512_loadu_si512(p + i + 192));
  }
  const __m512i a = _mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3));
  r = static_cast<std::uint64_t>(_mm512_reduce_or_epi64(a));
#endif
  for (; i + 8 <= bytes; i += 8) {
    std::uint64_t w;
    std::memcpy(&w, p + i, 8);
    r ^= w;
  }
  return r;
}

// The plain std::popcount loop a user would write, here auto-vectorised for this CPU.
void popcount_loop_u64(const std::uint8_t* q, const std::uint8_t* codes, std::size_t n,
                       std::uint16_t* out) {
  std::uint64_t qw;
  std::memcpy(&qw, q, 8);
  for (std::size_t i = 0; i < n; ++i) {
    std::uint64_t c;
    std::memcpy(&c, codes + 8 * i, 8);
    out[i] = static_cast<std::uint16_t>(std::popcount(c ^ qw));
  }
}

void popcount_loop_u16(const std::uint8_t* q, const std::uint8_t* codes, std::size_t n,
                       std::uint16_t* out) {
  std::uint16_t qw;
  std::memcpy(&qw, q, 2);
  for (std::size_t i = 0; i < n; ++i) {
    std::uint16_t c;
    std::memcpy(&c, codes + 2 * i, 2);
    out[i] = static_cast<std::uint16_t>(std::popcount(static_cast<std::uint16_t>(c ^ qw)));
  }
}

// Read every 64-bit code and write one narrow value per code, no arithmetic: the ceiling for
// any kernel that must emit a distance per code (write traffic included).
void read_write_u16(const std::uint8_t* codes, std::size_t n, std::uint16_t* out) {
  for (std::size_t i = 0; i < n; ++i) {
    std::uint64_t c;
    std::memcpy(&c, codes + 8 * i, 8);
    out[i] = static_cast<std::uint16_t>(c);
  }
}
void read_write_u8(const std::uint8_t* codes, std::size_t n, std::uint8_t* out) {
  for (std::size_t i = 0; i < n; ++i) {
    std::uint64_t c;
    std::memcpy(&c, codes + 8 * i, 8);
    out[i] = static_cast<std::uint8_t>(c);
  }
}

}  // namespace kvevict_bench_native
