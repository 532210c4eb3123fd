// kvevict_hf_tool: what tests/hf_test.py drives to check the Hugging Face reader
// (examples/llama2c/hf.hpp) against llama2.c and against an independent numpy reference.
//   kvevict_hf_tool load MODEL                 load (either format), print the config
//   kvevict_hf_tool compare A B [TOKENS]       full-cache logits of A and B on the same
//                                              tokens; prints the max abs difference
//   kvevict_hf_tool check MODEL REF [--block N] REF.safetensors holds "tokens" [T] and
//                                              "logits" [T, vocab]; prints the max abs
//                                              difference of the engine's logits (token by
//                                              token, or forward_block in blocks of N)
//   kvevict_hf_tool dump MODEL REF OUT         writes the trace (docs/traces.md) of REF's
//                                              tokens to OUT and reads it back
//   kvevict_hf_tool decode TOKENIZER IDS [--incremental]
//                                              tokenizer.json (or a directory holding it):
//                                              the text of IDS (comma-separated) on stdout,
//                                              raw bytes; --incremental: the pieces
//                                              IncrementalDecoder gives, concatenated
//   kvevict_hf_tool bench MODEL [--context C --decode N --block B --reps R]
//                                              full-cache decode throughput after a C-token
//                                              blocked prefill: median thread CPU time per
//                                              decode token, and the memory-bandwidth floor
//                                              (weights + K/V rows read per token over a
//                                              measured single-thread streaming-read rate)
// MODEL is a llama2.c checkpoint file or a Hugging Face checkpoint directory. Exit status:
// 0 when the difference is at most --tol (default 1e-4), 1 when above, 2 on bad input (one
// line on stderr).
#include <fmt/format.h>

#include <time.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <numeric>
#include <memory>
#include <string>
#include <vector>

#include "../examples/common/cli.hpp"
#include "../examples/llama2c/hf.hpp"
#include "../examples/llama2c/hf_tokenizer.hpp"
#include "../examples/llama2c/trace_dump.hpp"
#include "kvevict/policies/full_cache.hpp"

namespace {

using namespace kvevict::llama2c;

double cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

double median(std::vector<double> x) {
  std::nth_element(x.begin(), x.begin() + static_cast<std::ptrdiff_t>(x.size() / 2), x.end());
  return x[x.size() / 2];
}

std::vector<float> run_logits(const std::shared_ptr<const Model>& m, const std::vector<int>& tokens,
                              int block = 0) {
  Transformer<kvevict::policies::FullCache> tf(m, kvevict::Budget::unbounded());
  std::vector<float> out;
  if (block > 0) {
    std::vector<float> part;
    for (std::size_t at = 0; at < tokens.size(); at += static_cast<std::size_t>(block)) {
      const std::size_t n = std::min(tokens.size() - at, static_cast<std::size_t>(block));
      tf.forward_block(std::span<const int>(tokens.data() + at, n), static_cast<int>(at), &part);
      out.insert(out.end(), part.begin(), part.end());
    }
    return out;
  }
  for (std::size_t t = 0; t < tokens.size(); ++t) {
    const auto l = tf.forward(tokens[t], static_cast<int>(t));
    out.insert(out.end(), l.begin(), l.end());
  }
  return out;
}

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  kvevict::detail::require(a.size() == b.size(), "logit counts differ: ", a.size(), " and ",
                           b.size());
  double m = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double d = std::abs(static_cast<double>(a[i]) - static_cast<double>(b[i]));
    if (!(d <= m)) m = d;  // NaN propagates as NaN
  }
  return m;
}

// Bytes the decode step must read: every weight matrix once (the tied classifier once
// more), the norm vectors, and every cached K/V row of every layer.
double bytes_per_token(const Model& m, std::size_t cached) {
  const Config& c = m.config();
  auto bytes = [](const Weight& w) {
    return static_cast<double>(w.rows) * w.cols * static_cast<double>(kvevict::tensor::dtype_size(w.dtype));
  };
  double b = bytes(m.classifier()) + static_cast<double>(c.dim) * 4;
  for (int l = 0; l < c.n_layers; ++l) {
    const auto& y = m.layer(l);
    for (const Weight* w : {&y.wq, &y.wk, &y.wv, &y.wo, &y.w1, &y.w2, &y.w3}) b += bytes(*w);
    b += 2.0 * c.dim * 4;
  }
  b += 2.0 * static_cast<double>(cached) * c.n_layers * c.kv_dim() * 4;  // K and V, float
  return b;
}

