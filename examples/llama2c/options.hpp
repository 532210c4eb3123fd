#pragma once
// Command-line plumbing shared by the llama2c demo and llama2c_e2e: where the model is,
// and a policy chosen by name at run time, handed to a generic callable.
#include <cstdlib>
#include <filesystem>
#include <string>
#include <utility>

#include "kvevict/errors.hpp"
#include "kvevict/geometry.hpp"
#include "kvevict/policies/full_cache.hpp"
#include "kvevict/policies/h2o.hpp"
#include "kvevict/policies/knorm.hpp"
#include "kvevict/policies/oracle.hpp"
#include "kvevict/policies/random.hpp"
#include "kvevict/policies/streaming_llm.hpp"
#if __has_include("kvevict/policies/hash_evict.hpp")
#include "kvevict/policies/hash_evict.hpp"
#define KVEVICT_LLAMA2C_HAS_HASHEVICT 1
#endif
#if __has_include("kvevict/policies/buzz.hpp")
#include "kvevict/policies/buzz.hpp"
#define KVEVICT_LLAMA2C_HAS_BUZZ 1
#endif

namespace kvevict::llama2c {

/// The model directory: an explicit argument, else $KVEVICT_MODEL_DIR, else the shared
/// stories260K next to the repository (when it exists), else "".
inline std::string model_dir(const std::string& arg) {
  if (!arg.empty()) return arg;
  if (const char* env = std::getenv("KVEVICT_MODEL_DIR"); env != nullptr && *env != '\0')
    return env;
#ifdef KVEVICT_LLAMA2C_DEFAULT_MODEL_DIR
  if (std::filesystem::exists(KVEVICT_LLAMA2C_DEFAULT_MODEL_DIR))
    return std::filesystem::weakly_canonical(KVEVICT_LLAMA2C_DEFAULT_MODEL_DIR).string();
#endif
  return "";
}

/// Protection settings the runtime-chosen policies share.
struct PolicyKnobs {
  std::size_t sinks = 4;        ///< StreamingLLM sinks; also Random/KNorm/H2O sinks when set
  std::size_t h2o_recent = 10;  ///< H2O's recent window
  std::size_t h2o_sinks = 0;
  double h2o_recent_fraction = 0.0;  ///< > 0: H2O's window is this share of the budget
  std::size_t random_sinks = 0;
  std::size_t random_recent = 0;
  double random_recent_fraction = 0.0;  ///< > 0: Random's window is this share of the budget
  std::uint64_t seed = 0;
};

/// Where the checkpoint is: --model-dir and --checkpoint (model_dir() resolves the rest).
struct ModelArgs {
  std::string dir;
  std::string checkpoint;
};

/// The option loop both llama2c programs run. It handles --model-dir, --checkpoint and the
/// PolicyKnobs options (--sinks, --h2o-recent, --h2o-sinks, --h2o-recent-fraction,
/// --random-sinks, --random-recent, --random-recent-fraction), and hands every other
/// argument to own(arg, next), which returns false for one it does not know; next()
/// takes the option's value. On -h or --help it calls usage() and returns false.
template <class Own>
bool parse_options(int argc, char** argv, ModelArgs& model, PolicyKnobs& knobs, void (*usage)(),
                   Own&& own) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      detail::require(i + 1 < argc, "option ", a, " needs a value");
      return argv[++i];
    };
    if (a == "-h" || a == "--help") {
      usage();
      return false;
    }
    if (a == "--model-dir")
      model.dir = next();
    else if (a == "--checkpoint")
      model.checkpoint = next();
    else if (a == "--sinks")
      knobs.sinks = std::stoul(next());
    else if (a == "--h2o-recent")
      knobs.h2o_recent = std::stoul(next());
    else if (a == "--h2o-sinks")
      knobs.h2o_sinks = std::stoul(next());
    else if (a == "--h2o-recent-fraction")
      knobs.h2o_recent_fraction = std::stod(next());
    else if (a == "--random-sinks")
      knobs.random_sinks = std::stoul(next());
    else if (a == "--random-recent")
      knobs.random_recent = std::stoul(next());
    else if (a == "--random-recent-fraction")
      knobs.random_recent_fraction = std::stod(next());
    else if (!own(a, next))
      detail::fail("unknown option '", a, "'");
  }
  return true;
}

/// Calls fn(policy, cache_budget) with the policy named `name` configured for `rows`
/// rows per (layer, KV head). FullCache ignores rows; Oracle stores everything and
/// attends to `rows`.
template <class Fn>
decltype(auto) with_policy(const std::string& name, std::size_t rows, const PolicyKnobs& k,
                           Fn&& fn) {
  const auto b = Budget::uniform(static_cast<long long>(rows));
  if (name == "full") return fn(policies::FullCache{}, Budget::unbounded());
  if (name == "streaming") return fn(policies::StreamingLLM{k.sinks}, b);
  auto share = [&](double f, std::size_t fixed) {
    return f > 0.0 ? static_cast<std::size_t>(f * static_cast<double>(rows)) : fixed;
  };
  if (name == "h2o")
    return fn(policies::H2O(
                  policies::H2O::Config{share(k.h2o_recent_fraction, k.h2o_recent), k.h2o_sinks}),
              b);
  if (name == "random")
    return fn(policies::Random(policies::Random::Config{
                  k.seed, k.random_sinks, share(k.random_recent_fraction, k.random_recent)}),
              b);
  if (name == "knorm") return fn(policies::KNorm(policies::KNorm::Config{k.sinks, 0}), b);
  if (name == "oracle") return fn(policies::Oracle{rows}, Budget::unbounded());
#ifdef KVEVICT_LLAMA2C_HAS_HASHEVICT
  // The README's "HashEvict (key, b=16)": the reference code's key form, its defaults.
  if (name == "hashevict") {
    using HE = policies::HashEvictSimHash<policies::HashMode::key>;
    HE::Config c;
    c.bits = 16;
    return fn(HE(c), b);
  }
#endif
#ifdef KVEVICT_LLAMA2C_HAS_BUZZ
  // "BUZZ (budget-mapped)": window and threshold derived from each head's budget.
  if (name == "buzz") {
    policies::BuzzBeehive::Config c;
    c.budget_mode = true;
    return fn(policies::BuzzBeehive(c), b);
  }
#endif
  detail::fail("policy '", name,
               "', expected one of full, streaming, h2o, random, knorm, oracle, hashevict, buzz");
}

}  // namespace kvevict::llama2c
