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

using kvevict::cli::split_list;

}  // namespace

int main(int argc, char** argv) {
  return kvevict::cli::main_guard("llama2c_e2e", [&] {
    using namespace kvevict::llama2c;
    using kvevict::cli::Range;
    int n_streams = 4;
    SampleOptions sample;
    ProtocolOptions proto;
    std::vector<std::string> budgets = {"16", "32", "64", "128"};
    // Defaults: the protocol that reproduces the stories260K reference table (docs/engine.md).
    std::vector<std::string> names = {"streaming", "h2o", "hashevict", "buzz", "random", "oracle"};
    PolicyKnobs knobs = PolicyKnobs::reference_protocol();
    {
      ModelArgs m;
      kvevict::cli::Parser p(
          "llama2c_e2e",
          "The end-to-end protocol on a llama2.c checkpoint: samples --streams streams of "
          "--tokens\n"
          "tokens with the full cache, feeds each one token at a time under every policy and\n"
          "budget, and prints markdown tables of KL(full || policy) per token, top-1 agreement\n"
          "and perplexity.");
      add_model_options(p, m, knobs);
      p.number("--streams", "N", "streams sampled (stream i with seed S + i)", n_streams,
               Range<int>{1, 100000});
      p.number("--tokens", "T", "tokens per stream (at most the checkpoint's seq_len)",
               sample.tokens, Range<int>{2});
      p.number("--temperature", "X", "sampling temperature of the streams", sample.temperature,
               Range<float>{0.0f, 100.0f});
      p.number("--top-p", "P", "nucleus mass of the streams, in (0, 1]", sample.top_p,
               Range<float>{0.0f, 1.0f, true});
      p.number("--seed", "S", "seed of stream 0", sample.seed, Range<std::uint64_t>{0});
      p.custom(
          "--budgets", "LIST", "rows per layer and KV head, comma-separated (default 16,32,64,128)",
          [&](const std::string& v) {
            budgets = split_list(v);
            for (const auto& b : budgets)
              (void)kvevict::cli::parse_number<std::size_t>("--budgets", b, Range<std::size_t>{1});
          });
      p.custom("--policies", "LIST",
               "policy names, comma-separated (default streaming,h2o,hashevict,buzz,random,oracle)",
               [&](const std::string& v) {
                 names = split_list(v);
                 kvevict::registry::check_names(names, "--policies", false);
               });
      p.number("--skip", "N", "positions not counted at the start of each stream", proto.skip,
               Range<std::size_t>{0});
      p.number("--policy-seed", "S", "seed of the random policy", knobs.seed,
               Range<std::uint64_t>{0});
      p.info("--list", "list the policies, then exit",
             [] { fmt::print("policies:\n{}", kvevict::registry::listing()); });
      p.epilog(
          "Defaults reproduce the stories260K reference table: 4 streams of 512 tokens at\n"
          "temperature 1, seeds 0.., StreamingLLM sinks 1, H2O and Random recent = budget / 4.\n"
          "Model directory: --model-dir, else $KVEVICT_MODEL_DIR, else "
          "../shared/models/stories260K.\n");
      if (!p.parse(argc, argv)) return 0;
      std::string dir = m.dir, checkpoint = m.checkpoint;
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
          with_policy(names[p], rows, knobs, [&](auto pol, const kvevict::Budget& bud) {
            headers[p] = decltype(pol)::name();
            table[b][p] = evaluate(model, std::span<const Stream>(streams), bud, pol, proto);
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
    }
    return 0;
  });
}
