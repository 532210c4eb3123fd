// Fuzzes the saved-state reader (serialize.hpp): any bytes must either restore a valid
// cache or throw kvevict::Error leaving the target unchanged; nothing else may happen.
// The first byte picks the target and whether the checksum is verified (skipping it lets
// the fuzzer reach the structural checks behind it).
#include <kvevict/kvevict.hpp>
#include <kvevict/serialize.hpp>

#include <cstdlib>
#include <span>

namespace {

const kvevict::Geometry kGeo{2, 4, 2, 4};

template <class Cache>
void fill(Cache& c, std::int64_t base = 0) {
  std::vector<float> k(8), v(8), q(16);
  for (int t = 0; t < 9; ++t)
    for (int l = 0; l < 2; ++l) {
      for (std::size_t i = 0; i < 8; ++i) k[i] = v[i] = float((t * 7 + int(i)) % 5) - 2.0f;
      for (std::size_t i = 0; i < 16; ++i) q[i] = float((t + int(i)) % 3) - 1.0f;
      c.append(l, base + t, k, v, q);
      kvevict::attend(c, l, q);
    }
}

template <class Cache>
void check(Cache& c, std::span<const std::uint8_t> bytes, bool verify) {
  fill(c);
  const auto before = kvevict::save_bytes(c);
  try {
    kvevict::detail::CacheAccess<Cache>::load(c, bytes, verify);
  } catch (const kvevict::Error&) {
    if (kvevict::save_bytes(c) != before) std::abort();  // a failed load changed the target
    return;
  }
  // A restored cache must round-trip and keep working: appends after the restored last
  // position (a file may claim any last position, so a refusal there is fine).
  const auto again = kvevict::save_bytes(c);
  Cache d(c.geometry(), kvevict::Budget::uniform(6), c.policy());
  kvevict::load_bytes(d, again);
  if (kvevict::save_bytes(d) != again) std::abort();
  try {
    fill(c, std::int64_t{1} << 62);
  } catch (const kvevict::Error&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 1) return 0;
  namespace pol = kvevict::policies;
  const std::span<const std::uint8_t> bytes(data + 1, size - 1);
  const bool verify = data[0] & 1;
  const auto budget = kvevict::Budget::uniform(6);
  switch ((data[0] >> 1) % 4) {
    case 0: {
      kvevict::KVCache<pol::H2O> c(kGeo, budget, pol::H2O(pol::H2O::Config{2, 1}));
      check(c, bytes, verify);
      break;
    }
    case 1: {
      kvevict::KVCache<pol::Random, Eigen::half> c(kGeo, budget, pol::Random(pol::Random::Config{3, 1, 1}));
      check(c, bytes, verify);
      break;
    }
    case 2: {
      kvevict::KVCache<pol::KNorm, Eigen::bfloat16> c(kGeo, budget, pol::KNorm(pol::KNorm::Config{1, 1}));
      check(c, bytes, verify);
      break;
    }
    default: {
      kvevict::KVCache<pol::StreamingLLM> c(kGeo, budget, pol::StreamingLLM{2});
      check(c, bytes, verify);
      break;
    }
  }
  return 0;
}
