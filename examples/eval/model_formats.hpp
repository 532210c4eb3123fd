#pragma once
// kvevict-eval --kv-format: the llama2.c engine's streaming protocol (--model,
// examples/llama2c/e2e.hpp) and the synthetic/trace workload runner (runner.hpp) with the
// KVCache in each storage format of examples/common/kv_format.hpp, for the policy types
// the memory/quality frontier needs.
//
// Compile time: every (policy type, format) pair is one more instantiation of the engine,
// the cache and the policy. kvevict-eval compiles them outside main.cpp, in
// model_formats_*.cpp (the kvevict_eval_formats library, two translation units that build
// in parallel); a target linking that library sees KVEVICT_EVAL_SPLIT_FORMATS and the
// extern declarations below, anything else instantiates them where it uses them (or,
// with KVEVICT_EVAL_FP32_ONLY, runs every policy in fp32 only and instantiates none).
#include <memory>
#include <span>
#include <string_view>
#include <type_traits>

#include "../llama2c/e2e.hpp"
#include "kv_format.hpp"
#include "runner.hpp"
#include "kvevict/policies/decayed_attention.hpp"
#include "kvevict/policies/expected_attention.hpp"
#include "kvevict/policies/full_cache.hpp"
#include "kvevict/policies/h2o.hpp"
#include "kvevict/policies/streaming_llm.hpp"

namespace kvevict::eval {

/// The policy types --model runs in every format of kv_format.hpp: registry entries of
/// these types (decayed, tova, decayed-excess, decayed-distinct, streaming, h2o, probfree,
/// expected, full) take --kv-format; the others run in fp32 only. A type added here needs
/// its explicit instantiation in model_formats_*.cpp and an extern line below.
/// KVEVICT_EVAL_FP32_ONLY (tests/eval.cmake, for test_eval_runner, which exercises fp32):
/// no policy type takes other formats, so nothing below is instantiated.
#ifdef KVEVICT_EVAL_FP32_ONLY
template <class Policy>
inline constexpr bool kAllKvFormats = false;
#else
template <class Policy>
inline constexpr bool kAllKvFormats =
    std::is_same_v<Policy, policies::DecayedAttention> ||
    std::is_same_v<Policy, policies::StreamingLLM> || std::is_same_v<Policy, policies::H2O> ||
    std::is_same_v<Policy, policies::ExpectedAttention> ||
    std::is_same_v<Policy, policies::FullCache>;
#endif

/// The two protocols with the cache stored in the format called `format` (every format of
/// kv_format.hpp is instantiated for Policy): run() is llama2c::evaluate (--model),
/// synthetic() the workload runner's evaluate (synthetic and trace workloads). Defined out
/// of the class, not inline, so an extern declaration keeps them out of the including
/// translation unit.
template <class Policy>
struct FormatRunner {
  static_assert(kAllKvFormats<Policy>, "FormatRunner: list the policy type in kAllKvFormats");
  static llama2c::Summary run(std::string_view format,
                              const std::shared_ptr<const llama2c::Model>& model,
                              std::span<const llama2c::Stream> streams, const Budget& budget,
                              const Policy& policy, const llama2c::ProtocolOptions& protocol);
  static Quality synthetic(std::string_view format, const Workload& w, const Reference& ref,
                           const Policy& policy, const Budget& budget, const RunOptions& options,
                           const Tick& tick);
};

template <class Policy>
llama2c::Summary FormatRunner<Policy>::run(std::string_view format,
                                           const std::shared_ptr<const llama2c::Model>& model,
                                           std::span<const llama2c::Stream> streams,
                                           const Budget& budget, const Policy& policy,
                                           const llama2c::ProtocolOptions& protocol) {
  llama2c::Summary s;
  registry::with_kv_format(format, [&]<class Scalar>() {
    s = llama2c::evaluate<Policy, Scalar>(model, streams, budget, policy, protocol);
  });
  return s;
}

template <class Policy>
Quality FormatRunner<Policy>::synthetic(std::string_view format, const Workload& w,
                                        const Reference& ref, const Policy& policy,
                                        const Budget& budget, const RunOptions& options,
                                        const Tick& tick) {
  Quality q;
  registry::with_kv_format(format, [&]<class Scalar>() {
    q = evaluate<Policy, Scalar>(w, ref, policy, budget, options, tick);
  });
  return q;
}

#ifdef KVEVICT_EVAL_SPLIT_FORMATS
// Defined in model_formats_a.cpp / model_formats_b.cpp (the kvevict_eval_formats library).
extern template struct FormatRunner<policies::DecayedAttention>;
extern template struct FormatRunner<policies::StreamingLLM>;
extern template struct FormatRunner<policies::FullCache>;
extern template struct FormatRunner<policies::H2O>;
extern template struct FormatRunner<policies::ExpectedAttention>;
#endif

}  // namespace kvevict::eval
