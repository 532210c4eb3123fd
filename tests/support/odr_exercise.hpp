#pragma once
// Body of the two-translation-unit ODR test (tests/odr/): each TU includes this header and
// gets its own copy (anonymous namespace), so both instantiate every policy's cache,
// attend and the metrics independently; the linker must merge the library's inline
// functions and template instantiations without duplicate symbols, and both copies must
// compute the same result.
#include <cstdint>
#include <kvevict/kvevict.hpp>
#include <vector>

namespace {

template <class Policy, class Scalar = float>
double exercise(Policy policy, const kvevict::Budget& budget, std::size_t hot_rows = 0) {
  const kvevict::Geometry g{2, 4, 2, 8};
  kvevict::KVCache<Policy, Scalar> cache(g, budget, policy);
  if constexpr (kvevict::detail::MixedStorage<Scalar>) cache.set_hot_rows(hot_rows);
  std::uint64_t state = 0x9E3779B97F4A7C15ull;
  auto next = [&] {  // a tiny deterministic generator, identical in both TUs
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return static_cast<float>(static_cast<double>(state >> 40) / double(1 << 24) - 0.5);
  };
  double evicted = 0;
  cache.set_eviction_callback([&](const auto& e) { evicted += double(e.position); });
  double sum = 0;
  for (int t = 0; t < 64; ++t)
    for (int l = 0; l < 2; ++l) {
      std::vector<float> k(16), v(16), q(32);
      for (auto& x : k) x = next();
      for (auto& x : v) x = next();
      for (auto& x : q) x = next();
      cache.append(l, t, k, v, q);
      const auto r = kvevict::attend(cache, l, q);
      sum += double(r.out.sum());
    }
  for (int l = 0; l < 2; ++l)
    for (int h = 0; h < 2; ++h)
      for (auto p : cache.positions(l, h)) sum += double(p);
  const std::vector<float> a{0.5f, 0.25f, 0.25f};
  const std::vector<std::uint8_t> kept{1, 0, 1};
  sum += kvevict::metrics::mass_recall(a, kept) + kvevict::metrics::kl_divergence(a, a);
  return sum + evicted;
}

double exercise_all_policies() {
  using namespace kvevict;
  return exercise(policies::FullCache{}, Budget::unbounded()) +
         exercise(policies::Oracle{8}, Budget::unbounded()) +
         exercise(policies::StreamingLLM{2}, Budget::uniform(12)) +
         exercise(policies::H2O({4, 1}), Budget::per_layer({10, 14})) +
         exercise(policies::KNorm({1, 2}), Budget::uniform(9)) +
         exercise(policies::Random({7, 1, 1}), Budget::uniform(11)) +
         // Quantized storage: in separate-kernels mode, the quantized kernels compiled in
         // kvevict_kernels (quant_format.hpp's compiled_quant_format).
         exercise<policies::H2O, Q8<8>>(policies::H2O({4, 1}), Budget::uniform(10)) +
         exercise<policies::StreamingLLM, KV<E4M3, Q4<8>>>(policies::StreamingLLM{2},
                                                            Budget::uniform(12)) +
         exercise<policies::H2O, Mixed<Eigen::half, Q8<8>>>(policies::H2O({4, 1}),
                                                            Budget::uniform(10), 3);
}

/// Addresses of inline library functions: one definition each, so equal in every TU.
std::vector<const void*> inline_function_addresses() {
  using namespace kvevict;
  return {reinterpret_cast<const void*>(&metrics::kl_divergence),
          reinterpret_cast<const void*>(&metrics::topk_recall),
          reinterpret_cast<const void*>(&policies::Random::stream_seed),
          reinterpret_cast<const void*>(&detail::group_probabilities<float>),
          reinterpret_cast<const void*>(static_cast<AttentionResult (*)(
              KVCache<policies::H2O>&, int, std::span<const float>, AttendOptions)>(
              &attend<KVCache<policies::H2O>>))};
}

}  // namespace
