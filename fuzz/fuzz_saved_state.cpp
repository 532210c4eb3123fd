// Fuzzes the saved-state reader (serialize.hpp): any bytes must either restore a valid
// cache or throw kvevict::Error leaving the target unchanged; nothing else may happen.
//
// Input: byte 0 = (target << 1) | reseal; byte 1 = number of structured mutations m (mod
// 4), then m x (field, edge) byte pairs; the rest is the saved state. A structured
// mutation writes an edge value (INT64_MAX, UINT64_MAX, 2^62 + 1, NaN, inf, the largest
// half/bfloat16, ...) into a named field (tokens seen, last position, row count, a row's
// position or seq, a K/V element, the policy state) at the offsets the format defines for
// the target's geometry and policy name. With `reseal` the checksum is recomputed after
// every mutation, so the structural and policy-state validators behind the checksum are
// reached through the public load_bytes; without it the checksum must reject any change.
#include <kvevict/kvevict.hpp>
#include <kvevict/serialize.hpp>

#include <cfloat>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <span>
#include <string>

namespace {

namespace pol = kvevict::policies;
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

// 64-bit edge values for integer fields, and float edges for K/V and state floats.
std::uint64_t int_edge(std::uint8_t e) {
  constexpr std::uint64_t kEdges[] = {0,
                                      1,
                                      std::uint64_t(-1),
                                      std::uint64_t(std::numeric_limits<std::int64_t>::max()),
                                      std::uint64_t(std::numeric_limits<std::int64_t>::min()),
                                      std::uint64_t{1} << 62,
                                      (std::uint64_t{1} << 62) + 1,
                                      std::uint64_t(-2),
                                      6,
                                      7,
                                      9,
                                      std::uint64_t{1} << 32};
  return kEdges[e % (sizeof(kEdges) / sizeof(kEdges[0]))];
}
float float_edge(std::uint8_t e) {
  const float kEdges[] = {std::numeric_limits<float>::quiet_NaN(),
                          std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity(),
                          FLT_MAX,
                          -FLT_MAX,
                          65504.0f,
                          65520.0f,
                          3.3895314e38f,
                          -0.0f,
                          1e-45f,
                          -1.0f,
                          1.0f + 1.0f / 64};
  return kEdges[e % (sizeof(kEdges) / sizeof(kEdges[0]))];
}

template <class T>
void write_at(std::vector<std::uint8_t>& b, std::size_t at, T x) {
  if (at + sizeof(T) <= b.size()) std::memcpy(b.data() + at, &x, sizeof(T));
}

// One structured mutation of a save of a kGeo cache whose policy is `name`.
template <class Scalar>
void mutate(std::vector<std::uint8_t>& b, const std::string& name, std::uint8_t field,
            std::uint8_t edge) {
  const std::size_t heads = 4, layers_at = 8 + 4 + 4 + 4 + 4 + name.size() + 16 + heads * 8;
  const std::size_t head0 = layers_at + 2 * 16;
  std::uint64_t rows = 0;
  if (head0 + 8 <= b.size()) std::memcpy(&rows, b.data() + head0, 8);
  rows = rows > 64 ? 0 : rows;
  const std::size_t r = rows ? (field >> 3) % rows : 0;
  switch (field % 8) {
    case 0: write_at(b, layers_at + 16 * ((field >> 3) & 1), int_edge(edge)); break;      // tokens seen
    case 1: write_at(b, layers_at + 16 * ((field >> 3) & 1) + 8, int_edge(edge)); break;  // last position
    case 2: write_at(b, head0, int_edge(edge)); break;                                    // row count
    case 3: write_at(b, head0 + 8 + 16 * r, int_edge(edge)); break;                       // a position
    case 4: write_at(b, head0 + 8 + 16 * r + 8, int_edge(edge)); break;                   // a seq
    case 5: {  // a K (or V, past the keys) element, as the storage type holds it
      const std::size_t at = head0 + 8 + 16 * rows + sizeof(Scalar) * ((field >> 3) % (2 * 4 * rows + 1));
      write_at(b, at, static_cast<Scalar>(float_edge(edge)));
      break;
    }
    case 6:  // a float of the policy state (scores sit just before the checksum)
      if (b.size() >= 8 + 4 * (1 + (field >> 3))) write_at(b, b.size() - 8 - 4 * (1 + (field >> 3)), float_edge(edge));
      break;
    default:  // a 64-bit word of the policy state (configuration, counters)
      if (b.size() >= 8 + 8 * (1 + (field >> 3))) write_at(b, b.size() - 8 - 8 * (1 + (field >> 3)), int_edge(edge));
      break;
  }
}

// `make` builds the target cache. Every input starts from the same filled target, so it
// is built, filled and saved once per case (Case keeps the statics apart) and copied per
// input: a copy is the same cache (the copy constructor is tested in tests/), and the fill
// (18 appends and attends) was most of an input's cost.
template <int Case, class Make>
void check(Make make, std::span<const std::uint8_t> muts, std::span<const std::uint8_t> save,
           bool reseal) {
  using Cache = decltype(make());
  using Scalar = typename Cache::scalar_type;
  static const Cache filled = [&] {
    Cache f = make();
    fill(f);
    return f;
  }();
  static const std::vector<std::uint8_t> before = kvevict::save_bytes(filled);
  static std::vector<std::uint8_t> bytes;
  bytes.assign(save.begin(), save.end());
  for (std::size_t i = 0; i + 1 < muts.size(); i += 2)
    mutate<Scalar>(bytes, Cache::policy_type::name(), muts[i], muts[i + 1]);
  if (reseal && bytes.size() >= 8) {
    const auto h = kvevict::detail::fnv1a(std::span<const std::uint8_t>(bytes).first(bytes.size() - 8));
    std::memcpy(bytes.data() + bytes.size() - 8, &h, 8);
  }
  Cache c = filled;
  try {
    kvevict::load_bytes(c, bytes);
  } catch (const kvevict::Error&) {
    if (kvevict::save_bytes(c) != before) std::abort();  // a failed load changed the target
    return;
  }
  // A restored cache must round-trip and keep working: appends after the restored last
  // position (a file may claim any last position, so a refusal there is fine), attention
  // with the largest accepted probabilities, and its own save must load again.
  const auto again = kvevict::save_bytes(c);
  Cache d = c;
  kvevict::load_bytes(d, again);
  if (kvevict::save_bytes(d) != again) std::abort();
  try {
    fill(c, std::int64_t{1} << 61);
  } catch (const kvevict::Error&) {
  }
  for (int l = 0; l < 2; ++l)
    for (int h = 0; h < 2; ++h) {
      const std::vector<float> top(2 * c.size(l, h), 1.0f + kvevict::detail::kProbabilitySlack);
      c.observe(l, h, top);
    }
  Cache e = c;
  kvevict::load_bytes(e, kvevict::save_bytes(c));  // must not throw: scores stayed finite
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 2) return 0;
  const bool reseal = data[0] & 1;
  const std::size_t m = std::min<std::size_t>(data[1] % 4, (size - 2) / 2);
  const std::span<const std::uint8_t> muts(data + 2, 2 * m);
  const std::span<const std::uint8_t> save(data + 2 + 2 * m, size - 2 - 2 * m);
  const auto b = kvevict::Budget::uniform(6);
  switch ((data[0] >> 1) % 8) {
    case 0: check<0>([&] { return kvevict::KVCache<pol::H2O>(kGeo, b, pol::H2O(pol::H2O::Config{2, 1})); }, muts, save, reseal); break;
    case 1:
      check<1>([&] { return kvevict::KVCache<pol::Random, Eigen::half>(kGeo, b, pol::Random(pol::Random::Config{3, 1, 1})); },
               muts, save, reseal);
      break;
    case 2:
      check<2>([&] { return kvevict::KVCache<pol::KNorm, Eigen::bfloat16>(kGeo, b, pol::KNorm(pol::KNorm::Config{1, 1})); },
               muts, save, reseal);
      break;
    case 3: check<3>([&] { return kvevict::KVCache<pol::StreamingLLM>(kGeo, b, pol::StreamingLLM{2}); }, muts, save, reseal); break;
    case 4: {
      pol::DecayedAttention::Config dc;
      dc.decay = 0.5f;
      dc.sinks = 1;
      dc.recent = 1;
      check<4>([&] { return kvevict::KVCache<pol::DecayedAttention, Eigen::half>(kGeo, b, pol::DecayedAttention(dc)); },
               muts, save, reseal);
      break;
    }
    case 5: {
      pol::BuzzBeehive::Config bc;
      bc.sinks = 1;
      bc.window = 2;
      bc.threshold = 2;
      bc.stride = 3;
      check<5>([&] { return kvevict::KVCache<pol::BuzzBeehive>(kGeo, b, pol::BuzzBeehive(bc)); }, muts, save, reseal);
      break;
    }
    case 6: {
      pol::HashEvictSimHash<>::Config hc;
      hc.sinks = 1;
      hc.recent = 1;
      check<6>([&] { return kvevict::KVCache<pol::HashEvictSimHash<>, Eigen::bfloat16>(kGeo, b, pol::HashEvictSimHash<>(hc)); },
               muts, save, reseal);
      break;
    }
    default: {
      pol::SnapKV::Config sc;
      sc.window = 2;
      sc.kernel = 3;
      check<7>([&] { return kvevict::KVCache<pol::SnapKV>(kGeo, b, pol::SnapKV(sc)); }, muts, save, reseal);
      break;
    }
  }
  return 0;
}
