#pragma once
// kvevict-eval's view of the shared policy registry (examples/common/policy_registry.hpp):
// per policy a name, a description and runners for the synthetic/trace protocol and for
// --model. Adding a policy is one line in registry::for_each_policy().
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <kvevict/geometry.hpp>
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

#include "policy_registry.hpp"
#include "runner.hpp"

// The llama2.c engine's end-to-end protocol (KL, top-1, perplexity on a checkpoint),
// for kvevict-eval --model; compiled in when examples/llama2c is present.
#if __has_include("../llama2c/e2e.hpp")
#include "../llama2c/e2e.hpp"
#include "../llama2c/hf.hpp"
#include "../llama2c/hf_tokenizer.hpp"
#include "../llama2c/trace_dump.hpp"
#include "model_formats.hpp"
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
#if KVEVICT_EVAL_HAS_LLAMA2C
  /// --model: the protocol's options (the prompt prefilled in blocks).
  llama2c::ProtocolOptions protocol{};
#endif
  /// The cache's storage format (examples/common/kv_format.hpp; --kv-format).
  std::string kv_format = "fp32";
};

using registry::Family;
using registry::Regime;
using registry::Sizing;

struct PolicyEntry {
  std::string name;
  std::string description;
  Family family = Family::baseline;
  Regime regime = Regime::decode;
  Sizing sizing = Sizing::budget;
  std::function<Quality(const Workload&, const Reference&, const PolicyArgs&, const RunOptions&,
                        const Tick&)>
      run;
  /// Needs a workload's Q/K at setup (per-layer allocators): not available with --model.
  bool needs_workload = false;
  /// --model runs it in every format of kv_format.hpp (else fp32 only).
  bool all_kv_formats = false;
#if KVEVICT_EVAL_HAS_LLAMA2C
  /// The streaming KL protocol on a llama2.c checkpoint (budget: PolicyArgs::budget).
  std::function<llama2c::Summary(const std::shared_ptr<const llama2c::Model>&,
                                 std::span<const llama2c::Stream>, const PolicyArgs&)>
      run_model;
#endif
  [[nodiscard]] bool causal() const { return sizing != Sizing::unbounded; }
};

/// The settings kvevict-eval gives the registry's policies (its published tables):
/// StreamingLLM 4 sinks, H2O half the budget recent and no sinks, KNorm no sinks,
/// Random seeded with --seed.
inline registry::Knobs eval_knobs(std::uint64_t seed) {
  registry::Knobs k;
  k.sinks = 4;
  k.knorm_sinks = 0;
  k.h2o_recent_fraction = 0.5;
  k.seed = seed;
  // The synthetic and trace workloads carry no rotation (positions are content directions).
  k.rope = policies::RopeLayout::none;
  return k;
}

#if KVEVICT_EVAL_HAS_LLAMA2C
/// The registry names --model runs in every storage format (kAllKvFormats), comma-separated.
inline std::string all_kv_format_policies() {
  std::string out;
  registry::for_each_policy([&](const auto& re) {
    using Policy = typename std::decay_t<decltype(re)>::policy_type;
    if (kAllKvFormats<Policy> && !re.info.needs_prompt)
      out += (out.empty() ? "" : ", ") + std::string(re.info.name);
  });
  return out;
}
#endif

/// The prompt's keys and queries of a workload, for the per-layer allocators.
inline registry::PromptStats prompt_stats(const Workload& w) {
  registry::PromptStats p{w.geometry, w.prompt, {}, {}};
  const Geometry& g = w.geometry;
  for (int l = 0; l < g.n_layers; ++l) {
    p.keys.emplace_back(w.k(l, 0), w.prompt * static_cast<std::size_t>(g.n_kv_heads * g.head_dim));
    p.queries.emplace_back(w.q(l, 0), w.prompt * static_cast<std::size_t>(g.n_heads * g.head_dim));
  }
  return p;
}

/// Every policy the tool knows (the shared registry's), in its listing order.
inline const std::vector<PolicyEntry>& policy_registry() {
  static const std::vector<PolicyEntry> entries = [] {
    std::vector<PolicyEntry> out;
    registry::for_each_policy([&](const auto& re) {
      using Policy = typename std::decay_t<decltype(re)>::policy_type;
      PolicyEntry e;
      e.name = re.info.name;
      e.description = re.info.help;
      e.family = re.info.family;
      e.regime = re.info.regime;
      e.sizing = re.info.sizing;
      e.needs_workload = re.info.needs_prompt;
      e.run = [re](const Workload& w, const Reference& ref, const PolicyArgs& a,
                   const RunOptions& o, const Tick& tick) {
        const registry::PromptStats stats = prompt_stats(w);
        registry::Knobs knobs = eval_knobs(a.seed);
        knobs.snapkv_chunked = o.chunked;
        const registry::Args ra{a.budget, knobs, &stats};
        return registry::invoke(re, ra, [&](Policy policy, const Budget& b) {
#if KVEVICT_EVAL_HAS_LLAMA2C
          if constexpr (kAllKvFormats<Policy>) {
            return FormatRunner<Policy>::synthetic(a.kv_format, w, ref, policy, b, o, tick);
          } else {
            if (a.kv_format != "fp32")
              kvevict::detail::fail("K/V format '", a.kv_format, "': policy ", re.info.name,
                                    " runs in fp32 only (the other formats are built for: ",
                                    all_kv_format_policies(), ")");
            return evaluate<Policy>(w, ref, std::move(policy), b, o, tick);
          }
#else
          return evaluate<Policy>(w, ref, std::move(policy), b, o, tick);
#endif
        });
      };
#if KVEVICT_EVAL_HAS_LLAMA2C
      e.all_kv_formats = kAllKvFormats<Policy>;
      if (!re.info.needs_prompt)
        e.run_model = [re](const std::shared_ptr<const llama2c::Model>& model,
                           std::span<const llama2c::Stream> streams, const PolicyArgs& a) {
          registry::Knobs knobs = eval_knobs(a.seed);
          // The model's RoPE, for the policies that un-rotate queries (ExpectedAttention):
          // llama2.c's interleaved pairs, Hugging Face's halves, and its rope_theta.
          llama2c::set_model_rope(knobs, model->config());
          const registry::Args ra{a.budget, knobs, nullptr};
          return registry::invoke(re, ra, [&](Policy policy, const Budget& b) {
            if constexpr (kAllKvFormats<Policy>) {
              return FormatRunner<Policy>::run(a.kv_format, model, streams, b, policy, a.protocol);
            } else {
              if (a.kv_format != "fp32")
                kvevict::detail::fail("K/V format '", a.kv_format, "': policy ", re.info.name,
                                      " runs in fp32 only (the other formats are built for: ",
                                      all_kv_format_policies(), ")");
              return llama2c::evaluate<Policy>(model, streams, b, std::move(policy), a.protocol);
            }
          });
        };
#endif
      out.push_back(std::move(e));
    });
    return out;
  }();
  return entries;
}

/// The entry called `name`, or nullptr.
inline const PolicyEntry* find_policy(const std::string& name) {
  const auto& r = policy_registry();
  auto it = std::find_if(r.begin(), r.end(), [&](const PolicyEntry& e) { return e.name == name; });
  return it == r.end() ? nullptr : &*it;
}

}  // namespace kvevict::eval
