// The example programs' shared option parser and policy registry (examples/common).
#include <catch2/catch.hpp>
#include <cmath>
#include <kvevict/cache.hpp>
#include <set>
#include <string>
#include <vector>

#include "cli.hpp"
#include "policy_registry.hpp"

using kvevict::cli::parse_number;
using kvevict::cli::Range;
using kvevict::cli::UsageError;

TEST_CASE("parse_number accepts finite in-range numbers and nothing else") {
  CHECK(parse_number<float>("--t", "0.7", Range<float>{0.0f, 100.0f}) == Approx(0.7f));
  CHECK(parse_number<int>("--n", "42", Range<int>{1}) == 42);
  CHECK(parse_number<std::size_t>("--n", "0", Range<std::size_t>{0}) == 0);
  for (const char* bad : {"nan", "NaN", "inf", "-inf", "-1", "1e400", "", "0.5x", " 1", "1 "})
    CHECK_THROWS_AS(parse_number<float>("--t", bad, Range<float>{0.0f, 100.0f}), UsageError);
  CHECK_THROWS_AS(parse_number<float>("--p", "0", Range<float>{0.0f, 1.0f, true}), UsageError);
  CHECK(parse_number<float>("--p", "1", Range<float>{0.0f, 1.0f, true}) == 1.0f);
  CHECK_THROWS_AS(parse_number<float>("--p", "1.5", Range<float>{0.0f, 1.0f, true}), UsageError);
  for (const char* bad : {"-1", "1.5", "1e3", "x", "99999999999999999999999", "+-1"})
    CHECK_THROWS_AS(parse_number<std::size_t>("--n", bad, Range<std::size_t>{0}), UsageError);
  CHECK_THROWS_AS(parse_number<int>("--n", "0", Range<int>{1}), UsageError);
  try {
    parse_number<float>("--temperature", "nan", Range<float>{0.0f, 100.0f});
    FAIL("no throw");
  } catch (const UsageError& e) {
    CHECK(std::string(e.what()) == "--temperature = 'nan', expected a finite number in [0, 100]");
  }
}

TEST_CASE("Parser fills options and positionals, rejects unknown and incomplete arguments") {
  auto run = [](std::vector<std::string> args, float& t, std::string& pos, bool& flag) {
    kvevict::cli::Parser p("prog", "summary");
    p.number("--t", "T", "a number", t, Range<float>{0.0f, 10.0f});
    p.positional("FILE", "a file", pos);
    p.flag("--flag", "a flag", flag);
    std::vector<char*> argv{const_cast<char*>("prog")};
    for (auto& a : args) argv.push_back(a.data());
    return p.parse(static_cast<int>(argv.size()), argv.data());
  };
  float t = 1.0f;
  std::string pos;
  bool flag = false;
  CHECK(run({"--t", "2.5", "file.bin", "--flag"}, t, pos, flag));
  CHECK(t == 2.5f);
  CHECK(pos == "file.bin");
  CHECK(flag);
  CHECK(run({"--t=3"}, t, pos, flag));
  CHECK(t == 3.0f);
  CHECK_THROWS_AS(run({"--t"}, t, pos, flag), UsageError);
  CHECK_THROWS_AS(run({"--t", "nan"}, t, pos, flag), UsageError);
  CHECK_THROWS_AS(run({"--nope"}, t, pos, flag), UsageError);
  CHECK_THROWS_AS(run({"a", "b"}, t, pos, flag), UsageError);  // one positional only
  CHECK_THROWS_AS(run({"--flag=1"}, t, pos, flag), UsageError);
}

TEST_CASE("main_guard prints exit status 2 for bad input, 1 for other failures") {
  CHECK(kvevict::cli::main_guard("prog", [] { return 0; }) == 0);
  CHECK(kvevict::cli::main_guard("prog", []() -> int { throw UsageError("bad"); }) == 2);
  CHECK(kvevict::cli::main_guard("prog", []() -> int { kvevict::detail::fail("bad ", 1); }) == 2);
  CHECK(kvevict::cli::main_guard("prog", []() -> int { throw std::runtime_error("x"); }) == 1);
}

TEST_CASE("the registry holds every policy of include/kvevict/policies, recommended first") {
  const auto& infos = kvevict::registry::infos();
  REQUIRE(!infos.empty());
  CHECK(std::string(infos.front().name) == "decayed");
  std::set<std::string> names, types;
  kvevict::registry::for_each_policy([&](const auto& e) {
    using Policy = typename std::decay_t<decltype(e)>::policy_type;
    CHECK(names.insert(e.info.name).second);  // unique names
    types.insert(Policy::name());
  });
  // One entry per policy class (XkvLayerAllocator and PyramidKV budgets drive SnapKV).
  const std::set<std::string> expected{"DecayedAttention",
                                       "StreamingLLM",
                                       "H2O",
                                       "KNorm",
                                       "Random",
                                       "SnapKV",
                                       "HashEvictSimHash<key>",
                                       "HashEvictSimHash<query>",
                                       "BuzzBeehive",
                                       "Oracle",
                                       "FullCache",
                                       "ExpectedAttention",
                                       "KeyDiff",
                                       "BlockGranular"};
  CHECK(types == expected);
  for (const char* n : {"xkv", "pyramidkv", "uniform-w8", "tova", "expected", "keydiff", "probfree",
                        "probfree-fast", "decayed-excess", "decayed-distinct", "decayed-recall",
                        "block-decayed"})
    CHECK(names.count(n) == 1);
  // Every entry configures and hands over its policy (prompt statistics where needed).
  const kvevict::Geometry g{.n_layers = 2, .n_heads = 4, .n_kv_heads = 2, .head_dim = 8};
  const std::size_t prompt = 48;
  std::vector<float> k(2 * prompt * 2 * 8, 0.5f), q(2 * prompt * 4 * 8, 0.25f);
  for (std::size_t i = 0; i < k.size(); ++i) k[i] = std::sin(0.37f * static_cast<float>(i));
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = std::cos(0.11f * static_cast<float>(i));
  kvevict::registry::PromptStats stats{g, prompt, {}, {}};
  for (std::size_t l = 0; l < 2; ++l) {
    stats.keys.emplace_back(k.data() + l * prompt * 16, prompt * 16);
    stats.queries.emplace_back(q.data() + l * prompt * 32, prompt * 32);
  }
  for (const auto& info : infos) {
    int calls = 0;
    kvevict::registry::with_policy(info.name, {40, {}, &stats},
                                   [&](auto policy, const kvevict::Budget& b) {
                                     kvevict::KVCache<decltype(policy)> cache(g, b, policy);
                                     ++calls;
                                   });
    CHECK(calls == 1);
  }
  CHECK_THROWS_AS(kvevict::registry::check_names({"xkv"}, "--policy", false), UsageError);
  CHECK_THROWS_AS(kvevict::registry::check_names({"nope"}, "--policy"), UsageError);
}
