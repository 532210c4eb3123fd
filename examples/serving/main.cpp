// llama2c_serving: many sequences decoding in one process from ONE fixed BlockPool
// (PagedCache over the llama2.c Transformer), a FIFO request queue admitted when blocks
// free up, a progress line on stderr. For each policy (the full cache first) at the same
// pool size it reports tokens per second, peak blocks in use, sequences served
// concurrently and the per-request KL against the full cache on the same tokens
// (requests are streams sampled from the full model and teacher-forced, e2e.hpp).
// --kv-format runs the pool in fp16 or a quantized format too (quantized.hpp), and
// --pool-kib sizes every pool in bytes, so eviction, quantization and both are compared
// at equal memory.
#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "cpu_model.hpp"
#include "kvevict/policies/decayed_attention.hpp"
#include "kvevict/policies/expected_attention.hpp"
#include "kvevict/policies/full_cache.hpp"
#include "kvevict/policies/h2o.hpp"
#include "kvevict/policies/streaming_llm.hpp"
#include "kvevict/quantized.hpp"
#include "cli.hpp"
#include "e2e.hpp"
#include "options.hpp"
#include "policy_registry.hpp"
#include "serving.hpp"

namespace {

using namespace kvevict;
using namespace kvevict::llama2c;

struct Args {
  ModelArgs model;
  PolicyKnobs knobs = PolicyKnobs::reference_protocol();
  std::vector<std::string> policies{"full", "decayed", "probfree", "streaming"};
  int requests = 32;
  int tokens = 512;
  int min_tokens = 0;  // 0: every request has --tokens tokens
  std::uint64_t seed = 1000;
  std::size_t budget = 128;
  std::uint32_t pool_blocks = 2560;
  double pool_kib = 0.0;  // > 0: every pool gets the blocks that fit this many KiB
  std::vector<std::string> formats{"fp32"};
  std::uint32_t block_tokens = 16;
  int repeat = 1;
  bool per_request = false;
  bool quiet = false;
};

using kvevict::examples::cpu_model;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// The pool formats --kv-format offers (a small list: each is one more instantiation of the
// serving engine per policy type below). Q8<8> / Q4<8> need head_dim % 8 == 0.
using K8V4 = KV<Q8<8>, Q4<8>>;
constexpr const char* kFormats = "fp32, fp16, q8g8, k8v4";

template <class Fn>
void with_format(const std::string& name, Fn&& fn) {
  if (name == "fp32") return fn.template operator()<float>();
  if (name == "fp16") return fn.template operator()<Eigen::half>();
  if (name == "q8g8") return fn.template operator()<Q8<8>>();
  if (name == "k8v4") return fn.template operator()<K8V4>();
  throw kvevict::cli::UsageError(fmt::format("--kv-format: unknown format '{}', expected one of: {}",
                                             name, kFormats));
}

// The policy types that run in every format (the registry entries of these types: full,
// decayed and its variants, probfree, expected, streaming, h2o); the others run in fp32.
template <class P>
inline constexpr bool kAnyFormat =
    std::is_same_v<P, policies::DecayedAttention> || std::is_same_v<P, policies::ExpectedAttention> ||
    std::is_same_v<P, policies::StreamingLLM> || std::is_same_v<P, policies::H2O> ||
    std::is_same_v<P, policies::FullCache>;

struct Row {
  std::string name;
  std::string format;
  std::uint32_t pool_blocks = 0;
  double pool_kib = 0.0;
  serving::ServeResult r;
  double cpu_median = 0.0;
};

}  // namespace