// Single-thread streaming-read rate (GB/s): median of `reps` sums over a 512 MiB buffer.
double read_bandwidth(int reps) {
  std::vector<float> buf(std::size_t{128} << 20, 1.0f);
  std::vector<double> rates;
  volatile float sink = 0.0f;
  for (int r = 0; r < reps; ++r) {
    const double t0 = cpu_seconds();
    const float s = Eigen::Map<const Eigen::VectorXf>(buf.data(), static_cast<Eigen::Index>(buf.size())).sum();
    const double t = cpu_seconds() - t0;
    sink = sink + s;
    rates.push_back(static_cast<double>(buf.size()) * 4 / t / 1e9);
  }
  return median(rates);
}

int bench(const std::string& dir, int context, int decode, int block, int reps) {
  auto m = std::make_shared<const Model>(load_any(dir));
  const Config& c = m->config();
  kvevict::detail::require(context + decode <= c.seq_len, "bench: context + decode = ",
                           context + decode, ", expected <= seq_len = ", c.seq_len);
  Transformer<kvevict::policies::FullCache> tf(m, kvevict::Budget::unbounded());
  std::vector<int> toks(static_cast<std::size_t>(context));
  for (int t = 0; t < context; ++t) toks[static_cast<std::size_t>(t)] = static_cast<int>((t * 7919L + 13) % c.vocab_size);
  const double p0 = cpu_seconds();
  for (int at = 0; at < context; at += block) {
    const int n = std::min(block, context - at);
    tf.forward_block(std::span<const int>(toks.data() + at, static_cast<std::size_t>(n)), at);
  }
  const double prefill = cpu_seconds() - p0;
  std::vector<double> per_token;
  int token = toks.back();
  for (int i = 0; i < decode; ++i) {
    const double t0 = cpu_seconds();
    const auto logits = tf.forward(token, context + i);
    per_token.push_back(cpu_seconds() - t0);
    token = static_cast<int>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  }
  const double med = median(per_token);
  const double bw = read_bandwidth(reps);
  const double bytes = bytes_per_token(*m, static_cast<std::size_t>(context + decode / 2));
  fmt::print("model {}: layers {} dim {} heads {} kv_heads {} head_dim {} ffn {} vocab {}\n", dir,
             c.n_layers, c.dim, c.n_heads, c.n_kv_heads, c.head_dim(), c.hidden_dim, c.vocab_size);
  fmt::print("prefill {} tokens in blocks of {}: {:.2f} s CPU ({:.1f} tokens/s)\n", context,
             block, prefill, context / prefill);
  fmt::print("decode at context {}: median {:.1f} ms CPU per token over {} tokens ({:.2f} tokens/s)\n",
             context, 1e3 * med, decode, 1.0 / med);
  fmt::print("bytes read per decode token: {:.1f} MB (weights + K/V rows); single-thread read "
             "rate {:.2f} GB/s; bandwidth floor {:.1f} ms per token; measured / floor = {:.2f}\n",
             bytes / 1e6, bw, 1e3 * bytes / (bw * 1e9), med / (bytes / (bw * 1e9)));
  return 0;
}

