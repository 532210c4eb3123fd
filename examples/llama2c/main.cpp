// llama2c: generate text from a llama2.c checkpoint with a chosen eviction policy.
//   llama2c [CHECKPOINT [TOKENIZER]] [--model-dir DIR] [--checkpoint FILE] [--tokenizer FILE]
//           [--policy NAME]
//           [--budget ROWS] [--steps N] [--temperature T] [--top-p P] [--seed S] [--prompt TEXT]
// With temperature 0 (the default) decoding is greedy: from BOS on stories260K with the
// full cache it prints "Once upon a time, there was a little girl named Lily. ...".
#include <cstdio>
#include <cstring>
#include <exception>
#include <random>
#include <string>

#include <fmt/format.h>

#include "e2e.hpp"
#include "llama2c.hpp"
#include "options.hpp"

namespace {

void usage() {
  fmt::print(stderr,
               "usage: llama2c [CHECKPOINT [TOKENIZER]] [--model-dir DIR] [--checkpoint FILE]\n"
               "               [--tokenizer FILE]\n"
               "               [--policy full|streaming|h2o|random|knorm|oracle|hashevict|buzz] "
               "[--budget ROWS]\n"
               "               [--sinks N] [--steps N] [--temperature T] [--top-p P] [--seed S] "
               "[--prompt TEXT]\n"
               "               [--h2o-recent N] [--h2o-sinks N] [--h2o-recent-fraction F]\n"
               "               [--random-sinks N] [--random-recent N] "
               "[--random-recent-fraction F]\n"
               "Model directory: --model-dir, else $KVEVICT_MODEL_DIR, else ../shared/models/"
               "stories260K\n(stories260K.bin and tok512.bin inside it).\n");
}

}  // namespace

int main(int argc, char** argv) {
  using namespace kvevict::llama2c;
  ModelArgs m;
  std::string tokenizer, policy = "full", prompt;
  std::size_t budget = 64;
  int steps = 256;
  float temperature = 0.0f;
  float top_p = 1.0f;
  PolicyKnobs knobs;
  try {
    const bool run =
        parse_options(argc, argv, m, knobs, usage, [&](const std::string& a, auto& next) {
          if (a == "--tokenizer")
            tokenizer = next();
          else if (a == "--policy")
            policy = next();
          else if (a == "--budget")
            budget = std::stoul(next());
          else if (a == "--steps")
            steps = std::stoi(next());
          else if (a == "--temperature")
            temperature = std::stof(next());
          else if (a == "--top-p")
            top_p = std::stof(next());
          else if (a == "--seed")
            knobs.seed = std::stoull(next());
          else if (a == "--prompt")
            prompt = next();
          else if (a.rfind("--", 0) != 0 && m.checkpoint.empty())
            m.checkpoint = a;  // positional: CHECKPOINT [TOKENIZER], as llama2.c's run
          else if (a.rfind("--", 0) != 0 && tokenizer.empty())
            tokenizer = a;
          else
            return false;
          return true;
        });
    if (!run) return 0;  // --help
    std::string& checkpoint = m.checkpoint;
    const std::string dir = model_dir(m.dir);
    if (checkpoint.empty() || tokenizer.empty())
      kvevict::detail::require(!dir.empty(),
                               "no model: pass --checkpoint and --tokenizer, "
                               "--model-dir, or set KVEVICT_MODEL_DIR");
    if (checkpoint.empty()) checkpoint = dir + "/stories260K.bin";
    if (tokenizer.empty()) tokenizer = dir + "/tok512.bin";

    auto model = std::make_shared<const Model>(Model::load(checkpoint));
    const Tokenizer tok = Tokenizer::load(tokenizer, model->config().vocab_size);
    const auto& c = model->config();
    fmt::print(
        stderr,
        "model: dim {}, hidden {}, layers {}, heads {}, kv heads {}, vocab {}, seq_len {}\n", c.dim,
        c.hidden_dim, c.n_layers, c.n_heads, c.n_kv_heads, c.vocab_size, c.seq_len);
    kvevict::detail::require(steps >= 1 && steps <= c.seq_len, "--steps = ", steps,
                             ", expected 1..", c.seq_len);
    std::vector<int> prompt_ids = tok.encode(prompt, true, false);

    with_policy(policy, budget, knobs, [&](auto pol, const kvevict::Budget& b) {
      Transformer<decltype(pol)> tf(model, b, pol);
      std::mt19937_64 rng(knobs.seed);
      fmt::print(stderr, "policy {}, budget {} rows per layer and KV head\n",
                   decltype(pol)::name(), budget);
      int token = prompt_ids[0];
      for (int pos = 0; pos < steps; ++pos) {
        const auto logits = tf.forward(token, pos);
        int next;
        if (static_cast<std::size_t>(pos) + 1 < prompt_ids.size())
          next = prompt_ids[static_cast<std::size_t>(pos) + 1];
        else
          next = kvevict::llama2c::detail::sample(logits, temperature, rng, top_p);
        if (next == Tokenizer::kBos) break;  // llama2.c stops at the next story's BOS
        std::fputs(tok.decode(token, next).c_str(), stdout);
        std::fflush(stdout);
        token = next;
      }
      std::fputs("\n", stdout);
      return 0;
    });
  } catch (const std::exception& e) {
    fmt::print(stderr, "llama2c: {}\n", e.what());
    return 1;
  }
  return 0;
}