int main(int argc, char** argv) {
  return kvevict::cli::main_guard("llama2c_serving", [&] {
    using kvevict::cli::Range;
    Args a;
    kvevict::cli::Parser p(
        "llama2c_serving",
        "Continuous batching from one fixed block pool on a llama2.c checkpoint: every policy\n"
        "serves the same requests (streams sampled from the full model, teacher-forced) from a\n"
        "pool of the same size; tokens/s, peak blocks, concurrency and per-request KL against\n"
        "the full cache.");
    add_model_options(p, a.model, a.knobs);
    p.custom("--policies", "LIST",
             "registry policies, comma-separated (default full,decayed,probfree,streaming)",
             [&](const std::string& v) {
               a.policies = kvevict::cli::split_list(v);
               kvevict::registry::check_names(a.policies, "--policies", false);
               for (const auto& n : a.policies)
                 if (n == "oracle")
                   throw kvevict::cli::UsageError(
                       "--policies: 'oracle' stores every row and is not causal: nothing to serve "
                       "(use llama2c_headline for its KL)");
             });
    p.number("--requests", "N", "requests in the queue (request i: stream seed S + i)", a.requests,
             Range<int>{1, 100000});
    p.number("--tokens", "T", "tokens per request (at most the checkpoint's seq_len)", a.tokens,
             Range<int>{2});
    p.number("--min-tokens", "T",
             "> 0: request lengths drawn uniformly from [T, --tokens] (seeded by --seed)",
             a.min_tokens, Range<int>{0});
    p.number("--seed", "S", "seed of request 0's stream", a.seed, Range<std::uint64_t>{0});
    p.number("--budget", "ROWS", "tokens per (layer, KV head) of every bounded policy", a.budget,
             Range<std::size_t>{1});
    p.number("--pool-blocks", "N", "blocks in the one pool every policy serves from", a.pool_blocks,
             Range<std::uint32_t>{1});
    p.number("--pool-kib", "KIB",
             "> 0: size every pool in bytes instead (the blocks of its format that fit in KIB "
             "KiB of K+V), for comparisons at equal memory",
             a.pool_kib, Range<double>{0.0});
    p.custom("--kv-format", "LIST",
             std::string("pool storage formats, comma-separated (default fp32): ") + kFormats +
                 "; every policy runs in each (policy types other than full, decayed*, probfree, "
                 "expected, streaming, h2o: fp32 only)",
             [&](const std::string& v) {
               a.formats = kvevict::cli::split_list(v);
               if (a.formats.empty()) throw kvevict::cli::UsageError("--kv-format: empty list");
               for (const auto& f : a.formats) with_format(f, []<class>() {});
             });
    p.number("--block-tokens", "B", "tokens per block (a power of two, 1..256)", a.block_tokens,
             Range<std::uint32_t>{1, 256});
    p.number("--repeat", "N", "serving runs per policy; tokens/s is the median", a.repeat,
             Range<int>{1, 100});
    p.flag("--per-request", "print every request's KL per policy", a.per_request);
    p.flag("--quiet", "no progress line", a.quiet);
    p.info("--list", "list the registry's policies, then exit",
           [] { fmt::print("policies:\n{}", kvevict::registry::listing()); });
    if (!p.parse(argc, argv)) return 0;
    if (a.min_tokens > a.tokens)
      throw kvevict::cli::UsageError(fmt::format("--min-tokens = {}, expected <= --tokens = {}",
                                                 a.min_tokens, a.tokens));

    // Refuse a policy/format pair before any work (the registry builds the policy, cheaply).
    for (const auto& name : a.policies)
      kvevict::registry::with_policy(
          name, kvevict::registry::Args{a.budget, a.knobs, nullptr},
          [&]<class Policy>(const Policy&, const Budget&) {
            for (const auto& format : a.formats)
              if (format != "fp32" && !kAnyFormat<Policy>)
                throw kvevict::cli::UsageError(fmt::format(
                    "--kv-format {}: policy '{}' runs in fp32 only here (formats are built for "
                    "full, decayed*, probfree, expected, streaming, h2o)",
                    format, name));
          });

    const std::string dir = model_dir(a.model.dir);
    std::string checkpoint = a.model.checkpoint;
    if (checkpoint.empty()) {
      kvevict::detail::require(!dir.empty(),
                               "no model: pass --checkpoint, --model-dir or set KVEVICT_MODEL_DIR");
      checkpoint = dir + "/stories260K.bin";
    }
    auto model = std::make_shared<const Model>(Model::load(checkpoint));
    const auto& c = model->config();
    if (a.tokens > c.seq_len)
      throw kvevict::cli::UsageError(fmt::format(
          "--tokens = {}, expected <= the checkpoint's seq_len = {} (the full cache's limit)",
          a.tokens, c.seq_len));

    // Requests: streams sampled with the full cache (the headline protocol's sampling).
    std::vector<Stream> streams;
    std::vector<serving::Request> requests;
    std::mt19937_64 len_rng(a.seed);
    for (int i = 0; i < a.requests; ++i) {
      SampleOptions o;
      o.tokens = a.tokens;
      o.seed = a.seed + static_cast<std::uint64_t>(i);
      o.temperature = 1.0f;
      streams.push_back(sample_stream(model, o));
    }
    for (int i = 0; i < a.requests; ++i) {
      std::size_t n = static_cast<std::size_t>(a.tokens);
      if (a.min_tokens > 0)
        n = static_cast<std::size_t>(a.min_tokens) +
            len_rng() % static_cast<std::size_t>(a.tokens - a.min_tokens + 1);
      requests.push_back({&streams[static_cast<std::size_t>(i)], n});
    }
    std::size_t total_tokens = 0;
    for (const auto& r : requests) total_tokens += r.tokens;

    std::vector<Row> rows;
    for (const auto& name : a.policies) {
      kvevict::registry::with_policy(
          name, kvevict::registry::Args{a.budget, a.knobs, nullptr},
          [&]<class Policy>(Policy policy, const Budget& budget) {
            for (const auto& format : a.formats) {
              with_format(format, [&]<class Scalar>() {
                if constexpr (std::is_same_v<Scalar, float> || kAnyFormat<Policy>) {
                  serving::ServeOptions so;
                  so.block_tokens = a.block_tokens;
                  const BlockPool<Scalar> probe(1, a.block_tokens, c.head_dim());
                  const double block_bytes = static_cast<double>(a.block_tokens) *
                                             static_cast<double>(probe.key_row_bytes() +
                                                                 probe.value_row_bytes());
                  so.pool_blocks =
                      a.pool_kib > 0.0
                          ? static_cast<std::uint32_t>(std::min(
                                a.pool_kib * 1024.0 / block_bytes, 4.0e9))
                          : a.pool_blocks;
                  kvevict::detail::require(so.pool_blocks >= 1, "--pool-kib = ", a.pool_kib,
                                           ": no ", format, " block fits (expected >= ",
                                           block_bytes / 1024.0, " KiB)");
                  so.label = a.formats.size() > 1 ? name + "/" + format : name;
                  so.progress = !a.quiet;
                  Row row;
                  row.name = so.label;
                  row.format = format;
                  row.pool_blocks = so.pool_blocks;
                  row.pool_kib = so.pool_blocks * block_bytes / 1024.0;
                  std::vector<double> cpu;
                  for (int rep = 0; rep < a.repeat; ++rep) {
                    auto r = serving::serve<Policy, Scalar>(model, requests, budget, policy, so);
                    cpu.push_back(r.cpu_seconds);
                    if (rep == 0) {
                      row.r = std::move(r);
                    } else {
                      kvevict::detail::require(r.kl == row.r.kl, "serve: policy ", name,
                                               ": repeat ", rep, " gave different KL (expected "
                                               "deterministic runs)");
                    }
                  }
                  row.cpu_median = median(cpu);
                  rows.push_back(std::move(row));
                }
              });
            }
          });
    }

    // Printed once every run succeeded: a pool too small for one request is one error line.
    fmt::print("llama2c_serving: {} (dim {}, layers {}, KV heads {}, head_dim {}), CPU: {}\n",
               checkpoint, c.dim, c.n_layers, c.n_kv_heads, c.head_dim(), cpu_model());
    fmt::print("requests {} ({} tokens{}, seeds {}..{}, temperature 1, all queued at start); "
               "pool: {} x {} tokens; budget {} tokens per (layer, KV head); tok/s = tokens / "
               "process CPU seconds of the serving loop (KL excluded), median of {}\n\n",
               a.requests, total_tokens,
               a.min_tokens > 0 ? fmt::format(", {}..{} per request", a.min_tokens, a.tokens)
                                : fmt::format(", {} per request", a.tokens),
               a.seed, a.seed + static_cast<std::uint64_t>(a.requests) - 1,
               a.pool_kib > 0.0 ? fmt::format("the blocks that fit in {} KiB of K+V", a.pool_kib)
                                : fmt::format("{} blocks", a.pool_blocks),
               a.block_tokens, a.budget, a.repeat);

    const Row* full = nullptr;
    for (const auto& r : rows)
      if (r.name == "full" || r.name == "full/fp32") full = &r;
    fmt::print("| policy | format | pool blocks (KiB) | blocks / request (worst case) | max "
               "concurrent | mean concurrent | peak blocks in use | steps | tok/s (CPU) | mean KL | "
               "KL per request min / median / max |\n|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (const auto& row : rows) {
      const auto& r = row.r;
      // Pooled over positions, as the headline protocol: weight each request by its tokens.
      double pooled = 0.0;
      for (std::size_t i = 0; i < r.kl.size(); ++i)
        pooled += r.kl[i] * static_cast<double>(requests[i].tokens);
      pooled /= static_cast<double>(total_tokens);
      const auto [lo, hi] = std::minmax_element(r.kl.begin(), r.kl.end());
      std::string conc = fmt::format("{}", r.max_concurrent);
      if (full != nullptr && full != &row && full->r.max_concurrent > 0)
        conc += fmt::format(" ({:.2f}x full)", static_cast<double>(r.max_concurrent) /
                                                   static_cast<double>(full->r.max_concurrent));
      std::string tps = fmt::format("{:.0f}", static_cast<double>(r.tokens) / row.cpu_median);
      if (full != nullptr && full != &row)
        tps += fmt::format(" ({:.2f}x full)", full->cpu_median / row.cpu_median);
      fmt::print("| {} | {} | {} ({:.1f}) | {} | {} | {:.2f} | {} | {} | {} | {:.4f} | {:.4f} / {:.4f} / {:.4f} |\n",
                 row.name, row.format, row.pool_blocks, row.pool_kib, r.footprint_max, conc, r.mean_concurrent, r.peak_blocks, r.steps, tps,
                 pooled, *lo, median(r.kl), *hi);
    }
    if (a.per_request) {
      fmt::print("\nKL(full || served) per request, mean over its tokens\n\n| request | tokens |");
      for (const auto& row : rows) fmt::print(" {} |", row.name);
      fmt::print("\n|---|---|");
      for (std::size_t i = 0; i < rows.size(); ++i) fmt::print("---|");
      fmt::print("\n");
      for (std::size_t i = 0; i < requests.size(); ++i) {
        fmt::print("| {} | {} |", i, requests[i].tokens);
        for (const auto& row : rows) fmt::print(" {:.4f} |", row.r.kl[i]);
        fmt::print("\n");
      }
    }
    return 0;
  });
}
