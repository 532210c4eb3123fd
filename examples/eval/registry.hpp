#pragma once
// Policy registry of kvevict-eval: a name, a one-line description and a factory per
// policy. Adding a policy is one entry<Policy>(...) line in policy_registry().
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <kvevict/geometry.hpp>
#include <kvevict/policies/buzz.hpp>
#include <kvevict/policies/decayed_attention.hpp>
#include <kvevict/policies/expected_attention.hpp>
#include <kvevict/policies/full_cache.hpp>
#include <kvevict/policies/h2o.hpp>
#include <kvevict/policies/hash_evict.hpp>
#include <kvevict/policies/keydiff.hpp>
#include <kvevict/policies/knorm.hpp>
#include <kvevict/policies/oracle.hpp>
#include <kvevict/policies/random.hpp>
#include <kvevict/policies/snapkv.hpp>
#include <kvevict/policies/streaming_llm.hpp>
#include <kvevict/policies/xkv.hpp>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "runner.hpp"

// The llama2.c engine's end-to-end protocol (KL, top-1, perplexity on a checkpoint),
// for kvevict-eval --model; compiled in when examples/llama2c is present.
#if __has_include("../llama2c/e2e.hpp")
#include "../llama2c/e2e.hpp"
#define KVEVICT_EVAL_HAS_LLAMA2C 1
#else
#define KVEVICT_EVAL_HAS_LLAMA2C 0
#endif

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
  /// Needs a workload's Q/K at setup (per-layer allocators): not available with --model.
  bool needs_workload = false;
#if KVEVICT_EVAL_HAS_LLAMA2C
  /// The streaming KL protocol on a llama2.c checkpoint (budget: PolicyArgs::budget).
  std::function<llama2c::Summary(const std::shared_ptr<const llama2c::Model>&,
                                 std::span<const llama2c::Stream>, const PolicyArgs&)>
      run_model;
#endif
  [[nodiscard]] bool causal() const { return sizing != Sizing::unbounded; }
};

/// A policy with its own cache budget (per-layer allocators such as XKV), at the same
/// total memory as the uniform budget it replaces.
template <class Policy>
struct Configured {
  Policy policy;
  Budget budget;
};

/// The cache budget of a policy sized by `sizing`: B tokens per head, or unbounded.
inline Budget cache_budget(Sizing sizing, const PolicyArgs& a) {
  return sizing == Sizing::budget ? Budget::uniform(static_cast<long long>(a.budget))
                                  : Budget::unbounded();
}

/// Registers Policy under `name`; make(const PolicyArgs&) returns the configured policy,
/// or a Configured<Policy> to size the cache itself.
template <class Policy, class Make>
PolicyEntry entry(std::string name, std::string description, Make make,
                  Sizing sizing = Sizing::budget) {
  PolicyEntry e;
  e.name = std::move(name);
  e.description = std::move(description);
  e.sizing = sizing;
  using Made = std::invoke_result_t<Make, const PolicyArgs&>;
  constexpr bool configured = std::is_same_v<Made, Configured<Policy>>;
  e.needs_workload = configured;
  // A Configured policy brings its own budget: its lambda has no use for `sizing`.
  if constexpr (configured) {
    e.run = [make](const Workload& w, const Reference& ref, const PolicyArgs& a,
                   const RunOptions& o, const Tick& tick) {
      auto made = make(a);
      return evaluate<Policy>(w, ref, std::move(made.policy), made.budget, o, tick);
    };
  } else {
    e.run = [make, sizing](const Workload& w, const Reference& ref, const PolicyArgs& a,
                           const RunOptions& o, const Tick& tick) {
      return evaluate<Policy>(w, ref, make(a), cache_budget(sizing, a), o, tick);
    };
#if KVEVICT_EVAL_HAS_LLAMA2C
    e.run_model = [make, sizing](const std::shared_ptr<const llama2c::Model>& model,
                                 std::span<const llama2c::Stream> streams, const PolicyArgs& a) {
      return llama2c::evaluate<Policy>(model, streams, cache_budget(sizing, a), make(a));
    };
#endif
  }
  return e;
}

