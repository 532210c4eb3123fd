// llama2c_decode_timing: decode CPU time per token against context length in the llama2c
// engine, for the full cache and bounded policies (docs/benchmarks.md, "End to end").
//   llama2c_decode_timing [--model-dir DIR] [--policies full,streaming,h2o,decayed]
//                         [--budget ROWS] [--max-context N] [--window W] [--alloc-attend]
// Every policy gets its own Transformer; they are stepped in lockstep (token t of every
// policy, then token t + 1), so load from other processes hits them alike. The tokens are
// pseudo-random and the checkpoint's position limit is lifted for timing only (the outputs
// past seq_len are meaningless; the work per token is the real one). For each context
// length 512, 1K, 2K, ... <= N it prints the median thread CPU time per token over the W
// tokens ending there, as a markdown table and as CSV lines ("csv,policy,context,us").
// Unless --no-anchor, a row "K+V read pass" times, after each full-cache token, one pass that
// reads every K and V byte that cache holds: the memory cost its attention cannot avoid.
// --alloc-attend adds, per policy, a second engine with an (empty) attention observer set, so
// its forward() takes the allocating attend(cache, layer, q) path instead of the reused
// workspace; both run in lockstep.
#include <fmt/format.h>
#include <time.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "cli.hpp"
#include "llama2c.hpp"
#include "options.hpp"

namespace {

using namespace kvevict::llama2c;

double thread_cpu_us() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e6 + static_cast<double>(ts.tv_nsec) * 1e-3;
}

std::uint32_t sink = 0;  // keeps the anchor's reads alive

std::uint32_t xor_words(const float* p, std::size_t n) {
  std::uint32_t acc[8] = {};
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) acc[j] ^= std::bit_cast<std::uint32_t>(p[i + j]);
  for (; i < n; ++i) acc[0] ^= std::bit_cast<std::uint32_t>(p[i]);
  std::uint32_t r = 0;
  for (const std::uint32_t x : acc) r ^= x;
  return r;
}

struct Args {
  ModelArgs model;
  PolicyKnobs knobs;
  std::vector<std::string> policies{"full", "streaming", "h2o", "decayed"};
  std::size_t budget = 128;
  int max_context = 8192;
  int window = 64;
  bool alloc_attend = false;
  bool read_anchor = true;
};

struct Runner {
  std::string name;
  std::function<void(int token, int pos)> step;
  std::vector<double> us;  // per token
};

