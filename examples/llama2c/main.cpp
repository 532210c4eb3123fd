// llama2c: generate text from a llama2.c checkpoint with any policy of the registry.
//   llama2c [CHECKPOINT [TOKENIZER]] [--model-dir DIR] [--policy NAME] [--budget ROWS]
//           [--steps N] [--positions keep|reindex] [--temperature T] [--top-p P] ...
// With temperature 0 (the default) decoding is greedy: from BOS on stories260K with the
// full cache it prints "Once upon a time, there was a little girl named Lily. ...".
// A bounded policy generates past the checkpoint's seq_len (docs/engine.md).
// A Hugging Face checkpoint directory (config.json inside; --model-dir or CHECKPOINT) runs
// too: its tokenizer.json, when present, decodes the output (hf_tokenizer.hpp; without one,
// or with an unsupported decoder, the ids are printed); --prompt needs llama2.c's tokenizer.
#include <fmt/format.h>
#include <time.h>

#include <algorithm>
#include <cstdio>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "cli.hpp"
#include "e2e.hpp"
#include "hf.hpp"
#include "hf_tokenizer.hpp"
#include "llama2c.hpp"
#include "options.hpp"

namespace {

using namespace kvevict::llama2c;

struct Args {
  ModelArgs model;
  std::string tokenizer, policy = "full", prompt, positions = "keep";
  std::size_t budget = 64;
  int steps = 256;
  float temperature = 0.0f;
  float top_p = 1.0f;
  bool keep_going = false, timing = false;
  PolicyKnobs knobs;
};

double thread_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// Per-token CPU time in blocks of 1000 tokens (medians), on stderr.
void report_timing(const std::vector<double>& per_token) {
  constexpr std::size_t kBlock = 1000;
  std::vector<double> medians;
  for (std::size_t b = 0; b + kBlock <= per_token.size(); b += kBlock) {
    std::vector<double> x(per_token.begin() + static_cast<std::ptrdiff_t>(b),
                          per_token.begin() + static_cast<std::ptrdiff_t>(b + kBlock));
    std::nth_element(x.begin(), x.begin() + kBlock / 2, x.end());
    medians.push_back(x[kBlock / 2]);
    fmt::print(stderr, "timing: tokens {:>6}-{:<6} median CPU per token {:.1f} us\n", b,
               b + kBlock - 1, 1e6 * x[kBlock / 2]);
  }
  if (medians.size() >= 2)
    fmt::print(stderr, "timing: last / first thousand = {:.3f}\n",
               medians.back() / medians.front());
}

int run(int argc, char** argv) {
  Args a;
  using kvevict::cli::Range;
  kvevict::cli::Parser p("llama2c",
                         "Generates text from a llama2.c checkpoint with a KV-eviction policy.");
  p.positional("CHECKPOINT", "checkpoint file (as llama2.c's run)", a.model.checkpoint);
  p.positional("TOKENIZER", "tokenizer file", a.tokenizer);
  add_model_options(p, a.model, a.knobs);
  p.text("--tokenizer", "FILE", "tokenizer (default DIR/tok512.bin)", a.tokenizer);
  p.custom("--policy", "NAME", "eviction policy (default full; see --list)",
           [&](const std::string& v) {
             kvevict::registry::check_names({v}, "--policy", false);
             a.policy = v;
           });
  p.number("--budget", "ROWS", "rows per layer and KV head", a.budget, Range<std::size_t>{1});
  p.number("--steps", "N",
           "tokens to run; beyond the checkpoint's seq_len only with a bounded policy", a.steps,
           Range<int>{1});
  p.custom(
      "--positions", "MODE",
      "keep: keys rotated at their position and stored (default); reindex: stored before "
      "rotation and re-indexed inside the cache at attention (StreamingLLM)",
      [&](const std::string& v) {
        if (v != "keep" && v != "reindex")
          throw kvevict::cli::UsageError("--positions = '" + v + "', expected keep or reindex");
        a.positions = v;
      });
  p.number("--temperature", "T", "sampling temperature; 0 = greedy", a.temperature,
           Range<float>{0.0f, 100.0f});
  p.number("--top-p", "P", "nucleus sampling mass in (0, 1]", a.top_p,
           Range<float>{0.0f, 1.0f, true});
  p.number("--seed", "S", "seed of sampling and of the random policy", a.knobs.seed,
           Range<std::uint64_t>{0});
  p.custom("--prompt", "TEXT", "text the generation starts from",
           [&](const std::string& v) { a.prompt = v; });
  p.flag("--keep-going", "do not stop at a BOS token: the next story follows in the same context",
         a.keep_going);
  p.flag("--timing", "print per-token CPU time per 1000 tokens on stderr", a.timing);
  p.info("--list", "list the policies, then exit",
         [] { fmt::print("policies:\n{}", kvevict::registry::listing()); });
  p.epilog(
      "Model directory: --model-dir, else $KVEVICT_MODEL_DIR, else ../shared/models/stories260K\n"
      "(stories260K.bin and tok512.bin inside it), or a Hugging Face checkpoint directory\n"
      "(config.json, *.safetensors, optional tokenizer.json to print text; docs/real_models.md).\n"
      "Exit status 2 on bad arguments or input.\n");
  if (!p.parse(argc, argv)) return 0;

  std::string checkpoint = a.model.checkpoint, tokenizer = a.tokenizer;
  const std::string dir = model_dir(a.model.dir);
  if (checkpoint.empty() || tokenizer.empty())
    kvevict::detail::require(!dir.empty(),
                             "no model: pass --checkpoint and --tokenizer, "
                             "--model-dir, or set KVEVICT_MODEL_DIR");
  if (checkpoint.empty() && hf::is_checkpoint_dir(dir)) checkpoint = dir;
  if (checkpoint.empty()) checkpoint = dir + "/stories260K.bin";
  const bool hf_model = hf::is_checkpoint_dir(checkpoint);

  auto model = std::make_shared<const Model>(load_any(checkpoint));
  const auto& c = model->config();
  // Text: llama2.c's tokenizer, or a Hugging Face directory's tokenizer.json (decode only).
  std::optional<Tokenizer> tok;
  std::optional<hf::TokenizerJson> tok_json;
  if (hf_model) {
    if (!a.prompt.empty())
      throw kvevict::cli::UsageError(
          "--prompt: a Hugging Face checkpoint's tokenizer.json is read for decoding only; "
          "generation starts from bos_token_id");
    tok_json = hf::TokenizerJson::load_if_present(checkpoint);
    if (!tok_json)
      fmt::print(stderr, "llama2c: warning: no tokenizer.json in {}: printing token ids\n",
                 checkpoint);
    else if (!tok_json->unsupported().empty())
      fmt::print(stderr, "llama2c: warning: tokenizer.json {} is not supported: printing token ids\n",
                 tok_json->unsupported());
  } else {
    if (tokenizer.empty()) tokenizer = dir + "/tok512.bin";
    tok = Tokenizer::load(tokenizer, c.vocab_size);
  }
  const std::vector<int> prompt_ids =
      tok ? tok->encode(a.prompt, true, false) : std::vector<int>{c.bos_token};
  const int stop_token = tok ? Tokenizer::kBos : c.bos_token;  // llama2.c stops at the next BOS
  std::optional<hf::IncrementalDecoder> incremental;
  if (tok_json && tok_json->unsupported().empty()) incremental.emplace(*tok_json);
  const Positions positions = a.positions == "reindex" ? Positions::reindex : Positions::keep;

  with_policy(a.policy, a.budget, a.knobs, [&](auto pol, const kvevict::Budget& b) {
    using Policy = decltype(pol);
    if (b.is_unbounded() && a.steps > c.seq_len)
      throw kvevict::cli::UsageError(fmt::format(
          "--steps = {}: policy {} keeps every row, so it stops at the checkpoint's seq_len = {}; "
          "a bounded policy (e.g. --policy decayed --budget 64) generates further",
          a.steps, a.policy, c.seq_len));
    fmt::print(stderr,
               "model: dim {}, hidden {}, layers {}, heads {}, kv heads {}, vocab {}, seq_len {}\n",
               c.dim, c.hidden_dim, c.n_layers, c.n_heads, c.n_kv_heads, c.vocab_size, c.seq_len);
    if (a.policy == "full")
      fmt::print(stderr, "policy {}: every row kept (no budget), positions {}\n", Policy::name(),
                 a.positions);
    else if (b.is_unbounded())
      fmt::print(stderr,
                 "policy {}: every row stored, attention to the top {} rows per layer "
                 "and KV head, positions {}\n",
                 Policy::name(), a.budget, a.positions);
    else
      fmt::print(stderr, "policy {} ({}), budget {} rows per layer and KV head, positions {}\n",
                 Policy::name(), a.policy, a.budget, a.positions);
    Transformer<Policy> tf(model, b, std::move(pol), positions);
    std::mt19937_64 rng(a.knobs.seed);
    std::vector<double> per_token;
    if (a.timing) per_token.reserve(static_cast<std::size_t>(a.steps));
    int token = prompt_ids[0];
    for (int pos = 0; pos < a.steps; ++pos) {
      const double t0 = a.timing ? thread_cpu_seconds() : 0.0;
      const auto logits = tf.forward(token, pos);
      int next;
      if (static_cast<std::size_t>(pos) + 1 < prompt_ids.size())
        next = prompt_ids[static_cast<std::size_t>(pos) + 1];
      else
        next = kvevict::llama2c::detail::sample(logits, a.temperature, rng, a.top_p);
      if (a.timing) per_token.push_back(thread_cpu_seconds() - t0);
      if (next == stop_token && !a.keep_going) break;  // llama2.c stops at the next BOS
      if (next == stop_token)
        std::fputs("\n", stdout);
      else if (tok)
        std::fputs(tok->decode(token, next).c_str(), stdout);
      else if (incremental)
        std::fputs(incremental->push(next).c_str(), stdout);
      else
        fmt::print("{} ", next);
      std::fflush(stdout);
      token = next;
    }
    std::fputs("\n", stdout);
    if (a.timing) report_timing(per_token);
  });
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return kvevict::cli::main_guard("llama2c", [&] { return run(argc, argv); });
}
