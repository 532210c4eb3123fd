#pragma once
// Command-line plumbing shared by the llama2c demo and llama2c_e2e: where the model is,
// and a policy of the shared registry (examples/common) chosen by name at run time,
// handed to a generic callable.
#include <cstdlib>
#include <filesystem>
#include <string>
#include <utility>

#include "cli.hpp"
#include "kvevict/errors.hpp"
#include "policy_registry.hpp"

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

/// Protection settings the runtime-chosen policies share (the registry's knobs).
using PolicyKnobs = registry::Knobs;

/// Where the checkpoint is: --model-dir and --checkpoint (model_dir() resolves the rest).
struct ModelArgs {
  std::string dir;
  std::string checkpoint;
};

/// The options both llama2c programs share: --model-dir, --checkpoint and the policy knobs.
inline void add_model_options(cli::Parser& p, ModelArgs& model, PolicyKnobs& knobs) {
  p.text("--model-dir", "DIR",
         "model directory (default $KVEVICT_MODEL_DIR, else ../shared/models/stories260K)",
         model.dir);
  p.text("--checkpoint", "FILE", "checkpoint file (default DIR/stories260K.bin)", model.checkpoint);
  registry::add_knob_options(p, knobs);
}

/// Calls fn(policy, cache_budget) with the registry's policy `name` configured for `rows`
/// rows per (layer, KV head). FullCache ignores rows; Oracle stores everything and
/// attends to `rows`. Policies that need prompt statistics are refused.
template <class Fn>
void with_policy(const std::string& name, std::size_t rows, const PolicyKnobs& k, Fn&& fn) {
  registry::check_names({name}, "--policy", false);
  registry::with_policy(name, registry::Args{rows, k, nullptr}, std::forward<Fn>(fn));
}

}  // namespace kvevict::llama2c
