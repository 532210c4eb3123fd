#pragma once
// The one policy registry of the example programs (kvevict-eval, llama2c, llama2c_e2e,
// llama2c_headline, llama2c_diagnose, kvevict_engine_owned): every policy of
// include/kvevict/policies under one name, with its family, help text and the settings
// each tool uses for it, recommended first. A program picks a policy by name at run time
// and gets the configured policy object and its cache budget handed to a generic lambda:
//
//   kvevict::registry::with_policy("decayed", args, [&](auto policy, const Budget& b) { ... });
//
// Adding a policy is one add<Policy>(...) line in for_each_policy().
#include <fmt/format.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "cli.hpp"
#include "kvevict/errors.hpp"
#include "kvevict/geometry.hpp"
#include "kvevict/policies/block_granular.hpp"
#include "kvevict/policies/buzz.hpp"
#include "kvevict/policies/decayed_attention.hpp"
#include "kvevict/policies/expected_attention.hpp"
#include "kvevict/policies/full_cache.hpp"
#include "kvevict/policies/h2o.hpp"
#include "kvevict/policies/hash_evict.hpp"
#include "kvevict/policies/keydiff.hpp"
#include "kvevict/policies/knorm.hpp"
#include "kvevict/policies/oracle.hpp"
#include "kvevict/policies/random.hpp"
#include "kvevict/policies/snapkv.hpp"
#include "kvevict/policies/streaming_llm.hpp"
#include "kvevict/policies/xkv.hpp"

namespace kvevict::registry {

/// Panels of a plot and sections of a list: which kind of method a policy is.
enum class Family { kvevict, seed, baseline, ceiling };
inline const char* family_name(Family f) {
  switch (f) {
    case Family::kvevict:
      return "kvevict's own";
    case Family::seed:
      return "the seed papers' methods";
    case Family::baseline:
      return "baselines";
    case Family::ceiling:
      return "reference and ceiling";
  }
  return "";
}

/// When a policy decides: at prefill from the whole prompt (SnapKV and the layer
/// allocators), or step by step while decoding.
enum class Regime { decode, prompt, reference };

/// How a policy's cache is sized: `budget` = Budget::uniform(B); `unbounded` stores every
/// row (the Oracle limits attention instead); `reference` = the full cache, run once.
enum class Sizing { budget, unbounded, reference };

/// Settings the tools expose as options (add_knob_options); each tool sets its defaults
/// (the values its published tables were made with) before parsing.
struct Knobs {
  std::size_t sinks = 4;                   ///< StreamingLLM's sinks (--sinks)
  std::optional<std::size_t> knorm_sinks;  ///< KNorm's sinks; unset: --sinks
  std::size_t h2o_recent = 10;             ///< H2O's recent window
  std::size_t h2o_sinks = 0;
  double h2o_recent_fraction = 0.0;  ///< > 0: H2O's window is this share of the budget
  std::size_t random_sinks = 0;
  std::size_t random_recent = 0;
  double random_recent_fraction = 0.0;  ///< > 0: Random's window is this share of the budget
  std::uint64_t seed = 0;               ///< Random's seed
  /// The RoPE layout ExpectedAttention un-rotates queries with (and decayed-distinct's key
  /// signatures pair coordinates by): llama2.c's (interleaved
  /// pairs, base 10000) by default; kvevict-eval's synthetic and trace workloads set none
  /// (their positions are content directions, no rotation).
  policies::RopeLayout rope = policies::RopeLayout::interleaved;
  /// Its base (theta_i = base^(-2i / d)): llama2.c's 10000; a Hugging Face model's
  /// rope_theta (its rope_scaling, if any, is not modelled: the unscaled frequencies).
  float rope_base = 10000.0f;
  /// What SnapKV's selection (snapkv, xkv, pyramidkv, uniform-w8) does with prompt chunks
  /// after a layer's first (chunked prefill): select again (the default) or the decode rule.
  policies::ChunkedPrefill snapkv_chunked = policies::ChunkedPrefill::reselect;

