// RecallDedup's key signature as defined before stop 41 (std::hypot pair lengths, squares
// summed in index order, byte-serial FNV-1a), kept to count the keys whose signature the
// stop-41 definition (policies::detail::key_signature) changes: tests/test_key_signature.cpp
// on random keys, examples/llama2c/signature_count_main.cpp on a model's keys.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include <kvevict/policies/common.hpp>

namespace kvtest {

/// Byte-serial FNV-1a over the 8 bytes of u, least significant first.
inline std::uint64_t fnv_bytes(std::uint64_t h, std::uint64_t u) {
  for (int b = 0; b < 8; ++b, u >>= 8) {
    h ^= u & 0xffu;
    h *= 1099511628211ull;
  }
  return h;
}

inline std::uint64_t key_signature_before41(const float* k, std::size_t d,
                                            kvevict::policies::RopeLayout rope, float step) {
  using kvevict::policies::RopeLayout;
  double sq = 0.0;
  for (std::size_t i = 0; i < d; ++i) sq += static_cast<double>(k[i]) * static_cast<double>(k[i]);
  if (!(sq > 0.0)) return 0;
  const double norm = std::sqrt(sq);
  std::uint64_t h = 14695981039346656037ull;
  const auto mix = [&](double x) {
    h = fnv_bytes(h, static_cast<std::uint64_t>(std::llround(x / static_cast<double>(step))));
  };
  mix(std::log(norm));
  if (rope == RopeLayout::none) {
    for (std::size_t i = 0; i < d; ++i) mix(static_cast<double>(k[i]) / norm);
    return h;
  }
  const std::size_t pairs = d / 2;
  for (std::size_t j = 0; j < pairs; ++j) {
    const std::size_t a = rope == RopeLayout::halves ? j : 2 * j;
    const std::size_t b = rope == RopeLayout::halves ? j + pairs : 2 * j + 1;
    mix(std::hypot(static_cast<double>(k[a]), static_cast<double>(k[b])) / norm);
  }
  return h;
}

}  // namespace kvtest