/// XKV in this protocol: the allocator reads each layer's prompt (window 8, pooling 7)
/// and shares L x (min(B, prompt) - 8) selected tokens among the layers; each layer's
/// capacity is its selection + the window + the decode headroom B - min(B, prompt) that
/// the uniform budget also has. Selection inside a layer is SnapKV's with XKV's settings.
inline Configured<policies::SnapKV> xkv_setup(const PolicyArgs& a) {
  kvevict::detail::require(a.workload != nullptr, "xkv: needs a workload's prompt statistics");
  const Workload& w = *a.workload;
  policies::XkvLayerAllocator alloc(w.geometry);
  const std::size_t window = alloc.config().window;
  kvevict::detail::require(w.prompt > window, "xkv: prompt of ", w.prompt,
                           " tokens, expected more than the observation window ", window);
  kvevict::detail::require(a.budget > window + 1, "xkv: budget of ", a.budget,
                           " tokens, expected > ", window + 1, " (window + 1)");
  const Geometry& g = w.geometry;
  for (int l = 0; l < g.n_layers; ++l)
    alloc.observe_layer(
        l, w.prompt,
        std::span<const float>(w.k(l, 0),
                               w.prompt * static_cast<std::size_t>(g.n_kv_heads * g.head_dim)),
        std::span<const float>(w.q(l, 0),
                               w.prompt * static_cast<std::size_t>(g.n_heads * g.head_dim)));
  const std::size_t head = std::min(a.budget, w.prompt);
  const auto total = static_cast<long long>((head - window) * static_cast<std::size_t>(g.n_layers));
  const auto allocation = alloc.allocate(total);
  std::vector<long long> caps;
  for (long long n : allocation.tokens)
    caps.push_back(n + static_cast<long long>(window + a.budget - head));
  return {policies::SnapKV(alloc.selection()), Budget::per_layer(caps)};
}

/// PyramidKV and uniform budgets under the same protocol as xkv_setup: the same total of
/// selected rows, the same SnapKV selection (XKV's window 8, pool 7), only the per-layer
/// split differs, so the three rows of a table compare allocations and nothing else.
inline Configured<policies::SnapKV> fixed_allocation_setup(const PolicyArgs& a, bool pyramid) {
  kvevict::detail::require(a.workload != nullptr, "pyramidkv/uniform: needs a workload's prompt");
  const Workload& w = *a.workload;
  const policies::XkvLayerAllocator alloc(w.geometry);
  const std::size_t window = alloc.config().window;
  kvevict::detail::require(a.budget > window + 1, "pyramidkv/uniform: budget of ", a.budget,
                           " tokens, expected > ", window + 1, " (window + 1)");
  const Geometry& g = w.geometry;
  const std::size_t head = std::min(a.budget, w.prompt);
  kvevict::detail::require(head > window, "pyramidkv/uniform: prompt of ", w.prompt,
                           " tokens, expected more than the observation window ", window);
  const auto total = static_cast<long long>((head - window) * static_cast<std::size_t>(g.n_layers));
  const auto candidates = static_cast<long long>(w.prompt - window);
  const auto split = pyramid ? policies::pyramid_budgets(g.n_layers, total, candidates)
                             : policies::uniform_budgets(g.n_layers, total);
  std::vector<long long> caps;
  for (long long n : split) caps.push_back(n + static_cast<long long>(window + a.budget - head));
  return {policies::SnapKV(alloc.selection()), Budget::per_layer(caps)};
}

