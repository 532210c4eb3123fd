// llama2c_e2e: the end-to-end protocol on a llama2.c checkpoint, policies x budgets.
// Samples `--streams` streams of `--tokens` tokens with the full cache, feeds each one
// token at a time under every policy and budget, and prints markdown tables of
// KL(full || policy) per token, top-1 agreement and perplexity.
#include <chrono>
#include <cstdio>
#include <exception>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "e2e.hpp"
#include "llama2c.hpp"
#include "options.hpp"

namespace {

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

void usage() {
  fmt::print(
      stderr,
      "usage: llama2c_e2e [--model-dir DIR] [--checkpoint FILE] [--streams N] [--tokens T]\n"
      "                   [--temperature X] [--top-p P] [--seed S] [--budgets 16,32,64,128]\n"
      "                   [--policies streaming,h2o,random,oracle] [--skip N] [--sinks N]\n"
      "                   [--h2o-recent N] [--h2o-sinks N] [--random-sinks N]\n"
      "                   [--random-recent N] [--h2o-recent-fraction F]\n"
      "                   [--random-recent-fraction F] [--policy-seed S]\n"
      "Defaults reproduce the stories260K reference table: 4 streams of 512 tokens at\n"
      "temperature 1, seeds 0.., StreamingLLM sinks 1, H2O and Random recent = budget / 4.\n"
      "Stream i is sampled with seed S + i. Model directory: --model-dir, else\n"
      "$KVEVICT_MODEL_DIR, else ../shared/models/stories260K.\n");
}

}  // namespace

int main(int argc, char** argv) {
  using namespace kvevict::llama2c;
  int n_streams = 4;
  SampleOptions sample;
  ProtocolOptions proto;
  std::vector<std::string> budgets = {"16", "32", "64", "128"};
  // Defaults: the protocol that reproduces the stories260K reference table (docs/engine.md).
  std::vector<std::string> names = {"streaming", "h2o",
#ifdef KVEVICT_LLAMA2C_HAS_HASHEVICT
                                    "hashevict",
#endif
#ifdef KVEVICT_LLAMA2C_HAS_BUZZ
                                    "buzz",
#endif
                                    "random",    "oracle"};
  PolicyKnobs knobs;
  knobs.sinks = 1;
  knobs.h2o_recent_fraction = 0.25;
  knobs.random_recent_fraction = 0.25;
  try {
    ModelArgs m;
    const bool run =
        parse_options(argc, argv, m, knobs, usage, [&](const std::string& a, auto& next) {
          if (a == "--streams")
            n_streams = std::stoi(next());
          else if (a == "--tokens")
            sample.tokens = std::stoi(next());
          else if (a == "--temperature")
            sample.temperature = std::stof(next());
          else if (a == "--top-p")
            sample.top_p = std::stof(next());
          else if (a == "--seed")
            sample.seed = std::stoull(next());
          else if (a == "--budgets")
            budgets = split(next());
          else if (a == "--policies")
            names = split(next());
          else if (a == "--skip")
            proto.skip = std::stoul(next());
          else if (a == "--policy-seed")
            knobs.seed = std::stoull(next());
          else
            return false;
          return true;
        });
    if (!run) return 0;  // --help
    std::string dir = m.dir, checkpoint = m.checkpoint;
    kvevict::detail::require(n_streams >= 1, "--streams = ", n_streams, ", expected >= 1");
    if (checkpoint.empty()) {
      dir = model_dir(dir);
      kvevict::detail::require(!dir.empty(),
                               "no model: pass --checkpoint or --model-dir, or set "
                               "KVEVICT_MODEL_DIR");
      checkpoint = dir + "/stories260K.bin";
    }
    const auto t0 = std::chrono::steady_clock::now();
    auto model = std::make_shared<const Model>(Model::load(checkpoint));
    std::vector<Stream> streams;
    const std::uint64_t seed0 = sample.seed;
    for (int s = 0; s < n_streams; ++s) {
      sample.seed = seed0 + static_cast<std::uint64_t>(s);
      streams.push_back(sample_stream(model, sample));
    }
    std::vector<std::vector<Summary>> table(budgets.size(), std::vector<Summary>(names.size()));
    std::vector<std::string> headers(names.size());
    for (std::size_t b = 0; b < budgets.size(); ++b)
      for (std::size_t p = 0; p < names.size(); ++p) {
        const std::size_t rows = std::stoul(budgets[b]);
        table[b][p] = with_policy(names[p], rows, knobs, [&](auto pol, const kvevict::Budget& bud) {
          headers[p] = decltype(pol)::name();
          return evaluate(model, std::span<const Stream>(streams), bud, pol, proto);
        });
      }
    const Summary full =
        evaluate(model, std::span<const Stream>(streams), kvevict::Budget::unbounded(),
                 kvevict::policies::FullCache{}, proto);
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

    auto window = [](double f, std::size_t n) {
      return f > 0.0 ? fmt::format("{} x budget", f) : fmt::format("{}", n);
    };
    fmt::print(
        "T = {}, {} streams (temperature {:g}, top-p {:g}, seeds {}..{}), positions counted from "
        "{} "
        "({} per cell); StreamingLLM sinks {}; H2O sinks {}, recent {}; Random sinks "
        "{}, recent {}, seed {}; full-cache perplexity {:.4f}; {:.1f} s\n\n",
        sample.tokens, n_streams, static_cast<double>(sample.temperature),
        static_cast<double>(sample.top_p), static_cast<unsigned long long>(seed0),
        static_cast<unsigned long long>(seed0 + static_cast<std::uint64_t>(n_streams) - 1),
        proto.skip, full.positions, knobs.sinks, knobs.h2o_sinks,
        window(knobs.h2o_recent_fraction, knobs.h2o_recent), knobs.random_sinks,
        window(knobs.random_recent_fraction, knobs.random_recent),
        static_cast<unsigned long long>(knobs.seed), full.perplexity_full, secs);
    auto print = [&](const char* title, auto get, int decimals) {
      fmt::print("{}\n\n| budget |", title);
      for (const auto& h : headers) fmt::print(" {} |", h);
      fmt::print("\n|---|");
      for (std::size_t p = 0; p < names.size(); ++p) fmt::print("---|");
      fmt::print("\n");
      for (std::size_t b = 0; b < budgets.size(); ++b) {
        fmt::print("| {} |", budgets[b]);
        for (std::size_t p = 0; p < names.size(); ++p) fmt::print(" {:.{}f} |", get(table[b][p]), decimals);
        fmt::print("\n");
      }
      fmt::print("\n");
    };
    print(
        "Mean KL(full || policy) per token, nats", [](const Summary& s) { return s.mean_kl; },
        4);
    print(
        "Top-1 agreement with the full cache", [](const Summary& s) { return s.top1; }, 3);
    print(
        "Perplexity of the stream under the policy", [](const Summary& s) { return s.perplexity; },
        3);
  } catch (const std::exception& e) {
    fmt::print(stderr, "llama2c_e2e: {}\n", e.what());
    return 1;
  }
  return 0;
}