int run(int argc, char** argv) {
  std::string cmd, a, b, c;
  double tol = 1e-4;
  int tokens = 64, block = 0, context = 2048, decode = 32, reps = 3;
  bool incremental = false;
  kvevict::cli::Parser p("kvevict_hf_tool", "Checks the Hugging Face checkpoint reader.");
  p.positional("COMMAND", "load, compare or check", cmd);
  p.positional("A", "model", a);
  p.positional("B", "second model or reference", b);
  p.positional("OUT", "dump: the trace to write", c);
  p.number("--tol", "X", "largest accepted max abs difference", tol,
           kvevict::cli::Range<double>{0.0, 1e9});
  p.number("--tokens", "N", "tokens fed by compare", tokens, kvevict::cli::Range<int>{1, 1 << 20});
  p.number("--block", "N", "check: forward_block in blocks of N (0: token by token); bench: "
           "prefill block", block, kvevict::cli::Range<int>{0, 1 << 16});
  p.number("--context", "C", "bench: tokens before the timed decode steps", context,
           kvevict::cli::Range<int>{1, 1 << 24});
  p.number("--decode", "N", "bench: timed decode steps", decode, kvevict::cli::Range<int>{1, 1 << 20});
  p.number("--reps", "R", "bench: bandwidth measurement repetitions", reps,
           kvevict::cli::Range<int>{1, 1000});
  p.flag("--incremental", "decode: piece by piece (IncrementalDecoder)", incremental);
  if (!p.parse(argc, argv)) return 0;
  if (cmd == "decode") {
    std::error_code ec;
    const auto tok = std::filesystem::is_directory(a, ec)
                         ? hf::TokenizerJson::load_if_present(a)
                         : std::optional<hf::TokenizerJson>(hf::TokenizerJson::load(a));
    kvevict::detail::require(tok.has_value(), "decode: no tokenizer.json in '", a, "'");
    if (!tok->unsupported().empty())
      fmt::print(stderr, "kvevict_hf_tool: warning: tokenizer.json {}: not supported, showing ids\n",
                 tok->unsupported());
    std::vector<int> ids;
    for (const auto& x : kvevict::cli::split_list(b))
      ids.push_back(kvevict::cli::parse_number<int>("IDS", x, kvevict::cli::Range<int>{0}));
    std::string text;
    if (incremental) {
      hf::IncrementalDecoder inc(*tok);
      for (int id : ids) text += inc.push(id);
    } else {
      text = tok->decode(ids);
    }
    std::fwrite(text.data(), 1, text.size(), stdout);
    return 0;
  }
  if (cmd == "load") {
    const Model m = load_any(a);
    const Config& k = m.config();
    fmt::print("dim {} hidden {} layers {} heads {} kv_heads {} head_dim {} vocab {} seq_len {} "
               "tied {}\n",
               k.dim, k.hidden_dim, k.n_layers, k.n_heads, k.n_kv_heads, k.head_dim(),
               k.vocab_size, k.seq_len, k.shared_classifier);
    return 0;
  }
  if (cmd == "compare") {
    auto ma = std::make_shared<const Model>(load_any(a));
    auto mb = std::make_shared<const Model>(load_any(b));
    const int V = ma->config().vocab_size;
    std::vector<int> toks;
    toks.push_back(ma->config().bos_token);
    for (int t = 1; t < tokens; ++t) toks.push_back(static_cast<int>((t * 7919L + 13) % V));
    const double d = max_abs_diff(run_logits(ma, toks), run_logits(mb, toks));
    fmt::print("max_abs_diff {:.3e} over {} tokens x {} logits (tol {:.1e})\n", d, tokens, V, tol);
    return d <= tol ? 0 : 1;
  }
  if (cmd == "check") {
    auto m = std::make_shared<const Model>(load_any(a));
    const auto ref = kvevict::eval::SafetensorsFile::open(b);
    const auto* tt = ref.find("tokens");
    const auto* lt = ref.find("logits");
    kvevict::detail::require(tt != nullptr && lt != nullptr, "reference '", b,
                             "': needs tensors 'tokens' and 'logits'");
    std::vector<int> toks;
    for (float x : ref.read(*tt)) toks.push_back(static_cast<int>(x));
    const double d = max_abs_diff(run_logits(m, toks, block), ref.read(*lt));
    fmt::print("max_abs_diff {:.3e} over {} tokens{} (tol {:.1e})\n", d, toks.size(),
               block > 0 ? fmt::format(", blocks of {}", block) : std::string(), tol);
    return d <= tol ? 0 : 1;
  }
  if (cmd == "dump") {
    auto m = std::make_shared<const Model>(load_any(a));
    const auto ref = kvevict::eval::SafetensorsFile::open(b);
    const auto* tt = ref.find("tokens");
    kvevict::detail::require(tt != nullptr, "reference '", b, "': needs tensor 'tokens'");
    std::vector<int> toks;
    for (float x : ref.read(*tt)) toks.push_back(static_cast<int>(x));
    const std::string& out = c;
    kvevict::detail::require(!out.empty(), "dump: no OUT path after REF");
    dump_trace(m, toks, toks.size() / 4, out);
    const auto w = kvevict::eval::load_trace(out);
    fmt::print("trace {}: layers {} heads {} kv_heads {} head_dim {} tokens {} prompt {}\n", out,
               w.geometry.n_layers, w.geometry.n_heads, w.geometry.n_kv_heads, w.geometry.head_dim,
               w.tokens, w.prompt);
    return 0;
  }
  if (cmd == "bench") return bench(a, context, decode, block > 0 ? block : 64, reps);
  throw kvevict::cli::UsageError("COMMAND = '" + cmd + "', expected load, compare, check, dump, decode or bench");
}

}  // namespace

int main(int argc, char** argv) {
  return kvevict::cli::main_guard("kvevict_hf_tool", [&] { return run(argc, argv); });
}