int run(int argc, char** argv) {
  Args a;
  using kvevict::cli::Range;
  kvevict::cli::Parser p("llama2c_decode_timing",
                         "Decode CPU time per token against context length, per policy.");
  add_model_options(p, a.model, a.knobs);
  p.custom("--policies", "LIST", "registry policies (default full,streaming,h2o,decayed)",
           [&](const std::string& v) {
             a.policies = kvevict::cli::split_list(v);
             kvevict::registry::check_names(a.policies, "--policies", false);
           });
  p.number("--budget", "ROWS", "rows per layer and KV head of the bounded policies", a.budget,
           Range<std::size_t>{1});
  p.number("--max-context", "N", "tokens to run (context lengths 512, 1K, ... <= N)",
           a.max_context, Range<int>{512, 1 << 20});
  p.number("--window", "W", "tokens per median, ending at each context length", a.window,
           Range<int>{1, 512});
  p.flag("--alloc-attend",
         "also run each policy through the allocating attend() (a second engine with an "
         "attention observer set), in lockstep",
         a.alloc_attend);
  bool no_anchor = false;
  p.flag("--no-anchor", "skip the K+V read pass timed after each full-cache token", no_anchor);
  if (!p.parse(argc, argv)) return 0;
  a.read_anchor = !no_anchor;

  const std::string dir = model_dir(a.model.dir);
  const std::string checkpoint =
      !a.model.checkpoint.empty() ? a.model.checkpoint : dir + "/stories260K.bin";
  kvevict::detail::require(!a.model.checkpoint.empty() || !dir.empty(),
                           "no model: pass --checkpoint or --model-dir, or set KVEVICT_MODEL_DIR");
  auto model = std::make_shared<const Model>(Model::load(checkpoint));
  const auto& c = model->config();

  std::vector<Runner> runners;
  for (const auto& name : a.policies) {
    with_policy(name, a.budget, a.knobs, [&](auto pol, const kvevict::Budget& b) {
      using Policy = decltype(pol);
      const std::string name = b.is_unbounded()
                                   ? fmt::format("{}", Policy::name())
                                   : fmt::format("{} ({} rows)", Policy::name(), a.budget);
      auto tf = std::make_shared<Transformer<Policy>>(model, b, pol);
      tf->set_position_limit_for_timing(a.max_context);
      auto add = [&](const std::shared_ptr<Transformer<Policy>>& t, std::string label) {
        Runner r;
        r.name = std::move(label);
        r.step = [t](int token, int pos) {
          const auto logits = t->forward(token, pos);
          if (logits.empty()) kvevict::detail::fail("forward returned no logits");
        };
        r.us.reserve(static_cast<std::size_t>(a.max_context));
        runners.push_back(std::move(r));
      };
      add(tf, name);
      if (a.alloc_attend) {  // the same policy through the allocating attend(), in lockstep
        auto ta = std::make_shared<Transformer<Policy>>(model, b, pol);
        ta->set_position_limit_for_timing(a.max_context);
        ta->set_attention_observer(
            [](int, std::span<const float>, const kvevict::AttentionResult&) {});
        add(ta, name + ", allocating attend()");
      }
      if constexpr (std::is_same_v<Policy, kvevict::policies::FullCache>) {
        if (a.read_anchor) {
          // The memory anchor: one pass reading every stored K and V byte of the full cache
          // (what its attention must read), XOR-reduced, timed like a token.
          Runner anchor;
          anchor.name = "K+V read pass over the full cache (anchor)";
          anchor.step = [tf, &c](int, int) {
            std::uint32_t acc = 0;
            for (int l = 0; l < c.n_layers; ++l)
              for (int h = 0; h < c.n_kv_heads; ++h) {
                const auto k = tf->cache().keys(l, h);
                const auto v = tf->cache().values(l, h);
                acc ^= xor_words(k.data(), static_cast<std::size_t>(k.size()));
                acc ^= xor_words(v.data(), static_cast<std::size_t>(v.size()));
              }
            sink ^= acc;
          };
          anchor.us.reserve(static_cast<std::size_t>(a.max_context));
          runners.push_back(std::move(anchor));
        }
      }
    });
  }

  std::uint64_t state = 12345;
  for (int pos = 0; pos < a.max_context; ++pos) {
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    const int token = static_cast<int>((state >> 33) % static_cast<std::uint64_t>(c.vocab_size));
    for (auto& r : runners) {
      const double t0 = thread_cpu_us();
      r.step(token, pos);
      r.us.push_back(thread_cpu_us() - t0);
    }
  }

  std::vector<int> points;
  for (int q = 512; q <= a.max_context; q *= 2) points.push_back(q);
  auto median_at = [&](const Runner& r, int q) {
    std::vector<double> w(r.us.begin() + (q - a.window), r.us.begin() + q);
    std::nth_element(w.begin(), w.begin() + a.window / 2, w.end());
    return w[static_cast<std::size_t>(a.window / 2)];
  };
  fmt::print(
      "model {}: dim {}, layers {}, heads {}, kv heads {}, head dim {}; {} tokens; median thread "
      "CPU time per token (us) over the {} tokens ending at each context length; attend: {}\n\n",
      checkpoint, c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim(), a.max_context,
      a.window, a.alloc_attend ? "workspace and allocating attend()" : "workspace attend()");
  fmt::print("| policy |");
  for (const int q : points) fmt::print(" {} |", q);
  fmt::print("\n|---|");
  for (std::size_t i = 0; i < points.size(); ++i) fmt::print("---:|");
  fmt::print("\n");
  for (const auto& r : runners) {
    fmt::print("| {} |", r.name);
    for (const int q : points) fmt::print(" {:.1f} |", median_at(r, q));
    fmt::print("\n");
  }
  fmt::print("\n");
  for (const auto& r : runners)
    for (const int q : points) fmt::print("csv,{},{},{:.2f}\n", r.name, q, median_at(r, q));
  if (sink == 0x12345678u) fmt::print("(anchor checksum {})\n", sink);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return kvevict::cli::main_guard("llama2c_decode_timing", [&] { return run(argc, argv); });
}