  /// The stories260K reference table's protocol (llama2c_e2e, llama2c_headline and
  /// llama2c_diagnose): StreamingLLM 1 sink, H2O and Random recent = budget / 4.
  static Knobs reference_protocol() {
    Knobs k;
    k.sinks = 1;
    k.h2o_recent_fraction = 0.25;
    k.random_recent_fraction = 0.25;
    return k;
  }
};

/// A prompt's keys and queries per layer (rotated as attention sees them): what the
/// per-layer allocators (xkv, pyramidkv, uniform-w8) read before choosing budgets.
struct PromptStats {
  Geometry geometry;
  std::size_t prompt = 0;                       ///< prompt tokens
  std::vector<std::span<const float>> keys;     ///< per layer: prompt x (Hkv * d)
  std::vector<std::span<const float>> queries;  ///< per layer: prompt x (H * d)
};

/// What a factory configures its policy from.
struct Args {
  std::size_t budget = 0;  ///< rows per (layer, KV head)
  Knobs knobs;
  const PromptStats* prompt = nullptr;  ///< needed by entries with needs_prompt
};

struct Info {
  const char* name;
  const char* help;
  Family family;
  Regime regime = Regime::decode;
  Sizing sizing = Sizing::budget;
  bool needs_prompt = false;  ///< reads PromptStats (per-layer budgets from the prompt)
  [[nodiscard]] bool causal() const { return sizing != Sizing::unbounded; }
};

/// A policy with its own cache budget (per-layer allocators), at the same total memory as
/// the uniform budget it replaces.
template <class Policy>
struct Configured {
  Policy policy;
  Budget budget;
};

/// One registered policy: its Info and a factory make(const Args&) returning a Policy or
/// a Configured<Policy>.
template <class Policy, class Make>
struct Entry {
  using policy_type = Policy;
  Info info;
  Make make;
};

/// The cache budget of a policy sized by `sizing`: B rows per head, or unbounded.
inline Budget cache_budget(Sizing sizing, std::size_t budget) {
  return sizing == Sizing::budget ? Budget::uniform(static_cast<long long>(budget))
                                  : Budget::unbounded();
}

namespace detail {

inline std::size_t share(double fraction, std::size_t fixed, std::size_t budget) {
  return fraction > 0.0 ? static_cast<std::size_t>(fraction * static_cast<double>(budget)) : fixed;
}

inline const PromptStats& prompt_of(const Args& a, const char* who) {
  kvevict::detail::require(a.prompt != nullptr, who,
                           ": needs the prompt's keys and queries (a synthetic or trace workload)");
  return *a.prompt;
}

/// XKV in the eval protocol: the allocator reads each layer's prompt (window 8, pooling 7)
/// and shares L x (min(B, prompt) - 8) selected tokens among the layers; each layer's
/// capacity is its selection + the window + the decode headroom B - min(B, prompt) that
/// the uniform budget also has. Selection inside a layer is SnapKV's with XKV's settings.
inline Configured<policies::SnapKV> xkv_setup(const Args& a) {
  const PromptStats& w = prompt_of(a, "xkv");
  policies::XkvLayerAllocator alloc(w.geometry);
  const std::size_t window = alloc.config().window;
  kvevict::detail::require(w.prompt > window, "xkv: prompt of ", w.prompt,
                           " tokens, expected more than the observation window ", window);
  kvevict::detail::require(a.budget > window + 1, "xkv: budget of ", a.budget,
                           " tokens, expected > ", window + 1, " (window + 1)");
  const Geometry& g = w.geometry;
  for (int l = 0; l < g.n_layers; ++l)
    alloc.observe_layer(l, w.prompt, w.keys[static_cast<std::size_t>(l)],
                        w.queries[static_cast<std::size_t>(l)]);
  const std::size_t head = std::min(a.budget, w.prompt);
  const auto total = static_cast<long long>((head - window) * static_cast<std::size_t>(g.n_layers));
  const auto allocation = alloc.allocate(total);
  std::vector<long long> caps;
  for (long long n : allocation.tokens)
    caps.push_back(n + static_cast<long long>(window + a.budget - head));
  policies::SnapKV::Config c = alloc.selection();
  c.chunked = a.knobs.snapkv_chunked;
  return {policies::SnapKV(c), Budget::per_layer(caps)};
}

/// PyramidKV and uniform budgets under the same protocol as xkv_setup: the same total of
/// selected rows, the same SnapKV selection (XKV's window 8, pool 7), only the per-layer
/// split differs, so the three compare allocations and nothing else.
inline Configured<policies::SnapKV> fixed_allocation_setup(const Args& a, bool pyramid) {
  const PromptStats& w = prompt_of(a, pyramid ? "pyramidkv" : "uniform-w8");
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
  policies::SnapKV::Config c = alloc.selection();
  c.chunked = a.knobs.snapkv_chunked;
  return {policies::SnapKV(c), Budget::per_layer(caps)};
}

}  // namespace detail

/// Calls fn(entry) for every policy, in listing order (the recommended one first).
template <class Fn>
void for_each_policy(Fn&& fn) {
  using namespace kvevict::policies;
  auto add = [&]<class Policy>(Info info, auto make) {
    fn(Entry<Policy, decltype(make)>{info, make});
  };
  add.template operator()<DecayedAttention>(
      {"decayed",
       "DecayedAttention::recommended() (recommended): decayed attention with horizon C/3, "
       "3/8 of C recent, a recall reserve of C/8, 1 sink",
       Family::kvevict},
      [](const Args&) { return DecayedAttention::recommended(); });
  add.template operator()<StreamingLLM>(
      {"streaming", "StreamingLLM: sinks (--sinks) + sliding window", Family::baseline},
      [](const Args& a) { return StreamingLLM{a.knobs.sinks}; });
  add.template operator()<H2O>(
      {"h2o", "H2O: accumulated attention + recent window (--h2o-recent[-fraction], --h2o-sinks)",
       Family::baseline},
      [](const Args& a) {
        return H2O(
            {.recent = detail::share(a.knobs.h2o_recent_fraction, a.knobs.h2o_recent, a.budget),
             .sinks = a.knobs.h2o_sinks});
      });
  add.template operator()<DecayedAttention>(
      {"tova", "TOVA: drop the row the latest queries attend least (DecayedAttention decay 0)",
       Family::baseline},
      [](const Args&) { return DecayedAttention({.decay = 0.0f}); });
  add.template operator()<KNorm>(
      {"knorm", "KNorm: evict the key with the largest L2 norm (--knorm-sinks)", Family::baseline},
      [](const Args& a) {
        return KNorm(KNorm::Config{a.knobs.knorm_sinks.value_or(a.knobs.sinks), 0});
      });
  add.template operator()<DecayedAttention>(
      {"decayed-excess",
       "recommended() with the recall reserve ranked by excess spike (spike minus the row's "
       "mean long-range draw; RecallRank::excess, against repetitive text)",
       Family::kvevict},
      [](const Args&) {
        return DecayedAttention({.sinks = 1,
                                 .horizon = 3.0f,
                                 .recent_fraction = 0.375f,
                                 .recall_fraction = 0.125f,
                                 .recall_rank = DecayedAttention::RecallRank::excess});
      });
  add.template operator()<DecayedAttention>(
      {"decayed-distinct",
       "recommended() with the distinct-key recall reserve (RecallDedup::protected_rows, "
       "step 0.1: reserve rows whose keys differ modulo RoPE, against repetitive text)",
       Family::kvevict},
      [](const Args& a) {
        return DecayedAttention({.sinks = 1,
                                 .horizon = 3.0f,
                                 .recent_fraction = 0.375f,
                                 .recall_fraction = 0.125f,
                                 .recall_dedup = DecayedAttention::RecallDedup::protected_rows,
                                 .dedup_step = 0.1f,
                                 .rope = a.knobs.rope});
      });
  add.template operator()<DecayedAttention>(
      {"decayed-recall",
       "DecayedAttention::recall(): recommended() with a distinct-key recall reserve of 1/4 of "
       "the rows (recalls early facts through repetitive text; KL above recommended()'s)",
       Family::kvevict},
      [](const Args& a) { return DecayedAttention::recall(a.knobs.rope); });
  // kvevict's probability-free variant of recommended() (chosen with llama2c_headline
  // --tune-scorers, docs/policies/expected_attention.md): 1 sink, the 3/8 recent band, the
  // middle ranked by decayed expected attention.
  static constexpr auto probfree_config = [](const Args& a) {
    return ExpectedAttention::Config{.sinks = 1,
                                     .recent_fraction = 0.375f,
                                     .query_window = 1,
                                     .future_positions = 16,
                                     .covariance = ExpectedAttention::Covariance::none,
                                     .value_norm = true,
                                     .rope = a.knobs.rope,
                                     .rope_base = a.knobs.rope_base,
                                     .horizon = 3.0f};
  };
  // Since issue 16's cost work: float logits, every row rescored on every decision for heads
  // of at most 128 rows (one stale step already costs KL there: docs/quality.md) and on every
  // floor(C / 8)-th decision beyond (probfree-fast's rule, where a full rescoring would cost
  // more than the attention step's 5%). The earlier every-step double form is
  // `probfree_config` as is (`--rescore` in llama2c_headline prints it).
  add.template operator()<ExpectedAttention>(
      {"probfree",
       "probability-free recommended: 1 sink, 3/8 recent, decayed expected attention (W 1); "
       "float logits, all rows rescored every decision up to 128 rows, every floor(C/8)-th beyond",
       Family::kvevict},
      [](const Args& a) {
        auto c = probfree_config(a);
        c.float_logits = true;
        c.rescore_fraction = 1.0f / 8;
        c.rescore_all_up_to = 128;
        return ExpectedAttention(c);
      });
  // The same policy at a fraction of the per-step cost (docs/policies/expected_attention.md
  // "Cost"): float logits through the attention kernel, every row rescored on every
  // floor(C / 8)-th decision of a head of C rows (2 at 16 rows, 128 at 1K; chosen with
  // llama2c_headline --rescore on the tuning streams, docs/quality.md).
  add.template operator()<ExpectedAttention>(
      {"probfree-fast",
       "probfree with float logits, all rows rescored every floor(C/8)-th decision "
       "(arrivals scored on arrival)",
       Family::kvevict},
      [](const Args& a) {
        auto c = probfree_config(a);
        c.float_logits = true;
        c.rescore_fraction = 1.0f / 8;
        return ExpectedAttention(c);
      });
  add.template operator()<ExpectedAttention>(
      {"expected",
       "ExpectedAttention: paper settings (4 sinks, covariance, value norm, W 128)",
       Family::seed},
      [](const Args& a) {
        return ExpectedAttention({.rope = a.knobs.rope, .rope_base = a.knobs.rope_base});
      });
  add.template operator()<KeyDiff>(
      {"keydiff", "KeyDiff: evict the key most similar to the mean unit key (paper settings)",
       Family::seed},
      [](const Args&) { return KeyDiff{}; });
  // Block-granular eviction for a paged engine (docs/quality.md "Paged, block-granular"):
  // whole 16-token blocks leave, the one whose tokens drew the least decayed attention
  // (DecayedAttention h 3, summed per block); the first block and the newest are kept.
  // A budget under 4 blocks of 16 uses the largest power-of-two block that gives 4.
  add.template operator()<BlockGranular<DecayedAttention>>(
      {"block-decayed",
       "block-granular DecayedAttention: whole 16-token blocks (fewer tokens when the budget "
       "holds under 4 blocks), lowest summed decayed attention (h 3) leaves; 1 sink block, "
       "1 recent block",
       Family::kvevict},
      [](const Args& a) {
        std::uint32_t bt = 16;
        while (bt > 1 && bt * 4 > a.budget) bt /= 2;
        return BlockGranular<DecayedAttention>(
            DecayedAttention({.sinks = 1, .recent = 1, .horizon = 3.0f}),
            BlockGranularConfig{.block_tokens = bt, .sink_blocks = 1, .recent_blocks = 1,
                                .score = BlockScore::sum});
      });
  add.template operator()<Random>(
      {"random", "Random eviction, seeded (the floor; --random-sinks, --random-recent[-fraction])",
       Family::baseline},
      [](const Args& a) {
        return Random(Random::Config{
            a.knobs.seed, a.knobs.random_sinks,
            detail::share(a.knobs.random_recent_fraction, a.knobs.random_recent, a.budget)});
      });
  add.template operator()<SnapKV>(
      {"snapkv", "SnapKV: prompt selection by window-32 attention, pool 5", Family::baseline,
       Regime::prompt},
      [](const Args& a) { return SnapKV(SnapKV::Config{.chunked = a.knobs.snapkv_chunked}); });
  add.template operator()<SnapKV>(
      {"xkv", "XKV: per-layer budgets from prompt statistics + SnapKV selection (w 8, pool 7)",
       Family::seed, Regime::prompt, Sizing::budget, true},
      [](const Args& a) { return detail::xkv_setup(a); });
  add.template operator()<SnapKV>(
      {"pyramidkv", "PyramidKV budgets (beta 20) + the same selection as xkv", Family::baseline,
       Regime::prompt, Sizing::budget, true},
      [](const Args& a) { return detail::fixed_allocation_setup(a, true); });
  add.template operator()<SnapKV>(
      {"uniform-w8", "uniform budgets + the same selection as xkv (w 8, pool 7)", Family::baseline,
       Regime::prompt, Sizing::budget, true},
      [](const Args& a) { return detail::fixed_allocation_setup(a, false); });
  add.template operator()<HashEvictKey>(
      {"hashevict", "HashEvict: SimHash of the new key (16 bits), evict the farthest",
       Family::seed},
      [](const Args&) { return HashEvictKey{}; });
  add.template operator()<HashEvictQuery>(
      {"hashevict-q", "HashEvict, paper form: SimHash of the new queries", Family::seed},
      [](const Args&) { return HashEvictQuery{}; });
  add.template operator()<BuzzBeehive>(
      {"buzz", "BUZZ: sinks + window + segmented heavy hitters (budget mode)", Family::seed},
      [](const Args&) { return BuzzBeehive({.budget_mode = true}); });
  add.template operator()<Oracle>(
      {"oracle", "Oracle: attends the true top-budget rows each step (not causal: the ceiling)",
       Family::ceiling, Regime::decode, Sizing::unbounded},
      [](const Args& a) { return Oracle{a.budget}; });
  add.template operator()<FullCache>({"full", "FullCache: keeps every row (the reference)",
                                      Family::ceiling, Regime::reference, Sizing::reference},
                                     [](const Args&) { return FullCache{}; });
}

/// Every policy's Info, in listing order.
inline const std::vector<Info>& infos() {
  static const std::vector<Info> all = [] {
    std::vector<Info> v;
    for_each_policy([&](const auto& e) { v.push_back(e.info); });
    return v;
  }();
  return all;
}

inline const Info* find(std::string_view name) {
  for (const auto& i : infos())
    if (name == i.name) return &i;
  return nullptr;
}

inline std::string names(const char* sep = ", ") {
  std::string out;
  for (const auto& i : infos()) out += fmt::format("{}{}", out.empty() ? "" : sep, i.name);
  return out;
}

/// Width of a table's policy-name column: the registry's longest name (at least 12, the
/// width the tables had before names such as "decayed-excess" outgrew it).
inline std::size_t name_width() {
  static const std::size_t w = [] {
    std::size_t m = 12;
    for (const auto& i : infos()) m = std::max(m, std::string_view(i.name).size());
    return m;
  }();
  return w;
}

/// The policy list for --list / --help: name, family, help.
inline std::string listing() {
  std::string out;
  for (const auto& i : infos())
    out += fmt::format("  {:<{}} {}\n", i.name, name_width(), i.help);
  return out;
}

/// Checks a list of names against the registry (and, for a tool that has no prompt
/// statistics, against needs_prompt); throws cli::UsageError naming the first bad one.
inline void check_names(const std::vector<std::string>& list, std::string_view option,
                        bool have_prompt_stats = true) {
  for (const auto& n : list) {
    const Info* i = find(n);
    if (i == nullptr)
      throw cli::UsageError(
          fmt::format("{}: unknown policy '{}', expected one of: {}", option, n, names()));
    if (i->needs_prompt && !have_prompt_stats)
      throw cli::UsageError(fmt::format(
          "{}: policy '{}' chooses per-layer budgets from the prompt's keys and queries, which "
          "this program does not collect (use kvevict-eval with a synthetic or trace workload)",
          option, n));
  }
}

/// Configures the entry and calls fn(policy, budget) with the policy object and its cache
/// budget; returns what fn returns.
template <class E, class Fn>
decltype(auto) invoke(const E& e, const Args& a, Fn&& fn) {
  using Policy = typename E::policy_type;
  auto made = e.make(a);
  if constexpr (std::is_same_v<decltype(made), Configured<Policy>>)
    return fn(std::move(made.policy), made.budget);
  else
    return fn(std::move(made), cache_budget(e.info.sizing, a.budget));
}

/// Calls fn(policy, budget) for the policy called `name` (fn must return void).
template <class Fn>
void with_policy(std::string_view name, const Args& a, Fn&& fn) {
  bool found = false;
  for_each_policy([&](const auto& e) {
    if (found || name != e.info.name) return;
    found = true;
    invoke(e, a, fn);
  });
  if (!found) kvevict::detail::fail("policy '", name, "', expected one of: ", names());
}

/// Declares --policies LIST (registry names, checked; this program has no prompt
/// statistics) and --budgets LIST (rows per layer and KV head) on a parser.
inline void add_selection_options(cli::Parser& p, std::vector<std::string>& names,
                                  std::vector<std::size_t>& budgets, std::string policies_help) {
  p.custom("--policies", "LIST", std::move(policies_help), [&names](const std::string& v) {
    names = cli::split_list(v);
    check_names(names, "--policies", false);
  });
  std::string defaults;
  for (std::size_t b : budgets) defaults += fmt::format("{}{}", defaults.empty() ? "" : ",", b);
  p.custom("--budgets", "LIST", fmt::format("rows per layer and KV head (default {})", defaults),
           [&budgets](const std::string& v) {
             budgets.clear();
             for (const auto& b : cli::split_list(v))
               budgets.push_back(
                   cli::parse_number<std::size_t>("--budgets", b, cli::Range<std::size_t>{1}));
           });
}

/// Declares the Knobs options on a parser (each tool sets its defaults first).
inline void add_knob_options(cli::Parser& p, Knobs& k) {
  using R = cli::Range<std::size_t>;
  using F = cli::Range<double>;
  p.number("--sinks", "N", "StreamingLLM's sinks (also KNorm's unless --knorm-sinks)", k.sinks,
           R{0});
  p.number("--knorm-sinks", "N", "KNorm's sinks (default: --sinks)", k.knorm_sinks, R{0});
  p.number("--h2o-recent", "N", "H2O's recent window", k.h2o_recent, R{0});
  p.number("--h2o-sinks", "N", "H2O's sinks", k.h2o_sinks, R{0});
  p.number("--h2o-recent-fraction", "F", "> 0: H2O's window is F x budget", k.h2o_recent_fraction,
           F{0.0, 0.99});
  p.number("--random-sinks", "N", "Random's sinks", k.random_sinks, R{0});
  p.number("--random-recent", "N", "Random's recent window", k.random_recent, R{0});
  p.number("--random-recent-fraction", "F", "> 0: Random's window is F x budget",
           k.random_recent_fraction, F{0.0, 0.99});
}

}  // namespace kvevict::registry