/// Every policy the tool knows, in report order.
inline const std::vector<PolicyEntry>& policy_registry() {
  using namespace kvevict::policies;
  static const std::vector<PolicyEntry> registry{
      entry<FullCache>(
          "full", "FullCache: keeps every row (the reference)",
          [](const PolicyArgs&) { return FullCache{}; }, Sizing::reference),
      entry<StreamingLLM>("streaming", "StreamingLLM: 4 sinks + sliding window",
                          [](const PolicyArgs&) { return StreamingLLM{4}; }),
      entry<H2O>("h2o", "H2O: accumulated attention, half the budget recent (paper setting)",
                 [](const PolicyArgs& a) { return H2O({.recent = a.budget / 2, .sinks = 0}); }),
      entry<DecayedAttention>("tova", "TOVA: drop the row the latest queries attend least",
                              [](const PolicyArgs&) { return DecayedAttention({.decay = 0.0f}); }),
      entry<DecayedAttention>(
          "decayed",
          "DecayedAttention::recommended(): decayed attention, 3/8 recent, 1/8 recall, 1 sink",
          [](const PolicyArgs&) { return DecayedAttention::recommended(); }),
      entry<KNorm>("knorm", "KNorm: evict the key with the largest L2 norm",
                   [](const PolicyArgs&) { return KNorm{}; }),
      // Probability-free scorers. The synthetic workloads have no RoPE (positions are
      // content directions), a llama2.c checkpoint (--model) has llama2.c's RoPE.
      entry<ExpectedAttention>(
          "expected", "ExpectedAttention: paper settings (4 sinks, covariance, value norm, W 128)",
          [](const PolicyArgs& a) {
            return ExpectedAttention({.rope = a.workload ? RopeLayout::none : RopeLayout::interleaved});
          }),
      entry<KeyDiff>("keydiff", "KeyDiff: evict the key most similar to the mean unit key",
                     [](const PolicyArgs&) { return KeyDiff{}; }),
      entry<ExpectedAttention>(
          "probfree",
          "probability-free recommended: 1 sink, 3/8 recent, decayed expected attention (W 1)",
          [](const PolicyArgs& a) {
            return ExpectedAttention({.sinks = 1,
                                      .recent_fraction = 0.375f,
                                      .query_window = 1,
                                      .future_positions = 16,
                                      .covariance = ExpectedAttention::Covariance::none,
                                      .rope = a.workload ? RopeLayout::none : RopeLayout::interleaved,
                                      .horizon = 3.0f});
          }),
      entry<Random>("random", "Random eviction (the floor), seeded",
                    [](const PolicyArgs& a) { return Random({.seed = a.seed}); }),
      entry<SnapKV>("snapkv", "SnapKV: prompt selection by window-32 attention, pool 5",
                    [](const PolicyArgs&) { return SnapKV{}; }),
      entry<SnapKV>("xkv", "XKV: per-layer budgets from prompt statistics + SnapKV (w 8, pool 7)",
                    xkv_setup),
      entry<SnapKV>("pyramidkv", "PyramidKV budgets (beta 20) + the same selection as xkv",
                    [](const PolicyArgs& a) { return fixed_allocation_setup(a, true); }),
      entry<SnapKV>("uniform-w8", "uniform budgets + the same selection as xkv (w 8, pool 7)",
                    [](const PolicyArgs& a) { return fixed_allocation_setup(a, false); }),
      entry<HashEvictKey>("hashevict", "HashEvict: SimHash of the new key, evict the farthest",
                          [](const PolicyArgs&) { return HashEvictKey{}; }),
      entry<HashEvictQuery>("hashevict-q", "HashEvict, paper form: SimHash of the new queries",
                            [](const PolicyArgs&) { return HashEvictQuery{}; }),
      entry<BuzzBeehive>("buzz", "BUZZ: sinks + window + segmented heavy hitters (budget mode)",
                         [](const PolicyArgs&) { return BuzzBeehive({.budget_mode = true}); }),
      entry<Oracle>(
          "oracle", "Oracle: attends the true top-budget rows each step (not causal)",
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
