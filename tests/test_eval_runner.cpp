// kvevict-eval's runner: the full cache measures perfect quality, the Oracle bounds every
// causal policy at the same budget, the registry's entries all run, and the needle
// probes are answered by the full cache.
#include <catch2/catch.hpp>
#include <cmath>
#include <string>

#include "registry.hpp"
#include "runner.hpp"
#include "workloads.hpp"

using namespace kvevict::eval;

namespace {

SyntheticConfig small() {
  SyntheticConfig c;
  c.layers = 2;
  c.n_heads = 8;
  c.n_kv_heads = 2;
  c.head_dim = 64;
  c.prompt = 64;
  c.steps = 96;
  return c;
}

Quality run(const std::string& policy, const Workload& w, const Reference& ref,
            std::size_t budget) {
  return find_policy(policy)->run(w, ref, PolicyArgs{budget, 7, &w}, RunOptions{}, {});
}

}  // namespace

TEST_CASE("the full cache measures mass recall 1 and output error 0 exactly") {
  for (const char* name : {"mixed", "needle"}) {
    const auto w = make_synthetic(name, small());
    const auto ref = Reference::compute(w);
    const Quality q = run("full", w, ref, 0);
    CHECK(q.mass_recall == 1.0);
    CHECK(q.output_error == 0.0);
    CHECK(q.topk_recall == 1.0);
    CHECK(q.samples == static_cast<std::size_t>(small().steps * 2 * 8));
    REQUIRE(q.needle_probes == w.needles.size());
    CHECK(q.needle_rate() == 1.0);  // every planted needle is found with the whole cache
  }
}

TEST_CASE("the Oracle bounds every causal policy on mass recall at the same budget") {
  for (const char* name : {"mixed", "heavy", "drift"}) {
    const auto w = make_synthetic(name, small());
    const auto ref = Reference::compute(w);
    for (double f : {0.3, 0.6}) {  // SnapKV needs > 32 rows (its window)
      const auto budget = static_cast<std::size_t>(f * static_cast<double>(w.tokens));
      const Quality oracle = run("oracle", w, ref, budget);
      CHECK(oracle.mass_recall < 1.0);
      for (const auto& e : policy_registry()) {
        if (!e.causal() || e.sizing == Sizing::reference) continue;
        const Quality q = e.run(w, ref, PolicyArgs{budget, 7, &w}, RunOptions{}, {});
        INFO(name << " " << e.name << " at " << budget << ": " << q.mass_recall << " vs oracle "
                  << oracle.mass_recall);
        CHECK(q.mass_recall <= oracle.mass_recall + 1e-9);
        CHECK(q.mass_recall > 0.0);
        CHECK(q.output_error > 0.0);  // a budget below the context loses something
        CHECK(q.samples == oracle.samples);
      }
    }
  }
}

TEST_CASE("needles: StreamingLLM cannot keep an early needle at a small budget") {
  const auto w = make_synthetic("needle", small());
  const auto ref = Reference::compute(w);
  const std::size_t budget = w.tokens / 10;  // far fewer rows than the needle's age
  const Quality s = run("streaming", w, ref, budget);
  CHECK(s.needle_probes == w.needles.size());
  CHECK(s.needles_found == 0);
  const Quality o = run("oracle", w, ref, budget);
  CHECK(o.needle_rate() == 1.0);  // the ceiling attends the needle's row
}

TEST_CASE("quality improves with the budget for StreamingLLM on recency") {
  const auto w = make_synthetic("recency", small());
  const auto ref = Reference::compute(w);
  double prev = 0.0, prev_err = 2.0;
  for (double f : {0.1, 0.3, 0.6, 0.9}) {
    const Quality q = run("streaming", w, ref, static_cast<std::size_t>(f * double(w.tokens)));
    CHECK(q.mass_recall > prev);
    CHECK(q.output_error < prev_err);
    prev = q.mass_recall;
    prev_err = q.output_error;
  }
}

TEST_CASE("a budget below a policy's minimum is reported as a kvevict::Error") {
  const auto w = make_synthetic("mixed", small());
  const auto ref = Reference::compute(w);
  // StreamingLLM keeps 4 sinks, so it needs at least 5 rows.
  CHECK_THROWS_AS(run("streaming", w, ref, 3), kvevict::Error);
}

TEST_CASE("chunked prefill: one chunk of the whole prompt is whole-prompt selection; the decode "
          "rule policies do not depend on the chunk size; SnapKV does") {
  const auto w = make_synthetic("mixed", small());
  const auto ref = Reference::compute(w);
  auto with_chunk = [&](const std::string& policy, std::size_t chunk) {
    RunOptions o;
    o.prefill_chunk = chunk;
    return find_policy(policy)->run(w, ref, PolicyArgs{48, 7, &w}, o, {});
  };
  for (const char* p : {"snapkv", "h2o", "decayed", "xkv"}) {
    const Quality whole = with_chunk(p, 0), one = with_chunk(p, w.prompt);
    CHECK(whole.mass_recall == one.mass_recall);
    CHECK(whole.output_error == one.output_error);
  }
  // H2O and DecayedAttention pass prompt tokens through the decode rule one at a time
  // (with the container's causal attention), so chunking changes nothing.
  for (const char* p : {"h2o", "decayed"}) {
    const Quality whole = with_chunk(p, 0), chunked = with_chunk(p, 16);
    CHECK(whole.mass_recall == chunked.mass_recall);
    CHECK(whole.output_error == chunked.output_error);
  }
  // SnapKV selects again after every chunk (from its held rows plus the chunk), so its
  // figures depend on the chunk size; the first-chunk rule passes later chunks through its
  // decode rule, so every chunk size past the window gives the same figures.
  CHECK(with_chunk("snapkv", 0).output_error != with_chunk("snapkv", 16).output_error);
  auto first_only = [&](std::size_t chunk) {
    RunOptions o;
    o.prefill_chunk = chunk;
    o.chunked = kvevict::policies::ChunkedPrefill::first_chunk;
    return find_policy("snapkv")->run(w, ref, PolicyArgs{48, 7, &w}, o, {});
  };
  CHECK(first_only(16).output_error != with_chunk("snapkv", 16).output_error);
  CHECK(first_only(w.prompt).output_error == with_chunk("snapkv", 0).output_error);
}
