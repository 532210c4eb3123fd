// DecayedAttention::recommended()'s decode step outside Google Benchmark, for instruction
// counts (callgrind is exact and unaffected by other tenants, unlike timings): the same
// step as bench_policy_step's BM_policy (cache.append with its eviction decision, then
// cache.observe of every KV head), the same pool of token rows and stream of probabilities.
//   policy_step_count N HKV STEPS [POLICY]
// fills a cache of N rows per KV head (HKV heads, d = 128, G = 4), runs 256 warm-up steps,
// then STEPS steps, and prints CPU µs per step (including the probability draws) and a
// checksum of the rows kept (equal checksums: equal decisions). Instructions per step =
// the difference between two runs with different STEPS, divided by the difference in STEPS
// (bench/policy_step_count.sh).
// POLICY (default decayed_recommended): or hashevict_key_b64, hashevict_query_b64,
// hashevict_query_b16 (bench_policy_step's HashEvict captures; query mode passes queries).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <kvevict/cache.hpp>
#include <kvevict/policies/decayed_attention.hpp>
#include <kvevict/policies/hash_evict.hpp>
#include <string>

#include "policy_step_pool.hpp"

namespace {

using namespace kvevict;
using namespace policy_step;

template <class Policy>
int run(std::size_t n, int hkv, std::size_t steps, Policy policy) {
  const Pool& P = pool();
  KVCache<Policy> cache(geometry(hkv), Budget::uniform(static_cast<long long>(n)),
                        std::move(policy));
  std::size_t t = 0;
  const auto append = [&] {
    if constexpr (has(Policy::signals, Signals::query))
      cache.append(0, static_cast<std::int64_t>(t), P.key(t, hkv), P.value(t, hkv),
                   P.query(t, hkv));
    else
      cache.append(0, static_cast<std::int64_t>(t), P.key(t, hkv), P.value(t, hkv));
  };
  ProbStream probs;  // policy_step_count.sh subtracts refill()'s instructions (untimed in
                     // bench_policy_step)
  const auto step = [&] {
    append();
    if constexpr (has(Policy::signals, Signals::attention)) {
      if (probs.due(n * kGroup)) probs.refill(n * kGroup);
      for (int h = 0; h < hkv; ++h)
        cache.observe(0, h, probs.window(cache.size(0, h) * kGroup));
      probs.advance();
    }
    ++t;
  };
  while (cache.size(0, 0) < n) {  // fill without attention, then warm up (as BM_policy)
    append();
    ++t;
  }
  for (int i = 0; i < 256; ++i) step();
  const std::clock_t c0 = std::clock();
  for (std::size_t i = 0; i < steps; ++i) step();
  const std::clock_t c1 = std::clock();
  std::uint64_t sum = 0;
  for (int h = 0; h < hkv; ++h) {
    const auto s = cache.seqs(0, h);
    for (std::size_t r = 0; r < s.size(); ++r) sum = sum * 1000003u + s[r] * 31u + r;
  }
  std::printf("n=%zu hkv=%d steps=%zu cpu_us_per_step=%.2f kept_checksum=%016llx\n", n, hkv,
              steps, steps ? 1e6 * static_cast<double>(c1 - c0) / CLOCKS_PER_SEC / steps : 0.0,
              static_cast<unsigned long long>(sum));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4 && argc != 5) {
    std::fprintf(stderr, "usage: %s N HKV STEPS [POLICY]\n", argv[0]);
    return 2;
  }
  const std::size_t n = std::strtoul(argv[1], nullptr, 10);
  const int hkv = std::atoi(argv[2]);
  const std::size_t steps = std::strtoul(argv[3], nullptr, 10);
  if (n == 0 || hkv < 1 || hkv > 8) {
    std::fprintf(stderr, "expected N >= 1 and 1 <= HKV <= 8\n");
    return 2;
  }
  const std::string policy = argc == 5 ? argv[4] : "decayed_recommended";
  using policies::HashEvictKey;
  using policies::HashEvictQuery;
  if (policy == "decayed_recommended")
    return run(n, hkv, steps, policies::DecayedAttention::recommended());
  if (policy == "hashevict_key_b64") return run(n, hkv, steps, HashEvictKey({.bits = 64}));
  if (policy == "hashevict_query_b64") return run(n, hkv, steps, HashEvictQuery({.bits = 64}));
  if (policy == "hashevict_query_b16") return run(n, hkv, steps, HashEvictQuery({.bits = 16}));
  std::fprintf(stderr, "unknown POLICY %s\n", policy.c_str());
  return 2;
}
