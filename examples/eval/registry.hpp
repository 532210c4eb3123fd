#pragma once
// Policy registry of kvevict-eval: a name, a one-line description and a factory per
// policy. Adding a policy is one entry<Policy>(...) line in policy_registry().
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <kvevict/geometry.hpp>
#include <kvevict/policies/decayed_attention.hpp>
#include <kvevict/policies/full_cache.hpp>
#include <kvevict/policies/h2o.hpp>
#include <kvevict/policies/knorm.hpp>
#include <kvevict/policies/oracle.hpp>
#include <kvevict/policies/random.hpp>
#include <kvevict/policies/streaming_llm.hpp>

#include "runner.hpp"

namespace kvevict::eval {

/// What a factory may use to configure its policy for one run.
struct PolicyArgs {
  std::size_t budget = 0;  ///< tokens per (layer, KV head)
  std::uint64_t seed = 0;
  const Workload* workload = nullptr;
};

/// How a policy's cache is sized: `budget` gives the container Budget::uniform(budget);
/// `unbounded` stores every row (FullCache; the Oracle, which limits attention instead);
/// `reference` marks the full cache, run once whatever the budgets.
enum class Sizing { budget, unbounded, reference };

struct PolicyEntry {
  std::string name;
  std::string description;
  Sizing sizing = Sizing::budget;
  std::function<Quality(const Workload&, const Reference&, const PolicyArgs&, const RunOptions&,
                        const Tick&)>
      run;
  [[nodiscard]] bool causal() const { return sizing != Sizing::unbounded; }
};

/// Registers Policy under `name`; make(const PolicyArgs&) returns the configured policy.
template <class Policy, class Make>
PolicyEntry entry(std::string name, std::string description, Make make,
                  Sizing sizing = Sizing::budget) {
  PolicyEntry e{std::move(name), std::move(description), sizing, {}};
  e.run = [make, sizing](const Workload& w, const Reference& ref, const PolicyArgs& a,
                         const RunOptions& o, const Tick& tick) {
    const Budget b = sizing == Sizing::budget ? Budget::uniform(static_cast<long long>(a.budget))
                                              : Budget::unbounded();
    return evaluate<Policy>(w, ref, make(a), b, o, tick);
  };
  return e;
}

/// Every policy the tool knows, in report order.
inline const std::vector<PolicyEntry>& policy_registry() {
  using namespace kvevict::policies;
  static const std::vector<PolicyEntry> registry{
      entry<FullCache>("full", "FullCache: keeps every row (the reference)",
                       [](const PolicyArgs&) { return FullCache{}; }, Sizing::reference),
      entry<StreamingLLM>("streaming", "StreamingLLM: 4 sinks + sliding window",
                          [](const PolicyArgs&) { return StreamingLLM{4}; }),
      entry<H2O>("h2o", "H2O: accumulated attention, half the budget recent (paper setting)",
                 [](const PolicyArgs& a) { return H2O({.recent = a.budget / 2, .sinks = 0}); }),
      entry<DecayedAttention>("tova", "TOVA: drop the row the latest queries attend least",
                              [](const PolicyArgs&) { return DecayedAttention({.decay = 0.0f}); }),
      entry<KNorm>("knorm", "KNorm: evict the key with the largest L2 norm",
                   [](const PolicyArgs&) { return KNorm{}; }),
      entry<Random>("random", "Random eviction (the floor), seeded",
                    [](const PolicyArgs& a) { return Random({.seed = a.seed}); }),
      entry<Oracle>("oracle", "Oracle: attends the true top-budget rows each step (not causal)",
                    [](const PolicyArgs& a) { return Oracle{a.budget}; }, Sizing::unbounded),
  };
  return registry;
}

/// The entry called `name`, or nullptr.
inline const PolicyEntry* find_policy(const std::string& name) {
  const auto& r = policy_registry();
  auto it = std::find_if(r.begin(), r.end(), [&](const PolicyEntry& e) { return e.name == name; });
  return it == r.end() ? nullptr : &*it;
}

}  // namespace kvevict::eval
